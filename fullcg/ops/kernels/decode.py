"""Decode attention: split-KV over the keys, then an LSE-weighted reduction of the splits.

A decode request has one query token. One program of the split kernel takes one KV head
(all ``GROUP`` query heads sharing it, so they share each tile's skip decision), one
request and one run of its keys; the first tile of every run is never skipped.
It writes a normalised partial output and its log2 LSE to a workspace, and the merge
kernel combines a request's runs into ``out`` and the natural-log LSE.

Dense decode (no skip factor, no configured split) splits every request's keys into a
fixed *number* of runs, sized on the device from the request's own length: a CUDA graph
captured against a large cache capacity still spreads a short context over the SMs.
Skip-softmax decode splits into runs of a fixed number of *tiles* (the skip rule's unit),
so its grid is sized from the capacity and programs past a request's splits exit at once.

The merge kernel also owns the padding rows of a batch: rows at or past the real token
count (CUDA-graph stand-in requests) and rows no request owns come out as zeros with LSE
-inf, so callers need no masking pass. Workspace and grids are sized from shapes and fixed
bounds, so the launch is safe under CUDA graph capture.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fullcg.ops.kernels.launch import Launcher, raw_stream, static_key
from fullcg.ops.kernels.tile import attend_tile, kv_offsets, kv_source

__all__ = ["decode_attention", "plan_decode", "DecodeLaunch", "MAX_DENSE_SPLITS"]

_LOG2E = 1.4426950408889634

#: Most runs one request's keys are split into for dense decode (dense results do not
#: depend on the split, so the launcher picks a count that fills the GPU, up to this).
MAX_DENSE_SPLITS = 64


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _split_tiles(n_tiles, num_splits, SPLIT_TILES: tl.constexpr):
    """Tiles per run: fixed (SPLIT_TILES > 0) or the request's tiles over ``num_splits`` runs."""
    if SPLIT_TILES > 0:
        return n_tiles * 0 + SPLIT_TILES
    return tl.maximum(tl.cdiv(n_tiles, num_splits), 1)


# Counts that change with the batch are not specialised on: no recompile per batch size.
@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    Q, K, V, PartOut, PartLse, Ctr,
    PageTable, QLoc, KvLoc, SeqLens, IsDecode, NumTokens,
    stride_qt, stride_qh, stride_ps, stride_pr,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_pt,
    qk_scale2, factor, num_splits,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_TILES: tl.constexpr,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr, SKIP: tl.constexpr, DOT_F32: tl.constexpr,
):
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    req = tl.program_id(2)
    if tl.load(IsDecode + req) == 0:
        return
    q_row = tl.load(QLoc + req).to(tl.int64)
    if q_row >= tl.load(NumTokens):
        return  # a padding row: the merge kernel zeroes it
    if PAGED:
        kv_len = tl.load(SeqLens + req)
        kv_start = 0
    else:
        kv_start = tl.load(KvLoc + req)
        kv_len = tl.load(KvLoc + req + 1) - kv_start
    n_tiles = tl.cdiv(kv_len, BLOCK_N)
    split_tiles = _split_tiles(n_tiles, num_splits, SPLIT_TILES)
    first = split * split_tiles
    if first >= n_tiles:
        return
    last = tl.minimum(first + split_tiles, n_tiles)
    # Tiles before the request's last one are full: no mask needed there.
    n_full = tl.minimum(last, kv_len // BLOCK_N)

    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP
    head = kvh * GROUP + rows
    # The one query token sees every key (it is the newest): the limit is kv_len.
    row_limit = tl.where(row_ok, kv_len, 0)
    offs_d = tl.arange(0, HEAD_D)
    offs_dv = tl.arange(0, HEAD_DV)
    q = tl.load(Q + q_row * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0)

    log2_lam = 0.0
    if SKIP:
        lam = factor / tl.maximum(kv_len, 1).to(tl.float32)  # kv_len 0: no tiles anyway
        log2_lam = tl.where(lam < 1.0, tl.log2(lam), float("-inf"))

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DV], dtype=tl.float32)
    n_skipped = 0
    page_row = PageTable + req.to(tl.int64) * stride_pt
    K_h = K + kvh.to(tl.int64) * stride_kh
    V_h = V + kvh.to(tl.int64) * stride_vh
    for t in range(first, n_full):
        k_offs, pos = kv_offsets(page_row, kv_start, t * BLOCK_N, kv_len, stride_kp, stride_ks, PAGED, PAGE_SIZE, BLOCK_N)
        v_offs, pos = kv_offsets(page_row, kv_start, t * BLOCK_N, kv_len, stride_vp, stride_vs, PAGED, PAGE_SIZE, BLOCK_N)
        m_i, l_i, acc, sk = attend_tile(
            q, m_i, l_i, acc, K_h, V_h, k_offs, v_offs, pos, row_limit, kv_len, offs_d, offs_dv,
            qk_scale2, log2_lam, t - first, False, SKIP, DOT_F32,
        )
        n_skipped += sk
    for t in range(tl.maximum(n_full, first), last):
        k_offs, pos = kv_offsets(page_row, kv_start, t * BLOCK_N, kv_len, stride_kp, stride_ks, PAGED, PAGE_SIZE, BLOCK_N)
        v_offs, pos = kv_offsets(page_row, kv_start, t * BLOCK_N, kv_len, stride_vp, stride_vs, PAGED, PAGE_SIZE, BLOCK_N)
        m_i, l_i, acc, sk = attend_tile(
            q, m_i, l_i, acc, K_h, V_h, k_offs, v_offs, pos, row_limit, kv_len, offs_d, offs_dv,
            qk_scale2, log2_lam, t - first, True, SKIP, DOT_F32,
        )
        n_skipped += sk

    has = l_i > 0.0
    o = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    part = req.to(tl.int64) * stride_pr + split.to(tl.int64) * stride_ps
    tl.store(PartOut + (part + head[:, None]) * HEAD_DV + offs_dv[None, :], o, mask=row_ok[:, None])
    tl.store(PartLse + part + head, lse2, mask=row_ok)
    if SKIP:
        # Decode counters: row [1] of the layer's [2, 2] tensor.
        tl.atomic_add(Ctr + 2, (last - first).to(tl.int64))
        tl.atomic_add(Ctr + 3, n_skipped.to(tl.int64))


@triton.jit(do_not_specialize=["num_requests", "num_rows", "num_splits"])
def _decode_merge_kernel(
    PartOut, PartLse, Out, Lse,
    QLoc, KvLoc, SeqLens, IsDecode, NumTokens,
    num_requests, num_rows, num_splits,
    stride_ot, stride_oh, stride_lt, stride_ps, stride_pr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_TILES: tl.constexpr,
    BLOCK_S: tl.constexpr, HEAD_DV: tl.constexpr, PAGED: tl.constexpr,
):
    kvh = tl.program_id(0)
    req = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    head = kvh * GROUP + g
    offs_dv = tl.arange(0, HEAD_DV)
    if req == num_requests:
        # The extra program: rows past the last request's (padding no request owns).
        zeros = tl.zeros([BLOCK_G, HEAD_DV], dtype=Out.dtype.element_ty)
        for row in range(tl.load(QLoc + num_requests), num_rows):
            row64 = tl.zeros([1], dtype=tl.int64) + row
            tl.store(Out + row64 * stride_ot + head[:, None] * stride_oh + offs_dv[None, :], zeros, mask=g_ok[:, None])
            tl.store(Lse + row64 * stride_lt + head, tl.full([BLOCK_G], float("-inf"), tl.float32), mask=g_ok)
        return
    if tl.load(IsDecode + req) == 0:
        return
    q_row = tl.load(QLoc + req).to(tl.int64)
    if PAGED:
        kv_len = tl.load(SeqLens + req)
    else:
        kv_len = tl.load(KvLoc + req + 1) - tl.load(KvLoc + req)
    n_tiles = tl.cdiv(kv_len, BLOCK_N)
    # Padding rows (stand-in requests past the real token count) have no splits: zeros.
    n_splits = tl.where(q_row < tl.load(NumTokens), tl.cdiv(n_tiles, _split_tiles(n_tiles, num_splits, SPLIT_TILES)), 0)
    base = req.to(tl.int64) * stride_pr
    # Online merge over chunks of BLOCK_S splits (a request may have many).
    m = tl.zeros([BLOCK_G], dtype=tl.float32) - float("inf")
    w_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DV], dtype=tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        ok = (s < n_splits)[:, None] & g_ok[None, :]
        idx = base + s[:, None].to(tl.int64) * stride_ps + head[None, :]
        lse2 = tl.load(PartLse + idx, mask=ok, other=float("-inf"))  # [S, G]
        m_new = tl.maximum(m, tl.max(lse2, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse2 - m_safe[None, :])  # 0 for empty splits
        o = tl.load(PartOut + idx[:, :, None] * HEAD_DV + offs_dv[None, None, :], mask=ok[:, :, None], other=0.0)
        w_sum = w_sum * alpha + tl.sum(w, 0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 0)
        m = m_new
    has = w_sum > 0.0
    out = tl.where(has[:, None], acc / tl.where(has, w_sum, 1.0)[:, None], 0.0)
    lse = tl.where(has, (m + tl.log2(tl.where(has, w_sum, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(Out + q_row * stride_ot + head[:, None] * stride_oh + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=g_ok[:, None])
    tl.store(Lse + q_row * stride_lt + head, lse, mask=g_ok)


_SPLIT = Launcher(_decode_split_kernel)
_MERGE = Launcher(_decode_merge_kernel)


class DecodeLaunch:
    """The decode kernels' launches for one step and one layer shape, derived once.

    Calling it runs them for one layer: only that layer's tensors (``q``, ``k``, ``v``,
    ``out``, ``lse``, counters) differ between the calls of a step, so grids, strides,
    split counts, workspace and the compiled kernels are worked out by :func:`plan_decode`
    and every call only assembles arguments and launches.
    """

    def __init__(
        self, split_grid, split_tail, split_constexprs, merge_grid, merge_tail, merge_constexprs,
        part_out, part_lse, has_decode, skip, num_warps, num_stages, device,
    ) -> None:
        self.split_grid, self.split_tail, self.split_constexprs = split_grid, split_tail, split_constexprs
        self.merge_grid, self.merge_tail, self.merge_constexprs = merge_grid, merge_tail, merge_constexprs
        self.part_out, self.part_lse = part_out, part_lse
        self.has_decode, self.skip = has_decode, skip
        self.num_warps, self.num_stages = num_warps, num_stages
        self.device = device
        self._split_key: tuple | None = None
        self._merge_key: tuple | None = None

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
        counters: torch.Tensor | None,
    ) -> None:
        stream = raw_stream(self.device)
        if self.has_decode:
            ctr = counters if self.skip else self.part_lse  # unused unless skip
            args = (q, k, v, self.part_out, self.part_lse, ctr, *self.split_tail)
            if self._split_key is None:
                self._split_key = static_key(args, self.split_constexprs, self.num_warps, self.num_stages)
            _SPLIT.launch_keyed(self.split_grid, args, self.split_constexprs, self.num_warps, self.num_stages,
                                self._split_key, stream)
        args = (self.part_out, self.part_lse, out, lse, *self.merge_tail)
        if self._merge_key is None:
            self._merge_key = static_key(args, self.merge_constexprs, 4, 3)
        _MERGE.launch_keyed(self.merge_grid, args, self.merge_constexprs, 4, 3, self._merge_key, stream)


def plan_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    is_decode: torch.Tensor,
    scale: float,
    factor: float | None,
    tile_kv: int,
    split_tiles: int | None,
    max_kv_len: int,
    page_table: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    kv_start_loc: torch.Tensor | None = None,
    num_tokens: torch.Tensor | None = None,
    num_splits: int | None = None,
    has_decode: bool = True,
    workspace: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> DecodeLaunch:
    """Plan the decode kernels for calls shaped like these tensors (see :func:`decode_attention`)."""
    src = kv_source(k, v, page_table, kv_start_loc, query_start_loc)
    num_requests = query_start_loc.shape[0] - 1
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, head_dim_v = v.shape[-2], v.shape[-1]
    group = num_q_heads // num_kv_heads
    skip = factor is not None
    max_tiles = max(1, triton.cdiv(max_kv_len, tile_kv))
    if skip or split_tiles is not None:
        # Runs of a fixed number of tiles: the skip rule's "first tile of a run" depends on
        # it. Without a configured split, one run over all keys (the reference's walk).
        # Capped so the constexpr (and the compiled variant) does not grow with the cache.
        cap = triton.next_power_of_2(max_tiles)
        split_tiles = min(split_tiles if split_tiles is not None else cap, cap)
        max_splits = triton.cdiv(max_tiles, split_tiles)
        num_splits = max_splits
    else:
        # Dense: a fixed number of runs per request, each request's own length divided on
        # the device. Enough programs to give every SM work at small batch (few KV heads
        # would otherwise leave most of the GPU idle), sized from shapes only.
        if num_splits is None:
            num_splits = triton.cdiv(2 * _sm_count(q.device), num_kv_heads * max(1, num_requests))
        num_splits = max(1, min(num_splits, max_tiles, MAX_DENSE_SPLITS))
        split_tiles = 0
        max_splits = num_splits
    if num_tokens is None:
        num_tokens = torch.full((1,), q.shape[0], dtype=torch.int32, device=q.device)
    if not has_decode:
        max_splits = 1  # nothing reads the workspace: the merge kernel only writes padding rows
    shape = (num_requests, max_splits, num_q_heads, head_dim_v)
    parts = workspace.get(shape) if workspace is not None else None
    if parts is None:
        parts = (
            torch.empty(shape, dtype=torch.float32, device=q.device),
            torch.empty(shape[:3], dtype=torch.float32, device=q.device),
        )
        if workspace is not None:
            workspace[shape] = parts
    part_out, part_lse = parts
    if not src.paged:
        seq_lens = query_start_loc  # unused
    block_m = max(16, triton.next_power_of_2(group))
    split_tail = (
        src.page_table, query_start_loc, src.kv_start_loc, seq_lens, is_decode, num_tokens,
        q.stride(0), q.stride(1), part_lse.stride(1), part_lse.stride(0),
        *src.strides, src.stride_page_table,
        scale * _LOG2E, float(factor) if skip else 0.0, num_splits,
    )
    split_constexprs = (group, block_m, tile_kv, split_tiles, head_dim, head_dim_v, src.paged, src.page_size, skip,
                        q.dtype == torch.float32)
    merge_tail = (
        query_start_loc, src.kv_start_loc, seq_lens, is_decode, num_tokens,
        num_requests, q.shape[0], num_splits,
        out.stride(0), out.stride(1), lse.stride(0), part_lse.stride(1), part_lse.stride(0),
    )
    merge_constexprs = (group, triton.next_power_of_2(group), tile_kv, split_tiles, 16, head_dim_v, src.paged)
    return DecodeLaunch(
        (max_splits, num_kv_heads, num_requests), split_tail, split_constexprs,
        (num_kv_heads, num_requests + 1, 1), merge_tail, merge_constexprs,
        part_out, part_lse, has_decode, skip, num_warps, num_stages, q.device,
    )


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    counters: torch.Tensor | None,
    **options: object,
) -> None:
    """Attention of every decode request of a batch into ``out`` and ``lse``.

    Keyword options (those of :func:`plan_decode`): ``query_start_loc``, ``is_decode``,
    ``scale``, ``factor``, ``tile_kv``, ``split_tiles``, ``max_kv_len``, and the source:
    ``k``/``v`` are the paged cache (with ``page_table`` and ``seq_lens``) or ragged rows
    (with ``kv_start_loc``), as in :func:`fullcg.ops.kernels.prefill.prefill_attention`.
    ``max_kv_len`` is a fixed upper bound on any request's keys (not read off the device).
    ``split_tiles`` (skip-softmax runs) None means one run over all keys when skipping, the
    reference's unsplit walk. Dense decode splits each request into ``num_splits`` runs
    (default: enough programs to fill the GPU, at most :data:`MAX_DENSE_SPLITS`).

    ``num_tokens`` (``int32 [1]``, default: all rows) is the real token count: rows at or
    past it, and rows no request owns, are written as zeros with LSE -inf.
    ``has_decode=False`` promises the batch has no decode request (a host fact; never when
    capturing a graph that may be replayed for other batches): only the padding rows are
    written, with no split launch and no workspace.

    ``workspace`` (a dict the caller keeps for one step) lends the split results' buffers
    to every call of the step with the same shape: calls on one stream run in order, so a
    layer's merge has read them before the next layer's split writes them. Callers that
    attend many layers per step plan once with :func:`plan_decode` and call the plan.
    """
    if options.get("factor") is not None and counters is None:
        raise ValueError("skip-softmax needs a counters tensor (fullcg.telemetry.counters)")
    plan_decode(q, k, v, out, lse, **options)(q, k, v, out, lse, counters)
