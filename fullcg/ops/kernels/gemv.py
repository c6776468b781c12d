"""Skinny matmuls (a few rows against a large weight) as one pass over the weight.

``out[m, n] = sum_k x[m, k] * w[n, k]`` for ``x [M, K]`` and an ``nn.Linear`` weight
``w [N, K]`` (row-major, so a program's weight loads run along ``K``, contiguous). Each
program owns ``BLOCK_N`` outputs of every row and walks the whole of ``K``: no split of
``K`` and so no reduction kernel after it, which a library GEMM picks for these shapes.

``gated=True`` reads ``w`` as the two halves ``[gate; up]`` of an MLP's fused projection
and writes ``silu(x @ gate^T) * (x @ up^T)`` (``[M, N / 2]``): the activation happens in
the epilogue on the fp32 sums, so the projection's output never goes to memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fullcg.ops.kernels.launch import Launcher
from fullcg.ops.linear import MAX_GEMV_ROWS

__all__ = ["GemvConfig", "gemv", "choose", "ONE_ROW", "GATED_ROWS", "NARROW_ROWS"]


@dataclass(frozen=True)
class GemvConfig:
    """One launch shape: outputs per program, the ``K`` step, warps and pipeline stages."""

    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4



@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, M, N_OUT, K, stride_xm, stride_wn, stride_om, up_offset,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GATED: tl.constexpr, EVEN_K: tl.constexpr):
    # One row (BLOCK_M == 1) multiplies elementwise; more take tl.dot over 16 padded rows.
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N_OUT
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    if BLOCK_M == 1:
        # One row: accumulate products elementwise and reduce once at the end.
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None], other=0.0)
            x = tl.load(x_rows + ks[None, :], mask=m_mask[:, None], other=0.0)
            if GATED:
                w_up = tl.load(w_rows + up_offset + ks[None, :], mask=n_mask[:, None], other=0.0)
        else:
            k_mask = ks < K
            w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_rows + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if GATED:
                w_up = tl.load(w_rows + up_offset + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if BLOCK_M == 1:
            acc += w.to(tl.float32) * x.to(tl.float32)
            if GATED:
                acc_up += w_up.to(tl.float32) * x.to(tl.float32)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
            if GATED:
                acc_up = tl.dot(x, tl.trans(w_up), acc_up)
    if BLOCK_M == 1:
        res = tl.sum(acc, axis=1)[None, :]
        if GATED:
            up = tl.sum(acc_up, axis=1)[None, :]
            res = res / (1.0 + tl.exp(-res)) * up
    else:
        res = acc
        if GATED:
            res = res / (1.0 + tl.exp(-res)) * acc_up
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, res.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


_GEMV = Launcher(_gemv_kernel)

#: One row: elementwise products, 8 outputs a program. Fastest or within 1% on every
#: projection of a Llama-3-8B layer and its lm_head on an H100 (``benchmarks/gemv.py``).
ONE_ROW = GemvConfig(block_n=8, block_k=512, num_warps=4, num_stages=4)
#: Two to eight rows, tensor cores, for the gated MLP projection: 2-3% under cuBLAS plus
#: the SiLU kernel it replaces.
GATED_ROWS = GemvConfig(block_n=32, block_k=512, num_warps=4, num_stages=2)
#: Two to eight rows of a narrow plain projection (no more outputs than inputs: o_proj,
#: down), where the library GEMM splits ``K`` over a second kernel: 0.92-0.97 of cuBLAS.
NARROW_ROWS = GemvConfig(block_n=32, block_k=512, num_warps=4, num_stages=4)


def choose(rows: int, gated: bool, n: int, k: int, sms: int) -> GemvConfig | None:
    """The launch for ``rows`` rows of an ``n x k`` weight (``n`` outputs; ``gated`` writes
    ``n / 2``) on a GPU of ``sms`` multiprocessors, or None where the library GEMM is the
    faster choice: several rows of a plain projection with more outputs than inputs (qkv,
    an ungated gate_up), where cuBLAS measured level or faster, and several rows over too
    few programs to occupy half the GPU (a GEMM splits ``K`` to fill it; a tensor-parallel
    shard's MLP, 56 programs on 132 SMs, measured 1.1x cuBLAS)."""
    if rows == 1:
        return ONE_ROW
    if rows > MAX_GEMV_ROWS or not (gated or n <= k):
        return None
    config = GATED_ROWS if gated else NARROW_ROWS
    programs = -(-(n // 2 if gated else n) // config.block_n)
    return config if 2 * programs >= sms else None


def gemv(x: torch.Tensor, w: torch.Tensor, *, gated: bool = False, config: GemvConfig = ONE_ROW,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T`` for ``x [M, K]`` (``M <= 16``) and ``w [N, K]``; with ``gated``, ``silu`` of the
    first half of the outputs times the second half (``[M, N / 2]``). ``x`` and ``w`` must be
    contiguous along ``K``; the caller checks devices and dtypes."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemv takes x [M, K] and w [N, K]; got x {tuple(x.shape)} and w {tuple(w.shape)}")
    m, k = x.shape
    n = w.shape[0]
    if not 1 <= m <= 16:
        raise ValueError(f"gemv takes 1 to 16 rows, got {m}: larger batches belong to a GEMM")
    if gated and n % 2:
        raise ValueError(f"a gated gemv needs an even number of weight rows (gate and up halves), got {n}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("gemv needs x and w contiguous along K")
    n_out = n // 2 if gated else n
    if out is None:
        out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n_out) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"gemv's out must be [{m}, {n_out}] of {x.dtype}, contiguous along its rows; got "
                         f"{tuple(out.shape)} of {out.dtype} with strides {out.stride()}")
    _GEMV((triton.cdiv(n_out, config.block_n), 1, 1),
          (x, w, out, m, n_out, k, x.stride(0), w.stride(0), out.stride(0), n_out * w.stride(0)),
          (1 if m == 1 else 16, config.block_n, config.block_k, gated, k % config.block_k == 0),
          config.num_warps, config.num_stages)
    return out
