"""Triton kernels for the element-wise work between a decoder layer's matmuls, when it runs
without a compiler: RMSNorm, SiLU(gate) x up, and the rotary embedding of q and k, each one
kernel.

Run eagerly, a transformers ``RMSNorm`` is seven kernels (cast, square, mean, add, rsqrt,
multiply, cast, multiply by the weight), an MLP's activation two and the rotary embedding of
q and k ten; captured in a CUDA
graph each is a node whose ramp-up and tail the step pays per layer. Each kernel here reads
its inputs once and writes its output once, rounding to the inputs' dtype where the module it
stands for rounds; within a step it computes in float32 with Triton's fast math (``exp``,
``rsqrt``, the order of a sum), so values can differ from the module's in the last bits of
float32 and, rarely, by one unit in the last place of bfloat16.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from fullcg.ops.kernels.launch import Launcher

__all__ = ["FusedLaunch", "rms_norm_launch", "rms_norm_rows", "rotate_half_launch", "rotate_half_rows",
           "silu_mul_launch", "silu_mul_rows"]


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
    if CAST_BEFORE_WEIGHT:  # (weight + offset) * normed.to(input dtype), all in the weight's dtype (Llama's order)
        w = (w + weight_offset).to(w_ptr.dtype.element_ty).to(tl.float32)
        y = w * normed.to(x_ptr.dtype.element_ty).to(tl.float32)
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


@triton.jit
def _rotate_half_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin, q_heads,
    HALF: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per (token, head) of q and k together: heads past q's are k's.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    c1 = tl.load(cos_ptr + t * stride_cos + cols, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_cos + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_sin + cols, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_sin + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    if h < q_heads:
        src = q_ptr + t * stride_qt + h * stride_qh
        dst = q_out_ptr + (t * q_heads + h) * (2 * HALF)
    else:
        src = k_ptr + t * stride_kt + (h - q_heads) * stride_kh
        dst = k_out_ptr + (t * (tl.num_programs(1) - q_heads) + h - q_heads) * (2 * HALF)
    dtype = q_out_ptr.dtype.element_ty
    x1 = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1), each product and the
    # sum rounded to the input's dtype as the eager expression rounds them.
    first = (x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)
    second = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    tl.store(dst + cols, first.to(dtype), mask=mask)
    tl.store(dst + HALF + cols, second.to(dtype), mask=mask)


_RMS_NORM = Launcher(_rms_norm_kernel)
_ROTATE_HALF = Launcher(_rotate_half_kernel)
_SILU_MUL = Launcher(_silu_mul_kernel)
_SILU_BLOCK = 1024


class FusedLaunch(NamedTuple):
    """One launch of a fused kernel, whole: what ``*_rows`` runs and what a build ahead
    compiles (``fullcg.kernel_build``; the attribute names are :class:`PlannedLaunch`'s)."""

    launcher: Launcher
    grid: tuple[int, int, int]
    tail: tuple[Any, ...]
    constexprs: tuple[Any, ...]
    num_warps: int
    num_stages: int

    def __call__(self) -> None:
        self.launcher(self.grid, self.tail, self.constexprs, self.num_warps, self.num_stages)


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def rms_norm_launch(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float, weight_offset: float,
    cast_before_weight: bool,
) -> FusedLaunch:
    """The launch of :func:`rms_norm_rows` for these arguments."""
    rows, cols = x.shape
    block = triton.next_power_of_2(cols)
    return FusedLaunch(_RMS_NORM, (rows, 1, 1),
                       (x, weight, out, x.stride(0), out.stride(0), cols, float(eps), float(weight_offset)),
                       (bool(cast_before_weight), block), _warps(block), 1)


def rms_norm_rows(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float, weight_offset: float,
    cast_before_weight: bool,
) -> None:
    """``out[r] = rms_norm(x[r]) * weight`` for every row of ``x [R, C]`` (rows may be strided,
    each row contiguous); ``out [R, C]`` likewise."""
    if x.shape[0]:
        rms_norm_launch(x, weight, out, eps, weight_offset, cast_before_weight)()


def silu_mul_launch(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> FusedLaunch:
    """The launch of :func:`silu_mul_rows` for these arguments."""
    rows, cols = gate.shape
    block = min(_SILU_BLOCK, triton.next_power_of_2(cols))
    return FusedLaunch(_SILU_MUL, (rows, triton.cdiv(cols, block), 1),
                       (gate, up, out, gate.stride(0), up.stride(0), out.stride(0), cols), (block,), 4, 1)


def silu_mul_rows(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> None:
    """``out = silu(gate) * up`` over rows ``[R, C]`` (rows may be strided, each row contiguous)."""
    if gate.shape[0]:
        silu_mul_launch(gate, up, out)()


def rotate_half_launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       q_out: torch.Tensor, k_out: torch.Tensor) -> FusedLaunch:
    """The launch of :func:`rotate_half_rows` for these arguments."""
    tokens, q_heads, dim = q.shape
    half = dim // 2
    return FusedLaunch(_ROTATE_HALF, (tokens, q_heads + k.shape[1], 1),
                       (q, k, cos, sin, q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                        cos.stride(0), sin.stride(0), q_heads),
                       (half, triton.next_power_of_2(half)), 1 if half <= 64 else 2, 1)


def rotate_half_rows(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     q_out: torch.Tensor, k_out: torch.Tensor) -> None:
    """``x * cos + rotate_half(x) * sin`` for ``q [T, Hq, D]`` and ``k [T, Hk, D]`` (each head's
    ``D`` values contiguous) by ``cos``/``sin [T, D]`` (rows contiguous), into contiguous
    ``q_out`` and ``k_out``."""
    if q.shape[0]:
        rotate_half_launch(q, k, cos, sin, q_out, k_out)()
