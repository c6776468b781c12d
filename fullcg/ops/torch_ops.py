"""Plain-torch building blocks shared by the ops and every implementation: saving new k/v
into the paged cache, reading a request's k/v back, gathering a prefix chunk, and the exact
LSE merge of two partial attention results.
"""

from __future__ import annotations

import numpy as np
import torch

from fullcg.host_copy import upload
from fullcg.kv_cache import KVCache
from fullcg.metadata import AttentionMetadata, PrefixChunk

__all__ = ["save_kv", "save_new_kv", "read_kv", "merge", "merge_states", "gather_prefix_chunk"]

_NEG_INF = float("-inf")


def save_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new tokens' k/v into their cache slots (``page * page_size + offset``).

    Never records autograd history on the cache (an eager step run with autograd on would
    otherwise chain every step's graph onto it and keep them all alive).
    """
    if torch.is_grad_enabled():
        with torch.no_grad():
            return save_kv(cache, k, v, slot_mapping)
    # A view (never a copy, which index_copy_ would write into instead of the cache); a
    # latent cache's strided v (KVCache.v_in_k) views this way too.
    flat_k = cache.k.view(-1, cache.num_kv_heads, cache.head_dim)
    flat_v = cache.v.view(-1, cache.num_kv_heads, cache.v_head_dim)
    flat_k.index_copy_(0, slot_mapping, k.to(cache.k.dtype))
    flat_v.index_copy_(0, slot_mapping, v.to(cache.v.dtype))


def save_new_kv(k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata, cache: KVCache) -> None:
    """Write the batch's new k/v (the first ``num_tokens`` rows) into the layer's cache."""
    n = md.num_tokens
    slots = md.slot_mapping[:n].to(cache.k.device)
    keep = slots >= 0  # slots < 0 are padding tokens
    save_kv(cache, k[:n][keep], v[:n][keep], slots[keep])


def _slots(page_table_row: torch.Tensor, positions: torch.Tensor, page_size: int, num_pages: int) -> torch.Tensor:
    pages = page_table_row.long()[positions // page_size]
    if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
        raise IndexError(f"page_table refers to page {int(pages.max())} but the KV cache has {num_pages} pages")
    return pages * page_size + positions % page_size


def read_kv(cache: KVCache, page_table_row: torch.Tensor, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values at positions ``[start, start + length)`` of one request."""
    positions = torch.arange(start, start + length, device=cache.k.device)
    slots = _slots(page_table_row.to(cache.k.device), positions, cache.page_size, cache.num_pages)
    flat_k = cache.k.view(-1, cache.num_kv_heads, cache.head_dim)
    flat_v = cache.v.view(-1, cache.num_kv_heads, cache.v_head_dim)
    return flat_k[slots], flat_v[slots]


def merge(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two partial results; ``lse`` has one dimension fewer than ``o``."""
    lse1 = torch.where(lse1 == float("inf"), torch.full_like(lse1, _NEG_INF), lse1)
    lse2 = torch.where(lse2 == float("inf"), torch.full_like(lse2, _NEG_INF), lse2)
    m = torch.maximum(lse1, lse2)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w1, w2 = torch.exp(lse1 - m_safe), torch.exp(lse2 - m_safe)
    denom = w1 + w2
    # where(), not multiplication: an empty side may hold NaN and must not leak into the result.
    part1 = torch.where(w1[..., None] > 0, o1 * w1[..., None], torch.zeros_like(o1))
    part2 = torch.where(w2[..., None] > 0, o2 * w2[..., None], torch.zeros_like(o2))
    o = (part1 + part2) / torch.where(denom > 0, denom, torch.ones_like(denom))[..., None]
    lse = torch.where(denom > 0, m_safe + torch.log(denom), torch.full_like(denom, _NEG_INF))
    return o, lse


def merge_states(
    out: torch.Tensor,
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_out: torch.Tensor,
    suffix_lse: torch.Tensor,
    out_lse: torch.Tensor | None,
) -> None:
    """Merge two partial attention results into ``out`` (and ``out_lse``), in float32."""
    o, lse = merge(prefix_out.float(), prefix_lse.float(), suffix_out.float(), suffix_lse.float())
    out.copy_(o)
    if out_lse is not None:
        out_lse.copy_(lse)


def gather_prefix_chunk(
    k_out: torch.Tensor, v_out: torch.Tensor, cache: KVCache, md: AttentionMetadata, plan: PrefixChunk
) -> None:
    """Pack chunk ``plan`` of every request's cached prefix into ``k_out``/``v_out``.

    One gather for all requests: each packed row's slot is looked up on the host, through
    the page table the metadata keeps there (its page ids were checked when it was built),
    and reaches the device in one copy that never waits for the GPU.
    """
    total = plan.offsets[-1]
    if total:
        lens = np.asarray(plan.lens, dtype=np.int64)
        rows = np.repeat(np.arange(len(lens), dtype=np.int64), lens)
        # Row i of request r holds prefix position starts[r] + (i - offsets[r]).
        pos = np.arange(total, dtype=np.int64) + np.repeat(
            np.asarray(plan.starts, dtype=np.int64) - np.asarray(plan.offsets[:-1], dtype=np.int64), lens)
        page_size = cache.page_size
        pages = md.host_page_table().numpy()[rows, pos // page_size].astype(np.int64, copy=False)
        (slots,) = upload([pages * page_size + pos % page_size], cache.k.device)
        flat_k = cache.k.view(-1, cache.num_kv_heads, cache.head_dim)
        flat_v = cache.v.view(-1, cache.num_kv_heads, cache.v_head_dim)
        k_out[:total] = flat_k.index_select(0, slots)
        v_out[:total] = flat_v.index_select(0, slots)
    k_out[total:] = 0
    v_out[total:] = 0
