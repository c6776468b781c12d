"""A structural key for a piece of a split graph, so identical pieces are compiled once.

The layers of a decoder split into pieces that run the same code on different weights.
Weights are graph inputs, so two such pieces differ only in their placeholders' names
(``l_self_modules_layers_modules_0_...`` vs ``..._1_...``). :func:`piece_key` hashes a
piece's code with placeholders numbered instead of named, plus everything about its
inputs that a compiled artifact may depend on (shapes and strides, symbolic ones by their
symbol, dtypes, devices, ``requires_grad``, aliasing). Two pieces with the same key can run
one compiled artifact; any difference that matters gives a different key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["input_signature", "piece_key"]


def _target_name(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str:
    if node.op == "call_function":
        return torch.fx.node._get_qualified_name(node.target) if callable(node.target) else repr(node.target)
    if node.op in ("get_attr", "call_module"):
        # A constant or submodule belongs to this piece: two pieces share a compilation only
        # when they hold the very same object.
        obj: Any = gm
        for part in str(node.target).split("."):
            obj = getattr(obj, part)
        return f"{node.op}:{id(obj)}"
    return str(node.target)  # call_method: the method name


def _graph_code(gm: torch.fx.GraphModule) -> str:
    """The graph as text with every node named by its position, so names do not matter."""
    index = {node: i for i, node in enumerate(gm.graph.nodes)}

    def arg(a: Any) -> Any:
        return torch.fx.node.map_arg(a, lambda n: f"%{index[n]}")

    lines = []
    for node in gm.graph.nodes:
        target = "" if node.op == "placeholder" else _target_name(node, gm)
        lines.append(f"{index[node]} {node.op} {target} {arg(node.args)!r} {arg(dict(node.kwargs))!r}")
    return "\n".join(lines)


def input_signature(example_inputs: Sequence[Any]) -> list[Any]:
    """What a compiled artifact may assume about its inputs, with symbolic sizes by their symbol."""
    storages: list[tuple[StorageWeakRef, int]] = []
    signature = []
    for i, value in enumerate(example_inputs):
        if isinstance(value, torch.Tensor):
            ref = StorageWeakRef(value.untyped_storage())
            # Inputs sharing storage (tied weights, views) may compile differently from distinct ones.
            alias = next((j for r, j in storages if r == ref), None)
            storages.append((ref, i))
            signature.append((
                "tensor", type(value).__name__, tuple(str(d) for d in value.shape),
                tuple(str(s) for s in value.stride()), str(value.storage_offset()), str(value.dtype),
                str(value.device), value.requires_grad, str(value.layout), alias,
            ))
        elif isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            signature.append((type(value).__name__, str(value.node.expr)))
        else:
            signature.append((type(value).__name__, repr(value)))
    return signature


def piece_key(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """A hash of ``gm``'s code (names aside) and of its inputs' metadata."""
    text = repr((_graph_code(gm), input_signature(example_inputs)))
    return hashlib.sha256(text.encode()).hexdigest()
