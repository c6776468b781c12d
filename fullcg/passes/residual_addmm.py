"""A residual add stays out of the matmul before it: Inductor's ``mm + add -> addmm`` undone.

A decoder layer ends its attention and its MLP with ``h = residual + x @ W``. Inductor's
post-grad patterns fold that add into the matmul (``addmm(residual, x, W)``) whenever the
sum leaves the compiled graph or feeds something that is not element-wise, which is
exactly a decoder's case: the sum is the next layer's residual and the next norm's input.
On a skinny decode matmul the fold costs a launch: cuBLAS first copies the residual into
the output (one ``memcpy`` per matmul, 62 of a 32-layer step's 451 launches at batch 1).
Unfused, the matmul is a plain ``mm`` and the add joins the next RMSNorm's kernel, which
reads the residual anyway; the sum is then rounded as the eager model rounds it (the
matmul's output in the activation dtype, then the add).

The rewrite runs as Inductor's ``post_grad_custom_post_pass`` (after its pattern passes,
so nothing folds the add back in): an ``addmm`` with ``alpha = beta = 1`` whose addend has
the output's shape and dtype becomes ``add(mm(a, b), addend)``. A bias, broadcast over the
rows, keeps its ``addmm``. An ``addmm`` the model calls itself with a full-shape addend is
split as well (its sum is then rounded twice, as ``mm`` then ``add`` would round it). Passes
the user set in Inductor's config still run, after this one. Under
``TORCHINDUCTOR_FX_COMPILE_MODE=subprocess`` Inductor does not hand custom passes to its
compile subprocess, so the split does not run there.

``benchmarks/profile_decode.py --keep-residual-addmm`` measures a decode step without this
pass by setting :data:`ENABLED` to False (Inductor's cache key includes the switch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

__all__ = ["ENABLED", "ResidualAddmmSplit", "split_residual_addmm", "residual_addmm_split"]

#: Whether compiles split residual ``addmm`` nodes (benchmarks turn it off to compare).
ENABLED = True

_aten = torch.ops.aten


def _tensor(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def split_residual_addmm(graph: torch.fx.Graph) -> int:
    """Rewrite each residual ``addmm(c, a, b)`` in ``graph`` to ``add(mm(a, b), c)``;
    the number rewritten."""
    count = 0
    for node in list(graph.find_nodes(op="call_function", target=_aten.addmm.default)):
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1 or len(node.args) != 3:
            continue
        addend, a, b = node.args
        out, c, a_val, b_val = _tensor(node), _tensor(addend), _tensor(a), _tensor(b)
        if out is None or c is None or a_val is None or b_val is None or c.shape != out.shape or c.dtype != out.dtype:
            continue
        with graph.inserting_before(node):
            mm = graph.call_function(_aten.mm.default, (a, b))
            add = graph.call_function(_aten.add.Tensor, (mm, addend))
        # Source positions carry over; each node names its own op, which is what Inductor
        # names the kernels it fuses the node into after.
        for new, op, val in ((mm, _aten.mm.default, _aten.mm.default(a_val, b_val)),
                             (add, _aten.add.Tensor, node.meta["val"])):
            new.meta.update(node.meta)
            new.meta.update(val=val, original_aten=op)
        node.replace_all_uses_with(add)
        graph.erase_node(node)
        count += 1
    return count


def _custom_pass_base() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


class ResidualAddmmSplit(_custom_pass_base()):  # type: ignore[misc]
    """:func:`split_residual_addmm` as an Inductor custom post-grad pass, followed by
    ``then``: the pass the user had configured, on a torch whose Inductor takes one pass
    only (where it takes a list, the user's passes follow this one in the list)."""

    def __init__(self, then: Any = None) -> None:
        self.then = then

    def __call__(self, graph: torch.fx.Graph) -> None:
        if ENABLED:
            split_residual_addmm(graph)
        if self.then is not None:
            self.then(graph)

    def uuid(self) -> Any:
        then = None
        if self.then is not None:
            # Without a uuid Inductor cannot key a graph on the user's pass: no caching.
            then = self.then.uuid() if hasattr(self.then, "uuid") else None
            if then is None:
                return None
        from fullcg.compile_cache import file_digest

        return (file_digest(__file__), ENABLED, then)


@contextlib.contextmanager
def residual_addmm_split() -> Iterator[None]:
    """Inductor compiles inside this context run :class:`ResidualAddmmSplit` after their
    pattern passes (and then whatever post pass was configured before)."""
    import torch._inductor.config as inductor_config

    current = inductor_config.post_grad_custom_post_pass
    passes = list(current) if isinstance(current, (list, tuple)) else [] if current is None else [current]
    if any(isinstance(p, ResidualAddmmSplit) for p in passes):
        yield
        return
    import torch._inductor.custom_graph_pass as custom_graph_pass

    # A torch whose Inductor takes a list of passes calls each as it should (an
    # inference-aware pass with ``is_inference``) and keys its cache on each one's uuid.
    if hasattr(custom_graph_pass, "get_custom_graph_passes"):
        setting: Any = [ResidualAddmmSplit(), *passes]
    else:
        setting = ResidualAddmmSplit(current)
    with inductor_config.patch(post_grad_custom_post_pass=setting):
        yield
