"""Splits a graph at breakable attention ops into pieces.

Every breakable op (with any ``getitem`` users of its result) becomes a piece of its own,
run eagerly between the compiled pieces around it; non-breakable ops stay inside pieces.
``gather_prefix_chunk`` is always a split point: it reads the chunk plan on the host.
The split keeps the original node order, so each piece reads like the model's code.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from fullcg.passes.attributes import attention_nodes, is_breakable, node_attribute

import fullcg.ops  # noqa: F401  (registers torch.ops.fullcg)

# Ops that always run eagerly between pieces: their implementations read per-step host data.
_ALWAYS_SPLIT = (torch.ops.fullcg.gather_prefix_chunk, torch.ops.fullcg.gather_prefix_chunk.default)


def _is_split_point(node: torch.fx.Node) -> bool:
    return is_breakable(node) or (node.op == "call_function" and node.target in _ALWAYS_SPLIT)

__all__ = ["Piece", "SplitGraph", "split_graph"]


@dataclasses.dataclass
class Piece:
    """One submodule of the split graph."""

    name: str  # attribute name on the split graph module (``submod_<i>``)
    graph_module: torch.fx.GraphModule
    breakable: bool  # a split point (breakable attention or a prefix-chunk gather), run eagerly

    def attention_summary(self) -> list[str]:
        """One line per attention node inside: op and attributes."""
        lines = []
        for node in attention_nodes(self.graph_module.graph):
            attrs = ", ".join(
                f"{name}={node_attribute(node, name)}"
                for name in (
                    "layer_id", "key_value_num_tokens", "skip_softmax_prefill_scale_factor",
                    "skip_softmax_decode_scale_factor", "use_kv_cache", "causal", "prefix_chunk",
                )
            )
            lines.append(f"{node.target}({attrs})")
        return lines


@dataclasses.dataclass
class SplitGraph:
    """The top-level graph that calls the pieces in order, and the pieces."""

    graph_module: torch.fx.GraphModule
    pieces: list[Piece]


def split_graph(gm: torch.fx.GraphModule) -> SplitGraph:
    """Cut ``gm`` at every breakable attention op."""
    piece_of: dict[torch.fx.Node, int] = {}
    breakable_ids: set[int] = set()
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if _is_split_point(node):
            current += 1
            piece_of[node] = current
            breakable_ids.add(current)
            current += 1
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in piece_of \
                and piece_of[node.args[0]] in breakable_ids:
            piece_of[node] = piece_of[node.args[0]]
        else:
            piece_of[node] = current
    split = split_module(gm, None, lambda n: piece_of[n], keep_original_order=True)
    pieces = []
    for name, mod in split.named_children():
        idx = int(name.rsplit("_", 1)[1])
        pieces.append(Piece(name, mod, idx in breakable_ids))
    return SplitGraph(split, pieces)
