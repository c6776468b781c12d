"""Skip-softmax counters: tiles visited and skipped, per layer and per kind of request.

A tile is one (KV head, block of query rows, block of keys) unit of work. Counters live
on the device of the attention that updates them, as ``int64 [2, 2]`` tensors indexed
``[kind, what]`` with kind 0 = prefill/extend, 1 = decode and what 0 = visited,
1 = skipped. Kernels add to them without a host sync; reading them syncs.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["SkipSoftmaxStats", "skip_softmax_stats", "reset_skip_softmax_stats", "counters"]

PREFILL, DECODE = 0, 1
VISITED, SKIPPED = 0, 1

_counters: dict[tuple[int, torch.device], torch.Tensor] = {}


@dataclasses.dataclass(frozen=True)
class SkipSoftmaxStats:
    """Tiles visited and skipped by one layer since the last reset."""

    prefill_visited: int = 0
    prefill_skipped: int = 0
    decode_visited: int = 0
    decode_skipped: int = 0

    @property
    def visited(self) -> int:
        return self.prefill_visited + self.decode_visited

    @property
    def skipped(self) -> int:
        return self.prefill_skipped + self.decode_skipped

    @property
    def skipped_fraction(self) -> float:
        return self.skipped / self.visited if self.visited else 0.0


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


def skip_softmax_stats() -> dict[int, SkipSoftmaxStats]:
    """Counters of every layer that ran skip-softmax attention, summed over devices."""
    totals: dict[int, list[int]] = {}
    for (layer_id, _), t in _counters.items():
        vals = t.flatten().tolist()
        acc = totals.setdefault(layer_id, [0, 0, 0, 0])
        for i, x in enumerate(vals):
            acc[i] += int(x)
    return {lid: SkipSoftmaxStats(*vals) for lid, vals in sorted(totals.items())}


def reset_skip_softmax_stats() -> None:
    """Zero all counters in place (captured graphs keep pointing at the same tensors)."""
    for t in _counters.values():
        t.zero_()
