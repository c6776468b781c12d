"""Prefill/extend attention over a variable-length batch, with skip-softmax and LSE.

One program computes one row block of one request for one KV head: ``TILE_Q`` query
tokens times the ``GROUP`` query heads that share the KV head (GQA packing, so K and V
tiles are loaded once for the whole group). Rows are token-major: row ``i`` is token
``i // GROUP``, head ``i % GROUP`` of the group. Keys come from the paged KV cache (causal
over prefix plus new tokens) or from a ragged k/v tensor (causal or not).

With a sliding window of ``W`` keys, the query at key position ``p`` sees keys
``(p - W, p]``: a block's loop starts at the tile holding its first row's first visible
key, so a long context with a short window reads only its window (plus the block's span).
Query ``j`` of a request sits at key position ``offset + j``: the cached prefix's length
over the cache, 0 over given causal k/v, and for a prefix chunk (non-causal) the per-request
``window_offsets`` (the request's prefix length less the chunk's first position).

Decode requests are left to :mod:`fullcg.ops.kernels.decode`; their programs exit at once.
The grid is sized from tensor shapes only (tokens, heads, requests), never from lengths
read off the device, so launches are safe under CUDA graph capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fullcg.ops.kernels.launch import Launcher, PlannedLaunch
from fullcg.ops.kernels.tile import attend_tile, kv_offsets, kv_source, padded, softcap_args, with_cols

__all__ = ["prefill_attention", "plan_prefill", "PrefillLaunch"]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


# Not specialised on what changes from step to step (see the decode kernel): the page
# table's row stride and the addresses of the step's metadata vectors; nor on the window's
# size (a model's windows differ by layer, each one kernel).
@triton.jit(do_not_specialize=["stride_pt", "window"],
            do_not_specialize_on_alignment=["PageTable", "QLoc", "KvLoc", "SeqLens", "PrefixLens", "IsDecode"])
def _prefill_kernel(
    Q, K, V, Out, Lse, Ctr,
    PageTable, QLoc, KvLoc, SeqLens, PrefixLens, IsDecode,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_pt,
    qk_scale2, factor, window, cap_in, cap_out,
    GROUP: tl.constexpr, TILE_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr, SKIP: tl.constexpr, DOT_F32: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    kvh = tl.program_id(1)
    req = tl.program_id(2)
    if tl.load(IsDecode + req) != 0:
        return
    q_start = tl.load(QLoc + req)
    n_q = tl.load(QLoc + req + 1) - q_start
    n_blocks = tl.cdiv(n_q, TILE_Q)
    # Heaviest (last, under a causal mask) blocks first: better tail balance.
    blk = n_blocks - 1 - tl.program_id(0)
    if blk < 0:
        return
    if PAGED:
        kv_len = tl.load(SeqLens + req)
        offset = tl.load(PrefixLens + req)
        kv_start = 0
    else:
        kv_start = tl.load(KvLoc + req)
        kv_len = tl.load(KvLoc + req + 1) - kv_start
        offset = 0

    rows = tl.arange(0, BLOCK_M)
    tok = blk * TILE_Q + rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = (rows < TILE_Q * GROUP) & (tok < n_q)
    if CAUSAL:
        row_limit = tl.minimum(offset + tok + 1, kv_len)
    else:
        row_limit = tl.zeros([BLOCK_M], dtype=tl.int32) + kv_len
    row_limit = tl.where(row_ok, row_limit, 0)
    # Keys every real row sees (unmasked tiles) and keys any real row sees (the loop's end).
    first_tok = blk * TILE_Q
    last_tok = tl.minimum(first_tok + TILE_Q, n_q) - 1
    if CAUSAL:
        lo_keys = tl.minimum(offset + first_tok + 1, kv_len)
        hi_keys = tl.minimum(offset + last_tok + 1, kv_len)
    else:
        lo_keys = kv_len
        hi_keys = kv_len
    n_full = lo_keys // BLOCK_N
    n_tiles = tl.cdiv(hi_keys, BLOCK_N)
    # Tiles [t_start, t_inner) are masked below by some row's window, [t_inner, n_full) are
    # seen whole by every real row, [n_full, n_tiles) are masked above (causal or the end).
    t_start = 0
    t_inner = 0
    row_lo = row_limit  # read only with WINDOW
    if WINDOW:
        # Query j sits at key position win_off + j (a prefix chunk: PrefixLens holds it).
        if CAUSAL:
            win_off = offset
        else:
            win_off = tl.load(PrefixLens + req)
        row_lo = win_off + tok - window + 1
        lo_first = tl.maximum(win_off + first_tok - window + 1, 0)
        lo_last = tl.maximum(win_off + last_tok - window + 1, 0)
        # Rows see contiguous, overlapping ranges: the block sees [lo_first, hi_keys), every tile
        # of it holds a key some row sees. None (a chunk wholly before every window): no tile.
        t_start = tl.where(lo_first < hi_keys, lo_first // BLOCK_N, n_tiles)
        t_inner = tl.minimum(tl.maximum(tl.cdiv(lo_last, BLOCK_N), t_start), n_tiles)
        n_full = tl.minimum(tl.maximum(n_full, t_inner), n_tiles)

    # Register tiles are a power of two wide; a head of another size is padded (tile.py).
    BLOCK_D: tl.constexpr = padded(HEAD_D)
    BLOCK_DV: tl.constexpr = padded(HEAD_DV)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=with_cols(row_ok[:, None], offs_d, HEAD_D), other=0.0,
    )

    log2_lam = 0.0
    if SKIP:
        # lambda = factor / the keys a query can see: the request's, or the window where shorter.
        keys = kv_len
        if WINDOW:
            keys = tl.minimum(kv_len, window)
        lam = factor / tl.maximum(keys, 1).to(tl.float32)  # no keys: no tiles anyway
        # lambda >= 1 means no skipping for this request: -inf makes the test always false.
        log2_lam = tl.where(lam < 1.0, tl.log2(lam), float("-inf"))

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    n_skipped = 0
    page_row = PageTable + req.to(tl.int64) * stride_pt
    K_h = K + kvh.to(tl.int64) * stride_kh
    V_h = V + kvh.to(tl.int64) * stride_vh
    if WINDOW:
        for t in range(t_start, t_inner):
            k_offs, pos = kv_offsets(page_row, kv_start, t * BLOCK_N, kv_len, stride_kp, stride_ks, PAGED, PAGE_SIZE,
                                     BLOCK_N)
            v_offs, pos = kv_offsets(page_row, kv_start, t * BLOCK_N, kv_len, stride_vp, stride_vs, PAGED, PAGE_SIZE,
                                     BLOCK_N)
            m_i, l_i, acc, sk = attend_tile(
                q, m_i, l_i, acc, K_h, V_h, k_offs, v_offs, pos, row_limit, row_lo, kv_len, offs_d, offs_dv,
                qk_scale2, cap_in, cap_out, log2_lam, t - t_start, HEAD_D, HEAD_DV, True, SKIP, DOT_F32, True, SOFTCAP,
            )
            n_skipped += sk
    for t in range(t_inner, n_full):
        k_offs, pos = kv_offsets(page_row, kv_start, t * BLOCK_N, kv_len, stride_kp, stride_ks, PAGED, PAGE_SIZE, BLOCK_N)
        v_offs, pos = kv_offsets(page_row, kv_start, t * BLOCK_N, kv_len, stride_vp, stride_vs, PAGED, PAGE_SIZE, BLOCK_N)
        m_i, l_i, acc, sk = attend_tile(
            q, m_i, l_i, acc, K_h, V_h, k_offs, v_offs, pos, row_limit, row_lo, kv_len, offs_d, offs_dv,
            qk_scale2, cap_in, cap_out, log2_lam, t - t_start, HEAD_D, HEAD_DV, False, SKIP, DOT_F32, WINDOW, SOFTCAP,
        )
        n_skipped += sk
    for t in range(n_full, n_tiles):
        k_offs, pos = kv_offsets(page_row, kv_start, t * BLOCK_N, kv_len, stride_kp, stride_ks, PAGED, PAGE_SIZE, BLOCK_N)
        v_offs, pos = kv_offsets(page_row, kv_start, t * BLOCK_N, kv_len, stride_vp, stride_vs, PAGED, PAGE_SIZE, BLOCK_N)
        m_i, l_i, acc, sk = attend_tile(
            q, m_i, l_i, acc, K_h, V_h, k_offs, v_offs, pos, row_limit, row_lo, kv_len, offs_d, offs_dv,
            qk_scale2, cap_in, cap_out, log2_lam, t - t_start, HEAD_D, HEAD_DV, True, SKIP, DOT_F32, WINDOW, SOFTCAP,
        )
        n_skipped += sk

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    o = tl.where(has[:, None], o, 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(
        Out + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
        o.to(Out.dtype.element_ty), mask=with_cols(row_ok[:, None], offs_dv, HEAD_DV),
    )
    tl.store(Lse + q_rows * stride_lt + head, lse, mask=row_ok)
    if SKIP:
        # Prefill/extend counters: row [0] of the layer's [2, 2] tensor.
        tl.atomic_add(Ctr + 0, (n_tiles - t_start).to(tl.int64))
        tl.atomic_add(Ctr + 1, n_skipped.to(tl.int64))


_PREFILL = Launcher(_prefill_kernel)


class PrefillLaunch:
    """The prefill kernel's launch for one step and one layer shape, derived once; calling
    it runs the kernel for one layer's tensors (see :func:`plan_prefill`)."""

    def __init__(self, launch: PlannedLaunch, skip: bool) -> None:
        self.launch, self.skip = launch, skip

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
        counters: torch.Tensor | None,
    ) -> None:
        self.launch(q, k, v, out, lse, counters if self.skip else lse)


def plan_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    is_decode: torch.Tensor,
    scale: float,
    causal: bool,
    factor: float | None,
    tile_q: int,
    tile_kv: int,
    page_table: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    prefix_lens: torch.Tensor | None = None,
    kv_start_loc: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    window_offsets: torch.Tensor | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> PrefillLaunch:
    """Plan the prefill kernel for calls shaped like these tensors (see :func:`prefill_attention`)."""
    src = kv_source(k, v, page_table, kv_start_loc, query_start_loc)
    num_requests = query_start_loc.shape[0] - 1
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, head_dim_v = v.shape[-2], v.shape[-1]
    group = num_q_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(tile_q * group))
    if window is not None and not causal:
        # Non-causal attention with a window: a prefix chunk, whose queries' positions are given.
        if window_offsets is None:
            raise ValueError("a window over non-causal (prefix chunk) k/v needs window_offsets: each request's "
                             "first query position among the chunk's keys")
    if not src.paged:
        seq_lens = query_start_loc  # unused
        prefix_lens = window_offsets if window is not None and not causal else query_start_loc
    skip = factor is not None
    if num_warps is None:
        # By the register tiles' size: a padded head's (tile.py), not the head's own.
        num_warps = 8 if block_m * max(padded(head_dim), padded(head_dim_v)) >= 128 * 128 else 4
    if num_stages is None:
        num_stages = 2
    tail = (
        src.page_table, query_start_loc, src.kv_start_loc, seq_lens, prefix_lens, is_decode,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), lse.stride(0),
        *src.strides, src.stride_page_table,
        scale * _LOG2E, float(factor) if skip else 0.0, int(window) if window is not None else 0,
        *softcap_args(scale, softcap),
    )
    constexprs = (group, tile_q, block_m, tile_kv, head_dim, head_dim_v, src.paged, src.page_size, causal, skip,
                  q.dtype == torch.float32, window is not None, softcap is not None)
    grid = (triton.cdiv(q.shape[0], tile_q), num_kv_heads, num_requests)
    # Only the leading tensors' dtypes are read: an empty int64 stands in for the counters.
    counters = torch.empty(0, dtype=torch.int64, device=q.device) if skip else lse
    return PrefillLaunch(_PREFILL.plan(grid, (q, k, v, out, lse, counters), tail, constexprs, num_warps, num_stages),
                         skip)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    counters: torch.Tensor | None,
    **options: object,
) -> None:
    """Attention of every non-decode request of a batch into ``out`` and ``lse``.

    Keyword options (those of :func:`plan_prefill`): ``query_start_loc``, ``is_decode``,
    ``scale``, ``causal``, ``factor``, ``tile_q``, ``tile_kv`` and the source. With
    ``page_table`` (plus ``seq_lens`` and ``prefix_lens``), ``k``/``v`` are the paged
    cache ``[pages, page_size, Hkv, D]`` and attention is causal over prefix plus new tokens.
    Without, ``k``/``v`` are ragged ``[rows, Hkv, D]`` and request ``r`` owns rows
    ``kv_start_loc[r] : kv_start_loc[r + 1]``. ``factor`` None is dense attention;
    otherwise skip-softmax with ``lambda = factor / kv_len`` (``min(kv_len, window)`` with
    a window) and tiles counted into ``counters[0]``. ``lse`` is written in natural log for
    the rows computed here.

    ``window`` (keys a query sees, itself included) and ``softcap`` (scores become
    ``c * tanh(s / c)``) as the ops take them; non-causal attention with a window (a prefix
    chunk) needs ``window_offsets`` (``int32 [R]``): the key position of each request's
    first query (its prefix length less the chunk's first prefix position).
    """
    if options.get("factor") is not None and counters is None:
        raise ValueError("skip-softmax needs a counters tensor (fullcg.telemetry.counters)")
    plan_prefill(q, k, v, out, lse, **options)(q, k, v, out, lse, counters)
