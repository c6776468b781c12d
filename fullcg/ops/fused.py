"""Fused element-wise ops for steps that run without a compiler: ``fullcg::rms_norm``,
``fullcg::silu_mul`` and ``fullcg::rotate_half``.

A compiled step gets these fusions from Inductor. A step run eagerly, or captured as it runs
(``compiler="none"``), would launch each torch operation of the norm and the activation as a
kernel of its own; these ops are one Triton kernel each on CUDA (plain torch elsewhere, or
where Triton is not installed). They are dispatcher ops with fakes, so capture without a
compiler records them as it records any op, and tracing through them is possible.

Callers use them through :func:`eager_step`: only outside ``torch.compile``'s tracing (which
should see the plain torch operations, for Inductor to fuse with what surrounds them) and
only where no gradient is asked for (the ops have no backward).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

__all__ = ["rms_norm", "silu_mul", "rotate_half", "eager_step", "reference_rms_norm", "reference_silu_mul",
           "reference_rotate_half"]

_lib = torch.library.Library("fullcg", "FRAGMENT")
_lib.define("rms_norm(Tensor x, Tensor weight, float eps, float weight_offset=0.0, bool cast_before_weight=True) -> Tensor")
_lib.define("silu_mul(Tensor gate, Tensor up) -> Tensor")
_lib.define("rotate_half(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)")


def eager_step(*tensors: torch.Tensor) -> bool:
    """Whether a module's forward should take a fused op: not while ``torch.compile`` traces
    it or FX traces it symbolically (its arguments are then not tensors), and not where
    autograd would need the ops' (absent) backward."""
    if torch.compiler.is_compiling() or not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0,
                       cast_before_weight: bool = True) -> torch.Tensor:
    """RMSNorm over the last dimension in float32. ``cast_before_weight``: the normed value is
    cast back to ``x``'s dtype and then scaled by ``weight + weight_offset`` (Llama's order,
    result in the promoted dtype); otherwise scaled in float32 and cast to ``x``'s dtype
    (Gemma's order)."""
    xf = x.to(torch.float32)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if cast_before_weight:
        w = weight + weight_offset if weight_offset else weight
        return w * normed.to(x.dtype)
    return (normed * (weight.float() + weight_offset)).to(x.dtype)


def reference_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, as an MLP computes it eagerly."""
    return torch.nn.functional.silu(gate) * up


def reference_rotate_half(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding in transformers' form, token-major: ``x * cos + rotate_half(x) * sin``
    for ``q [T, Hq, D]`` and ``k [T, Hk, D]``, with ``cos``/``sin [T, D]`` (each half the same
    angles) and ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``."""
    c, s = cos[:, None, :], sin[:, None, :]

    def rotated(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * c + rotated(q) * s, k * c + rotated(k) * s


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


#: The dtypes the Triton kernels take (others run the reference).
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _use_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernel takes ``x``: half, bfloat16 or float32 values, at least one,
    on the current CUDA device (the kernels launch there); on the CPU only under Triton's
    interpreter when a test asks (``FULLCG_FUSED_TRITON_ON_CPU=1``)."""
    if x.dtype not in KERNEL_DTYPES or x.numel() == 0:
        return False
    if x.is_cuda:
        return _triton_available() and x.device.index == torch.cuda.current_device()
    return os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("FULLCG_FUSED_TRITON_ON_CPU") == "1"


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as ``[rows, last]`` without copying, or None when its rows cannot be strided alike."""
    if x.dim() == 0 or x.stride(-1) != 1:
        return None
    try:
        return x.view(-1, x.shape[-1]) if x.dim() != 2 else x
    except RuntimeError:
        return None


def _rms_norm_out_dtype(x: torch.Tensor, weight: torch.Tensor, cast_before_weight: bool) -> torch.dtype:
    return torch.promote_types(weight.dtype, x.dtype) if cast_before_weight else x.dtype


def _rms_norm_kernel(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0,
                     cast_before_weight: bool = True) -> torch.Tensor:
    if x.dim() == 0 or weight.shape != (x.shape[-1],):
        want = f"shape ({x.shape[-1]},)" if x.dim() else "x with a last dimension to normalise"
        raise ValueError(f"fullcg::rms_norm: weight of shape {tuple(weight.shape)} does not match the last "
                         f"dimension of x {tuple(x.shape)}; it needs {want}")
    if weight.device != x.device:
        raise ValueError(f"fullcg::rms_norm: x is on {x.device} and weight on {weight.device}; move them to one device")
    rows = _rows(x) if _use_triton(x) and weight.dtype in KERNEL_DTYPES and weight.is_contiguous() else None
    if rows is None:
        return reference_rms_norm(x, weight, eps, weight_offset, cast_before_weight)
    from fullcg.ops.kernels.fused import rms_norm_rows

    out = torch.empty(x.shape, dtype=_rms_norm_out_dtype(x, weight, cast_before_weight), device=x.device)
    rms_norm_rows(rows, weight, out.view(-1, x.shape[-1]), eps, weight_offset, cast_before_weight)
    return out


def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0,
                   cast_before_weight: bool = True) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=_rms_norm_out_dtype(x, weight, cast_before_weight))


def _silu_mul_kernel(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"fullcg::silu_mul: gate and up must have one shape, dtype and device; got "
                         f"{tuple(gate.shape)} {gate.dtype} on {gate.device} and {tuple(up.shape)} {up.dtype} on {up.device}")
    if not _use_triton(gate):
        return reference_silu_mul(gate, up)
    g, u = _rows(gate), _rows(up)
    if g is None or u is None:
        return reference_silu_mul(gate, up)
    from fullcg.ops.kernels.fused import silu_mul_rows

    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    silu_mul_rows(g, u, out.view(-1, gate.shape[-1]))
    return out


def _silu_mul_fake(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return gate.new_empty(gate.shape)


def _check_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[2] % 2:
        raise ValueError(f"fullcg::rotate_half: q and k must be [tokens, heads, dim] with one token count and one even "
                         f"dim; got {tuple(q.shape)} and {tuple(k.shape)}")
    if cos.shape != (q.shape[0], q.shape[2]) or sin.shape != cos.shape:
        raise ValueError(f"fullcg::rotate_half: cos and sin must be [tokens, dim] = {(q.shape[0], q.shape[2])}; got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if len({q.device, k.device, cos.device, sin.device}) != 1:
        raise ValueError("fullcg::rotate_half: q, k, cos and sin must be on one device")


def _rotate_half_kernel(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check_rotary(q, k, cos, sin)
    same = q.dtype == k.dtype == cos.dtype == sin.dtype
    rows = q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    if not (same and rows and _use_triton(q) and k.numel()):
        return reference_rotate_half(q, k, cos, sin)
    from fullcg.ops.kernels.fused import rotate_half_rows

    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    rotate_half_rows(q, k, cos, sin, q_out, k_out)
    return q_out, k_out


def _rotate_half_fake(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check_rotary(q, k, cos, sin)
    dtype = torch.promote_types(q.dtype, cos.dtype)
    return q.new_empty(q.shape, dtype=dtype), k.new_empty(k.shape, dtype=torch.promote_types(k.dtype, cos.dtype))


_lib.impl("rms_norm", _rms_norm_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("fullcg::rms_norm", _rms_norm_fake, lib=_lib)
_lib.impl("silu_mul", _silu_mul_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("fullcg::silu_mul", _silu_mul_fake, lib=_lib)
_lib.impl("rotate_half", _rotate_half_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("fullcg::rotate_half", _rotate_half_fake, lib=_lib)

#: ``fullcg::rms_norm(x, weight, eps, weight_offset=0.0, cast_before_weight=True)``: see :func:`reference_rms_norm`.
rms_norm = torch.ops.fullcg.rms_norm.default
#: ``fullcg::silu_mul(gate, up)``: ``silu(gate) * up``.
silu_mul = torch.ops.fullcg.silu_mul.default
#: ``fullcg::rotate_half(q, k, cos, sin) -> (q, k)``: see :func:`reference_rotate_half`.
rotate_half = torch.ops.fullcg.rotate_half.default
