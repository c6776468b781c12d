"""CUDA graph capture and replay, per capture size.

A step of ``n`` tokens runs captured when ``n`` is at most the largest capture size: it is
padded up to the next size ``S``, its token inputs are copied into persistent buffers,
and the graphs captured for ``S`` are replayed. All graphs of a compiled graph share one
memory pool.

- Piecewise: every compiled piece is a :class:`CapturedPiece` with one graph per size;
  split points (breakable attention, prefix gathers) run eagerly between them with the
  step's real metadata, and their outputs are copied into fixed *bridge* buffers so the
  next piece always reads the same addresses.
- Full: the whole step is one graph per ``(S, decode-only)``. Attention runs inside it,
  so it reads per-step metadata from :class:`StaticMetadata` buffers that are refilled
  before each replay (and the implementation's ``plan`` runs first, outside capture).

Outputs are views of static buffers: valid until the next step (all sizes share one
memory pool, so a step of another size may reuse an output's memory as scratch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fullcg.context import current_piece_size
from fullcg.metadata import AttentionMetadata, ForwardMode
from fullcg.telemetry import counts_discarded

__all__ = [
    "CapturedPiece", "BridgedPiece", "StaticMetadata", "StaticTables", "capture_graph", "begin_capture", "end_capture",
    "dummy_metadata", "tensor_ptrs", "copy_into",
]

logger = logging.getLogger(__name__)


def tensor_ptrs(values: Sequence[Any]) -> tuple[int, ...]:
    """The data addresses of ``values``' tensors (-1 for other values): what a graph was captured reading."""
    return tuple(v.data_ptr() if isinstance(v, torch.Tensor) else -1 for v in values)


@dataclasses.dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    output: Any
    input_ptrs: tuple[int, ...]


def capture_graph(
    fn: Callable[..., Any], args: Sequence[Any], device: torch.device, pool: Any,
    before_capture: Callable[[], None] | None = None,
) -> Captured:
    """Warm ``fn`` up once, then capture it in ``pool`` (the capture does not compute).

    ``pool`` is one compiled graph's pool (``torch.cuda.graph_pool_handle()``), shared by all
    its pieces and sizes. It lives as long as its graphs: a pool whose graphs were all freed
    cannot be captured into again. ``before_capture`` runs between warm-up and capture
    (the runner drops the step's memo there: buffers the warm-up made must not be baked
    into the graph, which would outlive them).
    """
    with counts_discarded():  # the step is computed by the replay after capture, not by this run
        fn(*args)  # first runs allocate workspaces, pick kernels, JIT-compile: never inside a capture
    torch.cuda.synchronize(device)
    if before_capture is not None:
        before_capture()
    graph = torch.cuda.CUDAGraph()
    try:
        output = _capture_into(graph, fn, args, device, pool)
    except torch.OutOfMemoryError:
        # A capture cannot draw on memory the allocator keeps cached for ordinary use (the
        # warm-up's, say): release it and try once more. The failed graph is kept until the
        # retry is captured: it may be what keeps the pool alive.
        failed = graph
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        output = _capture_into(graph, fn, args, device, pool)
        del failed
    return Captured(graph, output, tensor_ptrs(args))


def _capture_into(graph: torch.cuda.CUDAGraph, fn: Callable[..., Any], args: Sequence[Any], device: torch.device,
                  pool: Any) -> Any:
    capturing = begin_capture(graph, device, pool)
    try:
        output = fn(*args)
    except BaseException:
        end_capture(graph, capturing, failed=True)
        raise
    end_capture(graph, capturing)
    return output


def begin_capture(graph: torch.cuda.CUDAGraph, device: torch.device, pool: Any) -> contextlib.ExitStack:
    """Begin capturing into ``graph`` (in ``pool``) on this thread's capture stream for
    ``device``; :func:`end_capture` ends it. Both front ends capture through these two.

    What ``torch.cuda.graph()`` does, less emptying the allocator's cache at every capture:
    capturing all sizes makes hundreds of captures (pieces x sizes, or segments x sizes),
    and emptying would free and re-allocate the warm-up's memory before each one.
    """
    on_stream = contextlib.ExitStack()
    on_stream.enter_context(torch.cuda.device(device))
    on_stream.enter_context(torch.cuda.stream(_capture_stream(device)))
    try:
        # Thread-local: another thread's CUDA calls (a second model stepped beside this
        # one) must not invalidate this capture.
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    except BaseException:
        on_stream.close()
        raise
    return on_stream


def end_capture(graph: torch.cuda.CUDAGraph, on_stream: contextlib.ExitStack, *, failed: bool = False) -> None:
    """End the capture :func:`begin_capture` began; ``failed``: an error is being raised,
    and nothing of the capture is kept."""
    try:
        if not failed:
            graph.capture_end()
        else:
            try:
                graph.capture_end()
            except Exception:  # the capture was invalidated by the error being raised
                pass
    finally:
        on_stream.close()


_capture_streams = threading.local()


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's side stream for captures on ``device`` (CUDA graphs cannot be captured
    on the default stream; two threads capturing at once must not share one)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    streams = getattr(_capture_streams, "by_device", None)
    if streams is None:
        streams = _capture_streams.by_device = {}
    stream = streams.get(index)
    if stream is None:
        stream = streams[index] = torch.cuda.Stream(index)
    return stream


class CapturedPiece:
    """A compiled piece with one CUDA graph per capture size, captured on first use."""

    def __init__(self, name: str, fn: Callable[..., Any], device: torch.device, pool: Any, check_inputs: bool) -> None:
        self.name = name
        self.fn = fn
        self.device = device
        self.pool = pool
        self.check_inputs = check_inputs
        self.graphs: dict[int, Captured] = {}

    def __call__(self, *args: Any) -> Any:
        size = current_piece_size()  # the step's dispatch key, from its forward context
        if size is None:
            return self.fn(*args)
        entry = self.graphs.get(size)
        if entry is None:
            entry = self.graphs[size] = capture_graph(self.fn, args, self.device, self.pool)
        elif self.check_inputs and tensor_ptrs(args) != entry.input_ptrs:
            raise RuntimeError(
                f"fullcg: the inputs of captured piece {self.name} (size {size}) moved since capture; "
                "the graph would read stale memory"
            )
        entry.graph.replay()
        return entry.output


class BridgedPiece:
    """A split point run eagerly; in captured steps its tensor outputs are copied into fixed
    per-size buffers, so the captured piece after it reads the same addresses every time."""

    def __init__(self, name: str, fn: Callable[..., Any]) -> None:
        self.name = name
        self.fn = fn
        self.bridges: dict[int, Any] = {}

    def __call__(self, *args: Any) -> Any:
        out = self.fn(*args)
        size = current_piece_size()
        if size is None or out is None:
            return out
        bridge = self.bridges.get(size)
        if bridge is None:
            with torch.inference_mode(False):
                bridge = self.bridges[size] = _map_tensors(out, lambda t: t.clone())
        else:
            copy_into(bridge, out)
        return bridge


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def copy_into(dst: Any, src: Any) -> None:
    """Copy ``src``'s tensors into ``dst``'s (nested tuples and lists alike); other entries of
    ``dst`` (None: nothing to copy) are left."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            copy_into(d, s)


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

    @property
    def max_pages(self) -> int:
        return self.page_table.shape[1]

    def fill(self, md: AttentionMetadata) -> None:
        r, n = md.num_requests, md.num_tokens
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
        return md.pages_needed <= self.tables.max_pages and md.num_tokens <= self.size

    def fill(self, md: AttentionMetadata) -> AttentionMetadata:
        size, n, r = self.size, md.num_tokens, md.num_requests
        if not self.fits(md):
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
        # The batch over these buffers: its host fields and host-derived values as they are
        # (with_device_tensors checks nothing again: replace() would, at a measurable part
        # of a replay's host time).
        return md.with_device_tensors(**self._device_fields)


def dummy_metadata(size: int, decode_only: bool, page_size: int, device: torch.device) -> AttentionMetadata:
    """A batch of ``size`` tokens that writes nothing to the cache (slots -1) and reads page 0."""
    if decode_only:
        return AttentionMetadata.stand_in(
            [1] * size, [1] * size, torch.zeros(size, 1, dtype=torch.int32), page_size,
            [ForwardMode.DECODE] * size, device=device,
        )
    pages = -(-size // page_size)
    return AttentionMetadata.stand_in([size], [0], torch.zeros(1, pages, dtype=torch.int32), page_size, device=device)
