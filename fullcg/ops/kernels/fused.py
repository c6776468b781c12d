"""Triton kernels for the element-wise work between a decoder layer's matmuls, when it runs
without a compiler: RMSNorm and SiLU(gate) x up, each one kernel.

Run eagerly, a transformers ``RMSNorm`` is seven kernels (cast, square, mean, add, rsqrt,
multiply, cast, multiply by the weight) and an MLP's activation two; captured in a CUDA
graph each is a node whose ramp-up and tail the step pays per layer. Each kernel here reads
its inputs once and writes its output once, rounding where the module it stands for rounds
(so a bf16 model's values match it to the last bit but for the order of a sum).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fullcg.ops.kernels.launch import Launcher

__all__ = ["rms_norm_rows", "silu_mul_rows"]


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, stride_x, stride_out, n_cols, eps, weight_offset,
    CAST_BEFORE_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if CAST_BEFORE_WEIGHT:  # weight * normed.to(input dtype) (Llama's order)
        y = (w + weight_offset) * normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    else:  # (normed * (weight + offset)).to(output dtype) (Gemma's order)
        y = normed * (w + weight_offset)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(
    gate_ptr, up_ptr, out_ptr, stride_gate, stride_up, stride_out, n_cols,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    # SiLU rounds to the input's dtype before the product, as silu(gate) * up does eagerly.
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


_RMS_NORM = Launcher(_rms_norm_kernel)
_SILU_MUL = Launcher(_silu_mul_kernel)
_SILU_BLOCK = 1024


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def rms_norm_rows(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float, weight_offset: float,
    cast_before_weight: bool,
) -> None:
    """``out[r] = rms_norm(x[r]) * weight`` for every row of ``x [R, C]`` (rows may be strided,
    each row contiguous); ``out [R, C]`` likewise."""
    rows, cols = x.shape
    if rows == 0:
        return
    block = triton.next_power_of_2(cols)
    _RMS_NORM(
        (rows, 1, 1),
        (x, weight, out, x.stride(0), out.stride(0), cols, float(eps), float(weight_offset)),
        (bool(cast_before_weight), block),
        _warps(block), 1,
    )


def silu_mul_rows(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> None:
    """``out = silu(gate) * up`` over rows ``[R, C]`` (rows may be strided, each row contiguous)."""
    rows, cols = gate.shape
    if rows == 0:
        return
    block = min(_SILU_BLOCK, triton.next_power_of_2(cols))
    _SILU_MUL(
        (rows, triton.cdiv(cols, block), 1),
        (gate, up, out, gate.stride(0), up.stride(0), out.stride(0), cols),
        (block,),
        4, 1,
    )
