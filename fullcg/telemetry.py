"""Counters of what ran: steps by graph path, and skip-softmax tiles visited and skipped.

Steps: every compiled model has its own :class:`StepCounts` (``compiled.step_counts()``),
counting each of its steps by how it ran (``full``/``piecewise`` + ``:captured`` or
``:eager``), and ``fallback`` for steps that ran its layers outside fullcg (Dynamo running
the frame eagerly, for example past its recompile limit), so no step leaves fullcg
unseen. :func:`graph_mode_counts` is the process's total: every model's counts added up.
Counts are updated under a lock.

Skip-softmax: tiles visited and skipped, per layer and per kind of request.

A tile is one (KV head, block of query rows, block of keys) unit of work. Counters live
on the device of the attention that updates them, as ``int64 [2, 2]`` tensors indexed
``[kind, what]`` with kind 0 = prefill/extend, 1 = decode and what 0 = visited,
1 = skipped. Kernels add to them without a host sync; reading them syncs. Calls on
kernels that count nothing (FlashInfer's) are counted per layer as unmeasured calls.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from fullcg.diagnostics import log_once

if TYPE_CHECKING:
    from fullcg.distributed import TensorParallel

__all__ = [
    "SkipSoftmaxStats", "StepCounts", "skip_softmax_stats", "reset_skip_softmax_stats", "counters", "counts_discarded",
    "graph_mode_counts", "reset_graph_mode_counts", "count_fallback", "count_unmeasured",
]

logger = logging.getLogger(__name__)

_steps_lock = threading.Lock()


class StepCounts:
    """Steps of one compiled model by how they ran (see the module doc); each count is
    added to the process's total (:func:`graph_mode_counts`) as well."""

    def __init__(self, total: StepCounts | None = None) -> None:
        self._counts: collections.Counter[str] = collections.Counter()
        self._total = total

    def add(self, key: str) -> None:
        """Count one step under ``key``."""
        with _steps_lock:
            self._counts[key] += 1
            if self._total is not None:
                self._total._counts[key] += 1

    def snapshot(self) -> collections.Counter[str]:
        """The counts so far (a copy)."""
        with _steps_lock:
            return collections.Counter(self._counts)

    def reset(self) -> None:
        with _steps_lock:
            self._counts.clear()


#: The process's total over every model's counts (models since freed included).
_process_total = StepCounts()
#: Every model's counts, for :func:`reset_graph_mode_counts` (a registry that says so).
_model_counts: weakref.WeakSet[StepCounts] = weakref.WeakSet()


def model_counts() -> StepCounts:
    """New counts for one compiled model, adding up into the process's total."""
    counts = StepCounts(_process_total)
    with _steps_lock:
        _model_counts.add(counts)
    return counts


def graph_mode_counts() -> collections.Counter[str]:
    """Steps by how they ran, over every compiled model of the process: ``full``/``piecewise``
    + ``:captured`` (CUDA graphs) or ``:eager``, and ``fallback`` (a compiled model's step
    that ran outside fullcg). A model's own are its ``step_counts()``."""
    return _process_total.snapshot()


def reset_graph_mode_counts() -> None:
    """Zero the process's total and every model's counts, at once (under the counters' lock)."""
    with _steps_lock:
        _process_total._counts.clear()
        for counts in list(_model_counts):
            counts._counts.clear()


def count_fallback(counts: StepCounts, source: str) -> None:
    """Count a step of a compiled model (``counts``) that ran eagerly outside fullcg; warn
    the first time in the process."""
    counts.add("fallback")
    log_once(
        "fallback", logger, logging.WARNING,
        "fullcg: a step of %s ran its attention outside the compiled graph (no fullcg pieces or CUDA graphs): "
        "Dynamo ran the model eagerly, for example past its recompile limit (raise "
        "torch._dynamo.config.recompile_limit, or see why it recompiles with TORCH_LOGS=recompiles). "
        "Counted as graph_mode_counts()['fallback']; if you meant to run the compiled model's modules "
        "eagerly, ignore this.", source,
    )


PREFILL, DECODE = 0, 1
VISITED, SKIPPED = 0, 1

_counters: dict[tuple[int, torch.device], torch.Tensor] = {}
_unmeasured: collections.Counter[int] = collections.Counter()


@dataclasses.dataclass(frozen=True)
class SkipSoftmaxStats:
    """Tiles visited and skipped by one layer since the last reset."""

    prefill_visited: int = 0
    prefill_skipped: int = 0
    decode_visited: int = 0
    decode_skipped: int = 0
    #: Skip-softmax calls that ran on kernels which count no tiles (FlashInfer's): their
    #: tiles are in neither count, so the fraction above covers only the other calls.
    unmeasured_calls: int = 0

    @property
    def visited(self) -> int:
        return self.prefill_visited + self.decode_visited

    @property
    def skipped(self) -> int:
        return self.prefill_skipped + self.decode_skipped

    @property
    def skipped_fraction(self) -> float:
        """Skipped over visited tiles of the calls that were counted (0.0 when none were)."""
        return self.skipped / self.visited if self.visited else 0.0

    @property
    def measured(self) -> bool:
        """Every skip-softmax call of this layer was counted."""
        return self.unmeasured_calls == 0


def counters(layer_id: int, device: torch.device) -> torch.Tensor:
    """The ``int64 [2, 2]`` counter tensor of ``layer_id`` on ``device`` (created on first use).

    Create it before CUDA graph capture (a warm-up step does) so capture allocates nothing.
    """
    key = (layer_id, torch.device(device))
    t = _counters.get(key)
    if t is None:
        # A normal tensor even when first used under inference_mode, so it can be reset later.
        with torch.inference_mode(False):
            t = _counters[key] = torch.zeros(2, 2, dtype=torch.int64, device=device)
    return t


def count_unmeasured(layer_id: int) -> None:
    """Note one skip-softmax call of ``layer_id`` on a kernel that counts no tiles."""
    with _steps_lock:
        _unmeasured[layer_id] += 1


def skip_softmax_stats(tp: TensorParallel | None = None) -> dict[int, SkipSoftmaxStats]:
    """Counters of every layer that ran skip-softmax attention, summed over devices.

    A layer whose calls ran on kernels that count no tiles shows them as
    ``unmeasured_calls`` (``measured`` is False), never as zero skipped tiles. With ``tp``
    (a :class:`fullcg.TensorParallel` of size > 1; every rank of its group must call) the
    counts are also summed over its ranks, each of which attends its own heads."""
    totals = _local_totals()
    if tp is not None and tp.size > 1:
        totals = _summed_over_ranks(totals, tp)
    return {lid: SkipSoftmaxStats(*vals) for lid, vals in sorted(totals.items())}


def _summed_over_ranks(totals: dict[int, list[int]], tp: TensorParallel) -> dict[int, list[int]]:
    import torch.distributed as dist

    layers: list[list[int]] = [[] for _ in range(tp.size)]
    dist.all_gather_object(layers, sorted(totals), group=tp.group)
    union = sorted({lid for ids in layers for lid in ids})
    device = "cuda" if dist.get_backend(tp.group) == "nccl" else "cpu"
    counts = torch.tensor([totals.get(lid, [0] * 5) for lid in union], dtype=torch.int64, device=device).view(-1, 5)
    dist.all_reduce(counts, group=tp.group)
    return {lid: [int(x) for x in row] for lid, row in zip(union, counts.tolist())}


def _local_totals() -> dict[int, list[int]]:
    """This process's counts per layer: [prefill tiles, skipped, decode tiles, skipped, unmeasured calls]."""
    totals: dict[int, list[int]] = {}
    for (layer_id, _), t in _counters.items():
        vals = t.flatten().tolist()
        acc = totals.setdefault(layer_id, [0, 0, 0, 0, 0])
        for i, x in enumerate(vals):
            acc[i] += int(x)
    with _steps_lock:
        for layer_id, calls in _unmeasured.items():
            totals.setdefault(layer_id, [0, 0, 0, 0, 0])[4] = calls
    return totals


@contextlib.contextmanager
def counts_discarded() -> Iterator[None]:
    """Undo what the skip-softmax counters count inside: stand-in batches and warm-up runs
    (capturing runs a step once more than it computes it), so the counters report real steps.

    Restores the tensors in place, so captured graphs keep pointing at them. The counters
    are per process: counts another thread makes meanwhile are undone as well.
    """
    saved = {key: t.clone() for key, t in _counters.items()}
    with _steps_lock:
        saved_unmeasured = collections.Counter(_unmeasured)
    try:
        yield
    finally:
        for key, t in _counters.items():
            if key in saved:
                t.copy_(saved[key])
            else:
                t.zero_()
        with _steps_lock:
            _unmeasured.clear()
            _unmeasured.update(saved_unmeasured)


def reset_skip_softmax_stats() -> None:
    """Zero all counters in place (captured graphs keep pointing at the same tensors)."""
    for t in _counters.values():
        t.zero_()
    with _steps_lock:
        _unmeasured.clear()
