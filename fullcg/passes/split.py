"""Where a step is split: the one definition of a *split point*, and the split itself.

A split point is a call that runs eagerly between captured pieces of a piecewise step:
every attention op call, and ``merge_prefix_chunks``, ``merge_latent_prefix_chunks`` and
``gather_prefix_chunk``, which read the step's prefix-chunk plan on the host (:func:`is_split_target`). Both front ends
split there and nowhere else:

- the compile backend splits every graph Dynamo hands it (:func:`split_graph`), after
  :class:`SplitPointsPass` has retargeted each attention node to the breakable form of its
  op, so the graph shows its split points and Inductor's own partitioning agrees (the
  breakable ops carry ``cudagraph_unsafe``). One split graph serves both variants: a
  piecewise step replays the pieces' graphs with the split points eager between them, a
  full step runs pieces and split points inside one CUDA graph;
- capture without a compiler (:mod:`fullcg.eager_capture`) ends a graph segment at each
  split point while it captures the piecewise variant, and splits nothing in the full one.

Layers always emit the plain ops (:class:`fullcg.Attention`); a step's split points are
never a choice of the model or of the forward context. Each split point (with any
``getitem`` users of its result) becomes a piece of its own; the split keeps the original
node order, so each piece reads like the model's code.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from fullcg.ops.attention import ATTENTION_OPS
from fullcg.passes.attributes import attention_nodes, node_attribute, node_layer_id, prefix_chunk_nodes
from fullcg.passes.manager import source_hash

import fullcg.ops  # noqa: F401  (registers torch.ops.fullcg)

__all__ = ["Piece", "SplitGraph", "SplitPointsPass", "is_split_target", "reads_host_plan", "split_graph"]

# Ops that always run eagerly between pieces: they loop over the step's prefix-chunk plan
# on the host, so no CUDA graph can hold them.
_HOST_PLAN_OPS = (
    torch.ops.fullcg.gather_prefix_chunk, torch.ops.fullcg.gather_prefix_chunk.default,
    torch.ops.fullcg.merge_prefix_chunks, torch.ops.fullcg.merge_prefix_chunks.default,
    torch.ops.fullcg.merge_latent_prefix_chunks, torch.ops.fullcg.merge_latent_prefix_chunks.default,
)


def reads_host_plan(target: object) -> bool:
    """Whether op ``target`` reads the step's prefix-chunk plan on the host (never captured)."""
    return target in _HOST_PLAN_OPS


_OP_KEY = {op: key for key, op in ATTENTION_OPS.items()}  # op -> (breakable, return_lse)
_ATTENTION_PACKETS = tuple({op.overloadpacket for op in ATTENTION_OPS.values()})


def is_split_target(target: object) -> bool:
    """Whether calls of op ``target`` are split points (see the module doc): an attention
    op of any of the four forms, or an op that reads the step's prefix-chunk plan."""
    return target in _OP_KEY or target in _HOST_PLAN_OPS or target in _ATTENTION_PACKETS


class SplitPointsPass:
    """Retargets every attention node to the breakable form of its op (keeping ``return_lse``):
    the compiled graph's split points, shown in the graph (see the module doc)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in attention_nodes(graph):
            _, return_lse = _OP_KEY[node.target]
            node.target = ATTENTION_OPS[(True, return_lse)]

    def uuid(self) -> str:
        return source_hash(self)


def _is_split_point(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and is_split_target(node.target)


@dataclasses.dataclass
class Piece:
    """One submodule of the split graph."""

    name: str  # attribute name on the split graph module (``submod_<i>``)
    graph_module: torch.fx.GraphModule
    breakable: bool  # a split point (breakable attention or a prefix-chunk op), run eagerly

    def attention_summary(self) -> list[str]:
        """One line per attention (or prefix-chunk attention) node inside: op and attributes."""
        graph = self.graph_module.graph
        named = [(n, _ATTENTION_SUMMARY) for n in attention_nodes(graph)]
        named += [(n, _PREFIX_CHUNK_SUMMARY) for n in prefix_chunk_nodes(graph)]
        order = {n: i for i, n in enumerate(graph.nodes)}
        return [
            f"{node.target}({', '.join(f'{name}={_summary_value(node, name)}' for name in names)})"
            for node, names in sorted(named, key=lambda item: order[item[0]])
        ]


def _summary_value(node: torch.fx.Node, name: str) -> object:
    # A layer's key holds its id at run time; the report shows the id it held when compiled.
    return node_layer_id(node) if name == "layer_id" else node_attribute(node, name)


_ATTENTION_SUMMARY = (
    "layer_id", "key_value_num_tokens", "skip_softmax_prefill_scale_factor", "skip_softmax_decode_scale_factor",
    "use_kv_cache", "causal", "prefix_chunk",
)
_PREFIX_CHUNK_SUMMARY = ("layer_id", "skip_softmax_prefill_scale_factor", "skip_softmax_decode_scale_factor")


@dataclasses.dataclass
class SplitGraph:
    """The top-level graph that calls the pieces in order, and the pieces."""

    graph_module: torch.fx.GraphModule
    pieces: list[Piece]


def split_graph(gm: torch.fx.GraphModule) -> SplitGraph:
    """Cut ``gm`` at every split point (:func:`is_split_target`)."""
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
