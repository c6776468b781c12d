"""Graph dumps and the split report: what was compiled, what was cut, and why.

With ``FullCGConfig(dump_dir=...)`` (or ``FULLCG_DUMP_DIR``) every graph the compile
backend receives is written to ``<dump_dir>/graph_<n>/``:

- ``decompiled.py``: the Python that Dynamo actually runs for the compiled function,
  decompiled by depyf (written on the first call, when that code exists);
- ``before_passes.py`` and ``after_passes_<variant>.py``: the FX graph around the passes;
- ``<variant>/<piece>.py``: each piece's code;
- ``split_report.txt``: pieces, the attention nodes in each with their attributes, the
  graph mode and the capture sizes.

:func:`prepare_debug` wraps ``depyf.prepare_debug`` (depyf's full dump, Inductor kernels
included) with the shim that depyf 0.20 needs on torch 2.13.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch.fx

from fullcg.config import FullCGConfig, GraphMode
from fullcg.passes.attributes import prefix_chunk_nodes
from fullcg.passes.split import SplitGraph

__all__ = ["GraphDump", "split_report", "decompiled_caller_source", "prepare_debug"]

logger = logging.getLogger(__name__)
_graph_counter = itertools.count()


class GraphDump:
    """Writes the dumps of one compiled graph (does nothing when dumps are off)."""

    def __init__(self, dump_dir: str | os.PathLike[str] | None) -> None:
        self.root: Path | None = None
        if dump_dir is not None:
            self.root = Path(dump_dir) / f"graph_{next(_graph_counter)}"
            self.root.mkdir(parents=True, exist_ok=True)
            logger.info("fullcg: writing graph dumps to %s", self.root)

    @property
    def enabled(self) -> bool:
        return self.root is not None

    def write(self, relpath: str, text: str) -> None:
        if self.root is None:
            return
        path = self.root / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def graph(self, relpath: str, gm: torch.fx.GraphModule) -> None:
        if self.root is not None:
            self.write(relpath, gm.print_readable(print_output=False))


def _implementation_line(name: str, device: str) -> str:
    """The configured implementation and, for ``auto``, what it resolves to on ``device``."""
    if name != "auto":
        return name
    from fullcg.ops.impl import resolve_implementation

    try:
        impl = resolve_implementation("auto", torch.device(device))
    except Exception as exc:  # an implementation that cannot be imported: the report still gets written
        return f"auto (unresolved: {exc})"
    if impl.name == "auto":
        return ("auto (per call: flashinfer, FMHAv2 for eager bf16 prefill/extend batches on SM90; triton for the calls "
                "FlashInfer would refuse, such as skip-softmax decode below SM100)")
    return f"auto ({impl.name})"


def split_report(
    config: FullCGConfig,
    device: str,
    pass_uuid: str,
    split: SplitGraph,
    shared_with: dict[str, str] | None = None,
    fallbacks: dict[str, str] | None = None,
    regions: tuple[int, int] = (0, 0),
) -> str:
    """A plain-text account of how a graph was compiled: modes, capture sizes, pieces, attention nodes.

    ``shared_with`` maps a compiled piece that reuses another piece's compilation (same code
    and input metadata) to that piece's name; ``fallbacks`` maps a piece Inductor failed on
    (it runs as traced) to the error; ``regions`` is ``(layer calls, distinct regions)``
    Dynamo traced as nested compile regions (:mod:`fullcg.regions`).
    """
    shared_with = shared_with or {}
    fallbacks = fallbacks or {}

    sizes = config.sizes_to_capture
    lines = [
        "fullcg split report",
        f"graph mode: {config.graph_mode}",
        f"device: {device} ({'CUDA graphs captured' if device.startswith('cuda') and config.graph_mode is not GraphMode.NONE else 'no CUDA graph capture'})",
        f"compiler: {config.compiler}",
        f"attention implementation: {_implementation_line(config.attention_impl, device)}",
        f"skip-softmax factors: prefill={config.skip_softmax.prefill_scale_factor}, "
        f"decode={config.skip_softmax.decode_scale_factor}"
        + (f", per layer (layer, prefill, decode): {list(config.skip_softmax.per_layer)}"
           if config.skip_softmax.per_layer else ""),
        f"capture sizes ({len(sizes)}): {list(sizes)}",
        f"pass uuid: {pass_uuid}",
        "layers traced: " + (f"{regions[1]} traced layer region(s) served {regions[0]} layer calls" if regions[0]
                             else "each on its own (no compile regions)"),
        "",
    ]
    mode = config.graph_mode
    variants = []
    if mode is GraphMode.NONE:
        variants.append("piecewise, never captured")
    elif mode.wants_piecewise:
        variants.append("piecewise (each piece its own CUDA graph, attention eager between them)")
    if mode.wants_full:
        variants.append("full (the same pieces and attention inside one CUDA graph)")
    lines.append("variants: " + "; ".join(variants))
    compiled = sum(not p.breakable for p in split.pieces)
    lines.append(
        f"pieces: {len(split.pieces)} ({compiled} compiled, "
        f"{len(split.pieces) - compiled} split points run eagerly)"
    )
    lines.append(
        f"distinct compiled pieces: {compiled - len(shared_with)} of {compiled} "
        "(structurally identical pieces share one compilation)"
    )
    for piece in split.pieces:
        if not piece.breakable:
            kind = f"compiled piece, same compilation as {shared_with[piece.name]}" if piece.name in shared_with \
                else "compiled piece"
            if fallbacks.get(shared_with.get(piece.name, piece.name)):
                kind += f" (Inductor failed on it: runs as traced; {fallbacks[shared_with.get(piece.name, piece.name)]})"
        elif prefix_chunk_nodes(piece.graph_module.graph):
            kind = "prefix-chunk attention and merge (eager, split point)"
        elif piece.attention_summary():
            kind = "breakable attention (eager, split point)"
        else:
            kind = "prefix-chunk gather (eager, split point)"
        ops = sum(1 for n in piece.graph_module.graph.nodes if n.op == "call_function")
        lines.append(f"  {piece.name}: {kind}, {ops} ops")
        lines += [f"    {s}" for s in piece.attention_summary()]
    return "\n".join(lines) + "\n"


def decompiled_caller_source(max_depth: int = 16) -> str | None:
    """Decompile the Dynamo-transformed function that is calling us right now (via depyf).

    The compiled function's bytecode calls the backend's result through a global named
    ``__compiled_fn_*``; the first frame up the stack whose code names one is it.
    """
    try:
        import depyf
    except ImportError:
        return None
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        if any(name.startswith("__compiled_fn") for name in frame.f_code.co_names):
            try:
                return depyf.decompile(frame.f_code)
            except Exception as exc:  # decompilation is best effort; never break a run for a dump
                logger.warning("fullcg: depyf could not decompile %s: %s", frame.f_code.co_name, exc)
                return None
        frame = frame.f_back
    return None


def _forwarding_loader(depyf_loader):
    """depyf 0.20's patched ``PyCodeCache.load_by_key_path`` drops keywords that torch 2.13
    passes (``set_sys_modules``); forward them to the real loader around depyf's."""

    @functools.wraps(depyf_loader)
    def load(key, path, linemap=None, attrs=None, **kwargs):
        from depyf.explain.global_variables import data

        real = data["unpatched_load_by_key_path"]
        if kwargs:
            data["unpatched_load_by_key_path"] = functools.partial(real, **kwargs)
        try:
            return depyf_loader(key, path, linemap, attrs)
        finally:
            data["unpatched_load_by_key_path"] = real

    return load


@contextlib.contextmanager
def prepare_debug(dump_dir: str | os.PathLike[str]) -> Iterator[None]:
    """``depyf.prepare_debug(dump_dir)``, working on torch 2.11 and 2.13 alike.

    Wrap the first call of a compiled model in it to get depyf's full dump.
    """
    import depyf
    import depyf.explain.enable_debugging as enable_debugging

    original = enable_debugging.patched_load_by_key_path
    enable_debugging.patched_load_by_key_path = _forwarding_loader(original)
    try:
        with depyf.prepare_debug(str(dump_dir)):
            yield
    finally:
        enable_debugging.patched_load_by_key_path = original
