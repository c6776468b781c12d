"""Sibling projections of a transformers model laid out as row slices of one weight.

A decoder layer's query, key and value projections read the same input, as do its MLP's
gate and up projections. Stored as one weight (rows of each projection one after the
other) and called through :class:`SliceLinear`, each still computes what its own
``nn.Linear`` did, and a compiled graph sees ``linear(x, W[a:b])`` per projection, which
:class:`fullcg.passes.sibling_linears.FuseSiblingLinearsPass` turns into one matmul per
group. Memory is unchanged: the original weights are copied into the fused one and dropped.
The model's ``state_dict`` keeps the original keys (``q_proj.weight``, ...: row views of
the fused weight), and loading one with those keys fills the fused weight, so checkpoints
saved from a prepared model load into an unprepared one and back.

Run eagerly (no compiler traces the step) inside a fullcg step, the siblings share one
matmul too: the first sibling computes the whole group's product and each later one, called
on the same input tensor, returns its columns of it (:class:`SiblingProduct`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fullcg.context import current_context
from fullcg.ops import fused as fused_ops

__all__ = ["SliceLinear", "SiblingProduct", "fuse_sibling_projections", "SIBLING_GROUPS"]

logger = logging.getLogger(__name__)

#: Sibling projections in transformers' decoder layers (Llama, Mistral, Qwen, Gemma and the
#: many models that copy their attention and MLP code): attribute names -> the name the fused
#: linear is registered under, on the same module.
SIBLING_GROUPS: dict[tuple[str, ...], str] = {("q_proj", "k_proj", "v_proj"): "qkv_proj",
                                              ("gate_proj", "up_proj"): "gate_up_proj"}


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place write), None for an inference tensor (which has none)."""
    return None if t.is_inference() else t._version


class SiblingProduct:
    """One matmul for a group of sibling projections run eagerly.

    Siblings are called in order on the same input (``q_proj(x)``, ``k_proj(x)``,
    ``v_proj(x)``). The first computes ``x @ fused.weight.T`` for the whole group; a later
    sibling takes its columns of that product (a view: rows strided by the group's width)
    when all of these hold, and computes afresh otherwise:

    - it runs in the same fullcg forward context (the same step) as the sibling before it,
      and comes after it in the group;
    - its input is the same tensor, and neither the input nor the weight was written in
      place since (version counters; an inference tensor has none, so under
      ``torch.inference_mode`` a write to the input between two siblings of one step goes
      unseen: nothing in a decoder layer does that).

    Outside a forward context every sibling computes its own. The state is one tuple,
    replaced whole and read once per call, so threads stepping one model each see a
    consistent product (at worst, computed afresh). It is dropped after the last sibling.
    """

    def __init__(self, fused: nn.Linear, bounds: Sequence[tuple[int, int]]) -> None:
        self.fused = fused
        self.bounds = tuple(bounds)
        #: (context, input, versions, product, index of the last sibling served), or None.
        self._state: tuple[Any, torch.Tensor, tuple[int | None, int | None], torch.Tensor, int] | None = None

    def columns(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Sibling ``index``'s projection of ``x``."""
        ctx = current_context()
        weight = self.fused.weight
        if ctx is None:
            start, stop = self.bounds[index]
            return F.linear(x, weight[start:stop], None if self.fused.bias is None else self.fused.bias[start:stop])
        versions = (_version(x), _version(weight))
        state = self._state
        if state is not None and state[0] is ctx and state[1] is x and state[2] == versions and index > state[4]:
            product = state[3]
        else:
            product = F.linear(x, weight, self.fused.bias)
        start, stop = self.bounds[index]
        self._state = None if index == len(self.bounds) - 1 else (ctx, x, versions, product, index)
        return product[..., start:stop]

    def __getstate__(self) -> dict[str, Any]:  # the product of a step in flight is not the model's state
        return {"fused": self.fused, "bounds": self.bounds}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.fused, self.bounds = state["fused"], state["bounds"]
        self._state = None


class SliceLinear(nn.Module):
    """Rows ``[start, stop)`` of ``fused`` as a linear layer of its own.

    ``weight`` and ``bias`` are views of the fused parameters; ``in_features`` and
    ``out_features`` are those of the projection it stands for. The fused linear is a child
    of the module that holds the siblings, not of each slice, so its parameters are listed
    (and saved) once. With ``product`` (the group's :class:`SiblingProduct`) and ``index``
    (this slice's place in it), an eager call shares the group's matmul.
    """

    def __init__(self, fused: nn.Linear, start: int, stop: int, product: SiblingProduct | None = None,
                 index: int = 0) -> None:
        super().__init__()
        if not 0 <= start < stop <= fused.out_features:
            raise ValueError(f"rows [{start}, {stop}) do not lie in a linear of {fused.out_features} outputs")
        if product is not None and product.bounds[index] != (start, stop):
            raise ValueError(f"sibling {index} of the shared product has rows {product.bounds[index]}, not "
                             f"[{start}, {stop})")
        object.__setattr__(self, "fused", fused)  # not registered: see the class doc
        object.__setattr__(self, "product", product)
        self.start = start
        self.stop = stop
        self.index = index
        self.in_features = fused.in_features
        self.out_features = stop - start

    @property
    def weight(self) -> torch.Tensor:
        return self.fused.weight[self.start : self.stop]

    @property
    def bias(self) -> torch.Tensor | None:
        b = self.fused.bias
        return None if b is None else b[self.start : self.stop]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The product is read only on eager steps: a traced step reads nothing Dynamo would guard on.
        if fused_ops.eager_step(x, self.fused.weight) and self.product is not None:
            return self.product.columns(x, self.index)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"rows [{self.start}, {self.stop}) of a fused linear, in_features={self.in_features}"


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
          "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def _plain(m: nn.Module) -> bool:
    """A plain ``nn.Linear`` (not a subclass: quantised or sharded layers keep their own
    forward) with plain 2-D tensors for parameters and no hooks (an adapter, an offloading
    or a sharding hook would be bypassed by the fused matmul)."""
    if type(m) is not nn.Linear or hasattr(m, "_hf_hook") or any(getattr(m, h, None) for h in _HOOKS):
        return False
    params = [m.weight] + ([m.bias] if m.bias is not None else [])
    return m.weight.dim() == 2 and all(type(p.data) is torch.Tensor and p.device.type != "meta" for p in params)


def _fusable(linears: Sequence[Any]) -> bool:
    """Plain linears (:func:`_plain`) on one device and dtype, reading the same width, all
    with or all without bias, all trainable or all frozen."""
    if not all(_plain(m) for m in linears):
        return False
    first = linears[0]
    ref = first.weight

    def grads(m: nn.Linear) -> tuple[bool, bool | None]:
        return m.weight.requires_grad, None if m.bias is None else m.bias.requires_grad

    return all(
        m.in_features == first.in_features
        and m.weight.dtype == ref.dtype
        and m.weight.device == ref.device
        and (m.bias is None) == (first.bias is None)
        and grads(m) == grads(first)
        for m in linears
    )


def _split_state(names: tuple[str, ...], fused_name: str, sizes: tuple[int, ...], module: nn.Module,
                 state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``state_dict`` post-hook: the fused parameters saved under the siblings' own keys."""
    for kind in ("weight", "bias"):
        value = state_dict.pop(f"{prefix}{fused_name}.{kind}", None)
        if value is None:
            continue
        start = 0
        for name, rows in zip(names, sizes):
            state_dict[f"{prefix}{name}.{kind}"] = value[start : start + rows]
            start += rows


def _join_state(names: tuple[str, ...], fused_name: str, module: nn.Module, state_dict: dict[str, Any],
                prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook: the siblings' own keys loaded into the fused parameters."""
    for kind in ("weight", "bias"):
        keys = [f"{prefix}{name}.{kind}" for name in names]
        if all(k in state_dict for k in keys):
            state_dict[f"{prefix}{fused_name}.{kind}"] = torch.cat([state_dict.pop(k) for k in keys])


def _fuse(parent: nn.Module, names: Sequence[str], fused_name: str, shared: set[int]) -> bool:
    linears = [getattr(parent, n) for n in names]
    if not _fusable(linears) or any(id(m.weight) in shared for m in linears) or hasattr(parent, fused_name):
        return False
    ref = linears[0].weight
    with torch.no_grad():
        fused = nn.Linear(ref.shape[1], sum(m.out_features for m in linears), bias=linears[0].bias is not None,
                          device="meta")
        fused.weight = nn.Parameter(torch.cat([m.weight for m in linears]), requires_grad=ref.requires_grad)
        if fused.bias is not None:
            fused.bias = nn.Parameter(torch.cat([m.bias for m in linears]),
                                      requires_grad=linears[0].bias.requires_grad)
    parent.register_module(fused_name, fused)
    bounds, start = [], 0
    for m in linears:
        bounds.append((start, start + m.out_features))
        start += m.out_features
    product = SiblingProduct(fused, bounds)
    for index, (name, (first, stop)) in enumerate(zip(names, bounds)):
        setattr(parent, name, SliceLinear(fused, first, stop, product, index))
    # Module-level functions behind partials: the hooks pickle with the model.
    sizes = tuple(m.out_features for m in linears)
    parent.register_state_dict_post_hook(functools.partial(_split_state, tuple(names), fused_name, sizes))
    parent.register_load_state_dict_pre_hook(functools.partial(_join_state, tuple(names), fused_name))
    return True


def fuse_sibling_projections(model: nn.Module, groups: dict[tuple[str, ...], str] | None = None) -> int:
    """Store each module's sibling projections as one weight, registered on that module as a
    linear of its own, and replace them with :class:`SliceLinear` views; returns how many
    groups were fused. ``groups`` maps attribute names to the fused linear's name (default:
    :data:`SIBLING_GROUPS`).

    A group is fused only where every member is a plain ``nn.Linear`` (no subclass, no hooks,
    plain tensors) of one input width, dtype and device, with biases on all or none, all
    trainable or all frozen, no member's weight is shared with another module (tied weights
    keep their layout), and the module has no attribute of the fused name already. The
    module's ``state_dict`` keeps the siblings' keys (see the module doc). Calling it again
    fuses nothing more.
    """
    groups = SIBLING_GROUPS if groups is None else groups
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    shared = {pid for pid, n in counts.items() if n > 1}
    fused = 0
    for module in list(model.modules()):
        for names, fused_name in groups.items():
            if all(isinstance(getattr(module, n, None), nn.Module) for n in names):
                fused += _fuse(module, names, fused_name, shared)
    if fused:
        logger.info("fullcg: %d groups of sibling projections of %s stored as one weight each", fused,
                    type(model).__name__)
    return fused
