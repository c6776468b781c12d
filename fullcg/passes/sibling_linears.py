"""Linears that read one input through adjacent row slices of one weight become one matmul.

A decode step reads every weight once, and a skinny matmul reaches the copy bandwidth
only when it is large: three launches for a layer's query, key and value projections (or
two for an MLP's gate and up projections) each pay a matmul's ramp-up and tail, and the
small ones (grouped keys and values) stay well below bandwidth. When the projections'
weights are row slices of one tensor (:class:`fullcg.integrations.fused_linear.SliceLinear`
lays out a transformers model's sibling projections so), the graph holds

    linear(x, W[0:a]), linear(x, W[a:b]), linear(x, W[b:c])

and this pass rewrites it to one ``linear(x, W[0:c])`` whose output columns are copied
back out, contiguous (``out[..., 0:a].clone(memory_format=torch.contiguous_format)`` and
so on): each projection's output has the shape and strides it had, so whatever reads it
(views that merge or split the last dimension included) is unchanged, and Inductor fuses
the copies into their readers (the rotary embedding, the SiLU) or, before an opaque op,
runs one small copy. A strided column slice would not do: whether it is contiguous depends
on whether the step has one token, so the first ``.contiguous()`` or view after it would
make Dynamo's shape guards tell one-token steps from the others.

Slices must be constant, contiguous row ranges of the same 2-D weight (and of the same
bias, if any), and nothing between the first and the last of the linears may write to a
tensor (the fused linear runs where the first one ran); anything else is left alone.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

import torch
import torch.fx

from fullcg.passes.manager import source_hash

__all__ = ["FuseSiblingLinearsPass"]

logger = logging.getLogger(__name__)

_LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)


@dataclass
class _SlicedLinear:
    node: torch.fx.Node  # the linear call
    weight: torch.fx.Node  # the tensor whose rows it slices
    bias: torch.fx.Node | None  # the bias tensor it slices the same rows of, if any
    start: int
    stop: int


def _row_slice(node: object) -> tuple[torch.fx.Node, int, int] | None:
    """(base, start, stop) if ``node`` is ``base[start:stop]`` over dimension 0 with constant bounds."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return None
    base, index = node.args
    if not isinstance(base, torch.fx.Node) or not isinstance(index, slice) or index.step not in (None, 1):
        return None
    if not (isinstance(index.start, int) and isinstance(index.stop, int)) or not 0 <= index.start < index.stop:
        return None
    return base, index.start, index.stop


def _sliced_linear(node: torch.fx.Node, x: torch.fx.Node) -> _SlicedLinear | None:
    """``node`` as a linear of ``x`` over a row slice of a weight, or None."""
    if node.op != "call_function" or node.target not in _LINEAR:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    inp, weight, bias = args[0], args[1], node.kwargs.get("bias", args[2])
    if inp is not x or set(node.kwargs) - {"bias"}:
        return None
    w = _row_slice(weight)
    if w is None:
        return None
    base_b = None
    if bias is not None:
        b = _row_slice(bias)
        if b is None or b[1:] != w[1:]:
            return None
        base_b = b[0]
    return _SlicedLinear(node, w[0], base_b, w[1], w[2])


def _runs(members: list[_SlicedLinear]) -> list[list[_SlicedLinear]]:
    """Maximal groups of two or more whose row ranges follow one another without a gap."""
    members = sorted(members, key=lambda m: m.start)
    runs: list[list[_SlicedLinear]] = [[members[0]]]
    for m in members[1:]:
        if m.start == runs[-1][-1].stop:
            runs[-1].append(m)
        else:
            runs.append([m])
    return [r for r in runs if len(r) > 1]


def _mutates(node: torch.fx.Node) -> bool:
    """Whether ``node`` may write to a tensor (in-place methods, item assignment, ops with a
    mutable schema, or what FX counts as impure)."""
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__")
    if node.op != "call_function":
        return False
    if node.target is operator.setitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return True
    return node.is_impure()


def _is_matrix(node: torch.fx.Node) -> bool:
    """Whether the weight ``node`` is 2-D, where Dynamo recorded it (else assumed: linear
    weights are matrices, and a non-matrix one fails the unfused graph as well)."""
    value = node.meta.get("example_value", node.meta.get("val"))
    return not isinstance(value, torch.Tensor) or value.dim() == 2


class FuseSiblingLinearsPass:
    """Merges linears of one input over adjacent row slices of one weight (module doc)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        fused = 0
        position: dict[torch.fx.Node, int] | None = None
        for x in list(graph.nodes):
            groups: dict[tuple[torch.fx.Node, torch.fx.Node | None], list[_SlicedLinear]] = {}
            for user in x.users:
                m = _sliced_linear(user, x)
                if m is not None and _is_matrix(m.weight):
                    groups.setdefault((m.weight, m.bias), []).append(m)
            for members in groups.values():
                for run in _runs(members) if len(members) > 1 else ():
                    if position is None:  # (made once: fusing keeps the order of what is left)
                        position = {n: i for i, n in enumerate(graph.nodes)}
                    if self._fuse(graph, x, run, position):
                        fused += 1
        if fused:
            logger.debug("fullcg: %d groups of sibling linears fused", fused)

    @staticmethod
    def _fuse(graph: torch.fx.Graph, x: torch.fx.Node, run: list[_SlicedLinear],
              position: dict[torch.fx.Node, int]) -> bool:
        nodes = sorted((m.node for m in run), key=position.__getitem__)
        first, last = nodes[0], nodes[-1]
        node = first.next
        while node is not last:  # the fused linear runs where the first did: nothing between may write
            if _mutates(node):
                return False
            node = node.next
        lo, hi = run[0].start, run[-1].stop
        old_slices = {m.node.args[1] for m in run} | {m.node.kwargs.get("bias", (list(m.node.args) + [None] * 3)[2])
                                                       for m in run}
        with graph.inserting_before(first):
            weight = graph.call_function(operator.getitem, (run[0].weight, slice(lo, hi, None)))
            bias = None
            if run[0].bias is not None:
                bias = graph.call_function(operator.getitem, (run[0].bias, slice(lo, hi, None)))
            out = graph.call_function(torch._C._nn.linear, (x, weight, bias))
            pieces = [graph.call_method("clone", (graph.call_function(operator.getitem, (
                out, (Ellipsis, slice(m.start - lo, m.stop - lo)))),), {"memory_format": torch.contiguous_format})
                for m in run]
        # (After inserting: the insertion point is one of the nodes replaced.)
        for m, piece in zip(run, pieces):
            piece.meta.update(m.node.meta)  # the same shape and strides: Dynamo's example value holds
            m.node.replace_all_uses_with(piece)
            graph.erase_node(m.node)
        for node in old_slices:
            if isinstance(node, torch.fx.Node) and not node.users:
                graph.erase_node(node)
        return True

    def uuid(self) -> str:
        return source_hash(self)
