"""The inner step shared by the prefill and decode kernels: one KV tile of skip-softmax attention.

A program owns a block of query rows (``BLOCK_M``, some of them padding) and walks KV
tiles of ``BLOCK_N`` keys. Scores are kept in log2 space (``qk_scale2 = scale * log2(e)``)
so the kernel uses ``exp2``; the skip test ``exp(tile_max - running_max) < lambda`` becomes
``tile_max2 - running_max2 < log2(lambda)``, the same rule the reference applies.

Two optional features are compile-time switches, so that a kernel without them is the
same code as before they existed:

* ``WINDOW``: a sliding window. Masked tiles also hide keys below each row's lower bound
  ``row_lo`` (the callers start their loops at the window's first tile, so tiles wholly
  before every row's window are never visited).
* ``SOFTCAP``: logit soft-capping ``s -> c * tanh(s / c)`` on the natural-log scores
  ``s = scale * q.k``, applied before the mask, then converted to log2 space.

Head dims need not be powers of two (80, 96, DeepSeek's 192 for q/k with 128 for v):
``tl.arange`` does, so a head's register tile is :func:`padded` to the next power of two
and loads and stores of its columns are masked at the head dim, reading zeros there (zero
q and k columns add nothing to ``q.k``; zero v columns are never stored). The column mask
is compiled in only for a padded head: a power-of-two head is the same code as before.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.constexpr_function
def padded(head_dim: int) -> int:
    """Columns of the register tile that holds a head of ``head_dim``: the next power of two
    (``tl.arange`` takes nothing else). Callable in kernels on constexprs and on the host."""
    return 1 << (int(head_dim) - 1).bit_length()


@triton.jit
def with_cols(mask, cols, HEAD: tl.constexpr):
    """``mask`` (``[rows, 1]`` or ``[rows, cols]``) also false at columns ``cols >= HEAD``
    where the tile is :func:`padded` past the head: past it lie the next head's values, or
    the end of the tensor. A power-of-two head gets ``mask`` itself: no column predicate."""
    out = mask
    if padded(HEAD) != HEAD:
        out = mask & (cols < HEAD)[None, :]
    return out


def softcap_args(scale: float, softcap: float | None) -> tuple[float, float]:
    """``(cap_in, cap_out)`` for :func:`attend_tile`: capped log2 scores are
    ``cap_out * tanh(cap_in * q.k)`` = ``log2(e) * c * tanh(scale * q.k / c)``."""
    if softcap is None:
        return 1.0, 1.0
    return scale / softcap, softcap * _LOG2E


@triton.jit
def tanh(x):
    """``tanh(x)`` from one ``exp2`` (no libdevice: the same code runs under the CPU
    interpreter): ``sign(x) * (1 - e) / (1 + e)`` with ``e = exp(-2|x|)``, which never overflows."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def kv_offsets(
    page_row_ptr,
    kv_start,
    tile_start,
    kv_len,
    stride_page,
    stride_slot,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Element offsets (before the head and dim terms) of keys ``tile_start + [0, BLOCK_N)``.

    Paged: through the request's page-table row. Otherwise rows ``kv_start + pos`` of a
    ragged k/v tensor (``stride_page`` is unused there).
    """
    pos = tile_start + tl.arange(0, BLOCK_N)
    if PAGED:
        if PAGE_SIZE % BLOCK_N == 0:
            # The whole tile lies in one page: one page-table load instead of a gather.
            page = tl.load(page_row_ptr + tile_start // PAGE_SIZE).to(tl.int64)
            offs = page * stride_page + (pos % PAGE_SIZE).to(tl.int64) * stride_slot
        else:
            # Page-table entries past the request's keys may be stale: never look them up.
            pages = tl.load(page_row_ptr + pos // PAGE_SIZE, mask=pos < kv_len, other=0).to(tl.int64)
            offs = pages * stride_page + (pos % PAGE_SIZE).to(tl.int64) * stride_slot
    else:
        offs = (kv_start + pos).to(tl.int64) * stride_slot
    return offs, pos


@triton.jit
def attend_tile(
    q,
    m_i,
    l_i,
    acc,
    K,
    V,
    k_offs,
    v_offs,
    pos,
    row_limit,
    row_lo,
    kv_len,
    offs_d,
    offs_dv,
    qk_scale2,
    cap_in,
    cap_out,
    log2_lam,
    run_index,
    HEAD_D: tl.constexpr,
    HEAD_DV: tl.constexpr,
    MASK: tl.constexpr,
    SKIP: tl.constexpr,
    DOT_F32: tl.constexpr,
    WINDOW: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    """One tile: scores, the block's skip decision, then (unless skipped) exp, row sums and P·V.

    ``row_limit[i]`` is one past the last key row ``i`` may see (0 for padding rows); with
    ``WINDOW``, ``row_lo[i]`` is the first key it may see (otherwise unused). With ``MASK``
    false every key of the tile is visible to every real row. ``cap_in``/``cap_out`` (see
    :func:`softcap_args`) are read with ``SOFTCAP`` only. ``run_index`` is the tile's place
    in its run: 0 for the first tile of a run. ``offs_d``/``offs_dv`` span the :func:`padded`
    tiles of heads of ``HEAD_D``/``HEAD_DV`` (q's columns past its head must be 0); k and v
    columns past them load as 0. Returns the new state and 1 if the tile was skipped.
    """
    if MASK:
        k = tl.load(K + k_offs[:, None] + offs_d[None, :], mask=with_cols((pos < kv_len)[:, None], offs_d, HEAD_D),
                    other=0.0)
    elif padded(HEAD_D) != HEAD_D:
        k = tl.load(K + k_offs[:, None] + offs_d[None, :], mask=(offs_d < HEAD_D)[None, :], other=0.0)
    else:
        k = tl.load(K + k_offs[:, None] + offs_d[None, :])
    if DOT_F32:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    if SOFTCAP:
        # Capped in natural-log units (s / c = scale * q.k / c), then to log2 units.
        qk = tanh(qk * cap_in) * cap_out
    else:
        qk = qk * qk_scale2
    if MASK:
        if WINDOW:
            seen = (pos[None, :] < row_limit[:, None]) & (pos[None, :] >= row_lo[:, None])
            qk = tl.where(seen, qk, float("-inf"))
        else:
            qk = tl.where(pos[None, :] < row_limit[:, None], qk, float("-inf"))
    tile_max = tl.max(qk, 1)
    skipped = 0
    if SKIP:
        # Padding rows (row_limit 0) see nothing: they always agree to skip.
        seen = tl.where(row_limit > 0, tile_max, float("-inf"))
        m_known = m_i > float("-inf")
        gap = seen - tl.where(m_known, m_i, 0.0)  # never -inf - -inf: no NaN even where unused
        agree = (seen == float("-inf")) | (m_known & (gap < log2_lam))
        all_agree = tl.min(agree.to(tl.int32), 0)
        skipped = tl.where(run_index > 0, all_agree, 0)
    if skipped == 0:
        m_new = tl.maximum(m_i, tile_max)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASK:
            v = tl.load(V + v_offs[:, None] + offs_dv[None, :],
                        mask=with_cols((pos < kv_len)[:, None], offs_dv, HEAD_DV), other=0.0)
        elif padded(HEAD_DV) != HEAD_DV:
            v = tl.load(V + v_offs[:, None] + offs_dv[None, :], mask=(offs_dv < HEAD_DV)[None, :], other=0.0)
        else:
            v = tl.load(V + v_offs[:, None] + offs_dv[None, :])
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc, skipped


@dataclasses.dataclass(frozen=True)
class KVSource:
    """How the kernels address k/v: a paged cache or ragged rows, as launch arguments."""

    paged: bool
    page_size: int
    page_table: torch.Tensor  # a placeholder tensor when ragged (never read)
    stride_page_table: int
    kv_start_loc: torch.Tensor  # a placeholder tensor when paged (never read)
    strides: tuple[int, int, int, int, int, int]  # k: page, slot, head; v: page, slot, head


def kv_source(
    k: torch.Tensor,
    v: torch.Tensor,
    page_table: torch.Tensor | None,
    kv_start_loc: torch.Tensor | None,
    query_start_loc: torch.Tensor,
) -> KVSource:
    """Paged ``[pages, page_size, H, D]`` k/v with a page table, or ragged ``[T, H, D]`` rows
    with ``kv_start_loc`` (then every "page" is one row)."""
    if page_table is not None:
        return KVSource(
            True, k.shape[1], page_table, page_table.stride(0), query_start_loc,
            (k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2)),
        )
    if kv_start_loc is None:
        raise ValueError("ragged k/v needs kv_start_loc")
    return KVSource(
        False, 1, query_start_loc, 0, kv_start_loc, (0, k.stride(0), k.stride(1), 0, v.stride(0), v.stride(1))
    )
