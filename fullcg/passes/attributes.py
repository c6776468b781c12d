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
from fullcg.ops.attention import ATTENTION_OPS, LAYER_FROM_KEY
from fullcg.passes.manager import source_hash

__all__ = [
    "AttributesPass", "LAYER_ID_META", "attention_nodes", "node_attribute", "node_layer_id", "prefix_chunk_nodes",
    "resolve_layer_keys", "set_node_attribute",
]

#: ``node.meta`` key of the layer id a node's ``layer`` key input held when the graph was
#: compiled (written by :func:`resolve_layer_keys`).
LAYER_ID_META = "fullcg_layer_id"

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


def node_layer_id(node: torch.fx.Node) -> object:
    """The layer a fullcg op node serves: its ``layer_id``, or, for a node given a layer key
    (``layer_id=-1``), the id the key held at compile time (None when unknown)."""
    layer_id = node_attribute(node, "layer_id")
    if layer_id == LAYER_FROM_KEY and node_attribute(node, "layer") is not None:
        return node.meta.get(LAYER_ID_META)
    return layer_id


def resolve_layer_keys(gm: torch.fx.GraphModule, example_inputs: list[object]) -> None:
    """Note on each fullcg op node given a layer key (a graph input) the layer id the key
    holds (``node.meta[LAYER_ID_META]``): compile-time checks, per-layer skip-softmax
    factors and the split report need it; the op reads the key itself when it runs."""
    from torch._subclasses.fake_tensor import is_fake

    inputs = dict(zip(gm.graph.find_nodes(op="placeholder"), example_inputs))
    for node in gm.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "namespace", None) != "fullcg":
            continue
        if not any(a.name == "layer" for a in node.target._schema.arguments):
            continue
        key = node_attribute(node, "layer")
        value = inputs.get(key) if isinstance(key, torch.fx.Node) else None
        if isinstance(value, torch.Tensor) and not is_fake(value) and value.shape == (2,):
            node.meta[LAYER_ID_META] = int(value[0])


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
        layer = node_layer_id(node)
        if layer is None:
            continue  # a key whose value the compiler was not given (fake inputs): not checked
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
            layer = node_layer_id(node)
            if layer is None and self.skip_softmax.per_layer:
                raise ValueError(
                    f"{node.name}: skip-softmax factors are set per layer but this node's layer key was not an input "
                    "of the compiled graph, so its layer is unknown at compile time"
                )
            skip = self.skip_softmax
            prefill, decode = skip.factors_for(layer) if layer is not None else (
                skip.prefill_scale_factor, skip.decode_scale_factor)
            set_node_attribute(node, "skip_softmax_prefill_scale_factor", prefill)
            set_node_attribute(node, "skip_softmax_decode_scale_factor", decode)
        for node in attention_nodes(graph):
            kv_tokens = node_attribute(node, "key_value_num_tokens")
            rows = _rows(node.args[1])
            if isinstance(kv_tokens, int) and isinstance(rows, int) and not 0 <= kv_tokens <= rows:
                raise ValueError(
                    f"attention node {node.name} (layer {node_layer_id(node)}): key_value_num_tokens="
                    f"{kv_tokens} but k has {rows} rows; it must lie in [0, {rows}]"
                )
            if kv_tokens is not None and not isinstance(kv_tokens, (int, torch.fx.Node, torch.SymInt)):
                raise TypeError(f"attention node {node.name}: key_value_num_tokens must be an int, got {kv_tokens!r}")

    def uuid(self) -> str:
        return source_hash(self, self.skip_softmax)
