"""FlashInfer's MLA kernel over fullcg's latent cache, for the ``flashinfer`` implementation.

A latent cache (:func:`fullcg.mla.allocate_latent_cache`, :attr:`fullcg.KVCache.v_in_k`)
holds one ``[pages, page_size, 1, rank + rope]`` tensor whose first ``rank`` values are the
latent ``c`` (key and value) and the rest the rope key. ``flashinfer.BatchMLAPagedAttentionWrapper``
takes exactly this attention, split in two: ``q_nope``/``q_pe`` and a ``ckv``/``kpe`` cache
``[pages, page_size, rank]``/``[pages, page_size, rope]``. It is handed views, never copies:
``q[..., :rank]``, ``q[..., rank:]``, ``cache.k[:, :, 0, :rank]`` and ``cache.k[:, :, 0, rank:]``.
Its FA2 and FA3 kernels read every one of those through its strides (``batch_mla_run.cu``
and ``batch_mla_sm90_run.cu`` pass the row and page strides of q_nope, q_pe, ckv, kpe and
the output; ``mla.cuh``/``mla_hopper.cuh`` address pages as ``int64 page * stride_page``);
only the last dim must be dense, which a view of a contiguous tensor is. Rows are addressed
with 32-bit offsets (``q_indptr * q_nope_stride_n`` in ``mla.cuh``), so a step's
``q`` must hold fewer than 2**32 values: larger steps are refused.

Every call is causal over each request's prefix and new tokens (the kernel aligns the mask
to the end of each request's keys, as fullcg does), for decode, extend and mixed batches
alike: one wrapper and one plan serve them all. The LSE comes back in base 2, as from the
other wrappers, and is converted where they are.

Refused, with errors naming ``attention_impl='triton'`` or ``'reference'`` (for skip-softmax,
``'reference'``: Triton's MLA kernel is dense too), and ``serves`` False, so
``attention_impl='auto'`` passes over the call: dtypes other than float16 and
bfloat16 (or a cache in another dtype than q), latent dims other than DeepSeek's
``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64 (the ones FlashInfer builds and tests), a
sliding window or logit soft-cap (the kernel has neither), a skip-softmax factor the batch
would use (the kernel has none), GPUs below SM80 (its kernels need ``cp.async`` and 92,672
bytes of shared memory per SM, ``DISPATCH_SMEM_CONFIG`` in ``mla.cuh``), steps whose query
rows overflow the kernel's 32-bit offsets, and batches whose schedule would exceed the plan's
16384 work items (``max_total_num_works`` in ``scheduler.cuh``; FlashInfer does not check it
and would overwrite its own schedule).

CUDA graphs. The wrapper is made with ``use_cuda_graph=True`` and fixed index buffers; its
plan writes the whole schedule into the int workspace at offsets that never change, and its
launch grid is ``(cluster_size, num_sms / cluster_size)``, where the cluster size is 2 when a
plan's average packed query rows per request (``rows * heads / requests``) exceed 64. A
CUDA-graph plan of a padded size always has as many requests as rows (one stand-in request
per padding row, or one owning them all and empty ones after it), so that average is the
head count and the grid is that of the capture for every batch replayed at that size.
:func:`plan` checks this on every plan of a fixed wrapper and raises rather than replay a
graph whose launch no longer matches its schedule.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from fullcg.ops import device_facts
from fullcg.ops.kernels.save_kv import save_kv_to_cache

if TYPE_CHECKING:
    from fullcg.context import ForwardContext
    from fullcg.kv_cache import KVCache
    from fullcg.ops.call import AttentionCall

__all__ = [
    "RANK", "ROPE", "DIMS", "MAX_WORK_ITEMS", "is_latent_call", "backend_for", "capability", "num_sms",
    "schedule_bound", "padded_schedule_bound", "kv_lens", "refusal", "plan", "run", "save_latent",
]

#: ``kv_lora_rank``: the latent's values (the value head dim), DeepSeek-V2/V3's.
RANK = 512
#: ``qk_rope_head_dim``: the rope key's values after the latent.
ROPE = 64
#: ``(head_dim, v_head_dim)`` of an MLA call over the latent cache.
DIMS = (RANK + ROPE, RANK)
#: Work items a plan holds (``max_total_num_works`` in FlashInfer's ``scheduler.cuh``).
MAX_WORK_ITEMS = 16384
#: Packed query rows (``token * heads + head``) per CTA tile of the MLA kernels.
_CTA_TILE_Q = 64
_ALTERNATIVE = "use attention_impl='triton' or 'reference'"


def is_latent_call(cache: KVCache | None) -> bool:
    """Whether a call attending over ``cache`` runs on the MLA kernel: the cache is latent."""
    return cache is not None and cache.v_in_k


def backend_for(capability: tuple[int, int]) -> str:
    """FlashInfer's choice of MLA kernel for a GPU: its FA3 one on Hopper (built with
    CUDA >= 12.3), FA2 elsewhere (``determine_mla_backend`` in ``flashinfer/utils.py``)."""
    cuda = tuple(int(x) for x in (torch.version.cuda or "0.0").split(".")[:2])
    return "fa3" if capability[0] == 9 and cuda >= (12, 3) else "fa2"


@functools.lru_cache(maxsize=None)
def capability(device_index: int) -> tuple[int, int]:
    """A CUDA device's compute capability (asked once: refusals consult it on every call)."""
    return torch.cuda.get_device_capability(device_index)


def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached by :mod:`fullcg.ops.device_facts`):
    the MLA plan schedules one cluster per SM (or per pair)."""
    return device_facts.sm_count(device_index)


def schedule_bound(q_lens: Sequence[int], num_heads: int, sms: int) -> int:
    """An upper bound on the work items FlashInfer's MLA plan makes for requests of
    ``q_lens`` query rows (``MLAPlan`` in ``scheduler.cuh``): one per query tile of each
    request, plus at most one per cluster where long requests are split over clusters
    (its plan bounds each cluster's keys by ``total / clusters``)."""
    requests = len(q_lens)
    if requests == 0:
        return 0
    cluster = 2 if sum(q_lens) * num_heads // requests > 64 else 1
    tile = cluster * _CTA_TILE_Q
    return sum(-(-q * num_heads // tile) for q in q_lens) + sms // cluster


def padded_schedule_bound(size: int, num_heads: int, sms: int) -> int:
    """:func:`schedule_bound` of ``size`` one-row requests: the most any CUDA-graph plan of
    that padded size (as many requests as rows) can make, one-row requests having the most
    tiles (a tile count is subadditive in the rows)."""
    cluster = 2 if num_heads > 64 else 1
    return size * -(-num_heads // (cluster * _CTA_TILE_Q)) + sms // cluster


def kv_lens(kv_indptr: torch.Tensor, last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """Keys per request (what the MLA plan takes) from the paged layout's page counts and
    last-page lengths (what the other wrappers take): ``(pages - 1) * page_size + last``."""
    pages = kv_indptr[1:] - kv_indptr[:-1]
    return ((pages - 1) * page_size + last_page_len).to(torch.int32)


def refusal(
    call: AttentionCall, cache: KVCache, where: str, *, device_capability: tuple[int, int], uses_factor: bool,
    work_items: int,
) -> Exception | None:
    """The error refusing an MLA call over a latent ``cache`` that the kernel would not
    compute as asked, or None. ``device_capability``: the GPU's; ``uses_factor``: the batch
    uses a skip-softmax factor; ``work_items``: the schedule bound of the plan the call runs on
    (for a CUDA-graph plan, :func:`padded_schedule_bound` of its size, so that the verdict is
    the same at the capture and at every replay)."""
    q = call.q
    if q.dtype not in (torch.float16, torch.bfloat16):
        return TypeError(f"{where}: FlashInfer's MLA kernel computes in float16 or bfloat16, got {q.dtype}; cast "
                         "the model or use attention_impl='reference'")
    if cache.k.dtype != q.dtype:
        return TypeError(f"{where}: the latent cache holds {cache.k.dtype} but q is {q.dtype}; allocate the cache "
                         "in q's dtype")
    rank, rope = cache.v_head_dim, cache.head_dim - cache.v_head_dim
    if (rank, rope) != (RANK, ROPE) or cache.num_kv_heads != 1:
        return ValueError(
            f"{where}: FlashInfer's MLA kernel is built for DeepSeek's latent cache (kv_lora_rank {RANK}, "
            f"qk_rope_head_dim {ROPE}, one KV head), got kv_lora_rank {rank}, qk_rope_head_dim {rope} and "
            f"{cache.num_kv_heads} KV heads; {_ALTERNATIVE}"
        )
    if call.sliding_window is not None or call.logit_softcap is not None:
        return ValueError(f"{where}: FlashInfer's MLA kernel has no sliding window or logit soft-capping; "
                          f"{_ALTERNATIVE}")
    if uses_factor:
        return ValueError(
            f"{where}: FlashInfer's MLA kernel has no skip-softmax, and the factor would be silently ignored; use "
            "attention_impl='reference' (which honours it over a latent cache), or run the MLA layers dense (their "
            "factors None, e.g. through SkipSoftmaxConfig.per_layer)"
        )
    if device_capability < (8, 0):
        return RuntimeError(f"{where}: FlashInfer's MLA kernels need an SM80 or newer GPU, this is "
                            f"SM{device_capability[0]}{device_capability[1]}; {_ALTERNATIVE}")
    if q.shape[0] * q.shape[1] * q.shape[2] >= 2**32:
        return ValueError(f"{where}: {q.shape[0]} query rows of {q.shape[1]} x {q.shape[2]} values overflow the "
                          f"32-bit row offsets of FlashInfer's MLA kernel; run fewer tokens per step, or "
                          f"{_ALTERNATIVE}")
    if work_items > MAX_WORK_ITEMS:
        return ValueError(
            f"{where}: this step's schedule may need {work_items} work items, more than the {MAX_WORK_ITEMS} a "
            f"FlashInfer MLA plan holds; run fewer tokens per step (smaller prefill chunks or capture sizes), or "
            f"{_ALTERNATIVE}"
        )
    return None


def plan(
    wrapper: object, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
    lens: torch.Tensor, *, num_heads: int, page_size: int, scale: float, dtype: torch.dtype,
    launch: tuple[int, ...] | None,
) -> tuple[int, ...] | None:
    """Plan ``wrapper`` (causal, rank 512 + rope 64) for a batch; returns its launch (the
    plan info the run bakes into a kernel launch: grid and workspace offsets).

    ``launch``: the launch of this fixed (CUDA-graph) wrapper's first plan, or None for its
    first plan or an exact wrapper; a later plan must match it, since graphs captured with
    the first replay its launch."""
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, lens, num_heads=num_heads, head_dim_ckv=RANK, head_dim_kpe=ROPE,
                 page_size=page_size, causal=True, sm_scale=scale, q_data_type=dtype, kv_data_type=dtype)
    info = getattr(wrapper, "_plan_info", None)
    if info is None:
        return None
    now = tuple(int(x) for x in info)
    if launch is not None and now != launch:
        raise RuntimeError(
            f"flashinfer: the MLA plan of a CUDA-graph wrapper changed its launch ({launch} -> {now}), so graphs "
            "captured with it would run the new schedule on the old grid; run MLA steps uncaptured "
            "(graph_mode='piecewise'), or attention_impl='reference'"
        )
    return now


def run(wrapper: object, q: torch.Tensor, cache: KVCache, out: torch.Tensor, lse: torch.Tensor | None) -> None:
    """Attend ``q [T, H, rank + rope]`` (contiguous) over the latent ``cache`` as planned,
    into ``out [T, H, rank]`` and ``lse`` (base 2, float32 ``[T, H]``) when given. Only the
    planned rows are written."""
    latent = cache.k[:, :, 0]  # [pages, page_size, rank + rope]: views from here on
    rank = cache.v_head_dim
    wrapper.run(q[..., :rank], q[..., rank:], latent[..., :rank], latent[..., rank:], out=out, lse=lse,
                return_lse=lse is not None)


def save_latent(call: AttentionCall, ctx: ForwardContext, cache: KVCache) -> None:
    """Write the batch's new ``k``/``v`` into a latent cache on the device, skipping padding
    slots: each slot gets ``[v ; k[rank:]]``, what saving k and then v into v's view of k
    leaves there (the reference's order). The Triton save kernel writes whole contiguous rows,
    so the row is written as k and, identically, as v; it is assembled only when ``v`` is not
    already the leading values of ``k``."""
    slots = ctx.metadata.slot_mapping
    n = slots.shape[0]
    k, v = call.k[:n], call.v[:n]
    rank = cache.v_head_dim
    leads = v.data_ptr() == k.data_ptr() and v.stride() == k.stride() and v.shape[:2] == k.shape[:2]
    rows = k if leads else torch.cat([v, k[..., rank:]], dim=-1)
    save_kv_to_cache(rows, rows, slots, cache.k, cache.k)
