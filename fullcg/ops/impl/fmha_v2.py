"""FlashInfer's FMHAv2 prefill (TensorRT-LLM's warp-specialised Hopper kernels) for the
``flashinfer`` implementation.

It serves, on SM90 (Hopper) in bfloat16, attention that is never captured (eager steps,
and the attention between the pieces of piecewise steps; a full graph at a capture size is
captured after a warm-up run, which therefore stays on FA2 as the capture does):

- attention over the KV cache of a batch of prefill and extend requests only (a decode
  row would take a whole tile per query head, where FA2 packs a KV head's query heads),
  without LSE (``Q_PAGED_KV_NHD``; FMHAv2 saves softmax statistics only for contiguous
  k/v). The kernel addresses V pages from K's base pointer, so the cache's ``k`` and ``v``
  must be one allocation with V a whole number of pages after K, as
  :meth:`fullcg.KVCache.allocate` makes them; the page size must be a power of two that
  divides, or is a multiple of, the kernel's KV tile;
- attention over given k/v packed like q (``CONTIGUOUS_Q_KV``), with its LSE;
- the same for attention over the cache by a batch in which no request has a cached
  prefix and the call saves its k/v there (so the keys in the cache are exactly the given
  k/v), when the call asks for LSE or a skip-softmax factor: FMHAv2 skips faster over rows
  than over pages, and saves softmax statistics only for rows.

Everything else (batches with decode requests, LSE over a cached prefix, prefix chunks, fp16,
full graphs at capture sizes, sliding windows and logit soft-capping) stays on the
FlashAttention-2 wrappers. FMHAv2 takes ``window_left`` (with ``mask_mode="sliding_window"``)
and ``logits_soft_cap_scale``, but neither is checked here against fullcg's semantics, nor
are its softmax statistics under a soft-cap (what :func:`stats_to_lse` would read), so
those calls are not sent to it. Capture is left out
because FMHAv2 bakes the batch size, the longest query and q's row count into its launch.

Skip-softmax follows fullcg's rule, ``threshold = factor / kv_len`` per request, with two
differences of granularity: a tile is 64 query rows of one head by one KV tile, decided by
a warp-group vote, and the first KV tile of a request is never skipped. FMHAv2 also keeps
skipping where ``factor >= kv_len`` (fullcg turns skipping off there): harmless for a
request that fits one KV tile (never skipped), so a batch with a request longer than one
tile yet at most ``factor`` keys is refused (``auto`` runs it on Triton). FMHAv2 reports no
skipped-tile counts.

The softmax statistics come back as ``float32 [T, Hq, 2]``: the row maximum of the raw
(unscaled) ``q . k`` divided by ``sqrt(head_dim)``, and the sum of ``exp(scale * (s - max))``;
:func:`stats_to_lse` turns them into fullcg's natural-log LSE ``[T, Hq]``.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from fullcg.kv_cache import KVCache

__all__ = [
    "HEAD_DIMS", "available", "kv_tile", "page_size_fits", "v_offset_pages", "paged_tables", "stats_to_lse",
    "factor_refusal", "attend_paged", "attend_contiguous",
]

logger = logging.getLogger(__name__)

#: Head dims fullcg runs through FMHAv2 (q and v alike; FMHAv2 takes more on SM90).
HEAD_DIMS = (64, 128, 256)
#: The workspace FMHAv2 needs: a tile counter it zeroes before each launch.
WORKSPACE_BYTES = 4096
_INT = torch.int32


@functools.lru_cache(maxsize=None)
def available(device_index: int) -> bool:
    """FMHAv2's warp-specialised kernels exist for this GPU (SM90) in the installed FlashInfer."""
    if torch.cuda.get_device_capability(device_index) != (9, 0):
        return False
    try:
        from flashinfer.prefill import trtllm_fmha_v2_prefill  # noqa: F401
    except ImportError:
        return False
    return True


def kv_tile(head_dim: int) -> int:
    """Keys per KV tile of FMHAv2's SM90 kernels for ``head_dim``."""
    return 256 if head_dim <= 64 else 128 if head_dim <= 128 else 64


def page_size_fits(page_size: int, head_dim: int) -> bool:
    """FMHAv2 finds pages by shifting (a power of two) and loads whole tiles of pages."""
    tile = kv_tile(head_dim)
    return page_size & (page_size - 1) == 0 and (tile % page_size == 0 or page_size % tile == 0)


def v_offset_pages(cache: KVCache) -> int | None:
    """The cache's :attr:`~fullcg.KVCache.v_offset_pages` when FMHAv2 can address V from
    K's pointer with it (its page ids are int32), else None."""
    pages = cache.v_offset_pages
    if pages is None or pages + cache.num_pages > torch.iinfo(torch.int32).max:
        return None
    return pages


def paged_tables(page_table: torch.Tensor, v_offset: int) -> torch.Tensor:
    """``int32 [R, 2, M]`` page ids per request: K's pages, then V's (the same pages shifted
    by ``v_offset``), as FMHAv2 takes them for separate k and v caches."""
    pt = page_table.to(_INT)
    return torch.stack((pt, pt + v_offset), dim=1).contiguous()


def stats_to_lse(stats: torch.Tensor, scale: float, head_dim: int) -> torch.Tensor:
    """FMHAv2's softmax statistics ``[T, H, 2]`` (max of raw scores over ``sqrt(head_dim)``,
    sum of ``exp(scale * (s - max))``) as the natural-log LSE of ``scale * q . k``, ``[T, H]``."""
    return stats[..., 0] * (scale * math.sqrt(head_dim)) + torch.log(stats[..., 1])


@functools.lru_cache(maxsize=None)
def announce_build(layout: str, dtype: torch.dtype) -> None:
    """Warn, once per process and module, before FlashInfer compiles an FMHAv2 module that
    is not in its JIT cache yet: the first use on a machine takes minutes, later ones load it.

    Looks for the library where FlashInfer 0.6 puts it (``<jit or aot dir>/<uri>/<uri>.so``)
    rather than asking FlashInfer, which would generate the module's sources to answer."""
    try:
        from flashinfer.jit import env as jit_env

        name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        uri = f"trtllm_fmha_v2_{layout.lower()}_{name}_{name}"
        compiled = any((Path(base) / uri / f"{uri}.so").exists()
                       for base in (jit_env.FLASHINFER_JIT_DIR, jit_env.FLASHINFER_AOT_DIR))
    except Exception:  # a FlashInfer that keeps it elsewhere: nothing to announce
        return
    if not compiled:
        logger.warning(
            "fullcg: FlashInfer is compiling its FMHAv2 %s kernels for %s: this first use on this machine takes a "
            "minute or more (later processes load them from FlashInfer's JIT cache). To use FlashInfer's FA2 "
            "kernels instead: fullcg.ops.impl.flashinfer.FlashInferAttention.use_fmha_v2 = False",
            layout, dtype,
        )


def factor_refusal(factor: float, head_dim: int, kv_lens: Sequence[int], where: str) -> ValueError | None:
    """The error for a factor with which FMHAv2 would skip tiles that fullcg's rule keeps
    in this batch (``kv_lens``: prefix plus new tokens per request), or None.

    fullcg does not skip for a request of at most ``factor`` keys; FMHAv2 does, past its
    first KV tile. Requests that fit one tile are therefore safe whatever the factor."""
    tile = kv_tile(head_dim)
    if factor <= tile:
        return None
    short = [r for r, n in enumerate(kv_lens) if tile < n <= factor]
    if not short:
        return None
    r = short[0]
    return ValueError(
        f"{where}: request {r} has {kv_lens[r]} keys, at most the skip-softmax factor {factor}, so fullcg attends "
        "to it densely, but FlashInfer's FMHAv2 applies the threshold factor / kv_len even above 1 and would skip "
        f"its tiles past the first {tile} keys. Use a factor of at most {tile} (FMHAv2's KV tile at head dim "
        f"{head_dim}) or attention_impl='triton' (attention_impl='auto' runs such batches there)"
    )


def attend_paged(
    q: torch.Tensor,
    out: torch.Tensor,
    cache: KVCache,
    tables: torch.Tensor,
    cu_q: torch.Tensor,
    cu_kv: torch.Tensor,
    max_q_len: int,
    max_kv_len: int,
    scale: float,
    factor: float | None,
    workspace: torch.Tensor,
) -> None:
    """Causal attention of each request's new tokens over its prefix and themselves in the
    cache, into ``out`` (rows past ``cu_q[-1]`` are left as they were)."""
    from flashinfer.prefill import trtllm_fmha_v2_prefill

    announce_build("Q_PAGED_KV_NHD", q.dtype)
    trtllm_fmha_v2_prefill(
        (q, (cache.k, cache.v)), "Q_PAGED_KV_NHD", workspace_buffer=workspace, seq_lens=cu_kv[1:],  # not read
        max_q_len=max_q_len, max_kv_len=max_kv_len, bmm1_scale=scale, bmm2_scale=1.0,
        batch_size=tables.shape[0], cum_seq_lens_q=cu_q, cum_seq_lens_kv=cu_kv, block_tables=tables, out=out,
        mask_mode="causal", skip_softmax_threshold_scale_factor=factor or 0.0,
    )


def attend_contiguous(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_tokens: int,
    out: torch.Tensor,
    cu_q: torch.Tensor,
    max_q_len: int,
    causal: bool,
    scale: float,
    want_lse: bool,
    workspace: torch.Tensor,
    factor: float | None = None,
) -> torch.Tensor | None:
    """Attention of each request's rows of q over the same rows of k/v (the first
    ``num_tokens`` are the real ones), into ``out``; the natural-log LSE ``[T, Hq]`` iff
    ``want_lse`` (rows past ``cu_q[-1]`` undefined), with skip-softmax at ``factor``.

    This is also how prefills without a cached prefix attend over the cache: their keys
    are exactly their own new k/v, and FMHAv2 over rows is faster with a factor than
    over pages (1.22-1.24x SDPA at factor 30 against 1.12-1.14x, on an H200 at 16k
    tokens; ``benchmarks/skip_softmax.py --fmha-v2-layouts``) and saves softmax statistics."""
    from flashinfer.prefill import trtllm_fmha_v2_prefill

    n, rows = num_tokens, q.shape[0]
    # FMHAv2 bounds its k/v loads by q's row count: k/v rows past it would read as zeros.
    if n > rows or n > k.shape[0]:
        raise ValueError(f"FMHAv2: {n} tokens, {k.shape[0]} rows of k/v, {rows} rows of q")
    kv = k.new_empty((rows, 2, k.shape[1], k.shape[2]))
    kv[:n, 0].copy_(k[:n])
    kv[:n, 1].copy_(v[:n])
    # A request's last KV tile reaches past its rows: masked, but 0 * NaN would still be
    # NaN, so the rows past the real tokens (the caller's padding, never to be read) are zeros.
    kv[n:].zero_()
    announce_build("CONTIGUOUS_Q_KV", q.dtype)
    # seq_lens is not read by the kernel (it takes lengths from the cumulative ones).
    result = trtllm_fmha_v2_prefill(
        (q, kv), "CONTIGUOUS_Q_KV", workspace_buffer=workspace, seq_lens=cu_q[1:],
        max_q_len=max_q_len, max_kv_len=max_q_len, bmm1_scale=scale, bmm2_scale=1.0, batch_size=cu_q.shape[0] - 1,
        cum_seq_lens_q=cu_q, cum_seq_lens_kv=cu_q, out=out, mask_mode="causal" if causal else "padding",
        save_softmax_stats=want_lse, skip_softmax_threshold_scale_factor=factor or 0.0,
    )
    if not want_lse:
        return None
    return stats_to_lse(result[1], scale, q.shape[2])
