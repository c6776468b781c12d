"""The paged KV cache of one attention layer."""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING

import torch

from fullcg import source_keys
from fullcg.errors import KVCacheError

if TYPE_CHECKING:
    from fullcg.telemetry import StepCounts

__all__ = ["KVCache"]

_uids = itertools.count(1)


@dataclasses.dataclass(eq=False)
class KVCache:
    """K and V pages of one layer, each ``[num_pages, page_size, num_kv_heads, head_dim]``.

    :meth:`allocate` makes them one allocation, V after K, where their head dims agree:
    FlashInfer's FMHAv2 prefill addresses V from K's pointer and runs only on such a cache
    (:attr:`v_offset_pages`). Every other kernel takes a cache of any two tensors.

    The tensors are allocated once and never move, so CUDA graphs that read or write them
    stay valid for the cache's lifetime. ``uid`` is unique per cache in the process: an
    attention call names the cache its layer owns by it, so a step can never write into
    another model's cache.
    """

    k: torch.Tensor
    v: torch.Tensor
    uid: int = dataclasses.field(init=False, repr=False)
    #: The step counters of the compiled model whose runner stepped over this cache, if
    #: any: a step over it outside that runner (Dynamo running the model eagerly) is
    #: counted there as a fallback. Set by the runner, read by the attention ops.
    compiled_counts: StepCounts | None = dataclasses.field(init=False, repr=False, default=None)
    #: Made under ``torch.inference_mode``: it can only be written inside it.
    is_inference: bool = dataclasses.field(init=False, repr=False)
    #: What the attention ops last checked this cache against (heads, dims, dtype, device,
    #: page size): a call shaped like that needs no new check. Cleared when k or v is replaced.
    fit: tuple[object, ...] | None = dataclasses.field(init=False, repr=False, default=None)
    _v_offset: int | None | bool = dataclasses.field(init=False, repr=False, default=False)  # False: not known yet
    _v_in_k: bool | None = dataclasses.field(init=False, repr=False, default=None)  # None: not known yet

    def __setattr__(self, name: str, value: object) -> None:
        if name in ("k", "v"):
            if name == "k" and isinstance(value, torch.Tensor) and value.is_cuda:
                # Triton's first kernel lookup on this GPU waits for these: start them now.
                source_keys.prefetch_triton()
            object.__setattr__(self, "fit", None)
            object.__setattr__(self, "_v_offset", False)
            object.__setattr__(self, "_v_in_k", None)
        object.__setattr__(self, name, value)

    @property
    def v_in_k(self) -> bool:
        """V is the leading ``v_head_dim`` values of every key (a view of a contiguous ``k``):
        the latent cache of multi-head latent attention (:mod:`fullcg.mla`), where the value
        is the latent the key begins with. Only implementations with ``takes_v_in_k`` attend
        over such a cache (the others' kernels address v as a contiguous tensor)."""
        if self._v_in_k is None:
            k, v = self.k, self.v
            found = (k.is_contiguous() and v.data_ptr() == k.data_ptr() and v.stride() == k.stride()
                     and v.shape[:3] == k.shape[:3] and v.shape[3] < k.shape[3]
                     and v.untyped_storage().data_ptr() == k.untyped_storage().data_ptr())
            object.__setattr__(self, "_v_in_k", found)
        return self._v_in_k

    @property
    def v_offset_pages(self) -> int | None:
        """How many pages after K's first page V's first page lies when k and v are one
        allocation, V after K, a whole number of pages apart (as :meth:`allocate` makes
        them; kernels that address V from K's pointer need it); else None."""
        if self._v_offset is False:
            k, v = self.k, self.v
            offset = None
            if k.shape == v.shape and k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr():
                page_bytes = k[0].numel() * k.element_size()
                delta = v.data_ptr() - k.data_ptr()
                if delta > 0 and delta % page_bytes == 0:
                    offset = delta // page_bytes
            object.__setattr__(self, "_v_offset", offset)
        return self._v_offset

    def __post_init__(self) -> None:
        self.uid = next(_uids)
        if not isinstance(self.k, torch.Tensor) or not isinstance(self.v, torch.Tensor):
            raise KVCacheError(f"KV cache k and v must be tensors, got {type(self.k).__name__} and {type(self.v).__name__}")
        if self.k.dim() != 4 or self.v.dim() != 4:
            raise KVCacheError(
                "KV cache tensors must be [num_pages, page_size, num_kv_heads, head_dim], got "
                f"k {tuple(self.k.shape)} and v {tuple(self.v.shape)}"
            )
        if self.k.shape[:3] != self.v.shape[:3]:
            raise KVCacheError(f"k and v caches disagree on pages/heads: {tuple(self.k.shape)} vs {tuple(self.v.shape)}")
        if self.k.dtype != self.v.dtype or self.k.device != self.v.device:
            raise KVCacheError("k and v caches must share dtype and device")
        # Slots are addressed as a flat view [pages * page_size, heads, dim], and kernels
        # compute addresses from the layout: only a contiguous tensor has it (or, in a latent
        # cache, a v that is the leading values of a contiguous k: see v_in_k).
        for name, t in (("k", self.k), ("v", self.v)):
            if not t.is_contiguous() and not (name == "v" and self.v_in_k):
                raise KVCacheError(
                    f"KV cache {name} must be contiguous [num_pages, page_size, num_kv_heads, head_dim], got strides "
                    f"{t.stride()} for shape {tuple(t.shape)}: pass {name}.contiguous() or use KVCache.allocate"
                )
        self.is_inference = self.k.is_inference() or self.v.is_inference()

    def __deepcopy__(self, memo: dict) -> KVCache:
        # A copy is another cache: new tensors and a new uid (a copied model must not pass
        # for the original).
        import copy

        if self.v_offset_pages is not None:
            both = torch.stack((self.k, self.v))  # one allocation again, as allocate() makes it
            memo[id(self.k)], memo[id(self.v)] = both[0], both[1]
            return KVCache(both[0], both[1])
        return KVCache(copy.deepcopy(self.k, memo), copy.deepcopy(self.v, memo))

    @classmethod
    def allocate(
        cls,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        v_head_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        for name, value in (("num_pages", num_pages), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise KVCacheError(f"{name} must be a positive integer, got {value!r}")
        v_dim = head_dim if v_head_dim is None else v_head_dim
        if v_dim == head_dim:
            # One allocation, V right after K: kernels that address V pages from K's pointer
            # (FlashInfer's FMHAv2) can read it; to everything else k and v are two tensors.
            both = torch.zeros(2, num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
            return cls(both[0], both[1])
        return cls(
            torch.zeros(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device),
            torch.zeros(num_pages, page_size, num_kv_heads, v_dim, dtype=dtype, device=device),
        )

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @property
    def v_head_dim(self) -> int:
        return self.v.shape[3]
