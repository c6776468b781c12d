"""Writes new tokens' k/v into the paged cache, skipping padding slots (< 0), on the device.

CUDA-graph safe: one program per row of ``slot_mapping``, no host sync, and a padding row
writes nothing (a plain ``index_copy_`` would need a real slot to send it to).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from fullcg.ops.kernels.launch import Launcher, PlannedLaunch

if TYPE_CHECKING:
    from fullcg.context import ForwardContext
    from fullcg.kv_cache import KVCache
    from fullcg.ops.call import AttentionCall

__all__ = ["save_kv_to_cache", "save_new_kv", "plan_save", "SaveLaunch"]


@triton.jit
def _save_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_k, stride_v,
    ROW_K: tl.constexpr, ROW_V: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        ok = tl.arange(0, BLOCK_K)
        x = tl.load(k_ptr + t * stride_k + ok, mask=ok < ROW_K)
        tl.store(k_cache_ptr + slot * ROW_K + ok, x, mask=ok < ROW_K)
        ov = tl.arange(0, BLOCK_V)
        y = tl.load(v_ptr + t * stride_v + ov, mask=ov < ROW_V)
        tl.store(v_cache_ptr + slot * ROW_V + ov, y, mask=ov < ROW_V)


_SAVE = Launcher(_save_kv_kernel)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x [T, H, D]`` with each token's ``H * D`` values contiguous (a view when they already are)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def save_kv_to_cache(
    k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> None:
    """``k_cache.view(-1, H, D)[slot] = k[t]`` for every ``t`` with ``slot_mapping[t] >= 0``."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k, v = _rows(k), _rows(v)
    row_k, row_v = k.shape[1] * k.shape[2], v.shape[1] * v.shape[2]
    _SAVE(
        (n, 1, 1),
        (k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0)),
        (row_k, row_v, _next_pow2(row_k), _next_pow2(row_v)),
        4, 3,
    )


class SaveLaunch:
    """The save kernel's launch for one step and one k/v shape (see :func:`plan_save`):
    calling it writes one layer's new ``k``/``v`` into that layer's cache tensors."""

    def __init__(self, launch: PlannedLaunch | None, slot_mapping: torch.Tensor) -> None:
        self.launch, self.slot_mapping = launch, slot_mapping

    def __call__(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        if self.launch is None:  # k/v rows are not contiguous, or no rows: the general path
            n = self.slot_mapping.shape[0]
            save_kv_to_cache(k[:n], v[:n], self.slot_mapping, k_cache, v_cache)
        else:
            self.launch(k, v, k_cache, v_cache)


def plan_save(
    k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> SaveLaunch:
    """Plan :func:`save_kv_to_cache` for calls with k/v shaped like these (rows past
    ``slot_mapping``'s are never read) into caches shaped like these."""
    n = slot_mapping.shape[0]
    if n == 0 or _rows(k) is not k or _rows(v) is not v or k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        return SaveLaunch(None, slot_mapping)
    row_k, row_v = k.shape[1] * k.shape[2], v.shape[1] * v.shape[2]
    tail = (slot_mapping, k.stride(0), v.stride(0))
    constexprs = (row_k, row_v, _next_pow2(row_k), _next_pow2(row_v))
    return SaveLaunch(_SAVE.plan((n, 1, 1), (k, v, k_cache, v_cache), tail, constexprs, 4, 3), slot_mapping)


def _next_pow2(n: int) -> int:
    # triton.next_power_of_2 is a JIT-able function: microseconds per call from Python.
    return 1 << (n - 1).bit_length()


def save_new_kv(call: "AttentionCall", ctx: "ForwardContext", cache: "KVCache") -> None:
    """An implementation's ``save_kv``: the step's new k/v to ``metadata.slot_mapping``, on the device."""
    slots = ctx.metadata.slot_mapping
    n = slots.shape[0]
    k, v = call.k, call.v
    save_kv_to_cache(k if k.shape[0] == n else k[:n], v if v.shape[0] == n else v[:n], slots, cache.k, cache.v)
