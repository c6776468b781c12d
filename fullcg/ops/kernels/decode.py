"""Decode attention: split-KV over the keys, reduced by LSE in the same launch.

A decode request has one query token. One program takes one KV head (all ``GROUP``
query heads sharing it, so they share each tile's skip decision), one request and one
run of its keys; the first tile of every run is never skipped. A request whose keys fit
one run is written straight to ``out``. Otherwise each program writes a normalised
partial output and its log2 LSE to a workspace and counts itself done on a per-(request,
KV head) semaphore; the last to arrive merges the runs into ``out`` and the natural-log
LSE and resets the semaphore to zero for the next launch. One launch per layer, where a
separate merge kernel would cost a second launch's host time between captured pieces.

With ``SAVE`` (decode-only batches attending over the cache), the program whose run
holds the request's newest key first writes the new token's k/v into the cache slot
``slot_mapping`` names: the one program that reads that key, so no other launch (and no
other program) has to order itself after the write.

Dense decode (no skip factor, no configured split) splits every request's keys into a
fixed *number* of runs, sized on the device from the request's own length: a CUDA graph
captured against a large cache capacity still spreads a short context over the SMs
(never into runs shorter than ``DENSE_MIN_RUN_SCALE * sqrt(tiles)``, where the merge's walk
over the runs would cost more than the runs save).
Skip-softmax decode splits into runs of a fixed number of *tiles* (the skip rule's unit),
so its grid is sized from the capacity and programs past a request's splits exit at once.

With a sliding window of ``W`` keys the query (at key position ``p``) sees keys
``(p - W, p]``: runs start at the tile holding the window's first key, and a request's
runs (dense: its window's tiles divided; skip-softmax: runs of a fixed number of tiles)
cover only the window's tiles, so a 32k context with a 128-key window costs what a
128-key context costs. The grid is sized from the most tiles a window can span. ``p`` is
the request's newest key over the cache or given causal k/v, and read from
``window_offsets`` for a prefix chunk.

The kernel also owns the padding rows of a batch: rows at or past the real token count
(CUDA-graph stand-in requests) and rows no request owns come out as zeros with LSE -inf,
so callers need no masking pass. Workspace and grids are sized from shapes and fixed
bounds, so the launch is safe under CUDA graph capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fullcg.ops import device_facts
from fullcg.ops.kernels.launch import Launcher, PlannedLaunch
from fullcg.ops.kernels.tile import attend_tile, kv_offsets, kv_source, padded, softcap_args, with_cols

__all__ = ["decode_attention", "plan_decode", "DecodeLaunch", "MAX_DENSE_SPLITS", "window_tiles"]

_LOG2E = 1.4426950408889634

#: Most runs one request's keys are split into for dense decode (dense results do not
#: depend on the split, so the launcher picks a count that fills the GPU, up to this).
MAX_DENSE_SPLITS = 64

#: Runs whose LSE the merging program reads at once, to find their largest (a few bytes
#: a run: one load serves every dense split count, MAX_DENSE_SPLITS).
MERGE_LSE_BLOCK = MAX_DENSE_SPLITS

#: Runs whose partial outputs the merging program has in flight at once. The merge takes
#: the runs' largest LSE first, so each run's weight needs no result of the run before
#: and the loop over runs is unrolled, several runs' loads in flight together rather than
#: each waiting on the one before: on an H200 that takes 5-10% off a batch-1 launch at
#: 64q/4kv heads (27.3 against 30.5 us at 16k keys) and is within 2% elsewhere
#: (``benchmarks/decode_sweep.py --merge-unroll 1`` against the default).
#: The loads stay 2-D (one run per unrolled step): a [runs, rows, dim] tile set the
#: register count of every program, merging or not (168 registers for 4 runs against 126
#: for one, on an H200).
MERGE_UNROLL = 4


#: Dense decode's launch, tuned on an H200 over 64q/4kv and 32q/8kv heads of 128, batch
#: 1-64, contexts 1k-64k (``benchmarks/decode_sweep.py``; docs/benchmarks.md): KV tiles of
#: 128 keys where a tile of k and v fits (2-byte elements, head tiles at most 128 wide), at most
#: two programs per SM, and runs of at least ``DENSE_MIN_RUN_SCALE * sqrt(tiles)`` tiles.
#: Dense results do not depend on the tiling (only on rounding), so these are free to tune;
#: skip-softmax decode keeps the configured tile, which is the unit its rule skips.
DENSE_TILE_KV = 128
DENSE_PROGRAMS_PER_SM = 2
DENSE_MIN_RUN_SCALE = 0.4
#: Pipeline stages of dense decode's tile loop (skip-softmax decode keeps 2). One stage
#: (40 KiB of shared memory a program against 72) was faster or level at every shape of an
#: H100 sweep (32q/8kv and 64q/4kv heads, batch 1-64, 1k-32k keys: 0.81x at batch 1, 1k),
#: except batch 1 at 8k keys (1.04-1.06x); docs/benchmarks.md, "One decode launch".
DENSE_NUM_STAGES = 1


def _dense_tile_kv(q: torch.Tensor, k: torch.Tensor, head_dim: int, head_dim_v: int, tile_kv: int) -> int:
    """Keys per tile for dense decode: :data:`DENSE_TILE_KV` on a GPU where it fits, else ``tile_kv``.

    What has to fit is the register tiles, so a head of 80 or 96 counts as the 128 it is
    padded to and one of 192 as 256 (tile.py). The CPU interpreter keeps the configured
    tile, so its tests walk several tiles per run.
    """
    if q.device.type != "cuda" or k.element_size() > 2 or max(padded(head_dim), padded(head_dim_v)) > 128:
        return tile_kv
    return max(tile_kv, DENSE_TILE_KV)


def window_tiles(window: int, tile_kv: int) -> int:
    """The most tiles of ``tile_kv`` keys that ``window`` consecutive keys can touch."""
    return (window + tile_kv - 2) // tile_kv + 1


@triton.jit
def _split_tiles(n_tiles, num_splits, min_run_scale, SPLIT_TILES: tl.constexpr):
    """Tiles per run: fixed (SPLIT_TILES > 0) or the request's tiles over ``num_splits`` runs.

    A dense run is also at least ``min_run_scale * sqrt(n_tiles)`` tiles: a request's time
    is its longest run's tile loop plus the merge's loop over runs, smallest near
    ``sqrt(n_tiles)`` runs, so a short request is not cut into one-tile runs just because
    the grid has room for them.
    """
    if SPLIT_TILES > 0:
        return n_tiles * 0 + SPLIT_TILES
    floor = (min_run_scale * tl.sqrt(n_tiles.to(tl.float32))).to(tl.int32)
    return tl.maximum(tl.maximum(tl.cdiv(n_tiles, num_splits), floor), 1)


@triton.jit
def _store_row(Out, Lse, row, head, offs_dv, o, lse, g_ok, stride_ot, stride_oh, stride_lt, HEAD_DV: tl.constexpr):
    """Row ``row`` (int64) of ``out`` and ``lse`` for the heads ``head`` (``offs_dv`` spans
    the head's :func:`~fullcg.ops.kernels.tile.padded` tile)."""
    tl.store(Out + row * stride_ot + head[:, None] * stride_oh + offs_dv[None, :], o.to(Out.dtype.element_ty),
             mask=with_cols(g_ok[:, None], offs_dv, HEAD_DV))
    tl.store(Lse + row * stride_lt + head, lse, mask=g_ok)


@triton.jit
def _store_empty_row(Out, Lse, row, head, offs_dv, g_ok, stride_ot, stride_oh, stride_lt,
                     BLOCK_M: tl.constexpr, HEAD_DV: tl.constexpr):
    _store_row(Out, Lse, row, head, offs_dv, tl.zeros([BLOCK_M, padded(HEAD_DV)], dtype=tl.float32),
               tl.full([BLOCK_M], float("-inf"), tl.float32), g_ok, stride_ot, stride_oh, stride_lt, HEAD_DV)


@triton.jit
def _copy_head(Dst, dst, Src, cols, HEAD: tl.constexpr):
    """``(Dst + dst)[c] = Src[c]`` for the head's columns ``c < HEAD`` of ``cols`` (its padded tile)."""
    if padded(HEAD) != HEAD:
        x = tl.load(Src + cols, mask=cols < HEAD)
        tl.store(Dst + dst + cols, x, mask=cols < HEAD)
    else:
        x = tl.load(Src + cols)
        tl.store(Dst + dst + cols, x)


# What changes from step to step is not specialised on, so a new batch, capture size or
# page-table width is the same compiled kernel (each new one is a second of compile at
# startup): the counts, the page table's row stride (1 for a one-page table), the
# workspace's stride per request (runs per request times query heads: with 9 heads, 16
# runs make it a multiple of 16 and 15 do not) and the addresses of the metadata vectors
# (a captured graph's are views into one buffer at offsets that follow its capture size;
# read a scalar at a time, alignment buys nothing).
@triton.jit(do_not_specialize=["num_splits", "num_requests", "num_rows", "stride_pt", "window", "stride_pr"],
            do_not_specialize_on_alignment=["Sem", "Slots", "PageTable", "QLoc", "KvLoc", "SeqLens", "IsDecode",
                                            "NumTokens", "QPos"])
def _decode_kernel(
    Q, K, V, Out, Lse, Ctr, KNew, VNew,
    PartOut, PartLse, Sem, Slots, PageTable, QLoc, KvLoc, SeqLens, IsDecode, NumTokens, QPos,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_ps, stride_pr,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_pt,
    stride_knt, stride_knh, stride_vnt, stride_vnh,
    qk_scale2, factor, num_splits, min_run_scale, num_requests, num_rows, num_kv_heads, window, cap_in, cap_out,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_TILES: tl.constexpr,
    BLOCK_S: tl.constexpr, UNROLL: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr, SKIP: tl.constexpr, DOT_F32: tl.constexpr, SAVE: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    # WINDOW: 0 none; 1 the query is the request's newest key; 2 its position is QPos[req].
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    req = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP
    head = kvh * GROUP + rows
    # Register tiles are a power of two wide; a head of another size is padded (tile.py).
    BLOCK_D: tl.constexpr = padded(HEAD_D)
    BLOCK_DV: tl.constexpr = padded(HEAD_DV)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    if req == num_requests:
        # The extra program row: padding rows past the last request's (no request owns them).
        if split == 0:
            for row in range(tl.load(QLoc + num_requests), num_rows):
                row64 = tl.zeros([1], dtype=tl.int64) + row
                _store_empty_row(Out, Lse, row64, head, offs_dv, row_ok, stride_ot, stride_oh, stride_lt,
                                 BLOCK_M, HEAD_DV)
        return
    if tl.load(IsDecode + req) == 0:
        return  # the prefill kernel's request
    q_row = tl.load(QLoc + req).to(tl.int64)
    if PAGED:
        kv_len = tl.load(SeqLens + req)
        kv_start = 0
    else:
        kv_start = tl.load(KvLoc + req)
        kv_len = tl.load(KvLoc + req + 1) - kv_start
    n_tiles = tl.cdiv(kv_len, BLOCK_N)
    # The runs cover tiles [first_tile, n_tiles): all of them, or the window's.
    first_tile = 0
    lo = 0
    if WINDOW != 0:
        if WINDOW == 1:
            q_pos = kv_len - 1
        else:
            q_pos = tl.load(QPos + req)
        lo = tl.maximum(q_pos - window + 1, 0)  # the first key the query sees
        first_tile = tl.where(lo < kv_len, lo // BLOCK_N, n_tiles)
    split_tiles = _split_tiles(n_tiles - first_tile, num_splits, min_run_scale, SPLIT_TILES)
    # At most the grid's runs (more only with keys past max_kv_len, which metadata refuses):
    # a run counted here but never launched would leave its arrival count short for good.
    n_splits = tl.minimum(tl.cdiv(n_tiles - first_tile, split_tiles), tl.num_programs(0))
    if (q_row >= tl.load(NumTokens)) | (n_splits == 0):
        # A stand-in request past the real token count, or no keys at all: zeros, LSE -inf.
        if split == 0:
            _store_empty_row(Out, Lse, q_row, head, offs_dv, row_ok, stride_ot, stride_oh, stride_lt,
                             BLOCK_M, HEAD_DV)
        return
    first = first_tile + split * split_tiles
    if first >= n_tiles:
        return
    last = tl.minimum(first + split_tiles, n_tiles)
    if SAVE:
        if last == n_tiles:
            # This run holds the newest key (the request's own token): put it in the cache first.
            slot = tl.load(Slots + q_row).to(tl.int64)
            if slot >= 0:
                dst = (slot // PAGE_SIZE) * stride_kp + (slot % PAGE_SIZE) * stride_ks + kvh.to(tl.int64) * stride_kh
                _copy_head(K, dst, KNew + q_row * stride_knt + kvh.to(tl.int64) * stride_knh, offs_d, HEAD_D)
                dst = (slot // PAGE_SIZE) * stride_vp + (slot % PAGE_SIZE) * stride_vs + kvh.to(tl.int64) * stride_vh
                _copy_head(V, dst, VNew + q_row * stride_vnt + kvh.to(tl.int64) * stride_vnh, offs_dv, HEAD_DV)
            tl.debug_barrier()  # every thread of the program sees the new key before the tiles read it
    # Tiles before the request's last one are full: no mask needed there; nor past the
    # window's first key (tiles [first, t_inner) hold keys before it).
    n_full = tl.minimum(last, kv_len // BLOCK_N)
    t_inner = first

    # The one query token sees every key (it is the newest; a chunk's keys all precede it):
    # the limit is kv_len, and with a window the first key seen is lo.
    row_limit = tl.where(row_ok, kv_len, 0)
    row_lo = row_limit  # read only with WINDOW
    if WINDOW != 0:
        row_lo = tl.zeros([BLOCK_M], dtype=tl.int32) + lo
        t_inner = tl.minimum(tl.maximum(tl.cdiv(lo, BLOCK_N), first), last)
        n_full = tl.maximum(n_full, t_inner)
    q = tl.load(Q + q_row * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=with_cols(row_ok[:, None], offs_d, HEAD_D), other=0.0)

    log2_lam = 0.0
    if SKIP:
        keys = kv_len
        if WINDOW != 0:
            keys = tl.minimum(kv_len, window)  # lambda is over the keys the query can see
        lam = factor / tl.maximum(keys, 1).to(tl.float32)
        log2_lam = tl.where(lam < 1.0, tl.log2(lam), float("-inf"))

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    n_skipped = 0
    page_row = PageTable + req.to(tl.int64) * stride_pt
    K_h = K + kvh.to(tl.int64) * stride_kh
    V_h = V + kvh.to(tl.int64) * stride_vh
    if WINDOW != 0:
        for t in range(first, t_inner):
            k_offs, pos = kv_offsets(page_row, kv_start, t * BLOCK_N, kv_len, stride_kp, stride_ks, PAGED, PAGE_SIZE,
                                     BLOCK_N)
            v_offs, pos = kv_offsets(page_row, kv_start, t * BLOCK_N, kv_len, stride_vp, stride_vs, PAGED, PAGE_SIZE,
                                     BLOCK_N)
            m_i, l_i, acc, sk = attend_tile(
                q, m_i, l_i, acc, K_h, V_h, k_offs, v_offs, pos, row_limit, row_lo, kv_len, offs_d, offs_dv,
                qk_scale2, cap_in, cap_out, log2_lam, t - first, HEAD_D, HEAD_DV, True, SKIP, DOT_F32, True, SOFTCAP,
            )
            n_skipped += sk
    for t in range(t_inner, n_full):
        k_offs, pos = kv_offsets(page_row, kv_start, t * BLOCK_N, kv_len, stride_kp, stride_ks, PAGED, PAGE_SIZE, BLOCK_N)
        v_offs, pos = kv_offsets(page_row, kv_start, t * BLOCK_N, kv_len, stride_vp, stride_vs, PAGED, PAGE_SIZE, BLOCK_N)
        m_i, l_i, acc, sk = attend_tile(
            q, m_i, l_i, acc, K_h, V_h, k_offs, v_offs, pos, row_limit, row_lo, kv_len, offs_d, offs_dv,
            qk_scale2, cap_in, cap_out, log2_lam, t - first, HEAD_D, HEAD_DV, False, SKIP, DOT_F32, WINDOW != 0, SOFTCAP,
        )
        n_skipped += sk
    for t in range(tl.maximum(n_full, t_inner), last):
        k_offs, pos = kv_offsets(page_row, kv_start, t * BLOCK_N, kv_len, stride_kp, stride_ks, PAGED, PAGE_SIZE, BLOCK_N)
        v_offs, pos = kv_offsets(page_row, kv_start, t * BLOCK_N, kv_len, stride_vp, stride_vs, PAGED, PAGE_SIZE, BLOCK_N)
        m_i, l_i, acc, sk = attend_tile(
            q, m_i, l_i, acc, K_h, V_h, k_offs, v_offs, pos, row_limit, row_lo, kv_len, offs_d, offs_dv,
            qk_scale2, cap_in, cap_out, log2_lam, t - first, HEAD_D, HEAD_DV, True, SKIP, DOT_F32, WINDOW != 0, SOFTCAP,
        )
        n_skipped += sk
    if SKIP:
        # Decode counters: row [1] of the layer's [2, 2] tensor.
        tl.atomic_add(Ctr + 2, (last - first).to(tl.int64))
        tl.atomic_add(Ctr + 3, n_skipped.to(tl.int64))

    has = l_i > 0.0
    o = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    if n_splits == 1:
        _store_row(Out, Lse, q_row, head, offs_dv, o, lse2 * 0.6931471805599453, row_ok, stride_ot, stride_oh,
                   stride_lt, HEAD_DV)
        return
    part = req.to(tl.int64) * stride_pr + split.to(tl.int64) * stride_ps
    # The workspace holds the head's own columns (HEAD_DV a row), not the padded tile's.
    tl.store(PartOut + (part + head[:, None]) * HEAD_DV + offs_dv[None, :], o,
             mask=with_cols(row_ok[:, None], offs_dv, HEAD_DV))
    tl.store(PartLse + part + head, lse2, mask=row_ok)
    # Every thread's partial is stored before the program says it is done (release); the
    # last program to arrive sees all runs' partials (acquire) and merges them.
    tl.debug_barrier()
    arrivals = Sem + req.to(tl.int64) * num_kv_heads + kvh
    if tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu") != n_splits - 1:
        return
    tl.debug_barrier()
    base = req.to(tl.int64) * stride_pr
    # .cg on every load of the merge: other programs wrote these; never take them from this SM's L1.
    m = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    for s0 in range(0, n_splits, BLOCK_S):
        runs = s0 + tl.arange(0, BLOCK_S)
        ok = (runs < n_splits)[:, None] & row_ok[None, :]
        idx = base + runs[:, None].to(tl.int64) * stride_ps + head[None, :]
        m = tl.maximum(m, tl.max(tl.load(PartLse + idx, mask=ok, other=float("-inf"), cache_modifier=".cg"), 0))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    merged = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for run in tl.range(0, n_splits, loop_unroll_factor=UNROLL):
        idx = base + run * stride_ps + head  # base is int64
        w = tl.exp2(tl.load(PartLse + idx, mask=row_ok, other=float("-inf"), cache_modifier=".cg") - m_safe)
        part_o = tl.load(PartOut + idx[:, None] * HEAD_DV + offs_dv[None, :],
                         mask=with_cols(row_ok[:, None], offs_dv, HEAD_DV), other=0.0, cache_modifier=".cg")
        w_sum += w  # 0 for empty runs
        merged += w[:, None] * part_o
    has = w_sum > 0.0
    out = tl.where(has[:, None], merged / tl.where(has, w_sum, 1.0)[:, None], 0.0)
    lse = tl.where(has, (m + tl.log2(tl.where(has, w_sum, 1.0))) * 0.6931471805599453, float("-inf"))
    _store_row(Out, Lse, q_row, head, offs_dv, out, lse, row_ok, stride_ot, stride_oh, stride_lt, HEAD_DV)
    tl.store(arrivals, 0)  # ready for the next launch (graph replays included)


_DECODE = Launcher(_decode_kernel)


class DecodeLaunch:
    """The decode kernel's launch for one step and one layer shape, derived once.

    Calling it runs the kernel for one layer: only that layer's tensors (``q``, the cache
    or ``k``/``v``, ``out``, ``lse``, counters, and with ``save`` the new ``k``/``v``) differ
    between the calls of a step, so grid, strides, split counts, workspace and the compiled
    kernel are worked out by :func:`plan_decode` and every call only passes addresses.
    """

    def __init__(self, launch: PlannedLaunch, skip: bool, save: bool) -> None:
        self.launch, self.skip, self.save = launch, skip, save

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
        counters: torch.Tensor | None, k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
    ) -> None:
        self.launch(q, k, v, out, lse, counters if self.skip else lse, k_new if self.save else q,
                    v_new if self.save else q)


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
    slot_mapping: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    workspace: dict[tuple[int, ...], tuple[torch.Tensor, ...]] | None = None,
    window: int | None = None,
    softcap: float | None = None,
    window_offsets: torch.Tensor | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> DecodeLaunch:
    """Plan the decode kernel for calls shaped like these tensors (see :func:`decode_attention`)."""
    src = kv_source(k, v, page_table, kv_start_loc, query_start_loc)
    num_requests = query_start_loc.shape[0] - 1
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, head_dim_v = v.shape[-2], v.shape[-1]
    group = num_q_heads // num_kv_heads
    skip = factor is not None
    save = slot_mapping is not None
    if save and (not src.paged or new_kv is None):
        raise ValueError("saving new k/v in the decode kernel needs the paged cache and new_kv=(k, v)")
    min_run_scale = 0.0
    dense = not skip and split_tiles is None
    if num_stages is None:
        num_stages = DENSE_NUM_STAGES if dense else 2
    if dense:
        tile_kv = _dense_tile_kv(q, k, head_dim, head_dim_v, tile_kv)
        if num_splits is None:
            min_run_scale = DENSE_MIN_RUN_SCALE
    max_tiles = max(1, triton.cdiv(max_kv_len, tile_kv))
    if window is not None:
        # The most tiles a window of `window` keys can span (starting at a tile's last key).
        max_tiles = min(max_tiles, window_tiles(window, tile_kv))
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
        # would otherwise leave most of the GPU idle), sized from shapes only, and never
        # more than fit in one wave: a second wave of a few programs costs as long as the
        # first (9 runs instead of 8 was 1.5x slower at 4 KV heads, batch 8).
        if num_splits is None:
            num_splits = DENSE_PROGRAMS_PER_SM * device_facts.sm_count(q.device) // (num_kv_heads * max(1, num_requests))
        num_splits = max(1, min(num_splits, max_tiles, MAX_DENSE_SPLITS))
        split_tiles = 0
        max_splits = num_splits
    if num_tokens is None:
        num_tokens = torch.full((1,), q.shape[0], dtype=torch.int32, device=q.device)
    if not has_decode:
        max_splits = 1  # no run is ever written: only padding rows are
    shape = (num_requests, max_splits, num_q_heads, head_dim_v)
    # KV heads in the key too: the arrival counts are per KV head, and layers of one query
    # shape may differ in KV heads.
    parts = workspace.get((*shape, num_kv_heads)) if workspace is not None else None
    if parts is None:
        parts = (
            torch.empty(shape, dtype=torch.float32, device=q.device),
            torch.empty(shape[:3], dtype=torch.float32, device=q.device),
            # Arrival counts per (request, KV head): zero between launches (the merging
            # program resets its own), so one buffer serves every layer of the step.
            torch.zeros((max(1, num_requests), num_kv_heads), dtype=torch.int32, device=q.device),
        )
        if workspace is not None:
            workspace[(*shape, num_kv_heads)] = parts
    part_out, part_lse, arrivals = parts
    if not src.paged:
        seq_lens = query_start_loc  # unused
    k_new, v_new = new_kv if save else (q, q)  # placeholders: never read without SAVE
    block_m = max(16, triton.next_power_of_2(group))
    # WINDOW 1: the query is its request's newest key; 2: its position is read (a prefix chunk).
    window_mode = 0 if window is None else 1 if window_offsets is None else 2
    tail = (
        part_out, part_lse, arrivals, slot_mapping if save else query_start_loc, src.page_table, query_start_loc,
        src.kv_start_loc, seq_lens, is_decode, num_tokens, window_offsets if window_mode == 2 else query_start_loc,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), lse.stride(0), part_lse.stride(1), part_lse.stride(0),
        *src.strides, src.stride_page_table,
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        scale * _LOG2E, float(factor) if skip else 0.0, num_splits, min_run_scale, num_requests, q.shape[0],
        num_kv_heads, int(window) if window is not None else 0, *softcap_args(scale, softcap),
    )
    constexprs = (group, block_m, tile_kv, split_tiles, MERGE_LSE_BLOCK, MERGE_UNROLL, head_dim, head_dim_v, src.paged,
                  src.page_size, skip, q.dtype == torch.float32, save, window_mode, softcap is not None)
    # Only the leading tensors' dtypes are read: an empty int64 stands in for the counters.
    counters = torch.empty(0, dtype=torch.int64, device=q.device) if skip else lse
    grid = (max_splits, num_kv_heads, num_requests + 1)
    launch = _DECODE.plan(grid, (q, k, v, out, lse, counters, k_new, v_new), tail, constexprs, num_warps, num_stages)
    return DecodeLaunch(launch, skip, save)


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

    ``window`` and ``softcap`` as :func:`fullcg.ops.kernels.prefill.prefill_attention`
    takes them: the query is its request's newest key (the cache, given causal k/v) or,
    with ``window_offsets`` (``int32 [R]``, a prefix chunk), at that key position.

    ``slot_mapping`` and ``new_kv=(k_new, v_new)`` (paged cache only) first write each
    decode request's new token (row ``query_start_loc[r]`` of ``k_new``/``v_new``) into the
    cache slot ``slot_mapping`` gives for that row (none for a negative slot), in the same launch.

    ``workspace`` (a dict the caller keeps for one step) lends the runs' buffers to every
    call of the step with the same shape: calls on one stream run in order, so a layer's
    merge has read them before the next layer's runs write them. Callers that attend many
    layers per step plan once with :func:`plan_decode` and call the plan.
    """
    if options.get("factor") is not None and counters is None:
        raise ValueError("skip-softmax needs a counters tensor (fullcg.telemetry.counters)")
    new_kv = options.get("new_kv")
    k_new, v_new = new_kv if isinstance(new_kv, tuple) else (None, None)
    plan_decode(q, k, v, out, lse, **options)(q, k, v, out, lse, counters, k_new, v_new)
