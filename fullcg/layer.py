"""``fullcg.Attention``: the layer a model uses in place of its attention computation."""

from __future__ import annotations

import math

import torch
from torch import nn

from fullcg import context
from fullcg.context import CacheOwner
from fullcg.kv_cache import KVCache
from fullcg.ops.attention import ATTENTION_OPS

__all__ = ["Attention"]

class Attention(nn.Module, CacheOwner):
    """Attention over a paged KV cache (or over given k/v) through the ``fullcg`` ops.

    The layer holds its head counts, scale, layer id and KV cache; per-step data (which
    tokens belong to which request, where their KV lives) comes from
    :func:`fullcg.forward_context`.

    Args:
        num_heads: query heads.
        head_dim: query/key head size.
        num_kv_heads: key/value heads (GQA); defaults to ``num_heads``.
        layer_id: unique per layer of a model; names the layer's KV cache and counters.
        scale: softmax scale; defaults to ``1 / sqrt(head_dim)``.
        v_head_dim: value head size; defaults to ``head_dim``.

    Skip-softmax factors come from the step's config (the forward context's, or the
    compile backend's for compiled steps), never from the layer, so eager and compiled
    runs of one model always agree.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int | None = None,
        *,
        layer_id: int,
        scale: float | None = None,
        v_head_dim: int | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, value in (("num_heads", num_heads), ("head_dim", head_dim), ("num_kv_heads", num_kv_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Attention: {name} must be a positive integer, got {value!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"Attention: num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or layer_id < 0:
            raise ValueError(f"Attention: layer_id must be a non-negative integer, got {layer_id!r}")
        if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"Attention: scale must be a positive finite number, got {scale!r}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.layer_id = layer_id
        self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)
        self._kv_cache: KVCache | None = None

    def extra_repr(self) -> str:
        return (
            f"layer_id={self.layer_id}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, scale={self.scale:.4g}"
        )

    def allocate_kv_cache(
        self, num_pages: int, page_size: int, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> KVCache:
        """Give the layer a paged KV cache ``[num_pages, page_size, num_kv_heads, head_dim]``."""
        self.kv_cache = KVCache.allocate(
            num_pages, page_size, self.num_kv_heads, self.head_dim, v_head_dim=self.v_head_dim,
            dtype=dtype or torch.float32, device=device or "cpu",
        )
        return self.kv_cache

    @property
    def kv_cache(self) -> KVCache | None:
        """The layer's paged KV cache (None until allocated or assigned)."""
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, cache: KVCache | None) -> None:
        if cache is not None and (
            cache.num_kv_heads != self.num_kv_heads or cache.head_dim != self.head_dim or cache.v_head_dim != self.v_head_dim
        ):
            raise ValueError(
                f"Attention(layer_id={self.layer_id}): a KV cache of pages {tuple(cache.k.shape)} does not fit "
                f"{self.num_kv_heads} kv heads of {self.head_dim}"
            )
        self._kv_cache = cache
        if cache is not None:
            # Plain attributes, so traced code reads constants instead of lifting the cache tensors.
            self._kv_dtype, self._kv_device = cache.k.dtype, cache.k.device
        context.forget_kv_caches()

    def _as_3d(self, x: torch.Tensor, name: str, heads: int, dim: int) -> torch.Tensor:
        if x.dim() == 2 and x.shape[1] == heads * dim:
            return x.view(x.shape[0], heads, dim)
        if x.dim() == 3 and x.shape[1] == heads and x.shape[2] == dim:
            return x
        raise ValueError(
            f"Attention(layer_id={self.layer_id}): {name} must be [tokens, {heads}, {dim}] or "
            f"[tokens, {heads * dim}], got shape {tuple(x.shape)}"
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        return_lse: bool = False,
        key_value_num_tokens: int | None = None,
        use_kv_cache: bool = True,
        causal: bool = True,
        prefix_chunk: int | None = None,
        save_kv_cache: bool | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend ``q`` over this step's keys; returns ``out`` (and LSE if ``return_lse``).

        ``q`` is ``[T, num_heads, head_dim]`` or flattened ``[T, num_heads * head_dim]``;
        ``out`` comes back in the same layout. By default the new ``k``/``v`` are saved
        into the KV cache and every query token attends causally over its request's cached
        prefix and new tokens. With ``use_kv_cache=False`` it attends over ``k``/``v`` as
        given, packed per request like ``q`` (``causal`` or not), or, with
        ``prefix_chunk=c``, over chunk ``c`` of the cached prefix as gathered by
        :meth:`gather_prefix_chunk`. ``save_kv_cache`` (default: ``use_kv_cache``) writes
        the new ``k``/``v`` into the cache; the chunked-prefix pattern sets it for the
        suffix, which attends over given k/v. ``key_value_num_tokens`` says how many leading rows
        of ``k``/``v`` are valid; the rest (padding) is never read. LSE is
        ``float32 [T, num_heads]``, natural log.
        """
        flat = q.dim() == 2
        q3 = self._as_3d(q, "q", self.num_heads, self.head_dim)
        k3 = self._as_3d(k, "k", self.num_kv_heads, self.head_dim)
        v3 = self._as_3d(v, "v", self.num_kv_heads, self.v_head_dim)
        out = torch.empty((q3.shape[0], self.num_heads, self.v_head_dim), dtype=q3.dtype, device=q3.device)
        prefill_factor, decode_factor = context.skip_softmax_factors()
        op = ATTENTION_OPS[(context.is_breakable(), bool(return_lse))]
        lse = op(
            q3, k3, v3, out, self.layer_id, key_value_num_tokens, prefill_factor, decode_factor, self.scale,
            use_kv_cache, causal, prefix_chunk, use_kv_cache if save_kv_cache is None else save_kv_cache,
            # The cache's uid: the op checks the step's cache for this layer is this one. Dynamo
            # guards on it, so a layer given a new cache (new addresses) compiles anew.
            self._kv_cache.uid if self._kv_cache is not None else 0,
        )
        if flat:
            out = out.view(q3.shape[0], self.num_heads * self.v_head_dim)
        return (out, lse) if return_lse else out

    def merge_prefix_chunks(self, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Attend ``q`` over every chunk of this step's cached prefix, merging each into
        ``out``/``lse`` in place (the chunked-prefix pattern, whatever the chunk count).

        ``out``, ``lse`` are a partial result with LSE, usually of the new tokens over
        themselves: ``out, lse = attn(q, k, v, return_lse=True, use_kv_cache=False,
        save_kv_cache=True)``. Afterwards they are attention over prefix and new tokens.
        The chunk loop runs inside one op, so a compiled model has one graph for every
        chunk count (a Python loop over chunks in the model would trace one per count).
        Models that transform a chunk before attending to it (an up-projection) use
        :meth:`gather_prefix_chunk` and ``prefix_chunk=c`` instead.
        """
        q3 = self._as_3d(q, "q", self.num_heads, self.head_dim)
        out3 = self._as_3d(out, "out", self.num_heads, self.v_head_dim)
        prefill_factor, decode_factor = context.skip_softmax_factors()
        torch.ops.fullcg.merge_prefix_chunks.default(
            q3, out3, lse, self.layer_id, prefill_factor, decode_factor, self.scale,
            self._kv_cache.uid if self._kv_cache is not None else 0,
        )

    def gather_prefix_chunk(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of prefix chunk ``chunk`` of every request, packed, from the cache.

        Rows: ``metadata.prefix_chunk_tokens`` (a fixed size, so graphs do not depend on
        request lengths); the packing is ``metadata.prefix_chunks[chunk]``.
        """
        if self.kv_cache is None:
            raise RuntimeError(f"Attention(layer_id={self.layer_id}) has no KV cache; call allocate_kv_cache first")
        rows = context.prefix_chunk_tokens()
        k = torch.empty((rows, self.num_kv_heads, self.head_dim), dtype=self._kv_dtype, device=self._kv_device)
        v = torch.empty((rows, self.num_kv_heads, self.v_head_dim), dtype=self._kv_dtype, device=self._kv_device)
        torch.ops.fullcg.gather_prefix_chunk.default(k, v, self.layer_id, chunk)
        return k, v
