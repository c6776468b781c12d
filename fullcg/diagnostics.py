"""Diagnostics fullcg gives once per process: a warning or a log line per key.

A long-running server steps a model millions of times; a condition worth telling the user
about (autograd left on, running on the CPU, a compiled model's step falling back) is
told the first time and then stays quiet. The keys already told are process-wide on
purpose: the same condition in a second model is the same advice.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Hashable

__all__ = ["log_once", "warn_once", "forget_told"]

_told: set[Hashable] = set()
_lock = threading.Lock()


def _first_time(key: Hashable) -> bool:
    with _lock:
        if key in _told:
            return False
        _told.add(key)
        return True


def warn_once(key: Hashable, message: str, *, category: type[Warning] = UserWarning, stacklevel: int = 2) -> None:
    """``warnings.warn(message)`` the first time ``key`` is given in this process."""
    if key not in _told and _first_time(key):
        warnings.warn(message, category, stacklevel=stacklevel + 1)


def log_once(key: Hashable, log: logging.Logger, level: int, message: str, *args: object) -> None:
    """``log.log(level, message, *args)`` the first time ``key`` is given in this process."""
    if key not in _told and _first_time(key):
        log.log(level, message, *args)


def forget_told(key: Hashable | None = None) -> None:
    """Tell ``key`` (every key, with None) again next time: for tests of a diagnostic."""
    with _lock:
        if key is None:
            _told.clear()
        else:
            _told.discard(key)
