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
  so it reads per-step metadata from :class:`fullcg.runner.StaticMetadata` buffers that are refilled
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

import torch

from fullcg.context import current_piece_size
from fullcg.telemetry import counts_discarded

__all__ = [
    "CapturedPiece", "BridgedPiece", "capture_graph", "begin_capture", "end_capture", "tensor_ptrs", "copy_into",
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
    (the runner clears the step's ``StepState`` there: buffers the warm-up made must not be baked
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
