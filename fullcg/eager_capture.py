"""Capture without a compiler: CUDA graphs of a model that runs eagerly.

``fullcg.compile(model, compiler="none")`` runs no Dynamo and no Inductor: the model's own
Python runs every step, and on CUDA each capture size is captured the first time it is
used (or up front with :func:`fullcg.capture`), so startup is capture time. It offers what
the compiled path offers, through the same :class:`fullcg.runner.StepRunner` (policy,
padding, counters, capture up front):

- *full*: the whole step captured in one CUDA graph, attention inside, exactly as for a
  compiled model;
- *piecewise*: a :class:`SegmentedGraph`, SGLang's breakable CUDA graph. The model runs
  eagerly under capture; a :class:`~torch.utils._python_dispatch.TorchDispatchMode` ends
  the current graph *segment* at every split point (every attention call, and the ops that
  read the step's prefix-chunk plan on the host: :func:`fullcg.passes.split.is_split_target`),
  runs the op eagerly and records it, and begins the next segment in the same memory
  pool. A replay is: segment, op, segment, op, ..., segment. The ops run eagerly between
  replays with the step's real metadata, as the compiled path's split points do, and a
  fresh tensor an op returns (the LSE) is copied into a fixed *bridge* buffer that the
  next segment reads.

What is captured is what the model's Python did for that size: it must launch the same
kernels, with no host reads of tensor values, for every step that pads to the size; only
the split ops may depend on the batch. The capture primitive is a seam (:class:`Graphs`,
:class:`CudaGraphs` on a GPU), so the segment logic is also tested on the CPU.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fullcg import cudagraph, kernel_build
from fullcg.config import FullCGConfig, GraphMode
from fullcg.context import (
    ForwardContext, check_call_positions, current_padded_size, derived_context, get_forward_context, mla_mha_step,
    num_prefix_chunks, positions_argument, prefix_chunk_tokens,
)
from fullcg.errors import InvalidConfigError
from fullcg.frontend import device_of, note_device
from fullcg.ops.attention import EAGER_KERNELS
from fullcg.passes.split import is_split_target, reads_host_plan
from fullcg.runner import InputStager, StepRunner, dummy_metadata
from fullcg.telemetry import counts_discarded, model_counts

__all__ = ["Graphs", "CudaGraphs", "SegmentedGraph", "EagerCaptureModel", "launches_nothing"]

logger = logging.getLogger(__name__)
#: Runners (graph sets) one model may have, as Dynamo's recompile limit bounds its graphs.
_MAX_RUNNERS = 8

_aten = torch.ops.aten
# Ops that allocate and launch no kernel; with views, they are all a segment may hold and
# still be empty (nothing to capture or replay).
_ALLOCATIONS = frozenset((_aten.empty, _aten.empty_strided, _aten.empty_like, _aten.new_empty, _aten.new_empty_strided))
# Ops that index the prefix-chunk plan from the model's Python (a loop over
# context.num_prefix_chunks()): the kernels around them depend on the chunk count and rows.
_CHUNK_INDEXED = (torch.ops.fullcg.gather_prefix_chunk.default,)


def launches_nothing(func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> bool:
    """Whether a call of op overload ``func`` that returned ``out`` launched no kernel: an
    allocation, or a view whose results alias its inputs (by schema ``aten.to`` is a view
    too, yet it copies when it converts)."""
    if getattr(func, "overloadpacket", None) in _ALLOCATIONS:
        return True
    if not getattr(func, "is_view", False):
        return False
    inputs = _storages(args, kwargs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return all(not isinstance(o, torch.Tensor) or o.untyped_storage().data_ptr() in inputs for o in outs)


class Graphs(Protocol):
    """The graph primitive a :class:`SegmentedGraph` captures with (CUDA graphs on a GPU).

    All segments of a model are captured into one memory pool, in order; replays come in
    the order of capture. ``pool`` is what :class:`StepRunner` captures its full graphs in.
    """

    pool: Any

    def synchronize(self) -> None:
        """Wait until the device is idle (after warm-up, before capture)."""

    def begin(self) -> Any:
        """Begin capturing a segment; returns its handle."""

    def end(self, handle: Any, launched: bool) -> Any:
        """End capturing and run the segment once (capture computes nothing, and the op
        after the segment reads its results); returns the graph to replay, or None when
        the primitive knows the segment holds no work (``launched`` is False when no op
        torch dispatched launched a kernel: only a hint, kernels launched around the
        dispatcher are not seen)."""

    def abort(self, handle: Any) -> None:
        """End a capture that failed; nothing of it is kept."""

    def replay(self, graph: Any) -> None:
        """Replay a graph that :meth:`end` returned."""


class CudaGraphs:
    """Segments as CUDA graphs in one pool, captured on a side stream, replayed on the current one.

    Captured through :func:`fullcg.cudagraph.begin_capture`, as the compiled path's graphs
    are: cheaper per segment than ``torch.cuda.graph``, which empties the allocator's cache
    at every capture (a 32-layer model has 33 segments per size).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self._capturing: contextlib.ExitStack | None = None

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def begin(self) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        self._capturing = cudagraph.begin_capture(graph, self.device, self.pool)
        return graph

    def end(self, graph: torch.cuda.CUDAGraph, launched: bool) -> torch.cuda.CUDAGraph:
        # Kept and replayed even when no dispatched op launched a kernel: kernels that
        # bypass torch's dispatcher (a raw Triton launch) are invisible to `launched`, and
        # an empty graph's replay costs microseconds. `launched` only silences torch's
        # warning about an empty capture where one is expected.
        capturing, self._capturing = self._capturing, None
        with warnings.catch_warnings():
            if not launched:
                warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            cudagraph.end_capture(graph, capturing)
        graph.replay()
        return graph

    def abort(self, graph: torch.cuda.CUDAGraph) -> None:
        capturing, self._capturing = self._capturing, None
        if capturing is not None:
            cudagraph.end_capture(graph, capturing, failed=True)

    def replay(self, graph: torch.cuda.CUDAGraph) -> None:
        graph.replay()


@dataclasses.dataclass(eq=False, slots=True)
class _Split:
    """A split op as recorded at capture: called again with the same arguments at replay."""

    kernel: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    bridge: Any  # where fresh tensor results are copied (None where the op returns none)


@dataclasses.dataclass(eq=False)
class _Segments:
    """One size's capture: each segment's graph (None if empty) with the split op after it
    (None after the last), in order; the model's output; the input addresses."""

    segments: list[tuple[Any, _Split | None]]
    output: Any
    input_ptrs: tuple[int, ...]

    @property
    def num_segments(self) -> int:
        return len(self.segments)


def _storages(args: Sequence[Any], kwargs: dict[str, Any]) -> set[int]:
    found: set[int] = set()
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.add(value.untyped_storage().data_ptr())
        elif isinstance(value, (tuple, list)):
            found |= _storages(value, {})
    return found


def _bridge(result: Any, inputs: set[int]) -> tuple[Any, Any]:
    """(bridge, what the model gets): fresh tensors are cloned into fixed buffers; results
    that alias an argument already live at a fixed address and pass through."""
    if isinstance(result, torch.Tensor):
        if result.untyped_storage().data_ptr() in inputs:
            return None, result
        with torch.inference_mode(False):  # a normal tensor: refilled in or out of inference mode
            bridge = result.clone()
        return bridge, bridge
    if isinstance(result, (tuple, list)):
        pairs = [_bridge(r, inputs) for r in result]
        if all(b is None for b, _ in pairs):
            return None, result
        return type(result)(b for b, _ in pairs), type(result)(r for _, r in pairs)
    return None, result


class _NoDynamoMode(TorchDispatchMode):
    """A dispatch mode whose ``__torch_dispatch__`` torch does not wrap in a Dynamo disable.

    torch wraps it by default, and the wrapper imports Dynamo on its first call: over a
    second of startup for a path that runs no Dynamo at all.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


class _Splitter(_NoDynamoMode):
    """Active while a size is captured: ends the segment at every split op, runs the op
    eagerly outside any capture, records it, and begins the next segment."""

    def __init__(self, graphs: Graphs) -> None:
        super().__init__()
        self.graphs = graphs
        self.segments: list[tuple[Any, _Split | None]] = []
        self._handle: Any = None
        self._launched = False

    def begin(self) -> None:
        self._handle = self.graphs.begin()
        self._launched = False

    def end(self) -> Any:
        handle, self._handle = self._handle, None
        return self.graphs.end(handle, self._launched)

    def abort(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            self.graphs.abort(handle)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if not is_split_target(func):
            out = func(*args, **kwargs)
            if not self._launched and not launches_nothing(func, args, kwargs, out):
                self._launched = True
            return out
        graph = self.end()
        # The op's Python kernel, as the compiled path's split points call it: no
        # dispatcher round trip on every replay.
        kernel = EAGER_KERNELS.get(func, func)
        result = kernel(*args, **kwargs)
        bridge, returned = _bridge(result, _storages(args, kwargs))
        del result  # a fresh result is freed here, outside the capture (the model gets its bridge)
        self.segments.append((graph, _Split(kernel, args, kwargs, bridge)))
        self.begin()
        return returned


class SegmentedGraph:
    """The piecewise variant without a compiler: the model captured per size in segments
    broken at split ops, which run eagerly between segment replays.

    The capture size comes from the step's forward context (:func:`current_padded_size`);
    without one the model runs eagerly. The first call of a size warms up (kernels pick
    algorithms and compile, workspaces are allocated: never inside a capture), captures
    and computes the step; later calls replay.
    """

    def __init__(
        self, fn: Callable[..., Any], graphs: Graphs, *, name: str = "model", check_inputs: bool = False
    ) -> None:
        self.fn = fn
        self.graphs = graphs
        self.name = name
        self.check_inputs = check_inputs
        #: Capture per (size, prefix-chunk count, chunk rows) rather than per size: set for
        #: models that gather prefix chunks themselves (their kernels follow the chunk plan).
        self.per_chunk_plan = False
        self.entries: dict[Hashable, _Segments] = {}
        #: Sizes the model has already run at, warm-up included (a full graph's capture of
        #: that size): its segments hold the same kernels on the same shapes, so a capture
        #: of such a size needs no warm-up of its own (:meth:`note_warm`).
        self.warm_sizes: set[int] = set()

    def __call__(self, *args: Any) -> Any:
        size = current_padded_size()  # the step's dispatch key, from its forward context
        if size is None:
            return self.fn(*args)
        key: Hashable = (size, num_prefix_chunks(), prefix_chunk_tokens()) if self.per_chunk_plan else size
        if mla_mha_step():  # multi-head latent attention in MHA form: other ops, other segments
            key = (key, "mla_mha")
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = self._capture(size, args)
            return entry.output
        if self.check_inputs and cudagraph.tensor_ptrs(args) != entry.input_ptrs:
            raise RuntimeError(
                f"fullcg: the inputs of {self.name} (size {size}) moved since capture; "
                "the graph would read stale memory"
            )
        replay = self.graphs.replay
        for graph, split in entry.segments:
            if graph is not None:
                replay(graph)
            if split is not None:
                result = split.kernel(*split.args, **split.kwargs)
                if split.bridge is not None:
                    cudagraph.copy_into(split.bridge, result)
        return entry.output

    def note_warm(self, size: int) -> None:
        """The model has just run at ``size`` tokens, warmed up and captured whole (a full
        graph of that size): what a warm-up would do is done. The attention ops, which differ
        between batch kinds, run between the segments, outside any capture."""
        self.warm_sizes.add(size)

    def _capture(self, size: int, args: Sequence[Any]) -> _Segments:
        if size not in self.warm_sizes:
            with counts_discarded():  # the segments' replays compute the step; this run is only a warm-up
                self.fn(*args)  # warm-up: first runs pick kernels, compile and allocate, never inside a capture
        self.graphs.synchronize()
        splitter = _Splitter(self.graphs)
        splitter.begin()
        try:
            with splitter:
                output = self.fn(*args)
            graph = splitter.end()
        except BaseException as exc:
            splitter.abort()
            if hasattr(exc, "add_note"):
                exc.add_note(
                    f"fullcg: while capturing {self.name} for {size} tokens without a compiler: outside its attention "
                    "ops the model must launch the same kernels for every step of a size, with no host reads of tensor "
                    "values (.item(), .tolist(), printing); use graph_mode='none' to run it uncaptured"
                )
            raise
        splitter.segments.append((graph, None))
        entry = _Segments(splitter.segments, output, cudagraph.tensor_ptrs(args))
        empty = sum(g is None for g, _ in entry.segments)
        logger.info("fullcg: captured %s for %d tokens: %d segments (%d empty), %d eager ops between them",
                    self.name, size, entry.num_segments, empty, entry.num_segments - 1)
        return entry


class _ModelCall:
    """The model called eagerly with the runner's flat arguments (keyword arguments last).

    Its first call, and every uncaptured call, runs every attention op's shape and
    attribute checks, which compiled steps skip because tracing ran them once (the fake
    kernels); a captured size's later steps replay and never run the model's Python.
    """

    def __init__(self, model: torch.nn.Module, num_positional: int, kwarg_names: tuple[str, ...]) -> None:
        self.model = model
        self.num_positional = num_positional
        self.kwarg_names = kwarg_names
        self._checked = False

    def __call__(self, *args: Any) -> Any:
        ctx = get_forward_context()
        # A captured size runs the model's Python once (its shapes are then fixed); an
        # uncaptured step runs it on new shapes every time, with nothing traced to have
        # checked them: those are checked on every call, as eager calls are.
        if self._checked and ctx.padded_size is not None:
            return self._call(args)
        with derived_context(ctx, config=ctx.config.replace(debug_checks=True), variant=ctx.variant or GraphMode.FULL,
                             padded_size=ctx.padded_size, metadata=ctx.metadata):
            out = self._call(args)
        self._checked = True
        return out

    def _call(self, args: Sequence[Any]) -> Any:
        if not self.kwarg_names:
            return self.model(*args)
        p = self.num_positional
        return self.model(*args[:p], **dict(zip(self.kwarg_names, args[p:])))


class _PlanWatch(_NoDynamoMode):
    """Notes which ops that read the prefix-chunk plan on the host a run calls."""

    def __init__(self) -> None:
        super().__init__()
        self.reads_plan = False
        self.indexes_chunks = False

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if reads_host_plan(func):
            self.reads_plan = True
            self.indexes_chunks = self.indexes_chunks or func in _CHUNK_INDEXED
        return func(*args, **(kwargs or {}))


# Stand-in batches the model is probed with: (tokens, decode-only). Two token counts no
# other dimension is likely to share tell token outputs apart; decode stand-ins have a
# one-token prefix, so the batch has a prefix chunk for a model to gather.
_PROBES = ((3, True), (5, False))


@dataclasses.dataclass(frozen=True)
class _Probe:
    reads_plan: bool  # calls ops that read the chunk plan on the host: no full graph
    indexes_chunks: bool  # gathers chunk by chunk itself: its kernels follow the chunk plan
    token_outputs: tuple[bool, ...]


def _probe(call: _ModelCall, args: Sequence[Any], ctx: ForwardContext, config: FullCGConfig, variant: GraphMode,
           device: torch.device) -> _Probe:
    """Run the model on stand-in batches (they write nothing to the KV cache) to learn what
    tracing tells the compiled path: its token outputs, and its prefix-chunk ops."""
    with counts_discarded():  # stand-in batches: not steps the counters report
        return _probe_stand_ins(call, args, ctx, config, variant, device)


def _probe_stand_ins(call: _ModelCall, args: Sequence[Any], ctx: ForwardContext, config: FullCGConfig, variant: GraphMode,
                     device: torch.device) -> _Probe:
    page_size = next(iter(ctx.kv_caches.values())).page_size if ctx.kv_caches else 16
    watch = _PlanWatch()
    flags: tuple[bool, ...] | None = None
    for tokens, decode_only in _PROBES:
        md = dummy_metadata(tokens, decode_only, page_size, device)
        inputs = [
            torch.zeros((tokens, *a.shape[1:]), dtype=a.dtype, device=a.device) if isinstance(a, torch.Tensor) else a
            for a in args
        ]
        with derived_context(ctx, config=config, variant=variant, padded_size=None, metadata=md), \
                torch.inference_mode(), watch:
            out = call(*inputs)
        if not isinstance(out, (torch.Tensor, tuple, list)):
            raise TypeError(
                f"fullcg.compile(compiler='none'): the model returned a {type(out).__name__}; return a tensor or a "
                "tuple of tensors (wrap the model in a module that returns, say, the logits), so the padded token "
                "rows of captured steps can be cut off"
            )
        outs = out if isinstance(out, (tuple, list)) else (out,)
        now = tuple(isinstance(o, torch.Tensor) and o.dim() >= 1 and o.shape[0] == tokens for o in outs)
        flags = now if flags is None else tuple(a and b for a, b in zip(flags, now))
    assert flags is not None
    return _Probe(watch.reads_plan, watch.indexes_chunks, flags)


def _arg_key(index: int, value: Any) -> Hashable:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise TypeError(
                f"fullcg.compile(compiler='none'): argument {index} is a 0-d tensor, which a captured graph would keep "
                "reading from the first step's tensor; pass a Python number, or a tensor whose dimension 0 is the "
                "token count"
            )
        return (value.dtype, value.device, value.shape[1:])
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        raise TypeError(
            f"fullcg.compile(compiler='none'): argument {index} holds tensors in a {type(value).__name__}, which "
            "fullcg cannot stage for captured graphs; pass each tensor as an argument of its own"
        )
    return value


def _stager(args: Sequence[Any], config: FullCGConfig) -> InputStager | None:
    """Persistent zero buffers of the largest capture size for every tensor argument
    (dimension 0 is the token count), as the compiled path makes for its token inputs."""
    token_args = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    if not token_args:
        return None
    largest = config.sizes_to_capture[-1]
    with torch.inference_mode(False):  # persistent: written by every step, whatever its mode
        buffers = {i: torch.zeros((largest, *args[i].shape[1:]), dtype=args[i].dtype, device=args[i].device)
                   for i in token_args}
    return InputStager(token_args, [], buffers, config.sizes_to_capture)  # no guards: every size


def _report(config: FullCGConfig, device: torch.device, probe: _Probe | None, name: str) -> str:
    lines = [
        f"model: {name}",
        f"graph mode: {config.graph_mode}",
        f"device: {device}",
        "compiler: none (the model runs eagerly; captured per size, in segments broken at split points)",
        f"attention implementation: {config.attention_impl}",
        f"capture sizes: {list(config.sizes_to_capture)}",
    ]
    if probe is not None:
        reads = "yes (full graphs run uncaptured)" if probe.reads_plan else "no"
        lines.append(f"reads the prefix-chunk plan on the host: {reads}")
        lines.append(f"token outputs: {list(probe.token_outputs)}")
    return "\n".join(lines) + "\n"


class EagerCaptureModel:
    """A model run by fullcg without a compiler: what ``fullcg.compile(model, compiler="none")`` returns.

    Call it like the model, inside ``fullcg.forward_context``. Positional and keyword
    tensor arguments are token inputs (dimension 0 is the token count, the convention of
    models built on ``fullcg.Attention``); other arguments are constants of the step.
    Each distinct argument layout (dtypes, devices, trailing dimensions, constants, keyword
    names) and set of KV caches gets its own :class:`StepRunner`, as Dynamo would compile
    a graph for each: :attr:`runners`.

    ``graphs`` makes the graph primitive for a device (default: :class:`CudaGraphs` on CUDA,
    nothing to capture on the CPU, where every step runs eagerly).
    """

    def __init__(
        self, model: torch.nn.Module, config: FullCGConfig, *, graphs: Callable[[torch.device], Graphs] | None = None
    ) -> None:
        if config.compiler != "none":
            raise InvalidConfigError(
                f"EagerCaptureModel runs models without a compiler, but config.compiler is {config.compiler!r}: "
                "use fullcg.compile(model, config), which picks the path from config.compiler"
            )
        self.model = model
        self.config = config
        self._graphs = graphs
        self._runners: dict[Hashable, StepRunner] = {}
        #: Steps of this model (all its runners), by how they ran.
        self.counts = model_counts()
        self._positions = positions_argument(model) if config.debug_checks else None

    @property
    def runners(self) -> list[StepRunner]:
        """One runner per argument layout and set of KV caches seen so far (each has a ``report``)."""
        return list(self._runners.values())

    def step_counts(self) -> collections.Counter[str]:
        """This model's steps by how they ran (keys as :func:`fullcg.graph_mode_counts`)."""
        return self.counts.snapshot()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.config.debug_checks:
            check_call_positions(self._positions, args, kwargs)
        names = tuple(kwargs)
        if names:
            args = (*args, *kwargs.values())
        ctx = get_forward_context()
        # Captured graphs hold the caches' addresses: a layer given a new cache needs new
        # graphs (the compiled path's runner captures its full graphs again then).
        key = (names, tuple(_arg_key(i, a) for i, a in enumerate(args)), tuple(c.uid for c in ctx.kv_caches.values()))
        try:
            runner = self._runners.get(key)
        except TypeError:
            raise TypeError(
                "fullcg.compile(compiler='none'): the model's non-tensor arguments must be hashable constants "
                "(numbers, strings, None, tuples of them); pass tensors for values that change per step"
            ) from None
        if runner is None:
            if len(self._runners) >= _MAX_RUNNERS:
                raise RuntimeError(
                    f"fullcg.compile(compiler='none'): {len(self._runners)} argument layouts or KV-cache sets so far, "
                    "each with graphs of its own; a non-tensor argument that changes every step makes a new one each "
                    "time: pass values that change per step as tensors with a token dimension, or as fixed constants"
                )
            runner = self._runners[key] = self._build(args, names, ctx)
        return runner(*args)

    def _build(self, args: tuple[Any, ...], names: tuple[str, ...], ctx: ForwardContext) -> StepRunner:
        config = self.config
        device = device_of(args)
        name = type(self.model).__name__
        graphs: Graphs | None = None
        if config.graph_mode is not GraphMode.NONE:
            if self._graphs is not None:
                graphs = self._graphs(device)
            elif device.type == "cuda":
                graphs = CudaGraphs(device)
        if graphs is None:
            note_device(device, config, "the model runs eagerly")
        positional = len(args) - len(names)
        segmented: SegmentedGraph | None = None
        piecewise: Callable[..., Any] | None = None
        full: Callable[..., Any] | None = None
        if config.graph_mode.wants_piecewise:
            call = _ModelCall(self.model, positional, names)
            piecewise = call if graphs is None else (segmented := SegmentedGraph(
                call, graphs, name=name, check_inputs=config.debug_graph_inputs))
        if config.graph_mode.wants_full:
            full = _ModelCall(self.model, positional, names)
        probe: _Probe | None = None
        # What tracing tells the compiled path: needed to pad and capture, or for the
        # policy that runs full graphs when they can be captured.
        if graphs is not None or (piecewise is not None and full is not None):
            if graphs is not None:  # the probe is the model's first eager run: compilers run before it
                kernel_build.before_capture(ctx, config, self.model)
            probe = _probe(_ModelCall(self.model, positional, names), args, ctx, config,
                           GraphMode.FULL if full is not None else GraphMode.PIECEWISE, device)
            if segmented is not None:
                segmented.per_chunk_plan = probe.indexes_chunks
        stager = _stager(args, config) if graphs is not None else None
        runner = StepRunner(
            config, piecewise=piecewise, full=full, device=device, pool=graphs.pool if graphs is not None else None,
            stager=stager, token_outputs=probe.token_outputs if probe is not None else None,
            full_capturable=probe is None or not probe.reads_plan, counts=self.counts,
        )
        runner.report = _report(config, device, probe, name)
        logger.info("fullcg: %s runs without a compiler (graph mode %s on %s%s)", name, config.graph_mode, device,
                    ", captured per size" if runner.captures else ", uncaptured")
        return runner

    def __repr__(self) -> str:
        return f"fullcg.compile({type(self.model).__name__}, compiler=none, graph_mode={self.config.graph_mode})"
