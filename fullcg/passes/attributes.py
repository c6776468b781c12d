"""The attributes of attention op nodes, read and written where the graph shows them.

:class:`AttributesPass` writes the configured skip-softmax factors onto every attention
node (and every ``merge_prefix_chunks`` node, which attends over prefix chunks), checks
``key_value_num_tokens`` against the k/v it describes, and refuses a graph in which two
calls save new k/v for one layer. (Where a graph is split is :mod:`fullcg.passes.split`'s.)
"""

from __future__ import annotations

import torch
import torch.fx

from fullcg.config import SkipSoftmaxConfig
from fullcg.ops.attention import ATTENTION_OPS
from fullcg.passes.manager import source_hash

__all__ = ["AttributesPass", "attention_nodes", "node_attribute", "prefix_chunk_nodes", "set_node_attribute"]

_ATTENTION_OPS = frozenset(ATTENTION_OPS.values())
_PREFIX_CHUNK_OPS = (torch.ops.fullcg.merge_prefix_chunks.default, torch.ops.fullcg.merge_latent_prefix_chunks.default)


def attention_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """All calls of the four attention ops, in graph order."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target in _ATTENTION_OPS]


def _arg_index(node: torch.fx.Node, name: str) -> int:
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == name:
            return i
    raise KeyError(f"{node.target} has no argument {name!r}")


def node_attribute(node: torch.fx.Node, name: str) -> object:
    """The value of attribute ``name`` on a fullcg op node (its default when not passed)."""
    idx = _arg_index(node, name)
    if idx < len(node.args):
        return node.args[idx]
    if name in node.kwargs:
        return node.kwargs[name]
    schema_arg = node.target._schema.arguments[idx]
    return schema_arg.default_value if schema_arg.has_default_value() else None


def set_node_attribute(node: torch.fx.Node, name: str, value: object) -> None:
    idx = _arg_index(node, name)
    if idx < len(node.args):
        args = list(node.args)
        args[idx] = value
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, name: value}


def prefix_chunk_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """All calls of ``merge_prefix_chunks`` (attention over the prefix chunks), in graph order."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target in _PREFIX_CHUNK_OPS]


def _rows(node_or_value: object) -> object:
    val = getattr(node_or_value, "meta", {}).get("val") if isinstance(node_or_value, torch.fx.Node) else None
    return val.shape[0] if val is not None else None


def _check_one_save_per_layer(graph: torch.fx.Graph) -> None:
    """Raise if two attention calls of one graph save new k/v for the same layer: the second
    would overwrite the first in the layer's one KV cache (wrong k/v for every later step)."""
    saved: dict[object, torch.fx.Node] = {}
    for node in attention_nodes(graph):
        save = node_attribute(node, "save_kv_cache")
        if save is None:
            save = node_attribute(node, "use_kv_cache")
        if not save:
            continue
        layer = node_attribute(node, "layer_id")
        first = saved.setdefault(layer, node)
        if first is not node:
            raise ValueError(
                f"attention nodes {first.name} and {node.name} both save new k/v for layer {layer}: the second would "
                "overwrite the first in the layer's KV cache, so later steps would read the wrong k/v. fullcg keeps one "
                "cache per layer_id: give each attention call that saves its own fullcg.Attention with its own "
                "layer_id, or pass save_kv_cache=False to calls that attend over given k/v only"
            )


class AttributesPass:
    """Writes skip-softmax factors onto attention nodes and checks ``key_value_num_tokens``."""

    def __init__(self, skip_softmax: SkipSoftmaxConfig) -> None:
        self.skip_softmax = skip_softmax

    def __call__(self, graph: torch.fx.Graph) -> None:
        _check_one_save_per_layer(graph)
        # Attention over prefix chunks takes its layer's factors, as the layer's own call does.
        for node in [*prefix_chunk_nodes(graph), *attention_nodes(graph)]:
            prefill, decode = self.skip_softmax.factors_for(node_attribute(node, "layer_id"))
            set_node_attribute(node, "skip_softmax_prefill_scale_factor", prefill)
            set_node_attribute(node, "skip_softmax_decode_scale_factor", decode)
        for node in attention_nodes(graph):
            kv_tokens = node_attribute(node, "key_value_num_tokens")
            rows = _rows(node.args[1])
            if isinstance(kv_tokens, int) and isinstance(rows, int) and not 0 <= kv_tokens <= rows:
                raise ValueError(
                    f"attention node {node.name} (layer {node_attribute(node, 'layer_id')}): key_value_num_tokens="
                    f"{kv_tokens} but k has {rows} rows; it must lie in [0, {rows}]"
                )
            if kv_tokens is not None and not isinstance(kv_tokens, (int, torch.fx.Node, torch.SymInt)):
                raise TypeError(f"attention node {node.name}: key_value_num_tokens must be an int, got {kv_tokens!r}")

    def uuid(self) -> str:
        return source_hash(self, self.skip_softmax)
