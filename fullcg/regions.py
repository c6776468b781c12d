"""Tracing a repeated layer once: Dynamo's nested compile regions on a model's layers.

A decoder's layers are one module class run N times on different weights. Dynamo traces
each call's Python again (at 32 layers most of a cold start's tracing), unless the layer's
forward is a *nested compile region* (``torch.compiler.nested_compile_region``): then it
traces the first layer, and stamps that graph out for every later layer whose inputs and
guards match. Two things make fullcg's layers match:

- the attention ops take the layer's identity as a run-time value (its ``layer_key``
  tensor, see :mod:`fullcg.ops.attention`), so no per-layer constant enters the graph;
- :func:`mark_repeated_layers` marks the forward of every layer in a ``ModuleList`` of
  same-class modules that hold fullcg attention (``fullcg.compile`` does it unless
  ``FullCGConfig.trace_layers_once`` is False).

Dynamo hands the backend a graph that calls each region through ``invoke_subgraph``;
:func:`inline_regions` puts the region's nodes back in place of each call, so the passes,
the split at attention and the pieces see the flat graph they always see (and Inductor
compiles each distinct piece once, as ever). A layer that differs (another sliding
window, its own skip-softmax factors) fails the match and is traced on its own: correct,
only slower. Regions need torch's reuse of traced regions (torch 2.13 and later; on
older versions Dynamo would trace every layer anyway and the marking is skipped).

Dynamo's reuse is checked, not trusted: on torch 2.13 a stamped-out call is given the
first layer's tensors in place of its own when the region is called with plain tensor
arguments only (no keyword, no tuple), which would run every layer on layer 0's weights
and cache. Marked layers call the region with a keyword (:class:`RegionForward`), which
avoids that path, and :func:`check_region_calls` still maps each call's inputs to the
layer they belong to (by the attention keys it reads, and the marked layers' weights): a
call that reads two layers', or a layer read by two calls, is a
:class:`fullcg.errors.RegionReuseError`, on which ``fullcg.compile`` unmarks the layers
and lets Dynamo trace the model again, layer by layer (one warning). It does the same when
tracing with regions fails outright (Dynamo refuses some layers as regions: Gemma 4's,
which hand k/v to later layers).
"""

from __future__ import annotations

import inspect
import logging
import operator
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch import nn

from fullcg.context import CacheOwner
from fullcg.errors import RegionReuseError

__all__ = [
    "RegionForward", "check_region_calls", "inline_regions", "mark_repeated_layers", "regions_supported",
    "region_calls", "unmark_repeated_layers",
]

logger = logging.getLogger(__name__)

#: Every layer marked so far (weakly): whose tensors :func:`check_region_calls` can name.
_marked_layers: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def regions_supported() -> bool:
    """Whether Dynamo reuses a nested compile region's trace (``max_reuse_entries`` exists)."""
    region = getattr(torch.compiler, "nested_compile_region", None)
    return region is not None and "max_reuse_entries" in inspect.signature(region).parameters


def _is_layer_list(module: nn.Module) -> bool:
    """A ``ModuleList`` of two or more modules of one class, each holding fullcg attention."""
    if not isinstance(module, nn.ModuleList) or len(module) < 2 or len({type(m) for m in module}) != 1:
        return False
    return all(any(isinstance(m, CacheOwner) for m in layer.modules()) for layer in module)


def _repeated_layer_lists(model: nn.Module) -> list[nn.ModuleList]:
    """The innermost layer lists of ``model`` (a list of blocks that hold layer lists
    themselves is not one: its regions would hold several layers each)."""
    lists = [m for m in model.modules() if _is_layer_list(m)]
    return [outer for outer in lists if not any(
        inner is not outer and _is_layer_list(inner) for layer in outer for inner in layer.modules())]


def _layer_forward(layer: nn.Module, *args: Any, _fullcg_region: bool = True, **kwargs: Any) -> Any:
    """The region every marked layer runs: its class's forward. The keyword it takes (and
    drops) is what makes Dynamo fingerprint a call through its general path: a call of
    plain tensor arguments only goes through a fast path that, on torch 2.13, stamps a
    layer out with the first layer's tensors (see the module doc)."""
    return type(layer).forward(layer, *args, **kwargs)


class RegionForward:
    """A marked layer's ``forward``: its class's forward, called through the model's region.

    An object on the instance rather than a bound method: it pickles and copies as an
    unmarked forward (``region`` None: a plain call), which the next ``fullcg.compile``
    marks again. It refers to its layer: a reference cycle, so a dropped model is freed by
    the garbage collector rather than at once (:func:`unmark_repeated_layers` breaks it).
    """

    def __init__(self, layer: nn.Module, region: Callable[..., Any] | None) -> None:
        self.layer = layer
        self.region = region

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.region is None:
            return type(self.layer).forward(self.layer, *args, **kwargs)
        return self.region(self.layer, *args, _fullcg_region=True, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return RegionForward, (self.layer, None)


def mark_repeated_layers(model: nn.Module) -> int:
    """Make the forward of each repeated layer of ``model`` a nested compile region
    (see the module doc); returns how many of its layers are marked now (marked before
    included: the model compiled twice, or a copy of a marked model). Eager calls are
    unchanged: outside ``torch.compile`` a region is a plain call."""
    if not regions_supported():
        return 0
    lists = _repeated_layer_lists(model)
    # One region for the model (Dynamo keys its traces by the region function's code, one
    # for every marked layer), allowed an entry per layer: layers that cannot share a trace
    # get their own, never an error for running out of entries.
    region = torch.compiler.nested_compile_region(
        _layer_forward, max_reuse_entries=sum(len(layers) for layers in lists) + 1)
    marked = 0
    for layers in lists:
        for layer in layers:
            current = layer.__dict__.get("forward")
            if current is not None and not isinstance(current, RegionForward):
                continue  # an instance forward the user set (a hook or patch): the layer stays as it is
            if current is None or current.region is None:
                layer.forward = RegionForward(layer, region)
            _marked_layers.add(layer)  # (marked before too: a copy's layers are checked as well)
            marked += 1
    if marked:
        logger.info("fullcg: %d repeated layers marked to be traced once (nested compile regions)", marked)
    return marked


def unmark_repeated_layers(model: nn.Module) -> int:
    """Undo :func:`mark_repeated_layers` on ``model``; returns how many layers it unmarked."""
    unmarked = 0
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), RegionForward):
            del module.__dict__["forward"]
            _marked_layers.discard(module)
            unmarked += 1
    return unmarked


def _layer_tensors(layer: nn.Module) -> list[torch.Tensor]:
    keys = [key for m in layer.modules() if isinstance(key := getattr(m, "layer_key", None), torch.Tensor)]
    return [*layer.parameters(), *layer.buffers(), *keys]


def _key_operands(call: torch.fx.Node, region: torch.fx.GraphModule) -> list[Any]:
    """The operands of region call ``call`` that reach a fullcg op's ``layer`` key inside it."""
    placeholders = list(region.graph.find_nodes(op="placeholder"))
    operands = call.args[2:]
    found = []
    for node in region.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "namespace", None) != "fullcg":
            continue
        names = [a.name for a in node.target._schema.arguments]
        if "layer" not in names:
            continue
        i = names.index("layer")
        key = node.args[i] if i < len(node.args) else node.kwargs.get("layer")
        if isinstance(key, torch.fx.Node) and key in placeholders:
            found.append(operands[placeholders.index(key)])
    return found


def check_region_calls(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> None:
    """Raise :class:`RegionReuseError` unless every region call of ``gm`` reads the tensors
    of one layer, a layer no other call reads (see the module doc): layers are told apart
    by the attention keys a call reads, and, for layers :func:`mark_repeated_layers` marked,
    by their weights."""
    hop = _invoke_subgraph()
    calls = [n for n in gm.graph.nodes if hop is not None and n.op == "call_function" and n.target is hop]
    if not calls:
        return
    inputs = dict(zip(gm.graph.find_nodes(op="placeholder"), example_inputs))
    key_read_by: dict[int, torch.fx.Node] = {}
    for call in calls:
        for operand in _key_operands(call, getattr(gm, call.args[0].target)):
            key = inputs.get(operand) if isinstance(operand, torch.fx.Node) else None
            if key is None:
                continue
            first = key_read_by.setdefault(id(key), call)
            if first is not call:
                raise RegionReuseError(
                    f"fullcg: region calls {first.name} and {call.name} read one attention layer's key (Dynamo gave a "
                    "stamped-out layer another layer's tensors)"
                )
    owner: dict[int, int] = {}
    shared: set[int] = set()
    for layer in list(_marked_layers):
        for t in _layer_tensors(layer):
            if owner.setdefault(id(t), id(layer)) != id(layer):
                shared.add(id(t))  # tied between layers: names neither
    read_by: dict[int, torch.fx.Node] = {}
    for call in calls:
        layers = {owner[id(v)] for a in call.args[2:] if isinstance(a, torch.fx.Node)
                  and (v := inputs.get(a)) is not None and id(v) in owner and id(v) not in shared}
        if len(layers) > 1:
            raise RegionReuseError(f"fullcg: region call {call.name} reads the tensors of {len(layers)} layers")
        for layer in layers:
            first = read_by.setdefault(layer, call)
            if first is not call:
                raise RegionReuseError(
                    f"fullcg: region calls {first.name} and {call.name} read one layer's tensors (Dynamo gave a "
                    "stamped-out layer the first layer's weights)"
                )


def _invoke_subgraph() -> Any:
    return getattr(torch.ops.higher_order, "invoke_subgraph", None)


def region_calls(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """``(calls, distinct regions)`` of ``gm``'s region calls: 32 and 1 when Dynamo traced
    one layer for all 32."""
    hop = _invoke_subgraph()
    calls = [n for n in gm.graph.nodes if hop is not None and n.op == "call_function" and n.target is hop]
    return len(calls), len({n.args[0].target for n in calls})


def inline_regions(gm: torch.fx.GraphModule, make: Callable[[torch.nn.Module, torch.fx.Graph], torch.fx.GraphModule]
                   ) -> torch.fx.GraphModule:
    """``gm`` with every region call replaced by the region's nodes (``gm`` itself when it
    calls none). ``make(root, graph)`` builds the graph module."""
    hop = _invoke_subgraph()
    if hop is None or not any(n.op == "call_function" and n.target is hop for n in gm.graph.nodes):
        return gm
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is hop:
            region = getattr(gm, node.args[0].target)
            env[node] = _inline(graph, region, [torch.fx.map_arg(a, env.__getitem__) for a in node.args[2:]], make)
        elif node.op == "call_function" and node.target is operator.getitem and isinstance(env.get(node.args[0]), tuple):
            env[node] = env[node.args[0]][node.args[1]]
        elif node.op == "get_attr" and all(u.target is hop for u in node.users):
            continue  # a region's module: its nodes are inlined where it is called
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    out = make(gm, graph)
    out.meta.update(gm.meta)
    return out


def _inline(graph: torch.fx.Graph, region: torch.fx.GraphModule, operands: list[Any],
            make: Callable[[torch.nn.Module, torch.fx.Graph], torch.fx.GraphModule]) -> tuple[Any, ...]:
    """Copy ``region``'s nodes into ``graph`` on ``operands``; its outputs, as a tuple."""
    region = inline_regions(region, make)  # regions inside regions
    env: dict[torch.fx.Node, Any] = {}
    placeholders = iter(operands)
    for node in region.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(placeholders)
        elif node.op == "output":
            outputs = torch.fx.map_arg(node.args[0], env.__getitem__)
            return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
        elif node.op == "get_attr":
            raise NotImplementedError(f"fullcg: a compile region reads attribute {node.target!r}; regions must take "
                                      "their tensors as inputs")
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    raise ValueError("fullcg: a compile region's graph has no output")
