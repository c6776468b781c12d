"""``fullcg.MLAAttention``: multi-head latent attention (DeepSeek-V2/V3) over a latent cache.

MLA compresses a token's keys and values into one latent vector ``c`` (``kv_lora_rank``
values, after the model's kv_a norm) plus a rope key ``k_pe`` (``qk_rope_head_dim``
values) shared by every head. Per head ``h``, the keys are ``[W_UK[h] c ; k_pe]`` and the
values ``W_UV[h] c``, where ``kv_b_proj.weight`` viewed as ``[heads, nope + v, rank]``
holds ``W_UK`` (the first ``nope`` rows of each head) and ``W_UV`` (the rest).

The *absorbed* form attends without decompressing: ``q_nope[h] . (W_UK[h] c) =
(q_nope[h] W_UK[h]) . c``, so with ``q = [q_nope W_UK ; q_pe]`` (``rank + rope`` values per
head), key ``[c ; k_pe]`` and value ``c``, MLA is multi-query attention (one KV head)
whose output per head, ``rank`` values, maps to the head's ``v`` values through
``W_UV[h]``. This layer computes exactly that through a :class:`fullcg.Attention` child
with one KV head, key head dim ``rank + rope`` and value head dim ``rank``, so MLA gets
every graph mode, skip-softmax, LSE and the chunk ops as they are.

The cache holds ``rank + rope`` values per token, once: one allocation ``[pages,
page_size, 1, rank + rope]`` whose first ``rank`` values are also the value (the
:class:`fullcg.KVCache`'s ``v`` is a view of ``k``). DeepSeek-V3's 576 values per token
against 128 x (192 + 128) = 40,960 for decompressed keys and values.

Prompt-heavy steps of layers with many heads run in *MHA form* instead
(``FullCGConfig.mla_mha_min_tokens`` and ``mla_mha_min_heads``): the
new tokens' latents are up-projected to per-head keys (``nope + rope``) and values and
attended causally; the cached prefix is read back chunk by chunk, each chunk up-projected
into a fixed-size buffer and merged in by LSE (``fullcg::merge_latent_prefix_chunks``).
Attention then costs ``nope + rope + v`` per key and head rather than ``2 rank + rope``;
the cache stays latent either way.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fullcg import context
from fullcg.kv_cache import KVCache
from fullcg.layer import Attention, _NoBackward
from fullcg.ops.attention import ATTENTION_OPS, LAYER_FROM_KEY

__all__ = ["MLAAttention", "allocate_latent_cache"]


def allocate_latent_cache(
    num_pages: int, page_size: int, kv_lora_rank: int, qk_rope_head_dim: int, *,
    dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
) -> KVCache:
    """A latent paged cache: ``k`` is ``[pages, page_size, 1, rank + rope]`` (the latent then
    the rope key), ``v`` the view of its first ``rank`` values (the latent): one allocation."""
    for name, value in (("num_pages", num_pages), ("page_size", page_size), ("kv_lora_rank", kv_lora_rank),
                        ("qk_rope_head_dim", qk_rope_head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"allocate_latent_cache: {name} must be a positive integer, got {value!r}")
    k = torch.zeros(num_pages, page_size, 1, kv_lora_rank + qk_rope_head_dim, dtype=dtype, device=device)
    return KVCache(k, k[..., :kv_lora_rank])


class MLAAttention(nn.Module):
    """Multi-head latent attention in the absorbed form over a latent paged cache.

    Args:
        num_heads: query heads.
        kv_lora_rank: values of the compressed latent ``c`` per token (512 in DeepSeek-V3).
        qk_nope_head_dim: per-head query/key values without rotary embedding (128).
        qk_rope_head_dim: the rotary part, shared by all heads on the key side (64).
        v_head_dim: per-head value size (128).
        layer_id: unique per layer of a model, as for :class:`fullcg.Attention`.
        scale: softmax scale; defaults to ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``
            (DeepSeek's, before any YaRN mscale, which the model passes in).

    The layer holds no weights: :meth:`forward` takes ``kv_b_proj``'s weight, so a model
    keeps its own projections (and a Hugging Face model's weights stay where they are).
    """

    def __init__(
        self,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        *,
        layer_id: int,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("num_heads", num_heads), ("kv_lora_rank", kv_lora_rank),
                            ("qk_nope_head_dim", qk_nope_head_dim), ("qk_rope_head_dim", qk_rope_head_dim),
                            ("v_head_dim", v_head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MLAAttention: {name} must be a positive integer, got {value!r}")
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        if scale is None:
            scale = 1.0 / math.sqrt(qk_nope_head_dim + qk_rope_head_dim)
        #: The attention itself: MQA over [latent ; rope key] with the latent as value.
        self.attn = Attention(num_heads, kv_lora_rank + qk_rope_head_dim, 1, layer_id=layer_id, scale=scale,
                              v_head_dim=kv_lora_rank)

    @property
    def layer_id(self) -> int:
        return self.attn.layer_id

    @property
    def kv_cache(self) -> KVCache | None:
        """The latent cache (see :func:`allocate_latent_cache`); None until allocated."""
        return self.attn.kv_cache

    def allocate_kv_cache(
        self, num_pages: int, page_size: int, *, dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """Give the layer a latent paged cache of ``kv_lora_rank + qk_rope_head_dim`` values per token."""
        cache = allocate_latent_cache(num_pages, page_size, self.kv_lora_rank, self.qk_rope_head_dim,
                                      dtype=dtype or torch.float32, device=device or "cpu")
        self.attn.kv_cache = cache
        return cache

    def extra_repr(self) -> str:
        return (f"layer_id={self.layer_id}, num_heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
                f"qk_nope_head_dim={self.qk_nope_head_dim}, qk_rope_head_dim={self.qk_rope_head_dim}, "
                f"v_head_dim={self.v_head_dim}")

    def split_kv_b(self, kv_b_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_UK [heads, nope, rank], W_UV [heads, v, rank])`` from ``kv_b_proj.weight``
        (``[heads * (nope + v), rank]``), as views."""
        heads, nope, v, rank = self.num_heads, self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank
        if kv_b_weight.dim() != 2 or tuple(kv_b_weight.shape) != (heads * (nope + v), rank):
            raise ValueError(
                f"MLAAttention(layer_id={self.layer_id}): kv_b_weight must be [{heads} * ({nope} + {v}), {rank}] "
                f"(kv_b_proj.weight), got shape {tuple(kv_b_weight.shape)}"
            )
        per_head = kv_b_weight.view(heads, nope + v, rank)
        return per_head[:, :nope], per_head[:, nope:]

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        kv_b_weight: torch.Tensor,
        *,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend this step's queries over each request's cached latents and new ones.

        ``q_nope [T, heads, nope]`` and ``q_pe [T, heads, rope]`` (rotary embedding applied),
        ``latent [T, rank]`` (after the kv_a norm) and ``k_pe [T, rope]`` (rotary embedding
        applied) of the new tokens, which are saved into the latent cache; ``kv_b_weight``
        is ``kv_b_proj.weight``. Returns ``out [T, heads, v_head_dim]`` (and the LSE,
        ``float32 [T, heads]``, with ``return_lse``).
        """
        T = q_nope.shape[0]
        heads, rank = self.num_heads, self.kv_lora_rank
        expected = {"q_nope": (q_nope, (T, heads, self.qk_nope_head_dim)), "q_pe": (q_pe, (T, heads, self.qk_rope_head_dim)),
                    "latent": (latent, (T, rank)), "k_pe": (k_pe, (T, self.qk_rope_head_dim))}
        for name, (t, shape) in expected.items():
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"MLAAttention(layer_id={self.layer_id}): {name} must have shape {list(shape)}, got {tuple(t.shape)}")
        if context.mla_mha_step(heads):
            return self._mha_form(q_nope, q_pe, latent, k_pe, kv_b_weight, return_lse)
        w_uk, w_uv = self.split_kv_b(kv_b_weight)
        # Absorb W_UK into the query: [h, T, nope] x [h, nope, rank] -> [T, h, rank]. (bmm, not
        # einsum: einsum's reshapes make Dynamo guard that the token count is not 1, so a
        # one-token step would get a graph of its own.)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype)).transpose(0, 1)
        q = torch.cat([q_latent, q_pe], dim=-1)
        k = torch.cat([latent, k_pe], dim=-1).unsqueeze(1)
        v = latent.unsqueeze(1)
        result = self.attn(q, k, v, return_lse=return_lse)
        out_latent, lse = result if return_lse else (result, None)
        # Each head's latent output to its values: [h, T, rank] x [h, rank, v] -> [T, h, v], a
        # transposed view (copying it token-major here makes Dynamo guard the token count).
        out = torch.bmm(out_latent.transpose(0, 1), w_uv.to(out_latent.dtype).transpose(1, 2)).transpose(0, 1)
        return (out, lse) if return_lse else out

    def _mha_form(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
        kv_b_weight: torch.Tensor, return_lse: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The step in MHA form: the new tokens' latents up-projected to per-head keys and
        values, attended causally with LSE; then the latents saved and the cached prefix
        merged in chunk by chunk (``fullcg::merge_latent_prefix_chunks``, one op whatever
        the chunk count). Prompt-heavy steps cost less so: per key and head, 2 x (nope + rope
        + v) multiply-adds against 2 x (rank + rope + rank) absorbed."""
        self.split_kv_b(kv_b_weight)  # checks its shape
        T, heads = q_nope.shape[0], self.num_heads
        nope, v_dim = self.qk_nope_head_dim, self.v_head_dim
        kv = torch.nn.functional.linear(latent, kv_b_weight.to(latent.dtype)).view(T, heads, nope + v_dim)
        k = torch.cat([kv[..., :nope], k_pe.unsqueeze(1).expand(T, heads, self.qk_rope_head_dim)], dim=-1)
        v = kv[..., nope:].contiguous()
        q = torch.cat([q_nope, q_pe], dim=-1)
        out = q.new_empty((T, heads, v_dim))
        prefill_factor, decode_factor = context.layer_skip_softmax_factors(self.attn)
        scale, key = self.attn.scale, self.attn.layer_key  # the layer's identity, read when the ops run
        lse = ATTENTION_OPS[(False, True)](
            q, k, v, out, LAYER_FROM_KEY, None, prefill_factor, decode_factor, scale,
            False, True, None, False, None, None, 0, key,  # over the given k/v, causal, saving nothing
        )
        torch.ops.fullcg.merge_latent_prefix_chunks.default(
            q, out, lse, torch.cat([latent, k_pe], dim=-1), kv_b_weight, LAYER_FROM_KEY, prefill_factor,
            decode_factor, scale, 0, key,
        )
        if not torch.compiler.is_compiling() and torch.is_grad_enabled() and any(
            t.requires_grad for t in (q_nope, q_pe, latent, k_pe, kv_b_weight)
        ):
            inputs = (q_nope, q_pe, latent, k_pe, kv_b_weight)
            out = _NoBackward.apply(self.layer_id, out, *inputs)
            lse = _NoBackward.apply(self.layer_id, lse, *inputs)
        return (out, lse) if return_lse else out
