"""How a compiled model's step reaches its runner: :class:`CompiledModel`, and direct
dispatch, which takes steps past Dynamo once Dynamo has compiled their graph.

Dynamo checks thousands of guards per call on a 32-layer model (module hooks, types,
every parameter), then fetches every parameter to pass to the graph: a few hundred
microseconds of host time per step, more than a captured decode step's own host work.
fullcg already checks what matters for a step itself (the forward context names the
model and its caches; attention ops check the cache of every layer), so after Dynamo
has compiled a graph, :class:`DirectDispatch` learns how Dynamo called its runner and
calls it the same way:

- the graph's inputs are the step's arguments (by position), the token count (for
  symbolic sizes), and tensors of the model (parameters, buffers and the attention
  layers' keys, at fixed addresses);
- the step's arguments have the dtypes, devices and non-token shapes Dynamo saw;
- the token count is one the runner's graph serves (:func:`fullcg.backend.token_count_guard`);
- the static facts of the step that the graph's guards read (:func:`fullcg.context.static_facts`;
  Dynamo hands its guards to :meth:`DirectDispatch.note_guards`) and its KV caches are the
  ones the graph was traced with.

Any other step (a new token count, other caches, keyword arguments, a graph break, a
model whose compiled call was not a single runner call) goes through Dynamo, which may
compile anew and teach the dispatcher another graph. What Dynamo would notice and this does
not: the model changed after compiling in a way its traced code would see (a parameter or
module replaced by another object, a Python attribute such as a flag the forward reads
set to another value); weights updated in place are fine. Make such changes before
compiling, or compile again (``config.debug_checks`` keeps every step on Dynamo's guards).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from fullcg import context
from fullcg.config import FullCGConfig
from fullcg.errors import RegionReuseError
from fullcg.context import check_call_positions, positions_argument
from fullcg.runner import StepRunner, observed_runner_calls

if TYPE_CHECKING:
    from fullcg.backend import Backend

__all__ = ["CompiledModel", "DirectDispatch", "MISS", "observed_runner_calls"]

logger = logging.getLogger(__name__)

#: What :meth:`DirectDispatch.__call__` returns for a step that must go through Dynamo.
MISS = object()

_TRAILING_ITEMS = re.compile(r"(\[[^\[\]]*\])+$")
#: Held while a step goes through Dynamo with floats specialised (``CompiledModel._traced``):
#: the setting is process-wide, so threads take turns rather than undo each other's.
_SPECIALIZED_FLOATS = threading.RLock()
#: Guards that pin a value (rather than a type, an identity or a tensor's metadata).
_VALUE_GUARDS = frozenset({"CONSTANT_MATCH", "EQUALS_MATCH"})


def _portable_value(value: object) -> bool:
    """A value that pickles as itself and compares by value in another process."""
    if isinstance(value, (bool, int, float, str, type(None))):
        return True
    return isinstance(value, tuple) and all(_portable_value(v) for v in value)


def _signature(args: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], ...]:
    """What a route fixes of the step's arguments: dtype, device and the sizes after the tokens."""
    return tuple((a.dtype, a.device, tuple(a.shape[1:])) for a in args)


@dataclasses.dataclass
class _Route:
    """How one runner is called: its argument list with the step's parts filled in."""

    runner: StepRunner
    template: list[Any]
    user_slots: tuple[tuple[int, int], ...]  # (graph input position, step argument position)
    size_slots: tuple[int, ...]
    unwrap: bool  # the model returns the graph's single output, not the tuple
    facts: tuple[tuple[int, object], ...]  # (index in static_facts(), value) of the facts its guards read


class DirectDispatch:
    """Runs steps of one compiled model straight on its runners (see the module doc)."""

    def __init__(self, model: torch.nn.Module, runners: Sequence[StepRunner]) -> None:
        self._model = model
        self._runners = runners  # the backend's, newest last
        self._facts_read: dict[int, tuple[int, ...] | None] = {}  # id(runner) -> indices; None: unknown state
        self._noted = 0  # runners whose guards were noted
        self._routes: list[_Route] = []
        self._by_key: dict[tuple[int, tuple[object, ...]], _Route | None] = {}
        self._signature: tuple[tuple[torch.dtype, torch.device, tuple[int, ...]], ...] | None = None
        self._kv_caches: Mapping[int, Any] | None = None
        #: id(runner) -> the values its guards pinned, as (source, value) (see :meth:`note_guards`).
        self.value_guards: dict[int, tuple[tuple[str, object], ...]] = {}

    def note_guards(self, entries: Sequence[Any]) -> list[bool]:
        """Dynamo's ``guard_filter_fn``: keeps every guard, and notes which static facts the
        graph just compiled (the backend's newest runner) reads, and the plain values its
        guards pin (a config's number, a module constant; :mod:`fullcg.warm_start` checks
        them in the next process)."""
        read: set[int] | None = set()
        values: dict[str, object] = {}
        for entry in entries:
            # An item of a fact (``_state.layer_factors[0][1]``) is a read of the fact.
            owner, _, attr = _TRAILING_ITEMS.sub("", entry.name).rpartition(".")
            if owner.endswith("._state") or owner == "_state":
                if attr in context.STATIC_FACTS:
                    read.add(context.STATIC_FACTS.index(attr))
                    continue
                read = None  # traced code read thread state this dispatcher does not know
                break
            if entry.guard_type in _VALUE_GUARDS and getattr(entry, "has_value", False) and _portable_value(entry.value):
                values[entry.name] = entry.value
        # Dynamo hands over each frame's guards right after compiling it; a frame that made
        # no runner (no graph) has nothing to note.
        if len(self._runners) > self._noted:
            self._noted = len(self._runners)
            self._facts_read[id(self._runners[-1])] = None if read is None else tuple(sorted(read))
            self.value_guards[id(self._runners[-1])] = tuple(values.items())
        return [True] * len(entries)

    def learn(self, args: Sequence[Any], calls: Sequence[tuple[StepRunner, tuple[Any, ...], Any]],
              result: Any) -> _Route | None:
        """Learn a route from one step Dynamo ran: ``calls`` are its runner calls. Returns
        the route learned, if any."""
        if len(calls) != 1 or not args or not all(isinstance(a, torch.Tensor) and a.dim() >= 1 for a in args):
            return None
        runner, graph_args, out = calls[0]
        stager = runner.stager
        ctx = context.current_context()
        if ctx is not None and self._kv_caches is not None and ctx.kv_caches is not self._kv_caches \
                and ctx.kv_caches != self._kv_caches:
            # The model's caches changed (a layer got a new cache): the routes learned so far
            # were learned on the old ones; the runners capture their full graphs anew.
            self._routes.clear()
            self._by_key.clear()
            self._kv_caches = None
        facts_read = self._facts_read.get(id(runner))
        if stager is None or ctx is None or facts_read is None or any(r.runner is runner for r in self._routes):
            return None
        n = args[0].shape[0]
        if any(a.shape[0] != n for a in args):
            return None
        user_slots, template = [], list(graph_args)
        keys = (key for m in self._model.modules() if isinstance(key := getattr(m, "layer_key", None), torch.Tensor))
        model_tensors = {id(t) for t in (*self._model.parameters(), *self._model.buffers(), *keys)}
        for pos, value in enumerate(graph_args):
            if pos in stager.size_args:
                continue
            match = next((j for j, a in enumerate(args) if value is a), None)
            if match is not None:
                user_slots.append((pos, match))
            elif not (isinstance(value, torch.Tensor) and id(value) in model_tensors):
                return None  # an input that is neither the step's nor the model's: only Dynamo knows it
        if sorted(pos for pos, _ in user_slots) != sorted(stager.token_args):
            return None
        if result is out:
            unwrap = False
        elif isinstance(out, (tuple, list)) and len(out) == 1 and result is out[0]:
            unwrap = True
        else:
            return None
        signature = _signature(args)
        if self._signature is not None and signature != self._signature:
            return None
        for pos, _ in user_slots:
            template[pos] = None  # not kept alive: filled in by every step
        self._signature = signature
        self._kv_caches = ctx.kv_caches
        facts = context.static_facts()
        route = _Route(runner, template, tuple(user_slots), tuple(stager.size_args), unwrap,
                       tuple((i, facts[i]) for i in facts_read))
        self._routes.append(route)
        self._by_key.clear()
        return route

    def route(self, runner: StepRunner, graph_args: Sequence[Any], slots: Sequence[tuple[str, Any]], unwrap: bool,
              facts: tuple[tuple[int, object], ...]) -> _Route:
        """A route to ``runner`` (a warm start's, :mod:`fullcg.warm_start`): ``graph_args``
        are its inputs, with the step's arguments and sizes where ``slots`` say
        ``("arg", j)`` and ``("size", None)``; ``facts`` are those its guards read."""
        user_slots = tuple((pos, what) for pos, (kind, what) in enumerate(slots) if kind == "arg")
        size_slots = tuple(pos for pos, (kind, _) in enumerate(slots) if kind == "size")
        template = [None if kind in ("arg", "size") else value for (kind, _), value in zip(slots, graph_args)]
        return _Route(runner, template, user_slots, size_slots, unwrap, tuple(facts))

    def add_route(self, route: _Route, args: Sequence[torch.Tensor]) -> None:
        """Take steps like ``args``, in this forward context, on ``route`` from now on."""
        ctx = context.current_context()
        self._signature = _signature(args)
        self._kv_caches = ctx.kv_caches if ctx is not None else None
        self._routes.append(route)
        self._by_key.clear()

    @staticmethod
    def slots_of(route: _Route) -> list[tuple[str, Any] | None]:
        """Per input of ``route``'s graph: ``("arg", j)``, ``("size", None)``, or None for a
        tensor of the model."""
        slots: list[tuple[str, Any] | None] = [None] * len(route.template)
        for pos, j in route.user_slots:
            slots[pos] = ("arg", j)
        for pos in route.size_slots:
            slots[pos] = ("size", None)
        return slots

    def __call__(self, args: Sequence[Any]) -> Any:
        """The step's output, or :data:`MISS` when the step must go through Dynamo."""
        if not self._routes:
            return MISS
        ctx, facts = context.current_context_and_facts()
        if ctx is None or not args or (ctx.kv_caches is not self._kv_caches and ctx.kv_caches != self._kv_caches):
            return MISS  # (a model's cache map is one object until a cache changes; a mapping is compared)
        if not isinstance(args[0], torch.Tensor) or len(args) != len(self._signature):
            return MISS
        key = (args[0].shape[0], facts)
        route = self._by_key.get(key, MISS)
        if route is MISS:
            route = self._by_key[key] = self._route_for(*key)
        if route is None:
            return MISS
        n = key[0]
        for a, (dtype, device, rest) in zip(args, self._signature):
            if not isinstance(a, torch.Tensor) or a.dtype != dtype or a.device != device or a.shape[1:] != rest \
                    or a.shape[0] != n:
                return MISS
        graph_args = list(route.template)
        for pos, j in route.user_slots:
            graph_args[pos] = args[j]
        for pos in route.size_slots:
            graph_args[pos] = n
        out = route.runner(*graph_args)
        return out[0] if route.unwrap else out

    def _route_for(self, n: int, facts: tuple[object, ...]) -> _Route | None:
        # The newest route first, as Dynamo tries its newest graph first.
        for route in reversed(self._routes):
            admits = route.runner.stager.admits
            if all(facts[i] == value for i, value in route.facts) and (admits is None or admits(n)):
                return route
        return None


class CompiledModel:
    """A model compiled with fullcg whose token dimension is dynamic from the first step.

    Dimension 0 of every tensor argument is the token dimension (the convention of models
    built on ``fullcg.Attention``: ``input_ids [T]``, ``positions [T]``, hidden states
    ``[T, H]``), marked dynamic before each call, so the first trace already serves every
    token count and the second step never recompiles. Other dimensions stay static, so the
    runner can pad and capture. Built by :func:`compile`.
    """

    def __init__(self, model: torch.nn.Module, backend: Backend) -> None:
        self.model = model
        self.backend = backend
        # Steps after Dynamo's first call of a graph skip Dynamo (fullcg.dispatch);
        # debug_checks keeps every step on Dynamo's guards.
        self._direct = None if backend.config.debug_checks else DirectDispatch(model, backend.runners)
        self._positions = positions_argument(model) if backend.config.debug_checks else None
        options = {"guard_filter_fn": self._direct.note_guards} if self._direct is not None else None
        #: Whether the layers are marked as compile regions (until a trace fails with them).
        from fullcg.regions import mark_repeated_layers, unmark_repeated_layers

        if backend.config.trace_layers_once:
            self._marked = mark_repeated_layers(model) > 0
        else:
            self._marked = False
            unmark_repeated_layers(model)  # marked by an earlier fullcg.compile
        # Made on the first step that needs Dynamo: torch.compile imports Dynamo (a second or
        # more), which a warm start (fullcg.warm_start) never needs.
        self._compile_options = options
        self._compiled_fn: Any = None
        self._warm = None
        if backend.config.compiler == "inductor":
            from fullcg import source_keys

            source_keys.prefetch()
        if self._direct is not None and backend.config.warm_start:
            from fullcg.warm_start import WarmStart

            self._warm = WarmStart(model, backend, self._direct)
            backend.keep_sources = True  # each runner keeps its graph until the warm entry has it

    @property
    def _compiled(self) -> Any:
        """``torch.compile`` of the model with the fullcg backend, made on first use."""
        if self._compiled_fn is None:
            from fullcg.bytecode import warn_if_uncached

            warn_if_uncached()  # (once a process) torch.compile imports Dynamo, whatever the compiler
            self._compiled_fn = torch.compile(self.model, backend=self.backend, options=self._compile_options)
        return self._compiled_fn

    @_compiled.setter
    def _compiled(self, fn: Any) -> None:
        self._compiled_fn = fn

    @property
    def config(self) -> FullCGConfig:
        """The config every step runs under (the backend's)."""
        return self.backend.config

    @property
    def runners(self) -> list[StepRunner]:
        """One runner per graph compiled so far (each has a ``report``)."""
        return self.backend.runners

    def step_counts(self) -> collections.Counter[str]:
        """This model's steps by how they ran (keys as :func:`fullcg.graph_mode_counts`)."""
        return self.backend.counts.snapshot()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        direct = self._direct
        if direct is not None and not kwargs:
            if self._warm is not None and not self._warm.tried:
                self._warm.load(args)
            out = direct(args)
            if out is not MISS:
                return out
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and value.dim() >= 1:
                torch._dynamo.mark_dynamic(value, 0)
        if direct is None or kwargs:
            if self.backend.config.debug_checks:
                check_call_positions(self._positions, args, kwargs)
            return self._traced(*args, **kwargs)
        with observed_runner_calls() as calls:
            result = self._traced(*args)
        route = direct.learn(args, calls, result)
        if route is not None and self._warm is not None:
            self._warm.save(args, route.runner, direct.slots_of(route), route.unwrap, route.facts,
                            direct.value_guards.get(id(route.runner), ()))
        return result

    def _traced(self, *args: Any, **kwargs: Any) -> Any:
        """The step through Dynamo. While the model's layers are marked as regions
        (:mod:`fullcg.regions`), a trace that fails (Dynamo could not hold a layer in a
        region, or mapped a stamped-out layer onto another layer's tensors) is traced again
        with the layers unmarked, each on its own; an error that remains then is raised."""
        # Floats stay constants: after the same code ran with another value (a softmax scale
        # of a second model in the process), Dynamo would trace them as symbolic graph inputs,
        # which fullcg's ops (a constant scale) and pieces do not take.
        with _SPECIALIZED_FLOATS, torch._dynamo.config.patch(specialize_float=True):
            return self._traced_as_regions(*args, **kwargs)

    def _traced_as_regions(self, *args: Any, **kwargs: Any) -> Any:
        if not self._marked:
            return self._compiled(*args, **kwargs)
        from torch._dynamo.exc import InternalTorchDynamoError, Unsupported

        try:
            return self._compiled(*args, **kwargs)
        except (RegionReuseError, InternalTorchDynamoError, Unsupported) as exc:
            # Dynamo's own refusals only: the model's errors, the backend's and fullcg's are
            # the same without regions, and raise as they are.
            from fullcg.regions import unmark_repeated_layers

            self._marked = False
            if not unmark_repeated_layers(self.model):
                raise
            reason = "" if isinstance(exc, RegionReuseError) else f"{type(exc).__name__}: "
            logger.warning("fullcg: tracing %s with its layers as compile regions failed (%s%s); tracing it again, "
                           "every layer on its own", type(self.model).__name__, reason,
                           (str(exc).splitlines() or [""])[0])
            return self._compiled(*args, **kwargs)

    def __repr__(self) -> str:
        return f"fullcg.compile({type(self.model).__name__}, graph_mode={self.backend.config.graph_mode})"
