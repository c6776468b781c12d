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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fullcg import cudagraph, kernel_build
from fullcg.config import FullCGConfig, GraphMode
from fullcg.context import ForwardContext, derived, derived_context, enter, get_forward_context, leave
from fullcg.frontend import progress_bar
from fullcg.metadata import AttentionMetadata, ForwardMode
from fullcg.ops.impl import AttentionImpl, resolve_implementation
from fullcg.telemetry import StepCounts, counts_discarded, graph_mode_counts, model_counts, reset_graph_mode_counts

__all__ = [
    "StepRunner", "InputStager", "StaticMetadata", "StaticTables", "PieceCall", "padded_size", "dummy_metadata",
    "observed_runner_calls", "graph_mode_counts", "reset_graph_mode_counts",
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


#: The step counters' key of (variant, captured): ``full:captured``, ``piecewise:eager``, ...
_COUNT_KEYS = {(mode, captured): f"{mode.value}:{'captured' if captured else 'eager'}"
               for mode in (GraphMode.FULL, GraphMode.PIECEWISE) for captured in (False, True)}


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

    def pad(self, args: Sequence[Any]) -> tuple[int | None, int | None]:
        """(tokens, capture size) of a step's inputs: the size they are padded to, None when
        they exceed the largest (or the inputs disagree on the token count)."""
        if not self.token_args:
            return None, None
        n = args[self.token_args[0]].shape[0]
        if any(args[i].shape[0] != n for i in self.token_args) or any(args[i] != n for i in self.size_args):
            return None, None  # inputs with different token counts: not a shape this runner can pad
        sizes = self.sizes
        i = bisect.bisect_left(sizes, n)
        return n, (sizes[i] if i < len(sizes) else None)

    def num_tokens(self, args: Sequence[Any]) -> int | None:
        """The token count of a step's inputs (None: they disagree on it)."""
        return self.pad(args)[0]

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


class StaticTables:
    """The page table and slot mapping that every capture size's full graphs read.

    One pair for all sizes (size ``S`` uses the first ``S`` rows): a table as wide as a
    request's longest page list, not one per size. Sharing is safe because refills and
    replays are ordered on one stream. Refills clear only what the previous batch left.
    """

    def __init__(self, max_size: int, max_pages: int, device: torch.device) -> None:
        with torch.inference_mode(False):  # normal tensors: refilled in or out of inference mode
            self.page_table = torch.zeros(max_size, max_pages, dtype=torch.int32, device=device)
            self.slot_mapping = torch.full((max_size,), -1, dtype=torch.int64, device=device)
        self._table_rows = 0  # rows the last batch wrote (the rest are zeros)
        self._table_cols = 0  # columns the last batch wrote
        self._slots = 0  # slots the last batch wrote (the rest are -1)
        #: Pages per request the table holds (``max_pages_per_request``).
        self.max_pages = max_pages

    def fill(self, md: AttentionMetadata) -> None:
        r, n = len(md.query_lens), md.num_tokens
        cols = min(md.page_table.shape[1], self.max_pages)
        if self._table_rows > r or self._table_cols > cols:
            self.page_table[: self._table_rows, : self._table_cols].zero_()
        self.page_table[:r, :cols].copy_(md.page_table[:, :cols])
        self._table_rows, self._table_cols = r, cols
        self.slot_mapping[:n].copy_(md.slot_mapping)
        if self._slots > n:
            self.slot_mapping[n : self._slots].fill_(-1)
        self._slots = n


class StaticMetadata:
    """Metadata tensors at fixed addresses for one capture size, refilled before each replay.

    Padded layout: the real requests first; then one-token stand-in requests (decode mode,
    one key in page 0, never saved: slot -1) that own the padding tokens; then empty
    requests. Host fields stay the real batch's, for implementations that plan on the host.

    A refill is on the per-step path, so it is cheap: the small fields are written into one
    pinned host buffer and reach the device in one asynchronous copy (the host waits only
    if the previous refill's copy has not yet read that buffer); the page table and slot
    mapping are views of the shared :class:`StaticTables`.
    """

    def __init__(self, size: int, tables: StaticTables, device: torch.device) -> None:
        with torch.inference_mode(False):  # normal tensors: refilled in or out of inference mode
            self._allocate(size, tables, device)

    def _allocate(self, size: int, tables: StaticTables, device: torch.device) -> None:
        self.size = size
        self.tables = tables
        #: Pages per request the shared table holds.
        self.max_pages = tables.max_pages
        # int32 query_start_loc | seq_lens | prefix_lens | num_tokens, then bool is_decode:
        # views of one byte buffer, so one copy refills them all.
        num_ints = 3 * size + 2
        num_ints += -num_ints % 4  # is_decode starts 16-byte aligned, whatever the size
        nbytes = 4 * num_ints + size
        self._device_bytes = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        ints = self._device_bytes[: 4 * num_ints].view(torch.int32)
        self.query_start_loc = ints[: size + 1]
        self.seq_lens = ints[size + 1 : 2 * size + 1]
        self.prefix_lens = ints[2 * size + 1 : 3 * size + 1]
        self.num_tokens = ints[3 * size + 1 : 3 * size + 2]
        self.is_decode = self._device_bytes[4 * num_ints :].view(torch.bool)
        self._host_bytes = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self._host_ints = self._host_bytes[: 4 * num_ints].view(torch.int32).numpy()
        self._host_decode = self._host_bytes[4 * num_ints :].numpy()
        self._device = device
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self.page_table = tables.page_table[:size]
        self.slot_mapping = tables.slot_mapping[:size]
        self._device_fields = dict(
            page_table=self.page_table, slot_mapping=self.slot_mapping, query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens, prefix_lens_tensor=self.prefix_lens, is_decode=self.is_decode,
            num_tokens_tensor=self.num_tokens,
        )

    def fits(self, md: AttentionMetadata) -> bool:
        """Whether the batch's requests fit the static page table (and its tokens this size)."""
        return md.pages_needed <= self.max_pages and md.num_tokens <= self.size

    def fill(self, md: AttentionMetadata) -> AttentionMetadata:
        """:meth:`refill` with ``md``, and the batch with its device tensors swapped for these
        buffers (:meth:`metadata`)."""
        self.refill(md)
        return self.metadata(md)

    def metadata(self, md: AttentionMetadata) -> AttentionMetadata:
        """``md`` with its device tensors swapped for these buffers (host fields and what
        derives from them unchanged): what attention inside a full graph reads."""
        return md.with_device_tensors(**self._device_fields)

    def refill(self, md: AttentionMetadata) -> None:
        """Write batch ``md`` into the buffers (padded as the class doc says)."""
        size, n, r = self.size, md.num_tokens, len(md.query_lens)
        if md.pages_needed > self.max_pages or n > size:  # (fits(), inline: the per-step path)
            raise ValueError(
                f"a batch of {n} tokens whose longest request needs {md.pages_needed} pages does not fit captured "
                f"graphs of {size} tokens and {self.tables.max_pages} pages per request (max_pages_per_request)"
            )
        pad = size - n  # stand-in requests, one token each; requests r + pad .. size - 1 are empty
        if self._copied is not None:
            self._copied.synchronize()  # the previous refill's copy has read the host buffer
        h = self._host_ints
        h[: r + 1] = md.query_starts
        h[r + 1 : r + 1 + pad] = np.arange(n + 1, size + 1)
        h[r + 1 + pad : size + 1] = size
        seq = h[size + 1 : 2 * size + 1]
        seq[:r] = np.add(md.query_lens, md.prefix_lens)
        seq[r : r + pad] = 1
        seq[r + pad :] = 0
        prefix = h[2 * size + 1 : 3 * size + 1]
        prefix[:r] = md.prefix_lens
        prefix[r:] = 0
        h[3 * size + 1] = n
        decode = self._host_decode
        decode[:r] = md.decode_flags
        decode[r : r + pad] = 1
        decode[r + pad :] = 0
        self._device_bytes.copy_(self._host_bytes, non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self._device))  # the copy's stream
        self.tables.fill(md)


def dummy_metadata(size: int, decode_only: bool, page_size: int, device: torch.device) -> AttentionMetadata:
    """A batch of ``size`` tokens that writes nothing to the cache (slots -1) and reads page 0."""
    if decode_only:
        return AttentionMetadata.stand_in(
            [1] * size, [1] * size, torch.zeros(size, 1, dtype=torch.int32), page_size,
            [ForwardMode.DECODE] * size, device=device,
        )
    pages = -(-size // page_size)
    return AttentionMetadata.stand_in([size], [0], torch.zeros(1, pages, dtype=torch.int32), page_size, device=device)


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
        #: (graph, example inputs) it was compiled from, until a warm-start entry is made of them.
        self.source: tuple[torch.fx.GraphModule, list[Any]] | None = None
        #: The compiled model's step counts (shared by its runners).
        self.counts = counts if counts is not None else model_counts()
        self.sizes = stager.sizes if stager is not None else config.sizes_to_capture
        self.captures = pool is not None and stager is not None and bool(self.sizes)
        self.full_graphs: dict[tuple[int, bool], cudagraph.Captured] = {}
        self.static_metadata: dict[int, StaticMetadata] = {}
        self.tables: StaticTables | None = None
        self.on_first_call: Callable[[], None] | None = None
        self._first_call = True
        self._planners: dict[tuple[int, bool], tuple[AttentionImpl, ...]] = {}
        self._full_ok: bool | None = None
        #: The split report of the graph this runner runs (see fullcg.debug.split_report).
        self.report = ""
        #: ``(layer calls, distinct regions)`` Dynamo traced as nested compile regions
        #: (:mod:`fullcg.regions`): ``(32, 1)`` when one layer's trace served all 32.
        self.regions = (0, 0)
        self._kv_caches: Mapping[int, Any] | None = None  # the caches full graphs were captured on
        self._cache_uids: tuple[tuple[int, int], ...] = ()

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
            if not (self._full_ok if self._full_ok is not None else self.full_capture_ok()):
                return piecewise
            limit = self.config.auto_full_max_tokens
            return full if decode_only or limit is None or tokens <= limit else piecewise
        return full if decode_only else piecewise

    # ------------------------------------------------------------------ the step

    def __call__(self, *args: Any) -> Any:
        """Run one step: pick the variant and the capture size, then replay (fill the graph's
        buffers, replay its CUDA graphs) or run the variant uncaptured."""
        ctx = get_forward_context()
        if self._first_call:
            self._first_step(args, ctx)
        elif ctx.kv_caches is not self._kv_caches:
            self._note_caches(ctx)
        if self.captures and getattr(_capture, "requested", False):
            _take_capture_request()
            self.capture_all(args, ctx)
        md = ctx.metadata
        n, size = self.stager.pad(args) if self.captures else (None, None)
        variant = self.choose(md.is_decode_only, size or n or md.num_tokens)
        static = None
        if size is not None and variant is GraphMode.FULL:
            static = self.static_metadata.get(size) or self._static(size, ctx)
            if not self._full_ok:
                size = None
            elif md.pages_needed > static.max_pages:
                # Requests longer than the static page table: piecewise pieces need none.
                if self.piecewise is not None:
                    variant = GraphMode.PIECEWISE
                else:
                    size = None
        if size is None:
            self.counts.add(_COUNT_KEYS[variant, False])
            graph = self.full if variant is GraphMode.FULL else self.piecewise
            with derived_context(ctx, config=self.config, variant=variant, padded_size=None), torch.no_grad():
                out = graph(*args)
        else:
            self.counts.add(_COUNT_KEYS[variant, True])
            # Inference mode throughout: graph outputs made while capturing under it are updated
            # in place by eager split points on later steps, which only inference mode allows.
            with torch.inference_mode():
                staged = self.stager.stage(args, n, size)
                if variant is GraphMode.FULL:
                    out = self._replay_full(ctx, staged, size, static)
                else:
                    out = self._run_piecewise(ctx, staged, size)
            out = _slice_tokens(out, self.token_outputs, n)
        calls = getattr(_observed, "calls", None)
        if calls is not None:
            calls.append((self, args, out))
        return out

    def _first_step(self, args: tuple[Any, ...], ctx: ForwardContext) -> None:
        if self.on_first_call is not None:
            hook, self.on_first_call = self.on_first_call, None
            hook()
        self.full_capture_ok()  # decided (and warned about) once
        self._note_caches(ctx)
        self._first_call = False  # only now: a step that failed above sets up again
        if self.captures:  # compilers run before any capture, not inside the first one
            kernel_build.before_capture(ctx, self.config)
        if self.captures and (_take_capture_request() or self.config.capture_on_compile):
            self.capture_all(args, ctx)

    def _note_caches(self, ctx: ForwardContext) -> None:
        """Remember the step's KV caches; when a layer's cache is another than the one the
        full graphs were captured on (they hold its addresses), drop those graphs: they are
        captured again on the new caches when next used. (The layers' ops read their caches
        when they run, so nothing compiled depends on them.)"""
        caches = ctx.kv_caches
        uids = tuple((layer, cache.uid) for layer, cache in caches.items())
        if uids != self._cache_uids:
            if self.full_graphs:
                logger.info("fullcg: the model's KV caches changed; its %d full CUDA graphs are captured again on "
                            "the new ones when next used", len(self.full_graphs))
                if self.pool is not None:
                    # Into a new pool: dropping the graphs may leave the old one without a live
                    # graph (graph_mode="full"), and such a pool cannot be captured into again.
                    self.pool = torch.cuda.graph_pool_handle()
            self.full_graphs.clear()
            self._planners.clear()
            self.static_metadata.clear()
            self.tables = None  # sized for the caches' page count
            self._cache_uids = uids
            # The caches of a compiled model: an eager step over them is its fallback (see telemetry).
            for cache in caches.values():
                cache.compiled_counts = self.counts
        self._kv_caches = caches

    def _run_piecewise(self, ctx: ForwardContext, staged: list[Any], size: int) -> Any:
        with derived_context(ctx, config=self.config, variant=GraphMode.PIECEWISE, padded_size=size):
            return self.piecewise(*staged)

    def _static(self, size: int, ctx: ForwardContext) -> StaticMetadata:
        static = self.static_metadata.get(size)
        if static is None:
            if self.tables is None:
                width = self.config.max_pages_per_request or max(
                    (c.num_pages for c in ctx.kv_caches.values()), default=1
                )
                self.tables = StaticTables(self.sizes[-1], width, self.device)
            static = self.static_metadata[size] = StaticMetadata(size, self.tables, self.device)
        return static

    def _replay_full(self, ctx: ForwardContext, staged: list[Any], size: int,
                     static: StaticMetadata | None = None) -> Any:
        """Fill the static metadata of ``size``, replay the full graph of ``size`` and the
        batch kind (captured on first use), after the host-side plans of the attention
        implementations that make them. Without a capture or a plan to make, nothing in
        the replay reads a forward context, so none is entered."""
        if static is None:  # capturing up front
            static = self.static_metadata.get(size) or self._static(size, ctx)
        md = ctx.metadata
        static.refill(md)
        key = (size, md.is_decode_only)
        entry = self.full_graphs.get(key)
        if entry is not None and not self._planners[key]:
            entry.graph.replay()
            return entry.output
        static_ctx = derived(ctx, config=self.config, variant=GraphMode.FULL, padded_size=size,
                             metadata=static.metadata(md))
        enter(static_ctx)
        try:
            if entry is None:
                entry = self.full_graphs[key] = cudagraph.capture_graph(
                    self.full, staged, self.device, self.pool, before_capture=static_ctx.step.clear
                )
                # Pieces captured as the model runs (no compiler) skip their warm-up at this size.
                note_warm = getattr(self.piecewise, "note_warm", None)
                if note_warm is not None:
                    note_warm(size)
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
            md = dummy_metadata(size, decode_only, page_size, self.device)
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
