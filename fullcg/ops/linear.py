"""``fullcg::skinny_linear``: a bias-free linear that takes a one-pass GEMV when it has few rows.

A decode step's matmuls have one row per request. At one row a library GEMM picks
split-K for the narrow projections (a second kernel to reduce the splits) and stays below
the copy bandwidth on the small ones; :mod:`fullcg.ops.kernels.gemv` walks each weight
once, whole rows of it per program, and for an MLP's fused gate and up projection applies
``silu(gate) * up`` in its epilogue (the projection's output never reaches memory, and
the activation's kernel is gone).

``skinny_linear(x, weight, gated)`` is ``x @ weight.T`` (``gated``: ``silu`` of its first
half of columns times its second half) for ``x [..., K]``. The choice is made per call, by
row count (:func:`fullcg.ops.kernels.gemv.choose`): a graph captured at one token per
request holds the GEMV, a prefill step runs the library GEMM (and, gated, fullcg's
``silu_mul``). Only CUDA tensors of half precision (fp16, bf16) on the current device take
the GEMV; everything else is the plain torch computation, so the op is safe to put in any
graph. :class:`fullcg.passes.skinny_linear.SkinnyLinearPass` puts it there.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fullcg.ops import fused
from fullcg.ops.device_facts import sm_count

__all__ = ["skinny_linear", "reference_skinny_linear", "GEMV_DTYPES", "MAX_GEMV_ROWS"]

_lib = torch.library.Library("fullcg", "FRAGMENT")
_lib.define("skinny_linear(Tensor x, Tensor weight, bool gated=False) -> Tensor")

#: The most rows a GEMV launch takes (:func:`fullcg.ops.kernels.gemv.choose`); more go to
#: the library GEMM, decided before anything else, as the op's host time outside a graph.
MAX_GEMV_ROWS = 8

#: Weight dtypes the GEMV takes (fp32 stays with the library GEMM, whose accumulation
#: order tests compare against at tight tolerances).
GEMV_DTYPES = (torch.float16, torch.bfloat16)


def reference_skinny_linear(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """The op in plain torch: ``F.linear(x, weight)``, gated ``silu(first half) * second half``."""
    y = F.linear(x, weight)
    if not gated:
        return y
    half = y.shape[-1] // 2
    return F.silu(y[..., :half]) * y[..., half:]


def _check(x: torch.Tensor, weight: torch.Tensor, gated: bool) -> None:
    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fullcg::skinny_linear takes x [..., K] and weight [N, K]; got x {tuple(x.shape)} and "
                         f"weight {tuple(weight.shape)}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"fullcg::skinny_linear(gated=True) needs an even number of weight rows (gate and up "
                         f"halves), got {weight.shape[0]}")
    if x.device != weight.device:
        raise ValueError(f"fullcg::skinny_linear: x is on {x.device} and weight on {weight.device}; move them to "
                         "one device")


_kernels: Any = None  # fullcg.ops.kernels.gemv, imported (with Triton) on first use


def _gemv_module() -> Any:
    global _kernels
    if _kernels is None:
        from fullcg.ops.kernels import gemv

        _kernels = gemv
    return _kernels


def _skinny_linear(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
    _check(x, weight, gated)
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    # Above the GEMV's row counts (a prefill, uncaptured) straight to the library GEMM: this
    # path's host time is paid per linear when pieces run outside a CUDA graph.
    if (0 < rows <= MAX_GEMV_ROWS and weight.dtype in GEMV_DTYPES and x.dtype == weight.dtype
            and weight.stride(1) == 1 and fused._use_triton(x)):
        kernels = _gemv_module()
        config = kernels.choose(rows, gated, weight.shape[0], k, sm_count(x.device))
        flat = x.reshape(rows, k) if config is not None else None
        if flat is not None and flat.stride(1) == 1:
            out = kernels.gemv(flat, weight, gated=gated, config=config)
            return out.view(*x.shape[:-1], out.shape[-1])
    y = F.linear(x, weight)
    if not gated:
        return y
    half = y.shape[-1] // 2
    return fused.silu_mul(y[..., :half], y[..., half:])


def _skinny_linear_fake(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> torch.Tensor:
    _check(x, weight, gated)
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    return x.new_empty((*x.shape[:-1], n))


def _setup_context(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    x, weight, gated = inputs
    ctx.save_for_backward(x, weight)  # type: ignore[attr-defined]
    ctx.gated = gated  # type: ignore[attr-defined]


def _backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
    # The projection is recomputed rather than kept: the op exists for inference steps, and
    # a training step that passes through it should cost memory only when it asks for grads.
    x, weight = ctx.saved_tensors  # type: ignore[attr-defined]
    if ctx.gated:  # type: ignore[attr-defined]
        y = F.linear(x, weight)
        half = y.shape[-1] // 2
        gate, up = y[..., :half], y[..., half:]
        sig = torch.sigmoid(gate)
        grad = torch.cat((grad * up * sig * (1 + gate * (1 - sig)), grad * gate * sig), dim=-1)
    grad_x = grad @ weight if ctx.needs_input_grad[0] else None  # type: ignore[attr-defined]
    grad_w = None
    if ctx.needs_input_grad[1]:  # type: ignore[attr-defined]
        grad_w = grad.reshape(-1, grad.shape[-1]).T @ x.reshape(-1, x.shape[-1])
    return grad_x, grad_w, None


_lib.impl("skinny_linear", _skinny_linear, "CompositeExplicitAutograd")
torch.library.register_fake("fullcg::skinny_linear", _skinny_linear_fake, lib=_lib)
torch.library.register_autograd("fullcg::skinny_linear", _backward, setup_context=_setup_context, lib=_lib)

#: ``fullcg::skinny_linear(x, weight, gated=False)``: see the module's docstring.
skinny_linear = torch.ops.fullcg.skinny_linear.default
