"""Multi-head latent attention over a latent paged cache: one launch per layer, every request kind.

The absorbed form of MLA (:mod:`fullcg.mla`) is multi-query attention with one KV head
whose key is ``[c ; k_pe]`` (``RANK`` latent values then ``ROPE`` rope values, one row of
the cache ``[pages, page_size, 1, RANK + ROPE]``) and whose value is the latent ``c``:
the leading ``RANK`` values of the same row (:attr:`fullcg.KVCache.v_in_k`). The head dim
(576 for DeepSeek-V3) is no power of two, so a key tile is loaded as two tiles, the latent
``[BLOCK_N, RANK]`` and the rope part ``[BLOCK_N, ROPE]``; scores are
``q_lat . k_lat + q_pe . k_pe``, and P.V multiplies by the latent tile already loaded for
the keys, so each latent byte is read once per program.

One program takes ``BLOCK_H`` query heads (they all share the one KV head) of one query
token and one run (split) of that token's keys. The grid is one axis with the head block
fastest-varying: the programs reading the same keys are launched together and share
them through L2. Every query token of the batch is served, decode or not: token ``j`` of
a request with prefix ``p`` sees keys ``[0, p + j]`` (causal over the cache). A token's
request is found on the device by counting the request ends ``query_start_loc[1:]`` at
or below it (one vector load for up to :data:`REQUEST_BLOCK` requests), so nothing is
read on the host.

Split-KV: a token's keys are cut on the device into at most ``num_splits`` runs (fixed
per launch from shapes: about :data:`PROGRAMS_PER_SM` programs per SM over tokens times
head blocks, so a large batch is one run per token and a single token is many). A token
whose keys are one run writes ``out`` straight away; otherwise each run writes its
normalised partial output and log2 LSE to a workspace and counts itself done on a
per-(token, head block) arrival counter; the last to arrive merges the runs into ``out``
and the natural-log LSE and resets the counter for the next launch (the scheme of
:mod:`fullcg.ops.kernels.decode`).

With ``SAVE`` (decode-only batches, where every request's one new token is the newest key
it reads) the programs of a token's last run first write the token's new row into its
cache slot (``slot_mapping``; a slot < 0 is padding and is skipped): only they read that
key, so no other launch has to order itself after the write. Every head block's last run
writes the same bytes. Other batches save with :func:`save_latent` (one small launch)
before attending: a prefill token reads its request's other new keys, which other
programs would write.

Rows at or past the real token count (CUDA-graph stand-ins) and rows no request owns come
out as zeros with LSE -inf. Grids and workspace are sized from shapes and fixed bounds
only, and nothing is synchronised or read on the host, so launches are safe under CUDA
graph capture.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fullcg.ops import device_facts
from fullcg.ops.kernels.launch import Launcher, PlannedLaunch
from fullcg.ops.kernels.tile import kv_offsets

__all__ = [
    "MLALaunch", "LatentSaveLaunch", "MLATuning", "plan_mla", "mla_attention", "plan_latent_save", "save_latent",
    "default_tuning", "MAX_SPLITS", "PROGRAMS_PER_SM",
]

_LOG2E = 1.4426950408889634

#: Most runs one token's keys are split into (the merge reads every run's LSE in one load).
MAX_SPLITS = 64
#: Programs per SM the split count aims at; a program holds a [BLOCK_H, RANK] fp32
#: accumulator and BLOCK_N-key tiles of RANK + ROPE values, so few fit on an SM at once.
PROGRAMS_PER_SM = 2
#: Runs of a token are at least ``MIN_RUN_SCALE * sqrt(tiles)`` tiles (see decode.py's
#: DENSE_MIN_RUN_SCALE): the merge walks every run, so tiny runs cost more than they save.
MIN_RUN_SCALE = 0.4
#: Request ends loaded at once to find a token's request (more requests: a few loads).
REQUEST_BLOCK = 256
#: Latent values per step of the merge's walk over the runs: a [BLOCK_H, RANK] fp32 merge
#: tile beside the accumulator would double the registers every program reserves.
MERGE_D = 128
#: Runs whose partial outputs the merge has in flight at once.
MERGE_UNROLL = 4


@triton.jit
def _latent_tile(q_lat, q_pe, m_i, l_i, acc, KV, offs, pos, kv_len, offs_l, offs_r, qk_scale2,
                 RANK: tl.constexpr, MASK: tl.constexpr, DOT_F32: tl.constexpr):
    """One tile of keys: the latent and rope tiles, scores, online softmax, P times the latent tile."""
    base = KV + offs[:, None]
    if MASK:
        valid = (pos < kv_len)[:, None]
        k_lat = tl.load(base + offs_l[None, :], mask=valid, other=0.0)
        k_pe = tl.load(base + RANK + offs_r[None, :], mask=valid, other=0.0)
    else:
        k_lat = tl.load(base + offs_l[None, :])
        k_pe = tl.load(base + RANK + offs_r[None, :])
    if DOT_F32:
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee")
        s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision="ieee")
    else:
        s = tl.dot(q_lat, tl.trans(k_lat))
        s = tl.dot(q_pe, tl.trans(k_pe), s)
    s = s * qk_scale2
    if MASK:
        s = tl.where((pos < kv_len)[None, :], s, float("-inf"))
    # Every tile of a run holds a key the token sees, so m_new is finite.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p, k_lat, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(k_lat.dtype), k_lat)
    return m_new, l_i, acc


@triton.jit
def _store_out(Out, row, heads, offs, o, h_ok, stride_ot, stride_oh):
    """Values ``offs`` of row ``row`` (int64) of ``out`` for ``heads``."""
    tl.store(Out + row * stride_ot + heads[:, None].to(tl.int64) * stride_oh + offs[None, :],
             o.to(Out.dtype.element_ty), mask=h_ok[:, None])


# Not specialised on what changes from step to step (see decode.py): the split count (it
# follows the token count), the counts, the page table's row stride and the metadata
# vectors' addresses; a new batch or capture size is the same compiled kernel.
@triton.jit(do_not_specialize=["num_splits", "num_requests", "stride_pt"],
            do_not_specialize_on_alignment=["Sem", "Slots", "PageTable", "QLoc", "SeqLens", "NumTokens"])
def _mla_kernel(
    Q, KV, Out, Lse, KNew, VNew,
    PartOut, PartLse, Sem, Slots, PageTable, QLoc, SeqLens, NumTokens,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_kp, stride_ks, stride_pt, stride_knt, stride_vnt,
    qk_scale2, min_run_scale, num_splits, num_requests,
    NUM_HEADS: tl.constexpr, NUM_HEAD_BLOCKS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr, MERGE_BLOCK: tl.constexpr, UNROLL: tl.constexpr, DOT_F32: tl.constexpr,
    SAVE: tl.constexpr,
):
    pid = tl.program_id(0)
    hb = pid % NUM_HEAD_BLOCKS  # fastest: the head blocks of one run read the same keys together
    rest = pid // NUM_HEAD_BLOCKS
    split = rest % num_splits
    t = rest // num_splits
    row = t.to(tl.int64)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < NUM_HEADS
    offs_l = tl.arange(0, RANK)
    offs_r = tl.arange(0, ROPE)
    if (t >= tl.load(NumTokens)) | (t >= tl.load(QLoc + num_requests)):
        # A stand-in row past the real token count, or a row no request owns: zeros, LSE -inf.
        if split == 0:
            _store_out(Out, row, heads, offs_l, tl.zeros([BLOCK_H, RANK], dtype=tl.float32), h_ok, stride_ot,
                       stride_oh)
            tl.store(Lse + row * stride_lt + heads, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=h_ok)
        return
    # The token's request: how many requests end at or before it (query_start_loc is sorted).
    req = t * 0
    for c in range(0, num_requests, BLOCK_R):
        idx = c + 1 + tl.arange(0, BLOCK_R)
        ends = tl.load(QLoc + idx, mask=idx <= num_requests, other=2147483647)
        req += tl.sum((ends <= t).to(tl.int32), 0)
    # Token j of a request with prefix p sees keys [0, p + j]: its request's keys less the
    # new tokens after it.
    kv_len = tl.load(SeqLens + req) - (tl.load(QLoc + req + 1) - 1 - t)
    n_tiles = tl.cdiv(kv_len, BLOCK_N)
    floor = (min_run_scale * tl.sqrt(n_tiles.to(tl.float32))).to(tl.int32)
    split_tiles = tl.maximum(tl.maximum(tl.cdiv(n_tiles, num_splits), floor), 1)
    n_splits = tl.cdiv(n_tiles, split_tiles)  # <= num_splits: every counted run is launched
    first = split * split_tiles
    if first >= n_tiles:
        return
    last = tl.minimum(first + split_tiles, n_tiles)
    if SAVE:
        if last == n_tiles:
            # This run holds the newest key, the token's own: put it in the cache first. The
            # latent comes from v (as the reference saves k, then v over its leading values).
            slot = tl.load(Slots + row).to(tl.int64)
            if slot >= 0:
                dst = KV + (slot // PAGE_SIZE) * stride_kp + (slot % PAGE_SIZE) * stride_ks
                tl.store(dst + offs_l, tl.load(VNew + row * stride_vnt + offs_l))
                tl.store(dst + RANK + offs_r, tl.load(KNew + row * stride_knt + RANK + offs_r))
            tl.debug_barrier()  # every thread of the program sees the new key before the tiles read it

    q_row = Q + row * stride_qt + heads[:, None].to(tl.int64) * stride_qh
    q_lat = tl.load(q_row + offs_l[None, :], mask=h_ok[:, None], other=0.0)
    q_pe = tl.load(q_row + RANK + offs_r[None, :], mask=h_ok[:, None], other=0.0)
    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, RANK], dtype=tl.float32)
    page_row = PageTable + req.to(tl.int64) * stride_pt
    # Only the token's last tile can be partial: the others need no mask.
    n_full = tl.minimum(last, kv_len // BLOCK_N)
    for tile in range(first, n_full):
        offs, pos = kv_offsets(page_row, 0, tile * BLOCK_N, kv_len, stride_kp, stride_ks, True, PAGE_SIZE, BLOCK_N)
        m_i, l_i, acc = _latent_tile(q_lat, q_pe, m_i, l_i, acc, KV, offs, pos, kv_len, offs_l, offs_r, qk_scale2,
                                     RANK, False, DOT_F32)
    for tile in range(tl.maximum(n_full, first), last):
        offs, pos = kv_offsets(page_row, 0, tile * BLOCK_N, kv_len, stride_kp, stride_ks, True, PAGE_SIZE, BLOCK_N)
        m_i, l_i, acc = _latent_tile(q_lat, q_pe, m_i, l_i, acc, KV, offs, pos, kv_len, offs_l, offs_r, qk_scale2,
                                     RANK, True, DOT_F32)

    o = acc / l_i[:, None]  # l_i >= 1: the row's largest score counts exp2(0)
    lse2 = m_i + tl.log2(l_i)
    if n_splits == 1:
        _store_out(Out, row, heads, offs_l, o, h_ok, stride_ot, stride_oh)
        tl.store(Lse + row * stride_lt + heads, lse2 * 0.6931471805599453, mask=h_ok)
        return
    # Workspace [tokens, splits, heads, RANK] (and [tokens, splits, heads] for the LSE).
    base = row * num_splits * NUM_HEADS
    part = base + split * NUM_HEADS + heads
    tl.store(PartOut + part[:, None] * RANK + offs_l[None, :], o, mask=h_ok[:, None])
    tl.store(PartLse + part, lse2, mask=h_ok)
    # Every thread's partial is stored before the program says it is done (release); the
    # last to arrive sees every run's partial (acquire) and merges them.
    tl.debug_barrier()
    arrivals = Sem + row * NUM_HEAD_BLOCKS + hb
    if tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu") != n_splits - 1:
        return
    tl.debug_barrier()
    # .cg on every load of the merge: other programs wrote these; never take them from this SM's L1.
    runs = tl.arange(0, BLOCK_S)
    idx = base + runs[:, None].to(tl.int64) * NUM_HEADS + heads[None, :]
    ok = (runs < n_splits)[:, None] & h_ok[None, :]
    m = tl.max(tl.load(PartLse + idx, mask=ok, other=float("-inf"), cache_modifier=".cg"), 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # padding heads: nothing to weigh
    # The latent in chunks: a [BLOCK_H, MERGE_BLOCK] merge tile at a time.
    w_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    for d0 in tl.static_range(0, RANK, MERGE_BLOCK):
        offs_m = d0 + tl.arange(0, MERGE_BLOCK)
        w_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
        merged = tl.zeros([BLOCK_H, MERGE_BLOCK], dtype=tl.float32)
        for run in tl.range(0, n_splits, loop_unroll_factor=UNROLL):
            at = base + run * NUM_HEADS + heads  # base is int64
            w = tl.exp2(tl.load(PartLse + at, mask=h_ok, other=float("-inf"), cache_modifier=".cg") - m_safe)
            part_o = tl.load(PartOut + at[:, None] * RANK + offs_m[None, :], mask=h_ok[:, None], other=0.0,
                             cache_modifier=".cg")
            w_sum += w
            merged += w[:, None] * part_o
        _store_out(Out, row, heads, offs_m, merged / tl.where(w_sum > 0.0, w_sum, 1.0)[:, None], h_ok, stride_ot,
                   stride_oh)
    lse = (m + tl.log2(tl.where(w_sum > 0.0, w_sum, 1.0))) * 0.6931471805599453
    tl.store(Lse + row * stride_lt + heads, lse, mask=h_ok)
    tl.store(arrivals, 0)  # ready for the next launch (graph replays included)


_MLA = Launcher(_mla_kernel)


@triton.jit
def _latent_save_kernel(KNew, VNew, KV, Slots, stride_knt, stride_vnt, stride_kp, stride_ks,
                        RANK: tl.constexpr, ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(Slots + t).to(tl.int64)
    if slot >= 0:
        row = t.to(tl.int64)
        dst = KV + (slot // PAGE_SIZE) * stride_kp + (slot % PAGE_SIZE) * stride_ks
        offs_l = tl.arange(0, RANK)
        offs_r = tl.arange(0, ROPE)
        tl.store(dst + offs_l, tl.load(VNew + row * stride_vnt + offs_l))
        tl.store(dst + RANK + offs_r, tl.load(KNew + row * stride_knt + RANK + offs_r))


_SAVE = Launcher(_latent_save_kernel)


class MLATuning(NamedTuple):
    """The launch shape of :func:`plan_mla`."""

    block_h: int  # query heads per program (rows of every dot)
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


def default_tuning(num_heads: int, dtype: torch.dtype, device: torch.device) -> MLATuning:
    """The launch shape :func:`plan_mla` uses unless told otherwise.

    Head blocks of up to 64 heads: a token's head blocks each read all of its keys (from
    L2 after the first), so at 128 heads blocks of 16 would move 8x the cache's bytes
    through L2, more than its bandwidth serves at DRAM speed; 64 moves 2x. An
    accumulator [BLOCK_H, RANK] fp32 of 32 heads or more takes 8 warps (64 x 512 is 128
    registers a thread at 8 warps). Keys per tile: 64, two stages in flight (64 keys of
    576 two-byte values are 72 KiB of shared memory a stage, beside a [64, 576] q tile of
    72 KiB: 216 KiB, which Hopper's 227 KiB holds; a device with less takes 32-key
    tiles). On an H100, 64-key tiles against 32 took 606 against 846 us at 128 heads,
    batch 64, 8k keys, and 53-225 against 62-231 us at 16 heads, batch 1-64
    (``benchmarks/mla_kernel.py``; docs/benchmarks.md). fp32 (no tensor cores at full
    precision, operands in registers) and the CPU interpreter take 16 heads and 16 keys.
    """
    if device.type != "cuda" or dtype == torch.float32:
        return MLATuning(16, 16, 4, 1)
    block_h = min(64, max(16, triton.next_power_of_2(num_heads)))
    block_n = 64 if device_facts.shared_memory_per_block(device) >= _TWO_STAGES_OF_64_KEYS else 32
    return MLATuning(block_h, block_n, 8 if block_h >= 32 else 4, 2)


#: Shared memory (bytes) of 64-head programs with two stages of 64-key tiles, as compiled for sm_90.
_TWO_STAGES_OF_64_KEYS = 221184


class MLALaunch:
    """The MLA kernel's launch for one step and one layer shape (see :func:`plan_mla`):
    calling it attends one layer (``q``, its latent cache ``kv``, ``out``, ``lse`` and, when
    it saves, the new ``k``/``v``); grid, split count, workspace and the compiled kernel are
    fixed when planned."""

    __slots__ = ("launch", "save", "num_splits", "tuning")

    def __init__(self, launch: PlannedLaunch, save: bool, num_splits: int, tuning: MLATuning) -> None:
        self.launch, self.save, self.num_splits, self.tuning = launch, save, num_splits, tuning

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None) -> None:
        if self.save:
            self.launch(q, kv, out, lse, k_new, v_new)
        else:
            self.launch(q, kv, out, lse, q, q)


def _check_layout(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> tuple[int, int]:
    """``(rank, rope)`` of a call, after checking what the kernel assumes of the tensors."""
    if kv.dim() != 4 or kv.shape[2] != 1 or not kv.is_contiguous():
        raise ValueError(f"the MLA kernel attends over a contiguous latent cache [pages, page_size, 1, rank + rope], "
                         f"got shape {tuple(kv.shape)} strides {kv.stride()}: use fullcg.mla.allocate_latent_cache")
    rank = out.shape[2]
    rope = kv.shape[3] - rank
    if q.shape[2] != kv.shape[3] or out.shape[:2] != q.shape[:2] or lse.shape != q.shape[:2]:
        raise ValueError(f"the MLA kernel needs q [T, H, {kv.shape[3]}], out [T, H, rank] and lse [T, H]; got q "
                         f"{tuple(q.shape)}, out {tuple(out.shape)}, lse {tuple(lse.shape)}")
    if not (_pow2_at_least_16(rank) and _pow2_at_least_16(rope)):
        raise ValueError(f"the MLA kernel needs a latent (v head dim) and a rope part (head dim less v head dim) "
                         f"that are powers of two >= 16, got {rank} and {rope}")
    if q.stride(2) != 1 or out.stride(2) != 1 or lse.stride(1) != 1:
        raise ValueError("the MLA kernel needs q, out and lse with unit stride in their last dim: pass .contiguous()")
    return rank, rope


def _pow2_at_least_16(x: int) -> bool:
    return x >= 16 and x & (x - 1) == 0


def plan_mla(
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_tokens: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    workspace: dict[tuple[object, ...], tuple[torch.Tensor, ...]] | None = None,
    num_splits: int | None = None,
    programs_per_sm: int = PROGRAMS_PER_SM,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> MLALaunch:
    """Plan the MLA kernel for calls shaped like these tensors (see :func:`mla_attention`).

    ``block_h`` (heads per program), ``block_n`` (keys per tile), ``num_warps`` and
    ``num_stages`` default to :func:`default_tuning`; ``num_splits`` (most runs per token)
    to about ``programs_per_sm`` programs per SM, at most :data:`MAX_SPLITS`.
    """
    rank, rope = _check_layout(q, kv, out, lse)
    tokens, num_heads = q.shape[0], q.shape[1]
    page_size = kv.shape[1]
    tuning = default_tuning(num_heads, q.dtype, q.device)
    tuning = MLATuning(block_h or tuning.block_h, block_n or tuning.block_n, num_warps or tuning.num_warps,
                       num_stages or tuning.num_stages)
    if not _pow2_at_least_16(tuning.block_h) or not _pow2_at_least_16(tuning.block_n):
        raise ValueError(f"block_h and block_n must be powers of two >= 16 (tl.dot's smallest tile), got {tuning}")
    head_blocks = triton.cdiv(num_heads, tuning.block_h)
    max_tiles = max(1, triton.cdiv(page_table.shape[1] * page_size, tuning.block_n))
    if num_splits is None:
        # Enough programs to give every SM work when tokens x head blocks are few, never more
        # than about programs_per_sm per SM in all (a second wave of a few costs a whole one).
        num_splits = programs_per_sm * device_facts.sm_count(q.device) // max(1, tokens * head_blocks)
    num_splits = max(1, min(num_splits, max_tiles, MAX_SPLITS))
    save = slot_mapping is not None
    if save and new_kv is None:
        raise ValueError("saving new rows in the MLA kernel needs new_kv=(k, v)")
    k_new, v_new = new_kv if save else (q, q)  # placeholders: never read without SAVE
    if save and (k_new.shape[-1] != rank + rope or v_new.shape[-1] != rank or k_new.stride(-1) != 1
                 or v_new.stride(-1) != 1):
        raise ValueError(f"new_kv must be k [T, 1, {rank + rope}] and v [T, 1, {rank}] with unit stride in their "
                         f"last dim, got {tuple(k_new.shape)} and {tuple(v_new.shape)}")
    if num_tokens is None:
        num_tokens = torch.full((1,), tokens, dtype=torch.int32, device=q.device)
    if num_splits > 1:
        key = ("mla", tokens, num_splits, num_heads, rank, head_blocks)
        parts = workspace.get(key) if workspace is not None else None
        if parts is None:
            parts = (
                torch.empty((tokens, num_splits, num_heads, rank), dtype=torch.float32, device=q.device),
                torch.empty((tokens, num_splits, num_heads), dtype=torch.float32, device=q.device),
                # Arrival counts per (token, head block): zero between launches (the merging
                # program resets its own), so one buffer serves every layer of the step.
                torch.zeros((max(1, tokens), head_blocks), dtype=torch.int32, device=q.device),
            )
            if workspace is not None:
                workspace[key] = parts
        part_out, part_lse, arrivals = parts
    else:
        part_out = part_lse = lse  # never touched: every token is one run
        arrivals = query_start_loc
    num_requests = query_start_loc.shape[0] - 1
    tail = (
        part_out, part_lse, arrivals, slot_mapping if save else query_start_loc, page_table, query_start_loc,
        seq_lens, num_tokens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), lse.stride(0), kv.stride(0), kv.stride(1),
        page_table.stride(0), k_new.stride(0), v_new.stride(0),
        scale * _LOG2E, MIN_RUN_SCALE, num_splits, num_requests,
    )
    constexprs = (num_heads, head_blocks, rank, rope, tuning.block_h, tuning.block_n, page_size, REQUEST_BLOCK,
                  MAX_SPLITS, min(MERGE_D, rank), MERGE_UNROLL, q.dtype == torch.float32, save)
    grid = (head_blocks * num_splits * tokens, 1, 1)
    launch = _MLA.plan(grid, (q, kv, out, lse, k_new, v_new), tail, constexprs, tuning.num_warps, tuning.num_stages)
    return MLALaunch(launch, save, num_splits, tuning)


def mla_attention(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, **options: object) -> None:
    """Absorbed MLA of every query token of a batch over its latent cache, into ``out`` and ``lse``.

    ``q [T, H, rank + rope]``; ``kv`` the latent cache ``[pages, page_size, 1, rank + rope]``
    (its value is each row's first ``rank`` values); ``out [T, H, rank]``; ``lse`` float32
    ``[T, H]``, natural log. Keyword options (those of :func:`plan_mla`):
    ``query_start_loc`` (``int32 [R + 1]``), ``page_table``, ``seq_lens`` (prefix plus new
    tokens per request), ``scale``; ``num_tokens`` (``int32 [1]``, default all rows): rows
    at or past it, and rows no request owns, come out as zeros with LSE -inf.
    ``slot_mapping`` with ``new_kv=(k [T, 1, rank + rope], v [T, 1, rank])`` first writes
    each token's new row into its slot (none for a slot < 0): only right when every
    request has one new token (a decode-only batch). ``workspace`` (a dict kept for a
    step) lends the runs' buffers to every call of that shape.
    """
    new_kv = options.get("new_kv")
    k_new, v_new = new_kv if isinstance(new_kv, tuple) else (None, None)
    plan_mla(q, kv, out, lse, **options)(q, kv, out, lse, k_new, v_new)


class LatentSaveLaunch:
    """The latent save's launch for one step and one k/v shape (see :func:`plan_latent_save`);
    called as :class:`fullcg.ops.kernels.save_kv.SaveLaunch` is: ``(k, v, k_cache, v_cache)``,
    where ``v_cache`` (the view of ``k_cache``'s leading values) is not read."""

    __slots__ = ("launch",)

    def __init__(self, launch: PlannedLaunch | None) -> None:
        self.launch = launch

    def __call__(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None = None
                 ) -> None:
        if self.launch is not None:
            self.launch(k, v, k_cache)


def plan_latent_save(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, kv: torch.Tensor) -> LatentSaveLaunch:
    """Plan :func:`save_latent` for new rows shaped like ``k``/``v`` into caches shaped like ``kv``."""
    rank, rope = v.shape[-1], kv.shape[-1] - v.shape[-1]
    if kv.dim() != 4 or kv.shape[2] != 1 or not kv.is_contiguous() or k.shape[-1] != rank + rope \
            or k.stride(-1) != 1 or v.stride(-1) != 1 or k.dtype != kv.dtype or v.dtype != kv.dtype:
        raise ValueError(
            f"the latent save writes k [T, 1, rank + rope] and v [T, 1, rank] (unit stride in the last dim, the "
            f"cache's dtype {kv.dtype}) into a contiguous latent cache; got k {tuple(k.shape)} {k.dtype}, v "
            f"{tuple(v.shape)} {v.dtype}, cache {tuple(kv.shape)}"
        )
    n = slot_mapping.shape[0]
    if n == 0:
        return LatentSaveLaunch(None)
    tail = (slot_mapping, k.stride(0), v.stride(0), kv.stride(0), kv.stride(1))
    return LatentSaveLaunch(_SAVE.plan((n, 1, 1), (k, v, kv), tail, (rank, rope, kv.shape[1]), 4, 1))


def save_latent(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, kv: torch.Tensor) -> None:
    """Write each new token's row into the latent cache ``kv`` at ``slot_mapping`` (slots < 0
    are padding, skipped): its latent from ``v [T, 1, rank]`` and its rope key from the rest
    of ``k [T, 1, rank + rope]`` (the reference's order: k, then v over k's leading values)."""
    plan_latent_save(k, v, slot_mapping, kv)(k, v, kv)
