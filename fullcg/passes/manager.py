"""Runs graph passes in a fixed order and names the whole sequence with a stable uuid.

The uuid follows Inductor's ``CustomGraphPass`` contract: it changes exactly when a pass's
code or settings change, so compile caches keyed on it never reuse a graph that a
different pass sequence produced.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Sequence
from typing import Protocol

import torch.fx

__all__ = ["GraphPass", "PassManager"]

logger = logging.getLogger(__name__)


class GraphPass(Protocol):
    """A pass edits an FX graph in place and describes itself with a stable string."""

    def __call__(self, graph: torch.fx.Graph) -> None: ...

    def uuid(self) -> str: ...


def source_hash(obj: object, *settings: object) -> str:
    """A hash of ``obj``'s class source plus ``settings``: a pass's uuid."""
    src = inspect.getsource(type(obj))
    return hashlib.sha256(repr((src, settings)).encode()).hexdigest()


class PassManager:
    """Applies ``passes`` in order; :meth:`uuid` covers all of them."""

    def __init__(self, passes: Sequence[GraphPass]) -> None:
        self.passes = list(passes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)
            logger.debug("fullcg pass %s done", type(p).__name__)
        graph.lint()

    def uuid(self) -> str:
        h = hashlib.sha256()
        for p in self.passes:
            h.update(type(p).__name__.encode())
            h.update(p.uuid().encode())
        return h.hexdigest()
