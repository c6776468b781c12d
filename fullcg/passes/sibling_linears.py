"""Linears that read one input through adjacent row slices of one weight become one matmul.

A decode step reads every weight once, and a skinny matmul reaches the copy bandwidth
only when it is large: three launches for a layer's query, key and value projections (or
two for an MLP's gate and up projections) each pay a matmul's ramp-up and tail, and the
small ones (grouped keys and values) stay well below bandwidth. When the projections'
weights are row slices of one tensor (:class:`fullcg.integrations.fused_linear.SliceLinear`
lays out a transformers model's sibling projections so), the graph holds

    linear(x, W[0:a]), linear(x, W[a:b]), linear(x, W[b:c])

and this pass rewrites it to one ``linear(x, W[0:c])`` whose output columns are sliced
back (``out[..., 0:a]`` and so on): the same values, one kernel. Slices must be contiguous
row ranges of the same weight (and bias, if any) placeholder; anything else is left alone.
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


def _head_view(node: torch.fx.Node) -> tuple[list[object], int, object] | None:
    """(leading sizes, head size, head count) if ``node``'s one user is ``node.view(*lead, heads, d)``
    (or ``reshape``) with a constant ``d``; the view node is ``next(iter(node.users))``."""
    users = list(node.users)
    if len(users) != 1:
        return None
    view = users[0]
    if view.op != "call_method" or view.target not in ("view", "reshape") or view.args[0] is not node or view.kwargs:
        return None
    shape = list(view.args[1:])
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = list(shape[0])
    if len(shape) < 2 or isinstance(shape[-1], bool) or not isinstance(shape[-1], int) or shape[-1] <= 0:
        return None
    return shape[:-2], shape[-1], shape[-2]


class FuseSiblingLinearsPass:
    """Merges linears of one input over adjacent row slices of one weight (module doc).

    Where every projection's output is only viewed as heads of one size
    (``.view(*lead, -1, d)``, as attention projections are), the fused output is viewed as
    heads and each projection's heads are copied out contiguous
    (``clone(memory_format=torch.contiguous_format)``, fused by Inductor into whatever reads
    them, rotary for one). A strided slice would not do: whether it is contiguous depends on
    whether the step has one token, so the first ``.contiguous()`` after it would make
    Dynamo's shape guards tell one-token steps from the others, and give them a graph of
    their own.
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        fused = 0
        for x in list(graph.nodes):
            groups: dict[tuple[torch.fx.Node, torch.fx.Node | None], list[_SlicedLinear]] = {}
            for user in x.users:
                m = _sliced_linear(user, x)
                if m is not None:
                    groups.setdefault((m.weight, m.bias), []).append(m)
            for members in groups.values():
                for run in _runs(members) if len(members) > 1 else ():
                    self._fuse(graph, x, run)
                    fused += 1
        if fused:
            logger.debug("fullcg: %d groups of sibling linears fused", fused)

    def _fuse(self, graph: torch.fx.Graph, x: torch.fx.Node, run: list[_SlicedLinear]) -> None:
        lo, hi = run[0].start, run[-1].stop
        position = {n: i for i, n in enumerate(graph.nodes)}
        first = min((m.node for m in run), key=position.__getitem__)
        heads = self._heads(run, lo, position, position[first])
        old_slices = {m.node.args[1] for m in run} | {m.node.kwargs.get("bias", (list(m.node.args) + [None] * 3)[2])
                                                       for m in run}
        with graph.inserting_before(first):
            weight = graph.call_function(operator.getitem, (run[0].weight, slice(lo, hi, None)))
            bias = None
            if run[0].bias is not None:
                bias = graph.call_function(operator.getitem, (run[0].bias, slice(lo, hi, None)))
            out = graph.call_function(torch._C._nn.linear, (x, weight, bias))
            if heads is None:
                pieces = [graph.call_function(operator.getitem, (out, (Ellipsis, slice(m.start - lo, m.stop - lo))))
                          for m in run]
                replaced = [m.node for m in run]
            else:
                lead, d = heads
                as_heads = graph.call_method("view", (out, *lead, -1, d))
                pieces = [graph.call_method("clone", (graph.call_function(operator.getitem, (as_heads, (
                    Ellipsis, slice((m.start - lo) // d, (m.stop - lo) // d), slice(None)))),),
                    {"memory_format": torch.contiguous_format}) for m in run]
                replaced = [next(iter(m.node.users)) for m in run]
        # (After inserting: the insertion point is one of the nodes replaced.)
        for old, piece in zip(replaced, pieces):
            piece.meta.update(old.meta)  # Dynamo's example value: the shape readers downstream look at
            old.replace_all_uses_with(piece)
            graph.erase_node(old)
        if heads is not None:
            for m in run:
                graph.erase_node(m.node)  # its one user, the view, was replaced
        for node in old_slices:
            if isinstance(node, torch.fx.Node) and not node.users:
                graph.erase_node(node)

    @staticmethod
    def _heads(run: list[_SlicedLinear], lo: int, position: dict[torch.fx.Node, int],
               before: int) -> tuple[list[object], int] | None:
        """(leading sizes, head size) when every output of ``run`` is only viewed as heads of
        one size over the same leading sizes, known before the first linear; else None."""
        views = [_head_view(m.node) for m in run]
        if any(v is None for v in views):
            return None
        lead, d, _ = views[0]
        for m, (lead_m, d_m, count) in zip(run, views):
            rows = m.stop - m.start
            if d_m != d or len(lead_m) != len(lead) or any(a is not b and a != b for a, b in zip(lead_m, lead)):
                return None
            if (m.start - lo) % d or rows % d or count not in (-1, rows // d):
                return None
        if any(isinstance(a, torch.fx.Node) and position[a] >= before for a in lead):
            return None
        return lead, d

    def uuid(self) -> str:
        return source_hash(self)
