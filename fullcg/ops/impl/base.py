"""The base class of attention implementations: what the ops call, with the defaults."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from fullcg.ops import torch_ops

if TYPE_CHECKING:
    from fullcg.context import ForwardContext
    from fullcg.kv_cache import KVCache
    from fullcg.ops.call import AttentionCall

__all__ = ["AttentionImpl", "StepPlan"]


class StepPlan(Protocol):
    """Runs every later call of a step shaped like the one it was made for (same attributes
    but the layer, same tensor shapes and strides), for any layer: saves the new k/v where
    the call saves, attends, returns LSE iff the call asks for it. ``cache`` is the layer's
    own KV cache (checked by the caller) or None when the call uses none."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, cache: KVCache | None,
                 layer_id: int) -> torch.Tensor | None: ...


class AttentionImpl:
    """Computes what the ``fullcg`` attention ops promise; subclass it and override :meth:`forward`.

    Attributes:
        name: what ``FullCGConfig(attention_impl=...)`` calls it.
        capture_safe: :meth:`forward` and :meth:`save_kv` may be captured in a CUDA graph
            and replayed for other batches of the same padded shape, of every batch kind
            (decode-only, mixed, prefill): they read per-step data only from the metadata's
            tensors (never host values such as ``query_lens``), sync nothing, and allocate
            only shape-determined memory. Full graphs are captured only with such an
            implementation; others run those steps piecewise.
        takes_v_in_k: attends over a latent cache (:attr:`fullcg.KVCache.v_in_k`), reading
            v through its strides.
    """

    name: str = ""
    capture_safe: bool = False
    #: Attends over a latent cache, whose v is the leading values of k (``KVCache.v_in_k``).
    takes_v_in_k: bool = False

    def forward(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache | None) -> torch.Tensor | None:
        """Compute ``call`` into ``call.out``; return LSE ``float32 [T, Hq]`` iff ``call.return_lse``.

        ``cache`` is the layer's KV cache when ``call.use_kv_cache`` (the new tokens are
        already in it); attend over each request's prefix and new tokens there. Otherwise
        attend over ``call.k``/``call.v``. Rows of ``out`` past the batch's real tokens are
        zeroed (LSE -inf there).
        """
        raise NotImplementedError(f"attention implementation {self.name!r} does not define forward()")

    def save_kv(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache) -> None:
        """Write the batch's new k/v into the layer's cache (``metadata.slot_mapping``; slots
        < 0 are padding and skipped). Runs before :meth:`forward` whenever ``call.save_kv_cache``;
        an implementation whose forward kernel can write them itself may leave them to it,
        since :meth:`forward` always follows in the same call."""
        torch_ops.save_new_kv(call.k, call.v, ctx.metadata, cache)

    def step_plan(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache | None) -> StepPlan | None:
        """A :class:`StepPlan` for calls like ``call`` in compiled steps, made after ``call``
        itself ran through :meth:`save_kv` and :meth:`forward`; the ops then skip the per-call
        binding and checks for the rest of the step (the fake checked the shapes at trace
        time). The default, None, runs every call through :meth:`save_kv` and :meth:`forward`."""
        return None

    def serves(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache | None) -> bool:
        """Whether :meth:`forward` computes ``call`` as asked rather than refusing it (an
        unsupported dtype, a skip-softmax factor its kernels would not honour, ...); ``cache``
        as for :meth:`forward`. ``attention_impl="auto"`` runs another implementation where
        this is False. The default: every call."""
        return True

    def supports(self, head_dim: int, v_head_dim: int) -> bool:
        """Whether the kernels take these head dims; ``attention_impl="auto"`` passes over
        an implementation that does not. The default takes any."""
        return True

    def plan(self, ctx: ForwardContext) -> None:
        """Per-step host work (schedules, index buffers) for ``ctx``'s batch.

        The runner calls it before replaying a captured full graph, outside capture; eager
        calls of :meth:`forward` plan lazily themselves. The default has nothing to plan.
        """
