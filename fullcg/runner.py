"""The per-step call path of a compiled model: pick a graph variant, pad, replay or run.

A compiled model has up to two variants of its graph: *piecewise* (split at breakable
attention ops) and *full* (one graph with attention inside). Each step the runner picks
one from the graph mode and the batch (``full_and_piecewise``: decode-only batches run
full), and on CUDA runs it as CUDA graphs when the batch fits a capture size (see
:mod:`fullcg.cudagraph`). Every step is counted by how it ran, so a mode is never changed
silently: :func:`graph_mode_counts`.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

import torch

from fullcg import cudagraph
from fullcg.config import FullCGConfig
from fullcg.context import ForwardContext, derived_context, get_forward_context
from fullcg.ops.impl import resolve_implementation

__all__ = ["StepRunner", "PieceCall", "graph_mode_counts", "reset_graph_mode_counts", "request_capture"]

logger = logging.getLogger(__name__)

_counts: collections.Counter[str] = collections.Counter()
_capture_requested = False


def graph_mode_counts() -> collections.Counter[str]:
    """Steps by how they ran: ``full``/``piecewise`` + ``:captured`` (CUDA graphs) or ``:eager``."""
    return collections.Counter(_counts)


def reset_graph_mode_counts() -> None:
    _counts.clear()


def request_capture() -> None:
    """Make every runner capture all its sizes on its next call (see :func:`fullcg.capture`)."""
    global _capture_requested
    _capture_requested = True


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
    """What the compile backend returns to Dynamo: runs one step of the compiled model."""

    def __init__(
        self,
        config: FullCGConfig,
        *,
        piecewise: Callable[..., Any] | None,
        full: Callable[..., Any] | None,
        device: torch.device,
        pool: Any = None,
        stager: cudagraph.InputStager | None = None,
        token_outputs: tuple[bool, ...] | None = None,
        full_capturable: bool = True,
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
        self.sizes = config.sizes_to_capture
        self.captures = pool is not None and stager is not None
        self.full_graphs: dict[tuple[int, bool], cudagraph.Captured] = {}
        self.static_metadata: dict[int, cudagraph.StaticMetadata] = {}
        self.on_first_call: Callable[[], None] | None = None
        self._first_captured_call = True
        self._full_ok: bool | None = None
        self._impl: Any = None
        #: The split report of the graph this runner runs (see fullcg.debug.split_report).
        self.report = ""

    def choose(self, ctx: ForwardContext) -> str:
        """``"full"`` or ``"piecewise"`` for the current step."""
        if self.piecewise is None:
            return "full"
        if self.full is None:
            return "piecewise"
        return "full" if ctx.metadata.is_decode_only else "piecewise"

    def __call__(self, *args: Any) -> Any:
        global _capture_requested
        if self.on_first_call is not None:
            hook, self.on_first_call = self.on_first_call, None
            hook()
        ctx = get_forward_context()
        if self.captures and (_capture_requested or (self.config.capture_on_compile and self._first_captured_call)):
            _capture_requested = False
            self.capture_all(args, ctx)
        self._first_captured_call = False
        variant = self.choose(ctx)
        n = self.stager.num_tokens(args) if self.captures else None
        size = cudagraph.padded_size(n, self.sizes) if n is not None else None
        if size is not None and variant == "full" and not self._full_capture_ok(ctx):
            size = None
        if size is None:
            _counts[f"{variant}:eager"] += 1
            graph = self.full if variant == "full" else self.piecewise
            with derived_context(ctx, config=self.config, breakable=variant == "piecewise"), torch.no_grad():
                return graph(*args)
        _counts[f"{variant}:captured"] += 1
        # Inference mode throughout: graph outputs made while capturing under it are updated
        # in place by eager split points on later steps, which only inference mode allows.
        with torch.inference_mode():
            staged = self.stager.stage(args, n, size)
            if variant == "full":
                out = self._replay_full(ctx, staged, size)
            else:
                out = self._run_piecewise(ctx, staged, size)
        return _slice_tokens(out, self.token_outputs, n)

    def _full_capture_ok(self, ctx: ForwardContext) -> bool:
        if self._full_ok is None:  # fixed per runner: decided on first use, with one warning
            impl = resolve_implementation(self.config.attention_impl, self.device)
            if not self.full_capturable:
                logger.warning("fullcg: the full graph gathers prefix chunks on the host; running it uncaptured "
                               "(use graph_mode='piecewise' for the chunked-prefix pattern)")
            elif not getattr(impl, "capture_safe", False):
                logger.warning(f"fullcg: attention implementation {impl.name!r} cannot be captured in a full CUDA "
                               "graph; full steps run uncaptured (use attention_impl='triton' or 'flashinfer')")
            self._impl = impl
            self._full_ok = self.full_capturable and bool(getattr(impl, "capture_safe", False))
        return self._full_ok

    def _run_piecewise(self, ctx: ForwardContext, staged: list[Any], size: int) -> Any:
        cudagraph.set_active_size(size)
        try:
            with derived_context(ctx, config=self.config, breakable=True):
                return self.piecewise(*staged)
        finally:
            cudagraph.set_active_size(None)

    def _replay_full(self, ctx: ForwardContext, staged: list[Any], size: int) -> Any:
        static = self.static_metadata.get(size)
        if static is None:
            max_pages = max((c.num_pages for c in ctx.kv_caches.values()), default=1)
            static = self.static_metadata[size] = cudagraph.StaticMetadata(size, max_pages, self.device)
        key = (size, ctx.metadata.is_decode_only)
        md = static.fill(ctx.metadata)
        with derived_context(ctx, config=self.config, breakable=False, metadata=md) as static_ctx:
            entry = self.full_graphs.get(key)
            if entry is None:
                entry = self.full_graphs[key] = cudagraph.capture_graph(self.full, staged, self.device, self.pool)
            plan = getattr(self._impl, "plan", None)
            if plan is not None:
                plan(static_ctx)
            entry.graph.replay()
        return entry.output

    def capture_all(self, args: tuple[Any, ...], ctx: ForwardContext) -> None:
        """Capture every size up front (largest first, so smaller graphs reuse its pool memory)."""
        page_size = next(iter(ctx.kv_caches.values())).page_size if ctx.kv_caches else 16
        jobs = []
        for size in sorted(self.sizes, reverse=True):
            if self.piecewise is not None and self.config.graph_mode != "full":
                jobs.append((size, False))
            if self.full is not None and self.full_capturable:
                jobs.append((size, self.config.graph_mode != "full"))
        bar = _progress(len(jobs), "fullcg: capturing CUDA graphs")
        for size, decode_only in jobs:
            md = cudagraph.dummy_metadata(size, decode_only or self.piecewise is None, page_size, self.device)
            staged = self.stager.dummy(args, size)
            with derived_context(ctx, config=self.config, breakable=False, metadata=md) as dummy, \
                    torch.inference_mode():
                if self.choose(dummy) == "full" and self._full_capture_ok(dummy):
                    self._replay_full(dummy, staged, size)
                elif self.piecewise is not None:
                    self._run_piecewise(dummy, staged, size)
            bar(1)
        bar(0, done=True)


def _progress(total: int, label: str) -> Callable[..., None]:
    """A progress bar (tqdm when installed, else log lines every 10%)."""
    try:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=label, unit="graph")

        def update(k: int, done: bool = False) -> None:
            bar.update(k)
            if done:
                bar.close()

        return update
    except ImportError:
        state = {"n": 0}

        def update(k: int, done: bool = False) -> None:
            state["n"] += k
            if done or state["n"] % max(1, total // 10) == 0:
                logger.info("%s: %d/%d", label, state["n"], total)

        return update


def capture(compiled: Callable[..., Any], metadata: Any, kv_caches: Any, *inputs: Any) -> Any:
    """Capture every capture size of ``compiled`` now, with a progress bar, then run one step.

    ``compiled`` is ``torch.compile(model, backend="fullcg")``; ``metadata``, ``kv_caches``
    and ``inputs`` describe any valid step (it compiles the model if needed and is then
    run normally). Capturing writes nothing to the KV cache: stand-in batches use slot -1.
    """
    from fullcg.context import forward_context

    request_capture()
    with forward_context(metadata, kv_caches), torch.no_grad():
        return compiled(*inputs)
