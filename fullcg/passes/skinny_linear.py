"""Bias-free linears of half-precision CUDA weights become ``fullcg::skinny_linear``.

The op (:mod:`fullcg.ops.linear`) runs a one-pass GEMV when a call has one row (and up to
eight for an MLP's gated projection or a narrow weight): what a decode step's graph holds. Other calls run
the library GEMM as before, so the rewrite is safe in a graph that serves every step size.

Two forms are rewritten, on the graph Dynamo traced (after the sibling-linear pass, so a
transformers model's separate gate and up projections arrive as one linear):

- ``silu(gate) * up``, where ``gate`` and ``up`` are the two halves of one linear's output
  (``linear(x, W).chunk(2, dim=-1)``, or the column slices ``[..., :I]`` and ``[..., I:]``,
  with or without a contiguous ``clone``), becomes ``skinny_linear(x, W, gated=True)``: the
  activation moves into the GEMV's epilogue. Only when nothing else reads the projection,
  its halves or the activation.
- every other ``linear(x, W)`` without a bias becomes ``skinny_linear(x, W)``.

Then (``norms=True``), where a skinny linear's input is an RMSNorm of a residual sum,
``linear(rms_norm(a + b), W)``, the three become ``add_rms_norm_linear(a, b, ...)``, whose
second output stands for the sum wherever else it is read: the norm moves into the GEMV's
prologue, and its kernel leaves the step. The norm is matched in the two forms modules
write it, both in float32: scaled in float32 and then cast (fullcg's Llama; ``1 + weight``
for Gemma's), or cast and then scaled in the input's dtype (transformers' Llama, Qwen,
Mistral). Only where nothing else reads the norm's steps, the sum's operands are read by
nothing between the sum and the projection (the op reads them where the projection was),
and every other reader of the sum comes after the projection.

Weights on other devices or in fp32 are left alone (the op would only run the library
GEMM on them, and CPU graphs keep Inductor's own choices).
"""

from __future__ import annotations

import inspect
import logging
import operator
import sys
from collections.abc import Sequence

import torch
import torch.fx

from fullcg.ops.linear import GEMV_DTYPES, add_rms_norm_linear, skinny_linear
from fullcg.passes.manager import source_hash
from fullcg.passes.sibling_linears import _LINEAR

__all__ = ["SkinnyLinearPass"]

logger = logging.getLogger(__name__)

_SILU = (torch.nn.functional.silu, torch._C._nn.silu)
_MUL = (operator.mul, torch.mul)


def _value(node: object) -> torch.Tensor | None:
    if not isinstance(node, torch.fx.Node):
        return None
    value = node.meta.get("example_value", node.meta.get("val"))
    return value if isinstance(value, torch.Tensor) else None


def _bias_free_linear(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``(x, weight)`` if ``node`` is ``linear(x, weight)`` with no bias."""
    if node.op != "call_function" or node.target not in _LINEAR or set(node.kwargs) - {"bias"}:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    if len(args) != 3 or node.kwargs.get("bias", args[2]) is not None:
        return None
    x, weight = args[0], args[1]
    if not isinstance(x, torch.fx.Node) or not isinstance(weight, torch.fx.Node):
        return None
    return x, weight


def _only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _weight(node: torch.fx.Node) -> tuple[torch.Tensor, int] | None:
    """The tensor Dynamo recorded for ``node`` (or for the weight it takes a row slice of,
    as the sibling-linear pass writes them, without example values) and ``node``'s rows.
    (Open-ended slices such as ``W[:a]`` count too, unlike the sibling pass's ``_row_slice``.)"""
    value = _value(node)
    if value is not None:
        return (value, value.shape[0]) if value.dim() == 2 else None
    if not (node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2):
        return None
    base, index = node.args
    found = _weight(base) if isinstance(base, torch.fx.Node) else None
    if found is None or not isinstance(index, slice) or index.step not in (None, 1) or not isinstance(found[1], int):
        return None
    if not all(isinstance(b, (int, type(None))) for b in (index.start, index.stop)):
        return None  # bounds traced as values of the step
    start, stop, _ = index.indices(found[1])
    return (found[0], stop - start) if stop > start else None


def _half_of(node: torch.fx.Node) -> tuple[torch.fx.Node, object, list[torch.fx.Node]] | None:
    """``(linear, which, nodes between)`` if ``node`` is a part of a linear's output columns:
    ``which`` is 0 or 1 for the halves of a ``chunk(2, dim=-1)``, else the column slice
    ``(start, stop)``; ``nodes between`` are what the rewrite leaves without users."""
    between = [node]
    if node.op == "call_method" and node.target in ("clone", "contiguous") and len(node.args) == 1:
        node = node.args[0]
        between.append(node)
        if _only_user(node) is None:
            return None
    if not (node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node)):
        return None
    source, index = node.args
    if isinstance(index, int) and index in (0, 1):  # a chunk(2, dim=-1) of the linear
        chunk = source
        is_chunk = (chunk.op == "call_method" and chunk.target == "chunk") or (
            chunk.op == "call_function" and chunk.target is torch.chunk)
        if not is_chunk or len(chunk.args) < 2 or chunk.args[1] != 2 or set(chunk.kwargs) - {"dim"}:
            return None
        dim = chunk.args[2] if len(chunk.args) > 2 else chunk.kwargs.get("dim", 0)
        x = chunk.args[0].args[0] if isinstance(chunk.args[0], torch.fx.Node) and chunk.args[0].args else None
        x_value = _value(x)
        if dim != -1 and (x_value is None or dim != x_value.dim() - 1):
            return None
        if len(chunk.users) != 2:
            return None
        between.append(chunk)
        return chunk.args[0], index, between
    # A column slice: linear[..., a:b].
    if not (isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and isinstance(index[1], slice)):
        return None
    cols = index[1]
    if cols.step not in (None, 1) or not isinstance(cols.stop, int) or not isinstance(cols.start, (int, type(None))):
        return None
    return source, (cols.start or 0, cols.stop), between


_ADD = (operator.add, torch.add)


def _is_method(node: object, name: str) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target == name


def _binary(node: object, targets: tuple) -> tuple[object, object] | None:
    """The two operands of ``node`` if it is one of ``targets`` without keywords."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets
            and len(node.args) == 2 and not node.kwargs):
        return None
    return node.args[0], node.args[1]


def _to_dtype(node: object) -> tuple[torch.fx.Node, torch.dtype] | None:
    """``(x, dtype)`` for ``x.to(dtype)``, ``x.float()`` (float32) and ``x.type_as(y)``."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_method" or not node.args:
        return None
    x = node.args[0]
    if not isinstance(x, torch.fx.Node):
        return None
    if node.target == "float" and len(node.args) == 1 and not node.kwargs:
        return x, torch.float32
    if node.target == "to" and not (set(node.kwargs) - {"dtype"}):
        dtype = node.args[1] if len(node.args) == 2 else node.kwargs.get("dtype")
        if len(node.args) <= 2 and isinstance(dtype, torch.dtype):
            return x, dtype
    if node.target == "type_as" and len(node.args) == 2 and not node.kwargs:
        other = _value(node.args[1])
        if other is not None:
            return x, other.dtype
    return None


class _Norm:
    """An RMSNorm matched on Dynamo's graph: its input, weight, eps, form, and its nodes."""

    def __init__(self, hidden: torch.fx.Node, weight: torch.fx.Node, eps: float, weight_offset: float,
                 cast_before_weight: bool, nodes: list[torch.fx.Node]) -> None:
        self.hidden, self.weight, self.eps = hidden, weight, eps
        self.weight_offset, self.cast_before_weight, self.nodes = weight_offset, cast_before_weight, nodes


def _normalised(node: object) -> tuple[torch.fx.Node, float, list[torch.fx.Node]] | None:
    """``(h, eps, nodes)`` if ``node`` is ``hf * rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)``
    with ``hf = h`` in float32 (any operand order)."""
    ops = _binary(node, _MUL)
    if ops is None:
        return None
    for hf, rs in (ops, ops[::-1]):
        if not (isinstance(rs, torch.fx.Node) and rs.op == "call_function" and rs.target is torch.rsqrt
                and len(rs.args) == 1 and not rs.kwargs):
            continue
        summed = _binary(rs.args[0], _ADD)
        if summed is None:
            continue
        for mean, eps in (summed, summed[::-1]):
            if not (_is_method(mean, "mean") and isinstance(eps, float) and eps >= 0):
                continue
            dim = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
            keep = mean.kwargs.get("keepdim", mean.args[2] if len(mean.args) > 2 else False)
            if dim not in (-1, (-1,), [-1]) or keep is not True or len(mean.args) > 3 or set(mean.kwargs) - {"dim", "keepdim"}:
                continue
            square = mean.args[0]
            if not (_is_method(square, "pow") and square.args[1:] == (2,) and not square.kwargs
                    and square.args[0] is hf):
                continue
            cast = _to_dtype(hf)
            if cast is None or cast[1] is not torch.float32:
                continue
            return cast[0], eps, [node, rs, rs.args[0], mean, square, hf]  # type: ignore[list-item]
    return None


def _weight_term(node: object) -> tuple[torch.fx.Node, float] | None:
    """``(weight, offset)`` for a norm's scale: ``weight``, ``weight.float()``, ``1 + weight.float()``."""
    ops = _binary(node, _ADD)
    offset = 0.0
    if ops is not None:
        for w, c in (ops, ops[::-1]):
            if isinstance(c, (int, float)) and not isinstance(c, bool) and isinstance(w, torch.fx.Node):
                node, offset = w, float(c)
                break
        else:
            return None
    cast = _to_dtype(node)
    if cast is not None and cast[1] is torch.float32:
        node = cast[0]
    if not isinstance(node, torch.fx.Node):
        return None
    value = _value(node)
    return (node, offset) if value is not None and value.dim() == 1 else None


def _rms_norm(out: torch.fx.Node) -> _Norm | None:
    """The RMSNorm whose output is ``out``, in either of the module docstring's forms."""
    cast = _to_dtype(out)
    if cast is not None:  # scaled in float32, then cast
        ops = _binary(cast[0], _MUL)
        for normed, scale in (ops, ops[::-1]) if ops is not None else ():
            found, term = _normalised(normed), _weight_term(scale)
            if found is None or term is None:
                continue
            nodes = [out, cast[0], *found[2]]
            nodes += [n for n in (scale, *(a for a in getattr(scale, "args", ()) if isinstance(a, torch.fx.Node)))
                      if isinstance(n, torch.fx.Node) and n is not term[0] and n not in nodes]
            return _Norm(found[0], term[0], found[1], term[1], False, nodes)
        return None
    ops = _binary(out, _MUL)  # cast, then scaled in the input's dtype
    for scaled, weight in (ops, ops[::-1]) if ops is not None else ():
        cast = _to_dtype(scaled)
        if cast is None:
            continue
        found = _normalised(cast[0])
        term = _weight_term(weight) if isinstance(weight, torch.fx.Node) and _to_dtype(weight) is None else None
        if found is None or term is None:
            continue
        nodes = [out, scaled, *found[2]] + ([weight] if weight is not term[0] else [])
        return _Norm(found[0], term[0], found[1], term[1], True, nodes)
    return None


class SkinnyLinearPass:
    """Rewrites linears to ``fullcg::skinny_linear`` and folds the residual add and RMSNorm
    before one into ``fullcg::add_rms_norm_linear`` (module doc); ``devices`` are the
    weight device types it applies to (tests add ``"cpu"``), ``norms`` whether it folds norms."""

    def __init__(self, devices: Sequence[str] = ("cuda",), norms: bool = True) -> None:
        self.devices = tuple(devices)
        self.norms = norms

    def _eligible(self, x: torch.fx.Node, weight: torch.fx.Node) -> bool:
        """A weight of the devices and dtypes the GEMV takes, and an input of the same dtype
        (under autocast they differ, and the op has no autocast rule: left to ``linear``)."""
        found, x_value = _weight(weight), _value(x)
        return (found is not None and x_value is not None and found[0].dtype in GEMV_DTYPES
                and x_value.dtype == found[0].dtype and found[0].device.type in self.devices)

    def __call__(self, graph: torch.fx.Graph) -> None:
        gated = sum(self._gate(graph, node) for node in list(graph.nodes) if not node._erased)
        plain = 0
        for node in list(graph.nodes):
            found = _bias_free_linear(node)
            if found is not None and self._eligible(*found):
                node.target = skinny_linear
                node.args, node.kwargs = (found[0], found[1], False), {}
                plain += 1
        norms = sum(self._norm(graph, node) for node in list(graph.nodes)
                    if self.norms and not node._erased and node.target is skinny_linear)
        if gated or plain:
            logger.debug("fullcg: %d gated and %d plain linears made skinny_linear, %d with the norm before them",
                         gated, plain, norms)

    def _norm(self, graph: torch.fx.Graph, linear: torch.fx.Node) -> bool:
        x, weight, gated = linear.args
        if not isinstance(x, torch.fx.Node) or _only_user(x) is not linear:
            return False
        norm = _rms_norm(x)
        if norm is None:
            return False
        summed = _binary(norm.hidden, _ADD)
        a, b = summed if summed is not None else (None, None)
        values = [_value(n) for n in (norm.hidden, a, b)]
        x_value, g_value = _value(x), _value(norm.weight)
        if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node) and None not in values
                and x_value is not None and g_value is not None):
            return False
        h_value = values[0]
        if any(v.shape != h_value.shape or v.dtype != h_value.dtype for v in values[1:]):
            return False  # broadcast or promoted: not a plain residual sum
        if x_value.dtype != h_value.dtype or g_value.shape != h_value.shape[-1:] or (
                norm.cast_before_weight and g_value.dtype != h_value.dtype):
            return False  # the GEMV normalises into the sum's dtype
        chain = set(norm.nodes)
        if any(user not in chain for n in norm.nodes[1:] for user in n.users) or any(
                user not in chain and user is not linear for user in x.users):
            return False
        order = {n: i for i, n in enumerate(graph.nodes)}
        start, end = order[norm.hidden], order[linear]
        if any(start < order[u] < end for operand in (a, b) for u in operand.users if u is not norm.hidden):
            return False  # read (maybe written) between the sum and the projection
        if any(u not in chain and order[u] < end for u in norm.hidden.users):
            return False
        with graph.inserting_before(linear):
            fused = graph.call_function(add_rms_norm_linear, (a, b, norm.weight, norm.eps, norm.weight_offset,
                                                              norm.cast_before_weight, weight, gated))
            out = graph.call_function(operator.getitem, (fused, 0))
            hidden = graph.call_function(operator.getitem, (fused, 1))
        fused.meta.update(linear.meta)
        out.meta.update(linear.meta)
        hidden.meta.update(norm.hidden.meta)
        for key in ("example_value", "val"):
            if key in linear.meta and key in norm.hidden.meta:
                fused.meta[key] = (linear.meta[key], norm.hidden.meta[key])
        linear.replace_all_uses_with(out)
        graph.erase_node(linear)
        for node in norm.nodes:
            if not node.users:
                graph.erase_node(node)
        norm.hidden.replace_all_uses_with(hidden)
        graph.erase_node(norm.hidden)
        return True

    def _gate(self, graph: torch.fx.Graph, mul: torch.fx.Node) -> bool:
        if mul.op != "call_function" or mul.target not in _MUL or len(mul.args) != 2 or mul.kwargs:
            return False
        a, b = mul.args
        if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
            return False
        for silu, up in ((a, b), (b, a)):
            if not (silu.op == "call_function" and silu.target in _SILU and len(silu.args) == 1
                    and not silu.kwargs.get("inplace", False) and _only_user(silu) is mul):
                continue
            gate_half, up_half = _half_of(silu.args[0]), _half_of(up)
            if gate_half is None or up_half is None or _only_user(up) is not mul:
                continue
            if _only_user(silu.args[0]) is not silu:
                continue
            (linear, i, gate_between), (linear_up, j, up_between) = gate_half, up_half
            found = _bias_free_linear(linear)
            if linear is not linear_up or found is None or not self._eligible(*found):
                continue
            rows = _weight(found[1])[1]  # type: ignore[index]
            if not isinstance(rows, int) or rows % 2:
                continue  # (an odd chunk(2) gives unequal halves, a broadcasting product)
            if (i, j) != (0, 1):  # column slices: [0, h) and [h, 2h) of 2h columns
                if not (isinstance(i, tuple) and isinstance(j, tuple) and i[0] == 0 and i[1] == j[0]
                        and j[1] == rows == 2 * i[1]):
                    continue
            dead = {silu, *gate_between, *up_between}
            if any(user not in dead and user is not mul for n in [linear, *dead] for user in n.users):
                continue
            # Where the linear ran, not where the product is: a write to x or the weight
            # between the two must not reach the projection.
            with graph.inserting_before(linear):
                fused = graph.call_function(skinny_linear, (found[0], found[1], True))
            fused.meta.update(mul.meta)
            mul.replace_all_uses_with(fused)
            for node in [mul, silu, *gate_between, *up_between, linear]:
                if not node._erased and not node.users:
                    graph.erase_node(node)
            return True
        return False

    def uuid(self) -> str:
        # The matching lives in this module's functions, not only in the class.
        return source_hash(self, self.devices, self.norms, inspect.getsource(sys.modules[__name__]))
