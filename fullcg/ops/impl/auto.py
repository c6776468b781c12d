"""``attention_impl="auto"`` on CUDA with FlashInfer and Triton both installed: each call on
the faster implementation that computes it as asked.

FlashInfer runs every call it can: FA2 for decode and captured steps, FMHAv2 for eager
batches of prefill and extend requests on Hopper (skip-softmax prefill there too).
fullcg's Triton kernels run the calls FlashInfer would refuse rather than compute: below
SM100, skip-softmax for batches with decode requests (FlashInfer has no skip-softmax
decode on Hopper) and under CUDA-graph capture; a mixed batch whose prefill and decode
factors differ; skip-softmax with a sliding window or logit soft-cap; a sliding window over
a prefix chunk; fp32. (FlashInfer runs other windowed and soft-capped calls itself.) (Head dims FlashInfer lacks never get here: ``auto`` resolves to
Triton alone for them.)

The choice depends only on the call, the batch, the cache's layout and whether a graph is
being captured, never on timing. It is made once per step for calls alike (the rest of
the step's layers look it up), so saving and attending always run on the same
implementation, and a captured graph replays what was chosen at capture: under capture a
skip-softmax call goes to Triton whatever the batch kind, since FlashInfer honours no
factor there. (A full graph's warm-up run before its capture counts as captured: it must
choose what the capture chooses.) Replays of a captured graph plan only the
implementations its calls ran.
"""

from __future__ import annotations

import torch

from fullcg.context import ForwardContext
from fullcg.kv_cache import KVCache
from fullcg.ops.call import AttentionCall
from fullcg.ops.impl.base import AttentionImpl, StepPlan

__all__ = ["AutoAttention"]

_HALF = (torch.float16, torch.bfloat16)


class AutoAttention(AttentionImpl):
    """FlashInfer where it computes the call as asked, fullcg's Triton kernels elsewhere."""

    name = "auto"

    def __init__(self, flashinfer: AttentionImpl, triton: AttentionImpl) -> None:
        self.flashinfer = flashinfer
        self.triton = triton
        self.capture_safe = flashinfer.capture_safe and triton.capture_safe
        #: A latent cache (multi-head latent attention) reaches this only if both take one.
        self.takes_v_in_k = flashinfer.takes_v_in_k and triton.takes_v_in_k

    def choose(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache | None) -> AttentionImpl:
        """The implementation that runs ``call`` (``cache``: the layer's cache, when it has one)."""
        if call.prefill_scale_factor is None and call.decode_scale_factor is None and call.q.dtype in _HALF \
                and call.sliding_window is None and call.logit_softcap is None and call.q.shape[2] == call.v.shape[2]:
            # Dense half-precision calls of one head dim, the common case: decided without
            # probing (unequal dims, as multi-head latent attention has, ask serves()).
            # Recorded as the step's resolved implementations are: a captured graph's
            # replays plan what it ran, not both.
            ctx.step.ran[self.flashinfer.name] = self.flashinfer
            return self.flashinfer
        attends_cache = cache if call.use_kv_cache else None
        key = (call.op, call.use_kv_cache, call.causal, call.prefix_chunk, call.return_lse,
               call.key_value_num_tokens, call.prefill_scale_factor, call.decode_scale_factor,
               call.sliding_window, call.logit_softcap, call.q.dtype,
               call.q.shape, call.k.shape, call.v.shape,
               attends_cache.v_offset_pages if attends_cache is not None else None,
               attends_cache.v_in_k if attends_cache is not None else None,
               torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
        step = ctx.step
        chosen = step.auto_choices.get(key)
        if chosen is None:
            serves = self.flashinfer.serves(call, ctx, attends_cache)
            chosen = step.auto_choices[key] = self.flashinfer if serves else self.triton
            step.ran[chosen.name] = chosen
        return chosen

    def save_kv(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache) -> None:
        # The same implementation saves and attends: one may leave saving to its forward kernel.
        self.choose(call, ctx, cache).save_kv(call, ctx, cache)

    def forward(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache | None) -> torch.Tensor | None:
        return self.choose(call, ctx, cache).forward(call, ctx, cache)

    def step_plan(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache | None) -> StepPlan | None:
        return self.choose(call, ctx, cache).step_plan(call, ctx, cache)

    def supports(self, head_dim: int, v_head_dim: int) -> bool:
        return self.flashinfer.supports(head_dim, v_head_dim) or self.triton.supports(head_dim, v_head_dim)
