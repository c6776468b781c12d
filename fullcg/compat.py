"""The private torch APIs fullcg uses, in one place, each with the reason and a fallback.

fullcg's hot path (op dispatch, replay) and startup lean on a few torch internals because
their public counterparts cost measurable time per call. Keeping them here means a torch
upgrade that moves one breaks one function, not several
modules (``tests/test_step_state.py`` checks each on the installed torch). Triton's
compiled-launcher entry point is wrapped the same way, in
:mod:`fullcg.ops.kernels.launch`, the only module that launches Triton kernels.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "current_raw_stream", "current_device_index", "env_reader", "lazy_graph_modules", "make_graph_module",
    "enable_size_oblivious",
]

logger = logging.getLogger(__name__)

# torch.cuda.current_stream().cuda_stream and torch.cuda.current_device() build Python
# objects on every call; the C functions under them return plain ints (planned launches
# call them once per layer).
if hasattr(torch._C, "_cuda_getCurrentRawStream"):
    current_raw_stream: Callable[[int], int] = torch._C._cuda_getCurrentRawStream
    current_device_index: Callable[[], int] = torch._C._cuda_getDevice
else:  # a torch built without CUDA
    def current_raw_stream(device_index: int) -> int:
        return torch.cuda.current_stream(device_index).cuda_stream

    def current_device_index() -> int:
        return torch.cuda.current_device()


def env_reader(names: Sequence[str]) -> Callable[[], tuple[str | bytes | None, ...]]:
    """A function returning the current values of environment variables ``names`` (None
    when unset), for a per-step lookup. ``os.environ.get`` encodes the name and raises and
    catches ``KeyError`` for an unset variable (about 2 us each); the dict under it, keyed
    by encoded names, answers in a tenth of that. Values come back in whichever form is
    cheapest: compare them, do not parse them."""
    data = getattr(os.environ, "_data", None)
    if isinstance(data, dict):
        get, keys = data.get, tuple(map(os.environ.encodekey, names))
    else:
        get, keys = os.environ.get, tuple(names)
    return lambda: tuple(map(get, keys))


def lazy_graph_modules() -> Any:
    """A context in which new graph modules generate their Python code on first use.

    Generating and compiling a 32-layer graph's code takes a few tenths of a second, and
    splitting it makes a module per piece that is often never run.
    """
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:  # pragma: no cover - every supported torch has it
        import contextlib

        return contextlib.nullcontext()
    return _use_lazy_graph_module(True)


def make_graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A graph module of ``graph`` over ``root``'s attributes; lazy inside :func:`lazy_graph_modules`."""
    try:
        from torch.fx._lazy_graph_module import _make_graph_module
    except ImportError:  # pragma: no cover
        return torch.fx.GraphModule(root, graph)
    return _make_graph_module(root, graph)


_size_oblivious_set = False


def enable_size_oblivious() -> None:
    """Let Dynamo treat token counts of 0 and 1 like any other, for this process.

    Without it Dynamo specializes a batch of one token (every decode step of a single
    request) into a graph of its own: a recompile the first time such a batch comes. The
    flag is process-wide torch state, so fullcg sets it once (on the first step's forward
    context; patching it per step costs tens of microseconds) and logs that it did; it is
    never restored, since a graph Dynamo traced with it keeps relying on it.
    """
    global _size_oblivious_set
    if _size_oblivious_set:
        return
    _size_oblivious_set = True
    import torch.fx.experimental._config as fx_config

    if hasattr(fx_config, "backed_size_oblivious") and not fx_config.backed_size_oblivious:
        fx_config.backed_size_oblivious = True
        logger.info("fullcg: enabled torch.fx.experimental._config.backed_size_oblivious (one graph for all token counts)")
