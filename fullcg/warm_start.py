"""Warm starts without Dynamo: the next process runs the graph this one traced.

A warm start through Dynamo still traces the model's bytecode (seconds at 32 layers)
before the compile cache (:mod:`fullcg.compile_cache`) serves every piece. Within a
process, fullcg already takes steps past Dynamo once it has compiled their graph
(:class:`fullcg.dispatch.DirectDispatch`): a *route* says which graph input is which step
argument, which is a tensor of the model and which the token count. This module keeps
that route and the graph Dynamo traced in the compile cache, as entry ``warm/<key>.bin``,
and the next process with the same model compiles the graph straight from there and takes
its first step on the route, without Dynamo:

- the key covers what the trace depends on and is known before tracing: the model's
  code (the source files of its modules' classes) and structure (every module's class
  and plain attributes, a Hugging Face config, hooks; the names, shapes, dtypes and
  devices of its parameters and buffers), the step arguments' dtypes, devices and shapes
  past the token dimension, grad, inference and autocast mode and the default dtype, the
  config, the torch, triton and fullcg versions and fullcg's sources (:func:`entry_key`);
- the entry holds, per graph compiled (a model may need several), the graph with its fake
  values and symbolic sizes (FX's ``GraphPickler``), the symbolic inputs, the route by the
  names of the model's parameters, buffers and attention layers, the static facts of the
  forward context its guards read, and the digests of the source files Dynamo traced: a
  changed file (a helper the model calls, say) makes the entry stale (``warm_stale`` in
  :func:`fullcg.compile_cache.cache_stats`, one log line; Dynamo traces and the entry is
  written anew);
- a step that no loaded route serves goes through Dynamo as on a cold start, and the
  graph it compiles joins the entry; the pieces of a loaded graph come from the compile
  cache (Inductor's caches), as on any warm start;
- the compile cache's trust checks and signing apply; an entry that is bad, untrusted or
  cannot be used is one warning and a normal compile, never a wrong step.

What it does not see (as direct dispatch does not): state the traced code reads that the
key does not cover, such as a module-level flag of the user's code or an attribute of an
object held by the model that is not a Hugging Face config. A model whose trace depends
on such state turns warm starts off with ``FullCGConfig(warm_start=False)``. Steps with
keyword arguments, or whose arguments are not all tensors with a token dimension, always
go through Dynamo.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import logging
import pickle
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from fullcg import compile_cache
from fullcg.config import FullCGConfig
from fullcg.diagnostics import log_once

if TYPE_CHECKING:
    from fullcg.backend import Backend
    from fullcg.dispatch import DirectDispatch
    from fullcg.runner import StepRunner

__all__ = ["WarmStart", "entry_key", "model_fingerprint"]

logger = logging.getLogger(__name__)

# Bump when what an entry holds changes; part of every key.
_FORMAT = 1
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


@dataclasses.dataclass
class GraphRecord:
    """One graph of an entry: what :meth:`WarmStart.load` needs to compile and route it."""

    graph: bytes  # GraphPickler's bytes of (graph module, example inputs with tensors left out)
    slots: tuple[tuple[str, Any], ...]  # per graph input: ("arg", j), ("size", None) or ("param"|"buffer"|"key", name)
    facts: tuple[tuple[int, object], ...]  # (index in context.STATIC_FACTS, value) its guards read
    unwrap: bool
    regions: tuple[int, int]
    sources: tuple[tuple[str, str], ...]  # (file Dynamo traced, its SHA-256)


def _plain(value: Any) -> str | None:
    if isinstance(value, _PLAIN):
        return repr(value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
        return repr(value)
    return None


def _source_file(cls: type) -> str | None:
    try:
        return inspect.getsourcefile(cls)
    except (TypeError, OSError):  # a class of a built-in or generated module
        return None


def model_fingerprint(model: torch.nn.Module) -> str:
    """A digest of what tracing ``model`` reads besides the step's arguments (see the
    module doc): the source files of its modules' classes (torch's aside), module classes
    and plain attributes, Hugging Face configs, hooks, and the parameters' and buffers'
    names, shapes, dtypes, devices and whether they need grad. Weights' values are not
    part of it: they are inputs of the graph."""
    memo: dict[int, str] = {}
    parts: list[Any] = []
    files: dict[str, str] = {}
    for module in model.modules():
        for cls in type(module).__mro__:
            if not cls.__module__.startswith("torch.") and (path := _source_file(cls)) and path not in files:
                files[path] = compile_cache.file_digest(path)
    parts.append(sorted(files.items()))
    for name, module in model.named_modules(remove_duplicate=False):
        attrs = []
        for attr, value in sorted(vars(module).items()):
            if attr in ("_parameters", "_buffers", "_modules"):
                continue
            plain = _plain(value)
            if plain is None and isinstance(value, dict) and "hook" in attr:
                plain = repr([getattr(h, "__qualname__", type(h).__qualname__) for h in value.values()])
            elif plain is None and hasattr(value, "to_json_string"):  # a Hugging Face config
                if id(value) not in memo:
                    memo[id(value)] = value.to_json_string(use_diff=False)
                plain = memo[id(value)]
            attrs.append((attr, plain if plain is not None else type(value).__qualname__))
        kind = type(module)
        parts.append((name, kind.__module__, kind.__qualname__, attrs))
    for prefix, tensors in (("param", model.named_parameters(remove_duplicate=False)),
                            ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, t in tensors:
            parts.append((prefix, name, tuple(t.shape), str(t.dtype), t.device.type, t.requires_grad))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _signature(args: Sequence[torch.Tensor]) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    return tuple((str(a.dtype), str(a.device), tuple(a.shape[1:])) for a in args)


def _global_state() -> tuple[object, ...]:
    """The global state Dynamo guards on that changes what a step traces to."""
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled(),
            torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled())


def entry_key(model: torch.nn.Module, args: Sequence[torch.Tensor], config: FullCGConfig) -> str:
    """The warm entry's key for steps of ``model`` on arguments like ``args`` (see the module doc)."""
    relevant = config.replace(dump_dir=None, cache_dir=None, trust_shared_cache=False)
    sources = [(f, compile_cache.file_digest(f)) for f in compile_cache.fullcg_sources()]
    text = repr((_FORMAT, type(model).__module__, type(model).__qualname__, model_fingerprint(model),
                 _signature(args), _global_state(), repr(relevant), compile_cache.package_versions(), sources))
    return hashlib.sha256(text.encode()).hexdigest()


@contextlib.contextmanager
def _graph_pickling() -> Iterator[Any]:
    """FX's ``GraphPickler``, with what fullcg's graphs hold that it cannot pickle as is:
    the fake mode (a new one is given when loading), torch's sympy functions (by name)."""
    import sympy
    from torch._subclasses import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler

    base = GraphPickler.reducer_override

    def reducer_override(self: Any, obj: Any) -> Any:
        if inspect.isclass(obj) and issubclass(obj, sympy.Function) and hasattr(obj, "_torch_unpickler"):
            return obj._torch_unpickler, (obj._torch_handler_name,)
        if isinstance(obj, FakeTensorMode):
            return type(None), ()
        return base(self, obj)

    GraphPickler.reducer_override = reducer_override
    try:
        yield GraphPickler
    finally:
        GraphPickler.reducer_override = base


def _dump_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> bytes:
    from torch.fx._graph_pickler import Options

    # Where each node came from is for error messages only, and holds modules and functions.
    for node in gm.graph.nodes:
        node.meta.pop("source_fn_stack", None)
        node.meta.pop("nn_module_stack", None)
    inputs = [None if isinstance(v, torch.Tensor) else v for v in example_inputs]
    with _graph_pickling() as pickler:
        return pickler.dumps((gm, inputs), Options(ops_filter=None))


def _load_graph(data: bytes) -> tuple[torch.fx.GraphModule, list[Any], Any]:
    from torch._subclasses import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    with _graph_pickling() as pickler:
        gm, inputs = pickler.loads(data, fake_mode)
    return gm, list(inputs), fake_mode


class _Stale(Exception):
    """The entry was made from other sources or another model: not an error, a miss."""


class WarmStart:
    """A compiled model's warm entry: loaded before its first step, written as Dynamo
    teaches direct dispatch new routes. Built by :class:`fullcg.dispatch.CompiledModel`."""

    def __init__(self, model: torch.nn.Module, backend: Backend, direct: DirectDispatch) -> None:
        self._model = model
        self._backend = backend
        self._direct = direct
        self._key: str | None = None
        self._records: list[GraphRecord] = []
        self._tried = False
        self._may_store = True

    @property
    def tried(self) -> bool:
        return self._tried

    def load(self, args: Sequence[Any]) -> int:
        """Before the model's first step: compile the entry's graphs for steps like ``args``
        and give direct dispatch their routes. Returns how many graphs were loaded."""
        self._tried = True
        cache = self._cache()
        if cache is None or not args or not all(isinstance(a, torch.Tensor) and a.dim() >= 1 for a in args):
            return 0
        self._key = entry_key(self._model, args, self._backend.config)
        payload, self._may_store = cache.read(self._key, compile_cache.WARM)
        if payload is None:
            return 0
        path = cache.entry_path(self._key, compile_cache.WARM)
        start = time.perf_counter()
        try:
            records = pickle.loads(payload)
            if not isinstance(records, list) or not all(isinstance(r, GraphRecord) for r in records):
                raise TypeError(f"it holds a {type(records).__name__}, not fullcg's graph records")
            for record in records:
                for path_, digest in record.sources:
                    if compile_cache.file_digest(path_) != digest:
                        raise _Stale(f"{path_} changed since it was traced")
            loaded = [self._compile(record, args) for record in records]
        except _Stale as why:
            self._may_store = True  # it passed the trust checks: a new trace may take its place
            compile_cache.count("warm_stale")
            logger.info("fullcg: warm-start entry %s is stale (%s); tracing with Dynamo", path, why)
            return 0
        except Exception as exc:  # noqa: BLE001 - a warm start is an optimisation: compile as without it
            compile_cache.count("warm_bad")
            log_once(("warm start", str(path)), logger, logging.WARNING,
                     "fullcg: warm-start entry %s could not be used (%s: %s); tracing with Dynamo and replacing it",
                     path, type(exc).__name__, (str(exc).splitlines() or [""])[0])
            cache.discard(self._key, compile_cache.WARM)
            self._may_store = True
            return 0
        for runner, route in loaded:
            self._backend.runners.append(runner)
            self._direct.add_route(route, args)
        self._records = list(records)
        compile_cache.count("warm_hit")
        logger.info("fullcg: warm start: %d graph(s) of %s compiled from %s without Dynamo's tracing in %.2f s",
                    len(loaded), type(self._model).__name__, path, time.perf_counter() - start)
        return len(loaded)

    def _compile(self, record: GraphRecord, args: Sequence[Any]) -> tuple[StepRunner, Any]:
        from torch._guards import TracingContext, tracing

        from fullcg.backend import compile_graph

        gm, inputs, fake_mode = _load_graph(record.graph)
        named = self._named_tensors()
        graph_args: list[Any] = []
        example: list[Any] = []
        for (kind, what), symbolic in zip(record.slots, inputs, strict=True):
            if kind == "arg":
                value = args[what]
            elif kind == "size":
                value = None
            else:
                value = named.get((kind, what))
                if value is None:
                    raise _Stale(f"the model has no {kind} {what!r}")
            graph_args.append(value)
            example.append(symbolic if kind == "size" else value)
        with tracing(TracingContext(fake_mode)):
            runner = compile_graph(gm, example, self._backend.config, self._backend.counts, regions=record.regions)
        runner.source = None  # the entry holds it already
        if runner.stager is None:
            raise TypeError("the loaded graph has no token dimension")
        route = self._direct.route(runner, graph_args, record.slots, record.unwrap, record.facts)
        return runner, route

    def _named_tensors(self) -> dict[tuple[str, str], torch.Tensor]:
        named: dict[tuple[str, str], torch.Tensor] = {}
        for name, t in self._model.named_parameters(remove_duplicate=False):
            named.setdefault(("param", name), t)
        for name, t in self._model.named_buffers(remove_duplicate=False):
            named.setdefault(("buffer", name), t)
        for name, module in self._model.named_modules(remove_duplicate=False):
            key = getattr(module, "layer_key", None)
            if isinstance(key, torch.Tensor):
                named.setdefault(("key", name), key)
        return named

    def save(self, args: Sequence[Any], runner: StepRunner, slots_of: Sequence[tuple[str, Any] | None],
             unwrap: bool, facts: tuple[tuple[int, object], ...]) -> None:
        """Add the graph ``runner`` compiled (its ``source``) to the entry, with its route:
        ``slots_of`` per graph input, ``("arg", j)``, ``("size", None)`` or None for a model
        tensor, named here. Nothing is written when a model tensor has no name."""
        source = runner.source
        runner.source = None  # not kept alive past here
        cache = self._cache()
        if source is None or cache is None or not self._may_store:
            return
        gm, example_inputs = source
        by_id = {id(t): key for key, t in self._named_tensors().items()}
        slots = []
        for slot, value in zip(slots_of, example_inputs):
            if slot is None:
                slot = by_id.get(id(value))
                if slot is None:
                    logger.debug("fullcg: no warm-start entry: a graph input is a tensor the model does not name")
                    return
            slots.append(slot)
        start = time.perf_counter()
        try:
            record = GraphRecord(
                graph=_dump_graph(gm, example_inputs), slots=tuple(slots), facts=facts, unwrap=unwrap,
                regions=getattr(runner, "regions", (0, 0)),
                sources=tuple((f, compile_cache.file_digest(f)) for f in compile_cache.traced_source_files(gm)),
            )
            payload = pickle.dumps([*self._records, record])
        except Exception as exc:  # noqa: BLE001 - the next start traces with Dynamo, as without this
            log_once(("warm start save", type(exc).__name__), logger, logging.WARNING,
                     "fullcg: could not keep the traced graph for warm starts (%s: %s); later processes trace it "
                     "with Dynamo", type(exc).__name__, (str(exc).splitlines() or [""])[0])
            return
        if self._key is None:
            self._key = entry_key(self._model, args, self._backend.config)
        self._records.append(record)
        cache.write(self._key, payload, compile_cache.WARM)
        logger.debug("fullcg: warm-start entry written in %.2f s (%d bytes)", time.perf_counter() - start,
                     len(payload))

    def _cache(self) -> compile_cache.CompileCache | None:
        config = self._backend.config
        return compile_cache.cache_for(config) if config.warm_start else None
