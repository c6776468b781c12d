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
  and plain attributes: numbers, strings, flags, enums, functions by name, a Hugging Face
  config; hooks by name; the names, shapes, dtypes and devices of its parameters and
  buffers, and which are tied), the step arguments' dtypes, devices and shapes past the
  token dimension, grad, inference and autocast mode and the default dtype, the config,
  the torch, triton and fullcg versions and fullcg's sources (:func:`entry_key`). It is
  made again for every graph written, so a graph traced after the model changed goes
  under the changed model's key;
- the entry holds, per graph compiled (a model may need several), the graph with its fake
  values and symbolic sizes (FX's ``GraphPickler``; never a real tensor), the symbolic
  inputs, the route by the names of the model's parameters, buffers and attention
  layers, the static facts of the forward context its guards read, the plain values its
  guards pinned (a config's number, a module-level constant, a default argument: Dynamo's
  guard sources, read again in the next process) and the digests of the source files its
  nodes came from. A value that differs or cannot be read, a changed file, or a model
  tensor whose dtype or static sizes differ makes the entry stale (``warm_stale`` in
  :func:`fullcg.compile_cache.cache_stats`, one log line at INFO); Dynamo traces and the
  entry is written anew;
- a step that no loaded route serves goes through Dynamo as on a cold start, and the
  graph it compiles joins the entry; the pieces of a loaded graph come from the compile
  cache (Inductor's caches), as on any warm start;
- the compile cache's trust checks and signing apply; an entry that is bad, untrusted or
  cannot be used is one warning and a normal compile, never a wrong step.

What it does not see: state the traced code depends on through a guard that pins no plain
value (an object's identity or type, such as which function a module-level name is bound
to) and that the key does not cover. A model whose trace depends on such state turns warm
starts off with ``FullCGConfig(warm_start=False)``. Steps with keyword arguments, or whose
arguments are not all tensors with a token dimension, always go through Dynamo, and so
does the first step on new KV caches (direct dispatch learns its routes anew then).
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import enum
import hashlib
import importlib
import inspect
import logging
import pickle
import time
import types
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
#: Module attributes that are not state of the model: its children and tensors (named
#: apart), and what torch.compile itself sets on a module it compiles.
_NOT_FINGERPRINTED = frozenset({"_parameters", "_buffers", "_modules", "_is_torch_compile", "_compiled_call_impl"})


@dataclasses.dataclass
class GraphRecord:
    """One graph of an entry: what :meth:`WarmStart.load` needs to compile and route it."""

    graph: bytes  # GraphPickler's bytes of (graph module, example inputs with tensors left out)
    slots: tuple[tuple[str, Any], ...]  # per graph input: ("arg", j), ("size", None) or ("param"|"buffer"|"key", name)
    facts: tuple[tuple[int, object], ...]  # (index in context.STATIC_FACTS, value) its guards read
    unwrap: bool
    regions: tuple[int, int]
    sources: tuple[tuple[str, str], ...]  # (file of the graph's nodes, its SHA-256)
    values: tuple[tuple[str, object], ...]  # (Dynamo's guard source, the plain value it pinned)
    code: str  # SHA-256 of the graph's code: one record per graph


def _plain(value: Any) -> str | None:
    """A text that stands for ``value`` in another process, or None."""
    if isinstance(value, (_PLAIN, enum.Enum)):
        return repr(value)
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):  # F.silu or F.gelu, say
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    if isinstance(value, (tuple, list)):
        items = [_plain(v) for v in value]
        return None if None in items else f"{type(value).__name__}({', '.join(items)})"
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
            if attr in _NOT_FINGERPRINTED:
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
    first_name: dict[int, str] = {}  # tied weights: the name of the first of each tensor's names
    for prefix, tensors in (("param", model.named_parameters(remove_duplicate=False)),
                            ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, t in tensors:
            same = first_name.setdefault(id(t), name)
            parts.append((prefix, name, tuple(t.shape), str(t.dtype), t.device.type, t.requires_grad, same))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _signature(args: Sequence[torch.Tensor]) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    return tuple((str(a.dtype), str(a.device), tuple(a.shape[1:])) for a in args)


def _global_state() -> tuple[object, ...]:
    """The global state Dynamo guards on that changes what a step traces to."""
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled(),
            torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled())


def entry_key(model: torch.nn.Module, args: Sequence[torch.Tensor], config: FullCGConfig) -> str:
    """The warm entry's key for steps of ``model`` on arguments like ``args`` (see the module doc)."""
    relevant = compile_cache.compiled_config(config)
    sources = [(f, compile_cache.file_digest(f)) for f in compile_cache.fullcg_sources()]
    text = repr((_FORMAT, type(model).__module__, type(model).__qualname__, model_fingerprint(model),
                 _signature(args), _global_state(), repr(relevant), compile_cache.package_versions(), sources))
    return hashlib.sha256(text.encode()).hexdigest()


@contextlib.contextmanager
def _graph_pickling() -> Iterator[Any]:
    """FX's ``GraphPickler``, with what fullcg's graphs hold that it cannot pickle as is:
    the fake mode (a new one is given when loading), torch's sympy functions (by name).
    A real tensor is refused: an entry holds fake values only, never weights."""
    import sympy
    from torch._subclasses import FakeTensorMode
    from torch._subclasses.fake_tensor import is_fake
    from torch.fx._graph_pickler import GraphPickler

    base = GraphPickler.reducer_override

    def reducer_override(self: Any, obj: Any) -> Any:
        if inspect.isclass(obj) and issubclass(obj, sympy.Function) and hasattr(obj, "_torch_unpickler"):
            return obj._torch_unpickler, (obj._torch_handler_name,)
        if isinstance(obj, FakeTensorMode):
            return type(None), ()
        if isinstance(obj, torch.Tensor) and not is_fake(obj):
            raise TypeError(f"the graph's metadata holds a real tensor {tuple(obj.shape)} (a warm-start entry "
                            "holds fake values only)")
        return base(self, obj)

    GraphPickler.reducer_override = reducer_override
    try:
        yield GraphPickler
    finally:
        GraphPickler.reducer_override = base


#: Node metadata an entry leaves out: where a node came from (modules and functions, for
#: error messages) and Dynamo's record of each input (it references the live tensor: on
#: torch 2.13 GraphPickler would write the weights themselves).
_UNSAVED_META = ("source_fn_stack", "nn_module_stack", "grapharg")


def _dump_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> bytes:
    from torch.fx._graph_pickler import Options

    removed = [(node, key, node.meta.pop(key)) for node in gm.graph.nodes for key in _UNSAVED_META
               if key in node.meta]
    inputs = [None if isinstance(v, torch.Tensor) else v for v in example_inputs]
    try:
        with _graph_pickling() as pickler:
            return pickler.dumps((gm, inputs), Options(ops_filter=None))
    finally:  # the live graph keeps what it had
        for node, key, value in removed:
            node.meta[key] = value


def _load_graph(data: bytes) -> tuple[torch.fx.GraphModule, list[Any], Any]:
    from torch._subclasses import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    with _graph_pickling() as pickler:
        gm, inputs = pickler.loads(data, fake_mode)
    return gm, list(inputs), fake_mode


class _Stale(Exception):
    """The entry was made from other sources or another model: not an error, a miss."""


class _Globals(dict):
    """``G[...]`` of Dynamo's guard sources in a new process: the compiled forward's module
    globals, and the modules Dynamo reached through inlined code (``__import_a_dot_b``)."""

    def __init__(self, root: dict[str, Any]) -> None:
        super().__init__()
        self._root = root

    def __missing__(self, name: str) -> Any:
        if name.startswith("__import_"):
            return importlib.import_module(name[len("__import_"):].replace("_dot_", "."))
        return self._root[name]


def _check_values(model: torch.nn.Module, values: Sequence[tuple[str, object]]) -> None:
    """Raise :class:`_Stale` unless every value the trace's guards pinned holds for
    ``model`` in this process. Sources rooted in the step's other arguments are the
    route's to check (tensors); anything else that cannot be read is a miss."""
    forward = getattr(type(model), "forward", None)
    scope = {"self": model, "G": _Globals(getattr(forward, "__globals__", {}))}
    for source, want in values:
        root = source.split(".", 1)[0].split("[", 1)[0]
        if root not in scope:
            continue
        try:
            got = eval(source, {"__builtins__": builtins}, scope)  # noqa: S307 - Dynamo's own guard sources
        except Exception as exc:  # noqa: BLE001
            raise _Stale(f"{source} cannot be read ({type(exc).__name__})") from None
        if type(got) is not type(want) or got != want:
            raise _Stale(f"{source} is {got!r}, traced as {want!r}")


def _check_inputs(gm: torch.fx.GraphModule, graph_args: Sequence[Any]) -> None:
    """Raise :class:`_Stale` unless each tensor handed to the loaded graph has the dtype,
    device and static sizes its placeholder was traced with."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    for node, value in zip(placeholders, graph_args):
        fake = node.meta.get("example_value", node.meta.get("val"))
        if not isinstance(value, torch.Tensor) or not isinstance(fake, torch.Tensor):
            continue
        static = [None if isinstance(d, torch.SymInt) else int(d) for d in fake.shape]
        if (value.dtype != fake.dtype or value.device.type != fake.device.type or value.dim() != len(static)
                or any(d is not None and d != v for d, v in zip(static, value.shape))):
            raise _Stale(f"input {node.name} is {value.dtype} {tuple(value.shape)} on {value.device.type}, "
                         f"traced as {fake.dtype} {tuple(fake.shape)} on {fake.device.type}")


class WarmStart:
    """A compiled model's warm entry: loaded before its first step, written as Dynamo
    teaches direct dispatch new routes. Built by :class:`fullcg.dispatch.CompiledModel`."""

    def __init__(self, model: torch.nn.Module, backend: Backend, direct: DirectDispatch) -> None:
        self._model = model
        self._backend = backend
        self._direct = direct
        #: The records of each key this process read or wrote, and whether it may write it.
        self._records: dict[str, list[GraphRecord]] = {}
        self._may_store: dict[str, bool] = {}
        #: Whether :meth:`load` ran (the model's first step); a plain attribute: read every step.
        self.tried = False

    def load(self, args: Sequence[Any]) -> int:
        """Before the model's first step: compile the entry's graphs for steps like ``args``
        and give direct dispatch their routes. Returns how many graphs were loaded."""
        self.tried = True
        cache = self._cache()
        if cache is None or not args or not all(isinstance(a, torch.Tensor) and a.dim() >= 1 for a in args):
            return 0
        key = self._key_for(args)
        if key is None:
            return 0
        payload, may_store = cache.read(key, compile_cache.WARM)
        if payload is None:
            self._may_store[key] = may_store
            return 0
        path = cache.entry_path(key, compile_cache.WARM)
        # A new graph of this model may join the entry (it passed the trust checks).
        self._may_store[key] = cache.replaceable(key, compile_cache.WARM)
        start = time.perf_counter()
        try:
            records = pickle.loads(payload)
            if not isinstance(records, list) or not all(isinstance(r, GraphRecord) for r in records):
                raise TypeError(f"it holds a {type(records).__name__}, not fullcg's graph records")
            for record in records:
                for path_, digest in record.sources:
                    if compile_cache.file_digest(path_) != digest:
                        raise _Stale(f"{path_} changed since it was traced")
                _check_values(self._model, record.values)
            loaded = [self._compile(record, args) for record in records]
        except _Stale as why:
            compile_cache.count("warm_stale")
            logger.info("fullcg: warm-start entry %s is stale (%s); tracing with Dynamo", path, why)
            return 0
        except Exception as exc:  # noqa: BLE001 - a warm start is an optimisation: compile as without it
            compile_cache.count("warm_bad")
            log_once(("warm start", str(path)), logger, logging.WARNING,
                     "fullcg: warm-start entry %s could not be used (%s: %s); tracing with Dynamo and replacing it",
                     path, type(exc).__name__, (str(exc).splitlines() or [""])[0])
            cache.discard(key, compile_cache.WARM)
            return 0
        for runner, route in loaded:  # only once every graph compiled: nothing half-registered
            self._backend.runners.append(runner)
            self._direct.add_route(route, args)
        self._records[key] = list(records)
        compile_cache.count("warm_hit")
        logger.info("fullcg: warm start: %d graph(s) of %s compiled from %s without Dynamo's tracing in %.2f s",
                    len(loaded), type(self._model).__name__, path, time.perf_counter() - start)
        return len(loaded)

    def _key_for(self, args: Sequence[Any]) -> str | None:
        try:
            return entry_key(self._model, args, self._backend.config)
        except Exception as exc:  # noqa: BLE001 - e.g. a config object that cannot be serialized
            log_once(("warm start key", type(exc).__name__), logger, logging.WARNING,
                     "fullcg: no warm starts for %s: its key could not be made (%s: %s)", type(self._model).__name__,
                     type(exc).__name__, (str(exc).splitlines() or [""])[0])
            return None

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
        _check_inputs(gm, graph_args)
        with tracing(TracingContext(fake_mode)):
            runner = compile_graph(gm, example, self._backend.config, self._backend.counts, regions=record.regions)
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
             unwrap: bool, facts: tuple[tuple[int, object], ...], values: tuple[tuple[str, object], ...]) -> None:
        """Add the graph ``runner`` compiled (its ``source``) to the entry of the model as it
        is now and steps like ``args``, with its route: ``slots_of`` per graph input,
        ``("arg", j)``, ``("size", None)`` or None for a model tensor, named here; ``values``
        the plain values its guards pinned. Nothing is written when a model tensor has no
        name, or the entry's place is not trusted."""
        source = runner.source
        runner.source = None  # not kept alive past here
        cache = self._cache()
        if source is None or cache is None:
            return
        key = self._key_for(args)  # the model as it is now: it may have changed since the first step
        if key is None:
            return
        if key not in self._may_store:
            _, self._may_store[key] = cache.read(key, compile_cache.WARM)
        if not self._may_store[key]:
            return
        gm, example_inputs = source
        code = hashlib.sha256(gm.code.encode()).hexdigest()
        records = self._records.setdefault(key, [])
        if any(r.code == code and r.values == values and r.facts == facts for r in records):
            return  # the same graph again (a recompile that traced what the entry holds)
        by_id = {id(t): name for name, t in self._named_tensors().items()}
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
                values=values, code=code,
            )
            payload = pickle.dumps([*records, record])
        except Exception as exc:  # noqa: BLE001 - the next start traces with Dynamo, as without this
            log_once(("warm start save", type(exc).__name__), logger, logging.WARNING,
                     "fullcg: could not keep the traced graph for warm starts (%s: %s); later processes trace it "
                     "with Dynamo", type(exc).__name__, (str(exc).splitlines() or [""])[0])
            return
        records.append(record)
        cache.write(key, payload, compile_cache.WARM)
        logger.debug("fullcg: warm-start entry written in %.2f s (%d bytes)", time.perf_counter() - start,
                     len(payload))

    def _cache(self) -> compile_cache.CompileCache | None:
        config = self._backend.config
        return compile_cache.cache_for(config) if config.warm_start else None
