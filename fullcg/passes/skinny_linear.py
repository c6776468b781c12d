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

from fullcg.ops.linear import GEMV_DTYPES, skinny_linear
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


class SkinnyLinearPass:
    """Rewrites linears to ``fullcg::skinny_linear`` (module doc); ``devices`` are the
    weight device types it applies to (tests add ``"cpu"``)."""

    def __init__(self, devices: Sequence[str] = ("cuda",)) -> None:
        self.devices = tuple(devices)

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
        if gated or plain:
            logger.debug("fullcg: %d gated and %d plain linears made skinny_linear", gated, plain)

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
        return source_hash(self, self.devices, inspect.getsource(sys.modules[__name__]))
