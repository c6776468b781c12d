"""The ``reference`` attention implementation: plain torch, any device, float32 accumulation.

It is the oracle that the fast implementations are tested against, so it favours being
obviously right over being fast: one request at a time, host-side loops. With a
skip-softmax factor it walks keys tile by tile by the skip rule (docs/ops.md; same
tile sizes as the kernels, same row blocks, same split boundaries for decode), so its
skip decisions and counters can be compared with a kernel's.
"""

from __future__ import annotations


import torch

from fullcg import telemetry
from fullcg.context import ForwardContext
from fullcg.kv_cache import KVCache
from fullcg.ops.call import AttentionCall
from fullcg.ops.impl import register_implementation
from fullcg.ops.impl.base import AttentionImpl
from fullcg.ops.torch_ops import merge, read_kv

__all__ = ["ReferenceAttention", "attend_dense", "attend_tiled", "cap_scores", "visibility"]

_NEG_INF = float("-inf")


def visibility(
    num_q: int, num_kv: int, causal_offset: int | None, window: int | None, window_offset: int | None,
    device: torch.device,
) -> torch.Tensor | None:
    """``bool [num_q, num_kv]``: which keys each query sees (None: all of them).

    Query ``j`` sits at key position ``offset + j``: causal attention sees keys up to it
    (``causal_offset``); a sliding window of ``W`` sees keys after ``offset + j - W``, with
    ``window_offset`` the offset (default ``causal_offset``; a prefix chunk, attended
    without a causal mask, gives its own).
    """
    if causal_offset is None and window is None:
        return None
    kpos = torch.arange(num_kv, device=device)[None, :]
    qrow = torch.arange(num_q, device=device)[:, None]
    vis = kpos <= causal_offset + qrow if causal_offset is not None else torch.ones(
        (num_q, num_kv), dtype=torch.bool, device=device)
    if window is not None:
        offset = causal_offset if window_offset is None else window_offset
        vis = vis & (kpos > offset + qrow - window)
    return vis


def cap_scores(s: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Logit soft-capping: ``c * tanh(s / c)`` (identity without a cap)."""
    return s if softcap is None else softcap * torch.tanh(s / softcap)


def attend_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int | None,
    window: int | None = None, softcap: float | None = None, window_offset: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one request in float32 (or q's dtype if float64).

    ``window``, ``softcap`` and ``window_offset`` as in :func:`visibility` and
    :func:`cap_scores`. Returns ``out [n, Hq, Dv]`` and natural-log ``lse [n, Hq]``; rows
    that see no key get zeros and -inf.
    """
    n, num_q_heads, _ = q.shape
    length, num_kv_heads, dv = v.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if length == 0:
        return q.new_zeros((n, num_q_heads, dv), dtype=acc), q.new_full((n, num_q_heads), _NEG_INF, dtype=acc)
    group = num_q_heads // num_kv_heads
    qf = q.to(acc).view(n, num_kv_heads, group, -1)
    s = cap_scores(torch.einsum("nhgd,lhd->hgnl", qf, k.to(acc)) * scale, softcap)
    vis = visibility(n, length, causal_offset, window, window_offset, q.device)
    if vis is not None:
        s = s.masked_fill(~vis, _NEG_INF)
    m = s.amax(-1)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m_safe[..., None])
    denom = p.sum(-1)
    o = torch.einsum("hgnl,lhd->nhgd", p, v.to(acc))
    denom_nt = denom.permute(2, 0, 1)[..., None]  # [n, Hkv, G, 1]
    o = torch.where(denom_nt > 0, o / denom_nt.clamp_min(torch.finfo(acc).tiny), torch.zeros_like(o))
    lse = torch.where(denom > 0, m_safe + torch.log(denom), torch.full_like(denom, _NEG_INF))
    return o.reshape(n, num_q_heads, dv), lse.permute(2, 0, 1).reshape(n, num_q_heads)


def attend_tiled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal_offset: int | None,
    scale_factor: float,
    tile_kv: int,
    tile_q: int,
    split_tiles: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    window_offset: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Skip-softmax attention of one request, tile by tile (the rule in docs/ops.md).

    Rows are blocked as kernels block them: ``tile_q`` query tokens times the query heads
    of one KV head share each decision. With ``split_tiles`` the keys are processed in
    independent runs of that many tiles (split-KV decode), each starting from an empty
    running max, and merged by LSE at the end; with a sliding window the runs start at the
    first tile the window reaches. ``lambda`` is ``scale_factor`` over the keys a query
    can see: the request's keys, or the window where it is shorter. ``window``,
    ``softcap`` and ``window_offset`` as in :func:`attend_dense`.

    Returns ``out [n, Hq, Dv]``, ``lse [n, Hq]``, tiles visited and tiles skipped.
    """
    n, num_q_heads, d = q.shape
    length, num_kv_heads, dv = v.shape
    if length == 0:
        o, lse = attend_dense(q, k, v, scale, causal_offset)
        return o, lse, 0, 0
    group = num_q_heads // num_kv_heads
    lam = scale_factor / (length if window is None else min(length, window))
    skipping = lam < 1.0
    dev = q.device
    num_blocks = -(-n // tile_q)
    rows = tile_q * group

    qp = torch.zeros(num_blocks * tile_q, num_kv_heads, group, d, dtype=torch.float32, device=dev)
    qp[:n] = q.float().view(n, num_kv_heads, group, d)
    # [Hkv, NB, rows, D]; row r of block b is token b*tile_q + r // group, head r % group.
    qb = qp.view(num_blocks, tile_q, num_kv_heads, group, d).permute(2, 0, 1, 3, 4).reshape(
        num_kv_heads, num_blocks, rows, d
    )
    tok = (torch.arange(num_blocks, device=dev)[:, None] * tile_q + torch.arange(rows, device=dev)[None, :] // group)
    row_valid = tok < n  # [NB, rows]
    kf, vf = k.float(), v.float()

    num_tiles = -(-length // tile_kv)
    step = split_tiles if split_tiles is not None else num_tiles
    vis_all = visibility(n, length, causal_offset, window, window_offset, dev)
    first_tile = 0
    if window is not None and split_tiles is not None:
        # The first key any query sees (queries are in position order): runs start at its tile.
        first_tile = int(vis_all[0].nonzero()[0]) // tile_kv if vis_all[0].any() else 0
    visited = skipped = 0
    partials: list[tuple[torch.Tensor, torch.Tensor]] = []
    for first in range(first_tile, num_tiles, step):
        m = torch.full((num_kv_heads, num_blocks, rows), _NEG_INF, device=dev)
        l_sum = torch.zeros((num_kv_heads, num_blocks, rows), device=dev)
        acc = torch.zeros((num_kv_heads, num_blocks, rows, dv), device=dev)
        for t in range(first, min(first + step, num_tiles)):
            ks, ke = t * tile_kv, min(length, (t + 1) * tile_kv)
            s = cap_scores(torch.einsum("hbrd,khd->hbrk", qb, kf[ks:ke]) * scale, softcap)
            vis = row_valid[..., None].expand(num_blocks, rows, ke - ks)
            if vis_all is not None:
                tok_c = tok.clamp(max=n - 1)  # padding rows are masked by row_valid already
                vis = vis & vis_all[tok_c][..., ks:ke]
            s = s.masked_fill(~vis[None], _NEG_INF)
            active = vis.flatten(1).any(-1)  # [NB]: a kernel's loop reaches this tile for the block
            tile_max = s.amax(-1)
            if t == first or not skipping:
                skip = torch.zeros((num_kv_heads, num_blocks), dtype=torch.bool, device=dev)
            else:
                # A row agrees to skip when the tile cannot matter to it: nothing visible, or
                # exp(tile_max - running_max) < lambda. Every row of the block must agree.
                gap_small = torch.exp(tile_max - m) < lam
                agree = torch.isneginf(tile_max) | (~torch.isneginf(m) & gap_small)
                skip = agree.all(-1)
            skip = skip & active[None]
            visited += int(active.sum()) * num_kv_heads
            skipped += int(skip.sum())
            keep = ~skip[..., None]  # [Hkv, NB, 1]
            m_new = torch.where(keep, torch.maximum(m, tile_max), m)
            m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.where(keep, torch.exp(m - m_safe), torch.ones_like(m))
            p = torch.exp(s - m_safe[..., None]) * keep[..., None]
            l_sum = l_sum * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.einsum("hbrk,khd->hbrd", p, vf[ks:ke])
            m = m_new
        lse = torch.where(l_sum > 0, m + torch.log(l_sum), torch.full_like(l_sum, _NEG_INF))
        o = torch.where(l_sum[..., None] > 0, acc / l_sum.clamp_min(1e-38)[..., None], torch.zeros_like(acc))
        partials.append((o, lse))

    o, lse = partials[0]
    for o2, lse2 in partials[1:]:
        o, lse = merge(o, lse, o2, lse2)

    def unblock(x: torch.Tensor) -> torch.Tensor:  # [Hkv, NB, rows, ...] -> [n, Hq, ...]
        tail = x.shape[3:]
        x = x.reshape(num_kv_heads, num_blocks, tile_q, group, *tail)
        x = x.permute(1, 2, 0, 3, *range(4, 4 + len(tail))).reshape(num_blocks * tile_q, num_q_heads, *tail)
        return x[:n]

    return unblock(o), unblock(lse), visited, skipped


class ReferenceAttention(AttentionImpl):
    """Plain-torch attention for any device; see the module docstring."""

    name = "reference"
    takes_v_in_k = True

    def forward(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache | None) -> torch.Tensor | None:
        md = ctx.metadata
        q, out = call.q, call.out
        num_tokens = md.num_tokens
        skip_cfg = ctx.config.skip_softmax
        lse = torch.full(q.shape[:2], _NEG_INF, dtype=torch.float32, device=q.device) if call.return_lse else None
        starts = md.query_starts
        chunk = md.prefix_chunks[call.prefix_chunk] if call.prefix_chunk is not None else None
        window, softcap = call.sliding_window, call.logit_softcap
        for r, mode in enumerate(md.forward_modes):
            qs, qe = starts[r], starts[r + 1]
            causal_offset: int | None
            window_offset: int | None = None
            if cache is not None:
                k_r, v_r = read_kv(cache, md.page_table[r], 0, md.prefix_lens[r] + md.query_lens[r])
                causal_offset = md.prefix_lens[r]
            elif chunk is not None:
                k_r, v_r = call.k[chunk.offsets[r] : chunk.offsets[r + 1]], call.v[chunk.offsets[r] : chunk.offsets[r + 1]]
                causal_offset = None
                # The chunk's first key is prefix position starts[r]; the first new token is at prefix_lens[r].
                window_offset = md.prefix_lens[r] - chunk.starts[r]
            else:
                k_r, v_r = call.k[qs:qe], call.v[qs:qe]
                causal_offset = 0 if call.causal else None
            factor = call.scale_factor_for(mode)
            if factor is None:
                o, l_r = attend_dense(q[qs:qe], k_r, v_r, call.scale, causal_offset, window, softcap, window_offset)
            else:
                o, l_r, visited, skipped = attend_tiled(
                    q[qs:qe], k_r, v_r, call.scale, causal_offset, factor, skip_cfg.tile_kv, skip_cfg.tile_q,
                    skip_cfg.decode_split_tiles if mode.is_decode else None, window, softcap, window_offset,
                )
                ctr = telemetry.counters(call.layer_id, q.device)
                kind = telemetry.DECODE if mode.is_decode else telemetry.PREFILL
                ctr[kind, telemetry.VISITED] += visited
                ctr[kind, telemetry.SKIPPED] += skipped
            out[qs:qe] = o.to(out.dtype)
            if lse is not None:
                lse[qs:qe] = l_r
        # Padding rows (CUDA-graph padding) are zeroed so they never carry NaN or Inf.
        out[num_tokens:] = 0
        return lse


register_implementation(ReferenceAttention())
