"""Torch's and Triton's source hashes, computed off the step's critical path.

Inductor keys every compiled piece by a hash of torch's Python sources (``torch_key``) and
of Triton's sources and its 400 MB compiler library (``triton_key``), and Triton keys every
kernel it compiles by the latter. Each is computed once per process, the first time a
piece is compiled or looked up: half a second on a CPU of this project's CI, more where
the library is read from a cold disk, and all of it inside the first step of a warm start.
Both are pure reads and hashing, which release the GIL, so :func:`prefetch` starts them on
a background thread when a model is compiled with Inductor, while the process goes on with
its imports; the first real use waits for the result or finds it done. A failure leaves
the key to be computed where it is first needed, as without the prefetch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["prefetch"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_started = False


def prefetch() -> None:
    """Start computing torch's and Triton's source keys in the background, once per process."""
    global _started
    with _lock:
        if _started:
            return
        _started = True
    try:
        # Imported here, on the caller's thread: two threads importing one package at once
        # can see each other's half-initialised modules.
        from triton.runtime.cache import triton_key
    except ImportError:  # no Triton: Inductor's CPU keys do not need it
        triton_key = None
    from torch._inductor import codecache

    # torch >= 2.13 wraps both keys in caches that compute in the background and make the
    # first use wait (``prefetch``); torch 2.11 calls Triton's key directly, so ours runs it.
    pending = []
    for key in (codecache.torch_key, getattr(codecache, "triton_key", None) or triton_key):
        if key is None:
            continue
        if hasattr(key, "prefetch"):
            key.prefetch()
        else:
            pending.append(key)
    if pending:
        threading.Thread(target=_compute, args=pending, name="fullcg-source-keys", daemon=True).start()


def _compute(*keys: Callable[[], object]) -> None:
    for key in keys:
        try:
            key()  # cached by its module: the first real use finds it done
        except Exception as exc:  # noqa: BLE001 - computed again, and reported, where it is needed
            logger.debug("fullcg: prefetching %s failed (%s: %s)", getattr(key, "__name__", key), type(exc).__name__, exc)
