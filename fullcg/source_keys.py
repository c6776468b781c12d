"""Torch's and Triton's source hashes, computed off the step's critical path.

Inductor keys every compiled piece by a hash of torch's Python sources (``torch_key``) and
of Triton's sources and its 415 MB compiler library (``triton_key``), and Triton keys every
kernel it compiles by the latter. Each is computed once per process, the first time a
piece is compiled or looked up: half a second on a CPU of this project's CI, more where
the library is read from a cold disk, and all of it inside the first step of a warm start.
Most of that is reading files and hashing them, which release the GIL, so :func:`prefetch`
starts both on a background thread when a model is compiled with Inductor, while the
process goes on with its imports.

On torch >= 2.13 both keys are torch's own prefetchable caches: the first real use waits
for the background result, and a failure there is raised at that use, as it would have
been without the prefetch. A process forked before the result arrived would wait for a
thread it does not have, so a forked child forgets the pending result and computes the
keys itself. On torch 2.11 the caches take no lock: a first use that comes before the
thread is done computes the key a second time, with the same result.

Without Inductor, Triton's key is still the first thing a GPU step's kernels wait for (Triton
computes it to look up every kernel it has not loaded yet), and after it Triton's CUDA
driver object (its first use builds a C module with the host's compiler on a fresh
machine, a few tenths of a second, and loads it), so :func:`prefetch_triton` starts those
two alone, when the first fullcg attention layer is made in a process using CUDA, or else
when the first KV cache is put on a GPU: the model's weights are built or loaded
meanwhile, and the kernel build waits for the thread (:func:`wait_for_triton`) rather than
doing its work a second time beside it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

__all__ = ["prefetch", "prefetch_triton", "wait_for_triton"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_started = False
_triton_started = False
_triton_thread: threading.Thread | None = None
#: Keys whose computation torch's own cache runs in the background (torch >= 2.13).
_prefetched: list[Callable[[], object]] = []


def prefetch() -> None:
    """Start computing torch's and Triton's source keys in the background, once per process."""
    global _started
    with _lock:
        if _started:
            return
        _started = True
    from fullcg.bytecode import warn_if_uncached

    warn_if_uncached()  # before torch's compiler is imported: those imports are what it warns of
    try:
        # Imported here, on the caller's thread: two threads importing one package at once
        # can see each other's half-initialised modules.
        from triton.runtime.cache import triton_key
    except Exception as exc:  # noqa: BLE001 - no (or a broken) Triton: Inductor reports it where it matters
        logger.debug("fullcg: Triton's source key not prefetched (%s: %s)", type(exc).__name__, exc)
        triton_key = None
    from torch._inductor import codecache

    # torch >= 2.13 wraps both keys in caches with a background `prefetch`; torch 2.11 calls
    # Triton's key directly (an lru_cache), so a thread of ours computes what has none.
    pending: list[Callable[[], object]] = []
    for key in (codecache.torch_key, getattr(codecache, "triton_key", None) or triton_key):
        if key is None:
            continue
        if hasattr(key, "prefetch") and hasattr(key, "clear"):
            key.prefetch()
            _prefetched.append(key)
        else:
            pending.append(key)
    if pending:
        threading.Thread(target=_compute, args=pending, name="fullcg-source-keys", daemon=True).start()


def prefetch_triton() -> None:
    """Start computing Triton's source key and making its CUDA driver in the background,
    once per process, where CUDA is in use (no GPU, no Triton kernel is compiled or loaded
    by key). Called when a fullcg attention layer is made and when a KV cache lands on a GPU."""
    global _triton_started, _triton_thread
    if _triton_started or _started or not _cuda_in_use():  # not in use yet: a later call may start it
        return
    with _lock:
        if _triton_started:
            return
        _triton_started = True
    try:
        # Imported on this thread, as in prefetch(); the hashing and the driver's module
        # are what run in the background.
        from triton.runtime.cache import triton_key
        from triton.runtime.driver import driver
    except Exception as exc:  # noqa: BLE001 - no (or a broken) Triton: its first kernel reports it
        logger.debug("fullcg: Triton's source key not prefetched (%s: %s)", type(exc).__name__, exc)
        return

    def active_driver() -> object:
        return driver.active

    _triton_thread = threading.Thread(target=_compute, args=(triton_key, active_driver), name="fullcg-triton-key",
                                      daemon=True)
    _triton_thread.start()


def wait_for_triton() -> None:
    """Wait for :func:`prefetch_triton`'s thread, if one is running: a first kernel lookup
    that came sooner would hash Triton's sources, or make its driver, a second time beside it."""
    thread = _triton_thread
    if thread is not None and thread is not threading.current_thread():
        thread.join()


def _cuda_in_use() -> bool:
    """CUDA is initialised in this process already. (Asking whether it is available would
    initialise it, which a process that builds a model and then forks workers must not do.)"""
    import torch

    return torch.cuda.is_initialized()


def _compute(*keys: Callable[[], object]) -> None:
    for key in keys:
        try:
            key()  # cached by its module: the first real use finds it done
        except Exception as exc:  # noqa: BLE001 - computed again, and reported, where it is needed
            logger.debug("fullcg: prefetching %s failed (%s: %s)", getattr(key, "__name__", key), type(exc).__name__, exc)


def _forget_in_child() -> None:
    """After a fork: drop results the parent's background threads would have delivered."""
    for key in _prefetched:
        key.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
