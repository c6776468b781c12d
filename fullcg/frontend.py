"""What both front ends share: the compile backend (:mod:`fullcg.backend`) and capture
without a compiler (:mod:`fullcg.eager_capture`) both build a :class:`fullcg.runner.StepRunner`
from a model's inputs, and tell the user the same things the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fullcg.config import FullCGConfig
from fullcg.diagnostics import log_once

__all__ = ["device_of", "note_device", "progress_bar"]

logger = logging.getLogger("fullcg")


def device_of(values: Sequence[Any]) -> torch.device:
    """The device a step runs on: its first tensor input's that is not a parameter (a
    compiled graph's inputs lead with weights, which may sit elsewhere when offloaded),
    else its first tensor's, else the CPU."""
    for t in values:
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            return t.device
    for t in values:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def note_device(device: torch.device, config: FullCGConfig, how: str) -> None:
    """Log once per process that steps on ``device`` capture no CUDA graphs (``how`` says
    what runs instead)."""
    if device.type != "cuda":
        log_once(("no CUDA graphs", device.type), logger, logging.INFO,
                 "fullcg: running on %s: %s and no CUDA graphs are captured (graph_mode=%s)", device.type, how,
                 config.graph_mode)


def progress_bar(total: int, label: str, unit: str) -> Callable[..., None]:
    """``update(k, done=False, **postfix)``: a progress bar over ``total`` units (tqdm when
    installed, else a log line every 10% and at the end)."""
    try:
        from tqdm import tqdm
    except ImportError:
        count = [0]

        def log_update(k: int, done: bool = False, **postfix: object) -> None:
            before, count[0] = count[0], count[0] + k
            if done or count[0] == total or (k and count[0] // max(1, total // 10) != before // max(1, total // 10)):
                extra = "".join(f", {name} {value}" for name, value in postfix.items())
                logger.info("%s: %d/%d %s%s", label, count[0], total, unit, extra)

        return log_update
    bar = tqdm(total=total, desc=label, unit=unit)

    def update(k: int, done: bool = False, **postfix: object) -> None:
        if k:
            bar.update(k)
        if postfix:
            bar.set_postfix(postfix, refresh=False)
        if done:
            bar.close()

    return update
