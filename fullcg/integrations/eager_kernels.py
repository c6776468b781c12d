"""transformers modules whose eager forward runs fullcg's fused ops.

A model captured without a compiler (``compiler="none"``) runs transformers' Python every
step, so each torch operation of an ``RMSNorm`` (seven) and of a SwiGLU MLP's activation
(two) is a kernel of its own in the captured graph. :func:`use_fused_ops` gives such modules
a forward that calls :func:`fullcg.ops.fused.rms_norm` and :func:`fullcg.ops.fused.silu_mul`
(one kernel each) when the step runs eagerly, and the module's own forward while
``torch.compile`` traces it (Inductor fuses those operations itself) or while autograd
records.

A module is switched only where the fused form computes what its forward computes: the
class looks like the kind (an ``RMSNorm`` with a weight and an epsilon; an MLP with
``gate_proj``, ``up_proj`` and ``down_proj``), and on a probe input its own forward and the
fused form's plain-torch reference agree exactly. Anything else keeps its forward.
"""

from __future__ import annotations

import copy
import logging
import types
from typing import Any

import torch
from torch import nn

from fullcg.ops import fused

__all__ = ["use_fused_ops", "RMS_NORM_FORMS"]

logger = logging.getLogger(__name__)

#: The RMSNorm variants transformers' models use, as ``(weight_offset, cast_before_weight)``
#: (see :func:`fullcg.ops.fused.reference_rms_norm`): Llama's (weight times the normed value
#: cast back to the input's dtype) and Gemma's (normed value times ``1 + weight`` in float32,
#: then cast), with the other two combinations for the models that mix them.
RMS_NORM_FORMS: tuple[tuple[float, bool], ...] = ((0.0, True), (1.0, False), (0.0, False), (1.0, True))
_EPS_NAMES = ("variance_epsilon", "eps")
#: Instance attributes that record the fused form (plain values, part of a warm start's model
#: fingerprint): ``(weight_offset, cast_before_weight, name of the epsilon attribute)`` and a flag.
_NORM_FORM = "fullcg_rms_norm_form"
_FUSED_MLP = "fullcg_fused_mlp"


def _switched_or_patched(module: nn.Module) -> bool:
    """Whether ``module`` has a forward of its own: switched already, or given one by fullcg
    (latent attention) or by the user. A module unpickled after switching has its class's
    forward bound on the instance (see :func:`use_fused_ops`), which counts as none."""
    own = vars(module).get("forward")
    return own is not None and getattr(own, "__func__", None) is not type(module).forward


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks)


def _norm_eps(module: nn.Module) -> str | None:
    if not type(module).__name__.endswith("RMSNorm") or _hooked(module) or list(module.children()):
        return None
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or dict(module.named_parameters()).keys() != {"weight"}:
        return None
    if not weight.dtype.is_floating_point or weight.device.type == "meta" or list(module.buffers()):
        return None
    return next((name for name in _EPS_NAMES if type(getattr(module, name, None)) is float), None)


@torch.no_grad()
def _norm_form(module: nn.Module, eps: float) -> tuple[float, bool] | None:
    """The form of :data:`RMS_NORM_FORMS` whose reference equals the module's forward on a
    probe, in float32 (which tells the weight's offset) and in bfloat16 (which tells where it
    rounds); the probe runs on a copy with a random weight, so the model's own weight (ones
    before loading, say) cannot make two forms look alike."""
    probe_module = copy.deepcopy(module).to(torch.float32)
    hidden = probe_module.weight.shape[0]
    gen = torch.Generator(device="cpu").manual_seed(0)
    probe_module.weight.copy_(torch.randn(hidden, generator=gen))
    x = torch.randn(3, hidden, generator=gen).to(probe_module.weight.device)
    matches = []
    for dtype in (torch.float32, torch.bfloat16):
        probe_module.to(dtype)
        xd = x.to(dtype)
        try:
            out = type(module).forward(probe_module, xd)
        except Exception:  # noqa: BLE001 - a module whose forward this probe cannot call keeps its forward
            return None
        matches.append({form for form in RMS_NORM_FORMS if isinstance(out, torch.Tensor)
                        and torch.equal(out, fused.reference_rms_norm(xd, probe_module.weight, eps, *form))})
    found = [form for form in RMS_NORM_FORMS if form in matches[0] and form in matches[1]]
    return found[0] if found else None


def _rms_norm_forward(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """A switched RMSNorm's forward."""
    weight = module.weight
    if not fused.eager_step(hidden_states, weight):
        return type(module).forward(module, hidden_states)
    offset, cast_before_weight, eps_name = getattr(module, _NORM_FORM)
    return fused.rms_norm(hidden_states, weight, getattr(module, eps_name), offset, cast_before_weight)


def _is_mlp(module: nn.Module) -> bool:
    parts = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    return all(isinstance(p, nn.Module) for p in parts) and not _hooked(module)


@torch.no_grad()
def _mlp_matches(module: nn.Module) -> bool:
    """Whether the module's forward is ``down_proj(silu(gate_proj(x)) * up_proj(x))`` on a probe."""
    ref = getattr(module.gate_proj, "weight", None)  # a SliceLinear's is a view of the fused weight
    if not isinstance(ref, torch.Tensor) or not ref.dtype.is_floating_point or ref.device.type == "meta":
        return False
    hidden = getattr(module.gate_proj, "in_features", None)
    if not isinstance(hidden, int):
        return False
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, hidden, generator=gen).to(device=ref.device, dtype=ref.dtype)
    try:
        out = type(module).forward(module, x)
        want = module.down_proj(fused.reference_silu_mul(module.gate_proj(x), module.up_proj(x)))
    except Exception:  # noqa: BLE001 - a module whose forward this probe cannot call keeps its forward
        return False
    return isinstance(out, torch.Tensor) and torch.equal(out, want)


def _mlp_forward(module: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A switched MLP's forward."""
    if args or kwargs or not fused.eager_step(x, module.gate_proj.weight, module.up_proj.weight):
        return type(module).forward(module, x, *args, **kwargs)
    return module.down_proj(fused.silu_mul(module.gate_proj(x), module.up_proj(x)))


def use_fused_ops(model: nn.Module) -> int:
    """Give ``model``'s RMSNorm and SwiGLU MLP modules forwards that run fullcg's fused ops
    on eager steps (see the module doc); returns how many modules were switched. Calling it
    again switches nothing more.

    The new forward is a method bound on the instance, which Dynamo traces like the class's
    own (a callable object or a ``functools.partial`` there makes it trace the first layer of
    a model apart from the others, outside the region they share). A deep copy keeps it; a
    pickled model comes back with its class's forward (pickle finds a bound method by name),
    and calling this again switches it anew.
    """
    switched = 0
    for module in model.modules():
        if _switched_or_patched(module):
            continue
        if (eps_name := _norm_eps(module)) is not None:
            form = _norm_form(module, getattr(module, eps_name))
            if form is None:
                logger.debug("fullcg: %s keeps its forward: no fused RMSNorm form matches it", type(module).__name__)
                continue
            setattr(module, _NORM_FORM, (*form, eps_name))  # the epsilon is read per call, as the module does
            module.forward = types.MethodType(_rms_norm_forward, module)
            switched += 1
        elif _is_mlp(module):
            if not _mlp_matches(module):
                logger.debug("fullcg: %s keeps its forward: it is not down(silu(gate) * up)", type(module).__name__)
                continue
            setattr(module, _FUSED_MLP, True)
            module.forward = types.MethodType(_mlp_forward, module)
            switched += 1
    return switched


# Bound on an instance as its ``forward``: pickle reduces a bound method to
# ``getattr(instance, __name__)``, which finds the class's forward while the module is rebuilt.
_rms_norm_forward.__name__ = _mlp_forward.__name__ = "forward"
