"""Many small host arrays to the device in one asynchronous copy.

A step's host-built tensors (the metadata's page table, slots, starts and lengths; the
engine's input ids and positions) are each a few hundred bytes. Copied one by one from
pageable memory, every copy makes the host wait until the GPU has finished all work queued
before it (CUDA stages pageable copies synchronously), so a loop that prepares step
``n + 1`` while step ``n`` runs would stall at its first copy. :func:`upload` packs them
into one pinned buffer, sends it with one non-blocking copy, and returns typed views of
the device buffer; on the CPU the arrays are used in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["upload", "pack", "unpack"]

#: Segment alignment in the packed buffer: every view starts on a 16-byte boundary, as a
#: separate allocation would (kernels specialise on 16-byte alignment of their pointers).
_ALIGN = 16

_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.float32): torch.float32,
}


def upload(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """``arrays`` (int64, int32, bool or float32, any shape) as tensors on ``device``, in
    order, each with its array's dtype and shape.

    On the CPU they share the arrays' memory (nothing is copied). Elsewhere they are views
    of one device buffer filled by one copy of the packed arrays (:func:`pack`), on CUDA
    asynchronous from pinned memory (the caching host allocator keeps the pinned buffer
    until the copy has read it): the host never waits for the GPU here.
    """
    if device.type == "cpu":
        return [torch.from_numpy(np.ascontiguousarray(a).reshape(a.shape)) for a in arrays]
    host, offsets = pack(arrays, pinned=device.type == "cuda")
    return unpack(host.to(device, non_blocking=True), arrays, offsets)


def pack(arrays: Sequence[np.ndarray], *, pinned: bool = False) -> tuple[torch.Tensor, list[int]]:
    """One ``uint8`` host buffer holding ``arrays`` back to back (each on a 16-byte
    boundary), and where each starts."""
    offsets = []
    total = 0
    for a in arrays:
        if a.dtype not in _DTYPES:
            raise TypeError(f"upload takes int64, int32, bool or float32 arrays, got {a.dtype}")
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=pinned)
    flat = host.numpy()
    for a, start in zip(arrays, offsets):
        flat[start: start + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return host, offsets


def unpack(buffer: torch.Tensor, arrays: Sequence[np.ndarray], offsets: Sequence[int]) -> list[torch.Tensor]:
    """Views of a packed ``buffer`` (:func:`pack`) with each array's dtype and shape."""
    return [buffer[start: start + a.nbytes].view(_DTYPES[a.dtype]).view(a.shape) for a, start in zip(arrays, offsets)]
