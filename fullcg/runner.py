"""The per-step call path of a compiled model: pick a graph variant, run it.

A compiled model has up to two variants of its graph: *piecewise* (split at breakable
attention ops) and *full* (one graph with attention inside). Each step the runner picks
one from the graph mode and the batch (``full_and_piecewise``: decode-only batches run
full), runs it under the backend's config, and counts what ran, so a mode is never
changed silently.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

import torch

from fullcg.config import FullCGConfig
from fullcg.context import derived_context, get_forward_context

__all__ = ["StepRunner", "PieceCall", "graph_mode_counts", "reset_graph_mode_counts"]

logger = logging.getLogger(__name__)

_counts: collections.Counter[str] = collections.Counter()


def graph_mode_counts() -> collections.Counter[str]:
    """How many compiled steps ran each way: ``full``, ``piecewise``, with ``captured``/``eager`` suffixes."""
    return collections.Counter(_counts)


def reset_graph_mode_counts() -> None:
    _counts.clear()


class PieceCall:
    """Calls one compiled piece (or the full graph); CUDA-graph capture wraps this call path."""

    def __init__(self, name: str, fn: Callable[..., Any], *, unwrap_single: bool = False) -> None:
        self.name = name
        self.fn = fn
        self.unwrap_single = unwrap_single

    def __call__(self, *args: Any) -> Any:
        out = self.fn(*args)
        return out[0] if self.unwrap_single else out

    def __repr__(self) -> str:
        return f"PieceCall({self.name})"


class StepRunner:
    """What the compile backend returns to Dynamo: runs one step of the compiled model."""

    def __init__(
        self,
        config: FullCGConfig,
        *,
        piecewise: Callable[..., Any] | None,
        full: Callable[..., Any] | None,
        device: torch.device,
    ) -> None:
        if piecewise is None and full is None:
            raise ValueError("a StepRunner needs a piecewise or a full graph")
        self.config = config
        self.piecewise = piecewise
        self.full = full
        self.device = device
        self.on_first_call: Callable[[], None] | None = None
        #: The split report of the graph this runner runs (see fullcg.debug.split_report).
        self.report = ""

    def choose(self) -> str:
        """``"full"`` or ``"piecewise"`` for the current step."""
        if self.piecewise is None:
            return "full"
        if self.full is None:
            return "piecewise"
        return "full" if get_forward_context().metadata.is_decode_only else "piecewise"

    def __call__(self, *args: Any) -> Any:
        if self.on_first_call is not None:
            hook, self.on_first_call = self.on_first_call, None
            hook()
        ctx = get_forward_context()
        variant = self.choose()
        _counts[f"{variant}:eager"] += 1
        graph = self.full if variant == "full" else self.piecewise
        with derived_context(ctx, config=self.config, breakable=variant == "piecewise"), torch.no_grad():
            return graph(*args)
