"""The per-step call path of a compiled model: pick a graph variant, pad, replay or run.

A compiled model has up to two variants of its graph: *piecewise* (pieces captured one
by one, attention eager between them) and *full* (the same pieces and attention inside
one CUDA graph; for the compile backend the same split graph object). Each step the runner picks
one by the graph mode's policy (:class:`fullcg.config.GraphMode`) and the batch, and on
CUDA runs it as CUDA graphs when the batch fits a capture size (see
:mod:`fullcg.cudagraph`). The variant and the padded size are the step's *dispatch key*:
they travel in the forward context the graph runs in, where captured pieces read them.
Every step is counted by how it ran, so a mode is never changed silently: in the
compiled model's own :class:`fullcg.telemetry.StepCounts`, which add up to
:func:`graph_mode_counts`.

Whether a step's attention runs between pieces or inside one graph follows from the
variant alone (:mod:`fullcg.passes.split` defines the split points).
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fullcg import cudagraph
from fullcg.config import FullCGConfig, GraphMode
from fullcg.context import ForwardContext, derived, derived_context, enter, get_forward_context, leave
from fullcg.frontend import progress_bar
from fullcg.ops.impl import AttentionImpl, resolve_implementation
from fullcg.telemetry import StepCounts, counts_discarded, graph_mode_counts, model_counts, reset_graph_mode_counts

__all__ = [
    "StepRunner", "InputStager", "PieceCall", "padded_size", "observed_runner_calls", "graph_mode_counts", "reset_graph_mode_counts",
    "request_capture", "capture",
]

logger = logging.getLogger(__name__)

# A capture request is per thread, like the forward context that the capturing step runs in.
_capture = threading.local()


def request_capture() -> None:
    """Make the runners this thread calls next capture all their sizes (see :func:`capture`)."""
    _capture.requested = True


# Runner calls are observed per thread too (fullcg.dispatch learns from them).
_observed = threading.local()


class observed_runner_calls:
    """Collect the runner calls this thread makes inside the ``with`` block, as
    ``(runner, args, output)`` (for :class:`fullcg.dispatch.DirectDispatch`)."""

    def __enter__(self) -> list[tuple[StepRunner, tuple[Any, ...], Any]]:
        self._outer = getattr(_observed, "calls", None)
        self._calls: list[tuple[StepRunner, tuple[Any, ...], Any]] = []
        _observed.calls = self._calls
        return self._calls

    def __exit__(self, *exc: object) -> None:
        _observed.calls = self._outer
        if self._outer is not None:  # an enclosing block sees these calls too
            self._outer.extend(self._calls)


def _take_capture_request() -> bool:
    requested = getattr(_capture, "requested", False)
    _capture.requested = False
    return requested


def padded_size(num_tokens: int, sizes: Sequence[int]) -> int | None:
    """The smallest capture size >= ``num_tokens``; None when the batch is too large."""
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None


class InputStager:
    """Copies a step's token inputs into persistent buffers of the largest capture size.

    ``token_args`` are the positions of tensor inputs whose first dimension is the token
    count; ``size_args`` the positions of symbolic-int inputs (that count, as an int).
    Other inputs (weights) already live at fixed addresses. ``sizes`` are the capture sizes
    the graph may run padded to; ``admits`` says whether the graph may run at a token count
    (what its guards admit, see :func:`fullcg.backend.token_count_guard`; None: any).
    """

    def __init__(self, token_args: list[int], size_args: list[int], buffers: dict[int, torch.Tensor],
                 sizes: tuple[int, ...], admits: Callable[[int], bool] | None = None) -> None:
        self.token_args = token_args
        self.size_args = size_args
        self.buffers = buffers
        self.sizes = sizes
        self.admits = admits

    def num_tokens(self, args: Sequence[Any]) -> int | None:
        if not self.token_args:
            return None
        n = args[self.token_args[0]].shape[0]
        if any(args[i].shape[0] != n for i in self.token_args) or any(args[i] != n for i in self.size_args):
            return None  # inputs with different token counts: not a shape this runner can pad
        return n

    def stage(self, args: Sequence[Any], n: int, size: int) -> list[Any]:
        staged = list(args)
        for i in self.token_args:
            buf = self.buffers[i]
            buf[:n].copy_(args[i])
            staged[i] = buf[:size]
        for i in self.size_args:
            staged[i] = size
        return staged

    def dummy(self, args_like: Sequence[Any], size: int) -> list[Any]:
        """Inputs of ``size`` tokens for capturing up front: the buffers as they are (zeros at first)."""
        staged = list(args_like)
        for i in self.token_args:
            staged[i] = self.buffers[i][:size]
        for i in self.size_args:
            staged[i] = size
        return staged


class PieceCall:
    """Calls one compiled piece (or the full graph)."""

    def __init__(self, name: str, fn: Callable[..., Any], *, unwrap_single: bool = False) -> None:
        self.name = name
        self.fn = fn
        self.unwrap_single = unwrap_single

    def __call__(self, *args: Any) -> Any:
        out = self.fn(*args)
        return out[0] if self.unwrap_single else out

    def __repr__(self) -> str:
        return f"PieceCall({self.name})"


def _slice_tokens(value: Any, token_outputs: tuple[bool, ...] | None, n: int) -> Any:
    """The first ``n`` rows of the graph outputs that have a token dimension."""
    if isinstance(value, (tuple, list)) and token_outputs is not None and len(value) == len(token_outputs):
        return type(value)(v[:n] if tok else v for v, tok in zip(value, token_outputs))
    if isinstance(value, torch.Tensor):
        return value[:n]
    return value


class StepRunner:
    """What the compile backend returns to Dynamo: runs one step of the compiled model.

    One runner belongs to one model (Dynamo guards on the layers' KV caches); step it from
    one thread at a time.
    """

    def __init__(
        self,
        config: FullCGConfig,
        *,
        piecewise: Callable[..., Any] | None,
        full: Callable[..., Any] | None,
        device: torch.device,
        pool: Any = None,
        stager: InputStager | None = None,
        token_outputs: tuple[bool, ...] | None = None,
        full_capturable: bool = True,
        counts: StepCounts | None = None,
    ) -> None:
        if piecewise is None and full is None:
            raise ValueError("a StepRunner needs a piecewise or a full graph")
        self.config = config
        self.piecewise = piecewise
        self.full = full
        self.device = device
        self.pool = pool
        self.stager = stager
        self.token_outputs = token_outputs
        self.full_capturable = full_capturable
        #: The compiled model's step counts (shared by its runners).
        self.counts = counts if counts is not None else model_counts()
        self.sizes = stager.sizes if stager is not None else config.sizes_to_capture
        self.captures = pool is not None and stager is not None and bool(self.sizes)
        self.full_graphs: dict[tuple[int, bool], cudagraph.Captured] = {}
        self.static_metadata: dict[int, cudagraph.StaticMetadata] = {}
        self.tables: cudagraph.StaticTables | None = None
        self.on_first_call: Callable[[], None] | None = None
        self._first_call = True
        self._planners: dict[tuple[int, bool], tuple[AttentionImpl, ...]] = {}
        self._full_ok: bool | None = None
        #: The split report of the graph this runner runs (see fullcg.debug.split_report).
        self.report = ""

    # ------------------------------------------------------------------ policy

    def full_capture_ok(self) -> bool:
        """Whether the full graph can be captured: a capture-safe implementation and no
        prefix-chunk gathers (they read the chunk plan on the host). Fixed per runner."""
        if self._full_ok is None:
            impl = resolve_implementation(self.config.attention_impl, self.device)
            self._full_ok = self.full is not None and self.full_capturable and impl.capture_safe
            if not self._full_ok and self.full is not None and self.config.graph_mode is not GraphMode.AUTO:
                if not self.full_capturable:
                    logger.warning("fullcg: the full graph gathers prefix chunks on the host; running it uncaptured "
                                   "(use graph_mode='auto' or 'piecewise' for the chunked-prefix pattern)")
                else:
                    logger.warning(f"fullcg: attention implementation {impl.name!r} cannot be captured in a full "
                                   "CUDA graph; full steps run uncaptured (use attention_impl='triton' or 'flashinfer')")
        return self._full_ok

    def choose(self, decode_only: bool, tokens: int) -> GraphMode:
        """:attr:`GraphMode.FULL` or :attr:`GraphMode.PIECEWISE` for a step of ``tokens``
        tokens (padded to its capture size when it has one) of the given batch kind."""
        full, piecewise = GraphMode.FULL, GraphMode.PIECEWISE
        if self.piecewise is None:
            return full
        if self.full is None:
            return piecewise
        if self.config.graph_mode is GraphMode.AUTO:
            if not self.full_capture_ok():
                return piecewise
            limit = self.config.auto_full_max_tokens
            return full if decode_only or limit is None or tokens <= limit else piecewise
        return full if decode_only else piecewise

    # ------------------------------------------------------------------ the step

    def __call__(self, *args: Any) -> Any:
        out = self._step(args)
        calls = getattr(_observed, "calls", None)
        if calls is not None:
            calls.append((self, args, out))
        return out

    def _step(self, args: tuple[Any, ...]) -> Any:
        ctx = get_forward_context()
        if self._first_call:
            self._first_step(args, ctx)
        elif self.captures and _take_capture_request():
            self.capture_all(args, ctx)
        variant, n, size = self._dispatch_key(args, ctx)
        if size is None:
            self.counts.add(f"{variant.value}:eager")
            graph = self.full if variant is GraphMode.FULL else self.piecewise
            with derived_context(ctx, config=self.config, variant=variant, padded_size=None), torch.no_grad():
                return graph(*args)
        self.counts.add(f"{variant.value}:captured")
        # Inference mode throughout: graph outputs made while capturing under it are updated
        # in place by eager split points on later steps, which only inference mode allows.
        with torch.inference_mode():
            staged = self.stager.stage(args, n, size)
            if variant is GraphMode.FULL:
                out = self._replay_full(ctx, staged, size)
            else:
                out = self._run_piecewise(ctx, staged, size)
        return _slice_tokens(out, self.token_outputs, n)

    def _first_step(self, args: tuple[Any, ...], ctx: ForwardContext) -> None:
        self._first_call = False
        if self.on_first_call is not None:
            hook, self.on_first_call = self.on_first_call, None
            hook()
        # The caches of a compiled model: an eager step over them is its fallback (see telemetry).
        for cache in ctx.kv_caches.values():
            cache.compiled_counts = self.counts
        if self.captures and (_take_capture_request() or self.config.capture_on_compile):
            self.capture_all(args, ctx)

    def _dispatch_key(self, args: tuple[Any, ...], ctx: ForwardContext) -> tuple[GraphMode, int | None, int | None]:
        """(variant, real tokens, capture size) of the step; the size is None when the step
        runs uncaptured."""
        n = self.stager.num_tokens(args) if self.captures else None
        size = padded_size(n, self.sizes) if n is not None else None
        variant = self.choose(ctx.metadata.is_decode_only, size or n or ctx.metadata.num_tokens)
        if size is not None and variant is GraphMode.FULL:
            if not self.full_capture_ok():
                size = None
            elif not self._static(size, ctx).fits(ctx.metadata):
                # Requests longer than the static page table: piecewise pieces need none.
                if self.piecewise is not None:
                    variant = GraphMode.PIECEWISE
                else:
                    size = None
        return variant, n, size

    def _run_piecewise(self, ctx: ForwardContext, staged: list[Any], size: int) -> Any:
        with derived_context(ctx, config=self.config, variant=GraphMode.PIECEWISE, padded_size=size):
            return self.piecewise(*staged)

    def _static(self, size: int, ctx: ForwardContext) -> cudagraph.StaticMetadata:
        static = self.static_metadata.get(size)
        if static is None:
            if self.tables is None:
                width = self.config.max_pages_per_request or max(
                    (c.num_pages for c in ctx.kv_caches.values()), default=1
                )
                self.tables = cudagraph.StaticTables(self.sizes[-1], width, self.device)
            static = self.static_metadata[size] = cudagraph.StaticMetadata(size, self.tables, self.device)
        return static

    def _replay_full(self, ctx: ForwardContext, staged: list[Any], size: int) -> Any:
        """Fill the static metadata of ``size``, plan the host side of attention, replay the
        full graph of ``size`` and the batch kind (captured on first use)."""
        md = self._static(size, ctx).fill(ctx.metadata)
        key = (size, ctx.metadata.is_decode_only)
        static_ctx = derived(ctx, config=self.config, variant=GraphMode.FULL, padded_size=size, metadata=md)
        enter(static_ctx)
        try:
            entry = self.full_graphs.get(key)
            if entry is None:
                entry = self.full_graphs[key] = cudagraph.capture_graph(
                    self.full, staged, self.device, self.pool, before_capture=static_ctx.step.clear
                )
                # The implementations the captured attention calls resolved (per head dims)
                # that plan on the host: their plans are refilled before every replay.
                self._planners[key] = tuple(i for i in static_ctx.step.resolved() if type(i).plan is not AttentionImpl.plan)
            for impl in self._planners[key]:
                impl.plan(static_ctx)
            entry.graph.replay()
        finally:
            leave()
        return entry.output

    def capture_all(self, args: tuple[Any, ...], ctx: ForwardContext) -> None:
        """Capture every size up front (largest first, so smaller graphs reuse its pool memory).

        Captures what the policy will replay (:meth:`choose`): per size and batch kind, the
        full graph or the pieces. Pieces serve every batch kind, so they are captured once.
        """
        page_size = next(iter(ctx.kv_caches.values())).page_size if ctx.kv_caches else 16
        jobs = self.capture_jobs()
        bar = progress_bar(len(jobs), "fullcg: capturing CUDA graphs", "graph")
        with counts_discarded():  # stand-in batches: not steps the counters report
            self._capture(jobs, args, ctx, page_size, bar)
        bar(0, done=True)

    def capture_jobs(self) -> list[tuple[GraphMode, int, bool]]:
        """``(variant, size, decode_only)`` for every graph :meth:`capture_all` captures,
        largest size first. Pieces serve both batch kinds (``decode_only`` False)."""
        full_ok = self.full_capture_ok()
        jobs = []
        for size in sorted(self.sizes, reverse=True):
            variants = {decode_only: self.choose(decode_only, size) for decode_only in (True, False)}
            jobs += [(v, size, decode_only) for decode_only, v in variants.items() if v is GraphMode.FULL and full_ok]
            if GraphMode.PIECEWISE in variants.values():
                jobs.append((GraphMode.PIECEWISE, size, False))
        return jobs

    def _capture(self, jobs: list[tuple[GraphMode, int, bool]], args: tuple[Any, ...], ctx: ForwardContext,
                 page_size: int, bar: Callable[..., None]) -> None:
        for variant, size, decode_only in jobs:
            md = cudagraph.dummy_metadata(size, decode_only, page_size, self.device)
            staged = self.stager.dummy(args, size)
            with derived_context(ctx, config=self.config, variant=variant, padded_size=size, metadata=md) as dummy, \
                    torch.inference_mode():
                if variant is GraphMode.FULL:
                    self._replay_full(dummy, staged, size)
                else:
                    self._run_piecewise(dummy, staged, size)
            bar(1)


def capture(compiled: Callable[..., Any], metadata: Any, kv_caches: Any, *inputs: Any) -> Any:
    """Capture every capture size of ``compiled`` now, with a progress bar, then run one step.

    ``compiled`` is ``torch.compile(model, backend="fullcg")``; ``metadata``, ``kv_caches``
    and ``inputs`` describe any valid step (it compiles the model if needed and is then
    run normally). Capturing writes nothing to the KV cache: stand-in batches use slot -1.
    """
    from fullcg.context import forward_context

    request_capture()
    try:
        with forward_context(metadata, kv_caches), torch.no_grad():
            return compiled(*inputs)
    finally:
        # A call that reached no capturing runner (on the CPU, or not a compiled fullcg
        # model) must not leave the request to the next model this thread steps.
        _take_capture_request()
