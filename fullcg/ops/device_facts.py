"""Facts of a device that kernels plan their launches by, read once per device.

``torch.cuda.get_device_properties`` costs microseconds a call; launch planning consults
these facts on every eager attention call, so each is cached per device. A CPU device (the
Triton interpreter's tests) answers as one SM with no shared memory to opt into.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["sm_count", "shared_memory_per_block"]


def _cuda_index(device: torch.device | int) -> int | None:
    """The CUDA index of ``device``, ``None`` for a device that is not CUDA."""
    if isinstance(device, int):
        return device
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _properties(index: int) -> torch.cuda._CudaDeviceProperties:
    return torch.cuda.get_device_properties(index)


def sm_count(device: torch.device | int) -> int:
    """Streaming multiprocessors of ``device`` (a ``torch.device`` or a CUDA index); 1 off CUDA."""
    index = _cuda_index(device)
    return 1 if index is None else _properties(index).multi_processor_count


def shared_memory_per_block(device: torch.device | int) -> int:
    """Shared memory (bytes) one program may opt into on ``device``; 0 off CUDA or where torch
    does not say."""
    index = _cuda_index(device)
    return 0 if index is None else int(getattr(_properties(index), "shared_memory_per_block_optin", 0))
