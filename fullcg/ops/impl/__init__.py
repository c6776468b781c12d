"""Attention implementations: the code that computes what the ``fullcg`` ops promise.

An implementation is an object with a ``name`` and
``forward(call, ctx, cache) -> lse | None`` (see :class:`AttentionImpl`). The forward
context's ``config.attention_impl`` picks one by name for each step.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Protocol

import torch

from fullcg.context import ForwardContext
from fullcg.kv_cache import KVCache
from fullcg.ops.call import AttentionCall

__all__ = ["AttentionImpl", "register_implementation", "resolve_implementation", "available_implementations"]


class AttentionImpl(Protocol):
    """What an attention implementation provides.

    Optional members:

    - ``save_kv(call, ctx, cache)``: writes the batch's new k/v into the layer's cache
      (``metadata.slot_mapping``; slots < 0 are padding and skipped) before ``forward``
      runs whenever ``call.save_kv_cache``. Without it the reference implementation's
      plain-torch copy is used.
    - ``capture_safe`` (default False): ``forward`` and ``save_kv`` may be captured in a
      CUDA graph and replayed for other batches of the same padded shape: they read
      per-step data only from the metadata's tensors (never host values such as
      ``query_lens``), sync nothing, and allocate only shape-determined memory. The
      runner captures full graphs only with a capture-safe implementation.
    - ``plan(ctx)``: per-step host work (schedules, indptr buffers) for a batch. The
      runner calls it before replaying a captured graph, outside capture; eager calls
      of ``forward`` must plan lazily themselves.
    """

    name: str

    def forward(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache | None) -> torch.Tensor | None:
        """Compute ``call`` into ``call.out``; return LSE ``float32 [T, Hq]`` iff ``call.return_lse``.

        ``cache`` is the layer's KV cache when ``call.use_kv_cache`` (the new tokens are
        already in it); attend over each request's prefix and new tokens there. Otherwise
        attend over ``call.k``/``call.v``. Rows of ``out`` past the batch's real tokens are
        zeroed (LSE -inf there).
        """
        ...


_registry: dict[str, AttentionImpl] = {}
# Built-in implementations that are imported on first use (they may need optional packages).
_lazy: dict[str, str] = {
    "reference": "fullcg.ops.impl.reference",
    "triton": "fullcg.ops.impl.triton",
    "flashinfer": "fullcg.ops.impl.flashinfer",
}


def register_implementation(impl: AttentionImpl) -> None:
    """Make ``impl`` selectable as ``FullCGConfig(attention_impl=impl.name)``."""
    if not isinstance(getattr(impl, "name", None), str) or not callable(getattr(impl, "forward", None)):
        raise TypeError("an attention implementation needs a str `name` and a `forward(call, ctx, cache)` method")
    if impl.name == "auto":
        raise ValueError("'auto' is reserved: it picks an implementation by device")
    _registry[impl.name] = impl


def available_implementations() -> list[str]:
    return sorted({*_registry, *_lazy})


@functools.lru_cache(maxsize=None)
def _auto_name(device_type: str) -> str:
    """FlashInfer on CUDA devices when it is installed; the reference everywhere else.

    Cached: looking a package up on sys.path costs more than a whole op call.
    """
    if device_type == "cuda" and importlib.util.find_spec("flashinfer") is not None:
        return "flashinfer"
    return "reference"


def resolve_implementation(name: str, device: torch.device) -> AttentionImpl:
    """The implementation called ``name``; ``auto`` picks the best one for ``device``."""
    if name == "auto":
        name = _auto_name(torch.device(device).type)
    impl = _registry.get(name)
    if impl is None and name in _lazy:
        importlib.import_module(_lazy[name])  # registers itself
        impl = _registry.get(name)
    if impl is None:
        raise ValueError(
            f"unknown attention implementation {name!r}; available: {', '.join(available_implementations())} "
            "(or register one with fullcg.ops.impl.register_implementation)"
        )
    return impl
