"""The ``flashinfer`` attention implementation: FlashInfer's paged and ragged kernels.

What each call uses:

- attention over the KV cache: ``BatchDecodeWithPagedKVCacheWrapper`` for decode-only
  batches, otherwise ``BatchPrefillWithPagedKVCacheWrapper`` (causal) for every request,
  decode ones included. fullcg's cache pages ``[num_pages, page_size, kv_heads, head_dim]``
  are FlashInfer's ``NHD`` layout with separate k and v tensors.
- attention over given k/v (packed per request like q, or a prefix chunk packed as
  ``metadata.prefix_chunks[c]`` says): ``BatchPrefillWithRaggedKVCacheWrapper``.
- attention over a latent cache (multi-head latent attention, :attr:`fullcg.KVCache.v_in_k`):
  ``BatchMLAPagedAttentionWrapper`` for every batch kind (:mod:`fullcg.ops.impl.flashinfer_mla`
  says how, and what it refuses).

Head dims: 64, 128 or 256 (q and v alike) for every call kind; 192 for q and k with 128 for
v (DeepSeek's decompressed keys and values, the chunked-prefix path of MLA) over given k/v
only, where the ragged FA2 kernel takes them (FlashInfer's paged and decode paths are not
run at those dims: such a call over the cache is refused); 576 and 512 (DeepSeek's latent
plus rope key, and latent) over a latent cache only.

Sliding windows and logit soft-capping are plan arguments of FlashInfer's FA2 kernels
(``window_left = W - 1`` for a window of ``W`` keys, and ``logits_soft_cap``; ``_mask_args``
turns fullcg's attributes into them), so a windowed or soft-capped layer has plans of its
own: Gemma's sliding and full layers in one step never share one. These calls run on FA2
(never FMHAv2) for every call kind above, with LSE, and under CUDA-graph capture. Refused
(``attention_impl="auto"`` runs them on Triton): a sliding window over a prefix chunk
(FlashInfer measures the window back from the end of each request's keys, one
``window_left`` per plan, but a chunk ends a different distance before each request's
queries), and a skip-softmax factor together with a window or soft-cap (the kernels that
honour a factor are not run with those).

On Hopper (SM90), steps outside CUDA-graph capture run prefill and extend attention in
bfloat16 through FMHAv2 instead (:mod:`fullcg.ops.impl.fmha_v2` says exactly which calls),
which also honours a skip-softmax factor there (over the KV cache only, as every factor
here) and, for prefills with no cached prefix, returns LSE over the cache;
``FlashInferAttention.use_fmha_v2 = False`` turns that off.

FlashInfer's LSE is base 2; it is converted to the natural log at this boundary. Rows past
the batch's real tokens (and rows of a request with nothing to attend to, as in a prefix
chunk it has no part of) are zeroed, their LSE set to -inf.

Planning. FlashInfer splits work on the host (``wrapper.plan``) and runs kernels on the
device (``wrapper.run``); ``plan`` syncs and must not run under CUDA graph capture. A
wrapper plan needs the layer's shape (heads, head dims, dtype, scale), which only attention
calls reveal, so the implementation remembers the shapes it has seen and ``plan(ctx)``
plans all of them for a new batch: run one eager step (the usual warm-up) before capturing.
Eager calls plan lazily whenever the current metadata object has not been planned.

CUDA graphs. For a padded batch size that is one of the config's capture sizes, plans use
wrappers made with ``use_cuda_graph=True``, one per (layer shape, call kind, padded size),
whose index buffers never move and whose request count is fixed at the padded size: real
requests come first, then one stand-in request that owns the padding rows, then empty
requests (decode-only batches: one stand-in request per padding row). Replaying a graph for
another batch of the same padded size only needs ``plan(ctx)`` first, which rewrites those
buffers in place. MLA wrappers replay the same way (see :mod:`fullcg.ops.impl.flashinfer_mla`
for why their launch does not change with the batch).
"""

from __future__ import annotations

import dataclasses
import math
import weakref

import numpy as np
import torch

try:
    import flashinfer
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "attention_impl='flashinfer' needs FlashInfer: `pip install fullcg[flashinfer]` "
        "(flashinfer-python 0.6.18); or choose attention_impl='triton' or 'reference'"
    ) from exc

from fullcg import telemetry
from fullcg.context import ForwardContext
from fullcg.kv_cache import KVCache
from fullcg.metadata import AttentionMetadata
from fullcg.ops.call import AttentionCall
from fullcg.ops.impl import flashinfer_mla, fmha_v2, register_implementation
from fullcg.ops.impl.base import AttentionImpl
from fullcg.ops.kernels.save_kv import save_new_kv

__all__ = ["FlashInferAttention", "WORKSPACE_BYTES", "DENSE_BACKEND"]

#: Float workspace shared by every wrapper of a device (split-KV partial results); FlashInfer
#: recommends 128 MiB. Kernels of one device run in stream order, so sharing is safe.
WORKSPACE_BYTES = 128 * 1024 * 1024
#: FlashAttention-2 kernels run on every GPU FlashInfer supports and JIT-compile about four
#: times faster than fa3 on Hopper (measured on an H200); paged, ragged and tensor-core decode
#: share one compiled module per dtype and head dim.
DENSE_BACKEND = "fa2"
#: The wrappers' backend that honours ``skip_softmax_threshold_scale_factor`` (SM100+);
#: on SM90 FMHAv2 does (:mod:`fullcg.ops.impl.fmha_v2`).
SKIP_SOFTMAX_BACKEND = "trtllm-gen"

_LN2 = math.log(2.0)
_INT = torch.int32
#: Head dims FlashInfer's kernels take (q and v alike); FMHAv2 takes the same.
_HEAD_DIMS = fmha_v2.HEAD_DIMS
#: ``(head_dim, v_head_dim)`` of DeepSeek's decompressed attention (nope 128 + rope 64, v 128),
#: which FlashInfer's ragged prefill takes (over given k/v only).
_DEEPSEEK_MHA_DIMS = (192, 128)


@dataclasses.dataclass(frozen=True)
class _Shape:
    """What a wrapper plan depends on besides the batch: one layer's attention shape."""

    device: torch.device
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype
    scale: float
    sliding_window: int | None  # keys a query sees, itself included (None: all)
    logit_softcap: float | None  # scores c * tanh(s / c) (None: not capped)


def _mask_args(shape: _Shape) -> dict[str, object]:
    """FlashInfer's plan arguments for the shape's sliding window and soft-cap.

    FlashInfer lets query ``i`` of a request with ``qo_len`` queries and ``kv_len`` keys
    see keys ``j >= i + kv_len - qo_len - window_left``: the query's own position less
    ``window_left``, so a window of ``W`` keys (itself included) is ``window_left = W - 1``
    (-1: no window). ``logits_soft_cap`` caps ``sm_scale * q . k`` as fullcg does. Both are
    fixed at plan time (the compiled module depends on them), so they are part of the shape
    that keys wrappers and plans."""
    window = -1 if shape.sliding_window is None else shape.sliding_window - 1
    return dict(window_left=window, logits_soft_cap=shape.logit_softcap)


# Call kinds: ("cache",), ("mla",), ("ragged", causal), ("chunk", index). "cache" plans the
# decode wrapper for decode-only batches and the paged prefill wrapper otherwise; "mla" is
# attention over a latent cache, on the MLA wrapper for every batch kind.
_Kind = tuple


@dataclasses.dataclass
class _Plan:
    """A wrapper and the batch it is planned for."""

    wrapper: object
    metadata: weakref.ReferenceType[AttentionMetadata]
    slots: int | None  # fixed request count (CUDA-graph wrapper) or None (exact batch)
    kv_rows: int  # rows of given k/v the plan reads (ragged kinds)
    backend: str


@dataclasses.dataclass
class _Indices:
    """Host-built index arrays of one plan."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor | None = None
    last_page_len: torch.Tensor | None = None

    def for_plan(self, device: torch.device) -> _Indices:
        """These arrays for a plan on ``device``: on a GPU, the small ones page-locked and the
        page list already sent to the device. FlashInfer's plans copy them with
        ``non_blocking=True``, and a copy from pageable memory first waits for all the work
        queued on the stream; a CUDA-graph wrapper copies a page list that is on the host
        with a blocking copy. Either would make the host wait for the previous step to
        finish before it could plan this one."""
        if device.type != "cuda":
            return self
        pages = self.kv_indices
        if pages is not None:
            pages = pages.pin_memory().to(device, non_blocking=True)
        return _Indices(self.qo_indptr.pin_memory(), self.kv_indptr.pin_memory(), pages,
                        None if self.last_page_len is None else self.last_page_len.pin_memory())


@dataclasses.dataclass
class _FmhaBatch:
    """What FMHAv2 calls of one batch share: built once per metadata object."""

    metadata: weakref.ReferenceType[AttentionMetadata]
    cu_kv: torch.Tensor  # int32 [R + 1] cumulative prefix + new tokens
    max_q_len: int
    max_kv_len: int
    tables: dict[int, torch.Tensor]  # by V's page offset: int32 [R, 2, M]


def _index(device: torch.device) -> int:
    """A CUDA device's index (the current one for a bare ``cuda``)."""
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if device.type == "cuda" else 0


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _in_captured_graph(ctx: ForwardContext) -> bool:
    """The call is being captured, or is the warm-up run of a full graph about to be
    captured (which must choose what the capture chooses): a full graph at a capture size."""
    return (ctx.variant == "full" and ctx.padded_size is not None) or _capturing()


def _padded_size(ctx: ForwardContext) -> int | None:
    """The capture size this batch is padded to, or None when it runs uncaptured."""
    if ctx.padded_size is not None:  # the runner's (sizes its graph's guards admit)
        return ctx.padded_size
    n = ctx.metadata.num_tokens
    for size in ctx.config.sizes_to_capture:
        if size >= n:
            return size
    return None


def _paged_indices(md: AttentionMetadata, slots: int | None, padded_rows: int, decode: bool) -> _Indices:
    """indptr/indices/last_page_len over each request's prefix and new tokens.

    With ``slots`` the request count is padded to ``slots``: a stand-in request owns the
    padding rows (``padded_rows - num_tokens``; for decode, one row per missing request)
    and reads page 0, so it never reaches outside the cache; its output is zeroed later.
    Vector operations over the host page table (a plan of 256 requests is a few of them,
    not 256 tensor slices).
    """
    ps = md.page_size
    q = np.asarray(md.query_lens, dtype=np.int64)
    kv = q + np.asarray(md.prefix_lens, dtype=np.int64)
    table = md.host_page_table().numpy()  # never a copy back from the device: see AttentionMetadata.host_page_table
    counts = -(-kv // ps)
    indices = table[np.arange(table.shape[1])[None, :] < counts[:, None]]  # row by row, in page order
    if slots is not None:
        extra = slots - len(q)
        if extra < 0:
            raise ValueError(f"flashinfer: {len(q)} requests do not fit a CUDA-graph plan of {slots} slots")
        pad_q = np.ones(extra, dtype=np.int64) if decode else np.zeros(extra, dtype=np.int64)
        if extra and not decode:
            pad_q[0] = padded_rows - md.num_tokens
        pad_kv = np.maximum(pad_q, 1)
        pad_counts = -(-pad_kv // ps)
        q, kv, counts = np.concatenate([q, pad_q]), np.concatenate([kv, pad_kv]), np.concatenate([counts, pad_counts])
        indices = np.concatenate([indices, np.zeros(int(pad_counts.sum()), dtype=indices.dtype)])
    qo = np.zeros(len(q) + 1, dtype=np.int64)
    np.cumsum(q, out=qo[1:])
    kv_indptr = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=kv_indptr[1:])
    last = kv - (counts - 1) * ps
    return _Indices(*(torch.from_numpy(a.astype(np.int32)) for a in (qo, kv_indptr, indices, last)))


def _ragged_indices(md: AttentionMetadata, kind: _Kind, slots: int | None, padded_rows: int) -> _Indices:
    """qo/kv indptr for attention over given k/v; stand-in requests read no k/v rows."""
    q_lens = list(md.query_lens)
    if kind[0] == "chunk":
        kv_lens = list(md.prefix_chunks[kind[1]].lens)
    else:
        kv_lens = list(md.query_lens)
    if slots is not None:
        extra = slots - len(q_lens)
        if extra < 0:
            raise ValueError(f"flashinfer: {len(q_lens)} requests do not fit a CUDA-graph plan of {slots} slots")
        pad_rows = padded_rows - md.num_tokens
        q_lens += [pad_rows] + [0] * (extra - 1) if extra else []
        kv_lens += [0] * extra
    qo = torch.zeros(len(q_lens) + 1, dtype=_INT)
    qo[1:] = torch.tensor(q_lens, dtype=_INT).cumsum(0)
    kv = torch.zeros(len(kv_lens) + 1, dtype=_INT)
    kv[1:] = torch.tensor(kv_lens, dtype=_INT).cumsum(0)
    return _Indices(qo, kv)


class FlashInferAttention(AttentionImpl):
    """FlashInfer kernels behind fullcg's attention ops; see the module docstring."""

    name = "flashinfer"
    capture_safe = True
    #: Latent caches are attended by FlashInfer's MLA kernel (:mod:`fullcg.ops.impl.flashinfer_mla`).
    takes_v_in_k = True
    #: Run eager prefill/extend attention through FMHAv2 on SM90 (see the module docstring).
    use_fmha_v2 = True
    #: The MLA wrapper's backend: None for FlashInfer's choice (FA3 on Hopper, FA2 elsewhere),
    #: or ``"fa2"``/``"fa3"``.
    mla_backend: str | None = None

    def save_kv(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache) -> None:
        """New k/v are written by a Triton kernel that skips padding slots (CUDA-graph safe);
        into a latent cache as one row per token, the value being the key's leading values."""
        if cache.v_in_k:
            flashinfer_mla.save_latent(call, ctx, cache)
        else:
            save_new_kv(call, ctx, cache)

    def __init__(self) -> None:
        self._workspaces: dict[torch.device, torch.Tensor] = {}
        # One int workspace (plan info) per shape and kind: wrappers of different padded
        # sizes share it, since each is planned again right before it runs.
        self._int_workspaces: dict[tuple, torch.Tensor] = {}
        self._wrappers: dict[tuple, object] = {}
        self._plans: dict[tuple, _Plan] = {}
        self._known: dict[_Shape, set[_Kind]] = {}
        self._fmha_batch: _FmhaBatch | None = None
        self._fmha_workspaces: dict[torch.device, torch.Tensor] = {}
        # The launch of each CUDA-graph MLA wrapper's first plan, by id (wrappers live as
        # long as the implementation): later plans must keep it (flashinfer_mla.plan).
        self._mla_launches: dict[int, tuple[int, ...] | None] = {}

    # ------------------------------------------------------------------ planning

    def plan(self, ctx: ForwardContext) -> None:
        """Plan every layer shape and call kind seen so far for ``ctx``'s batch.

        Runs on the host (and syncs); call it outside CUDA graph capture, before replaying
        a graph captured for this batch's padded size.
        """
        slots = _padded_size(ctx)
        md = ctx.metadata
        for shape, kinds in self._known.items():
            for kind in kinds:
                if kind[0] == "chunk" and kind[1] >= len(md.prefix_chunks):
                    continue
                cache = None
                if kind[0] in ("cache", "mla"):
                    # The largest cache of this shape (latent for MLA) sizes the page buffers.
                    fits = [
                        c for c in ctx.kv_caches.values()
                        if c.k.device == shape.device and c.num_kv_heads == shape.num_kv_heads
                        and c.head_dim == shape.head_dim and c.v_head_dim == shape.v_head_dim
                        and c.v_in_k == (kind[0] == "mla")
                    ]
                    if not fits:
                        continue
                    cache = max(fits, key=lambda c: c.num_pages)
                if kind[0] == "mla" and not self._mla_schedule_fits(shape, md, slots):
                    continue  # refused at this size, so never captured on FlashInfer: nothing to plan
                self._plan(shape, kind, md, slots, cache, skip_factor=None)

    def _workspace(self, device: torch.device) -> torch.Tensor:
        ws = self._workspaces.get(device)
        if ws is None:
            with torch.inference_mode(False):  # a normal tensor: planning may run outside inference mode
                ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self._workspaces[device] = ws
        return ws

    def _wrapper(
        self, shape: _Shape, kind: _Kind, decode: bool, slots: int | None, max_pages: int, backend: str
    ) -> object:
        """The wrapper for ``kind`` (and decode or not); CUDA-graph ones get fixed buffers."""
        if kind[0] == "mla":
            flavour = "mla"
        else:
            flavour = "ragged" if kind[0] != "cache" else ("decode" if decode else "paged")
        # max_pages follows the cache's size: a new cache gets new buffers (graphs captured
        # with the old ones are captured again anyway, since the cache moved).
        key = (shape, kind, flavour, slots, max_pages if slots is not None else 0, backend)
        wrapper = self._wrappers.get(key)
        if wrapper is not None:
            return wrapper
        # Fixed buffers are normal tensors, so plans can update them in or out of inference mode.
        with torch.inference_mode(False):
            return self._new_wrapper(key, shape, kind, flavour, decode, slots, max_pages, backend)

    def _new_wrapper(
        self, key: tuple, shape: _Shape, kind: _Kind, flavour: str, decode: bool, slots: int | None, max_pages: int,
        backend: str,
    ) -> object:
        dev = shape.device
        ws = self._workspace(dev)
        graph: dict[str, object] = {}
        if slots is not None:
            graph["use_cuda_graph"] = True
        if flavour == "decode":
            if slots is not None:
                graph.update(
                    paged_kv_indptr_buffer=torch.zeros(slots + 1, dtype=_INT, device=dev),
                    paged_kv_indices_buffer=torch.zeros(max_pages, dtype=_INT, device=dev),
                    paged_kv_last_page_len_buffer=torch.zeros(slots, dtype=_INT, device=dev),
                )
            # Tensor-core decode runs on the prefill module: one JIT compile serves both.
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_tensor_cores=backend != SKIP_SOFTMAX_BACKEND, backend=backend, **graph
            )
        elif flavour == "paged":
            if slots is not None:
                graph.update(
                    qo_indptr_buf=torch.zeros(slots + 1, dtype=_INT, device=dev),
                    paged_kv_indptr_buf=torch.zeros(slots + 1, dtype=_INT, device=dev),
                    paged_kv_indices_buf=torch.zeros(max_pages, dtype=_INT, device=dev),
                    paged_kv_last_page_len_buf=torch.zeros(slots, dtype=_INT, device=dev),
                )
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend, **graph)
        elif flavour == "mla":
            if slots is not None:
                graph.update(
                    qo_indptr=torch.zeros(slots + 1, dtype=_INT, device=dev),
                    kv_indptr=torch.zeros(slots + 1, dtype=_INT, device=dev),
                    kv_indices=torch.zeros(max_pages, dtype=_INT, device=dev),
                    kv_len_arr=torch.zeros(slots, dtype=_INT, device=dev),
                )
            wrapper = flashinfer.BatchMLAPagedAttentionWrapper(ws, backend=backend, **graph)
            # The MLA wrapper has no reset_workspace_buffer: its plan info goes to the shared
            # int workspace through the attribute its plan and run read (each wrapper keeps
            # its own page-locked staging buffer). Without the attribute each keeps its own.
            int_key = (shape, kind, flavour, backend)
            shared = self._int_workspaces.get(int_key)
            if shared is None:
                self._int_workspaces[int_key] = getattr(wrapper, "_int_workspace_buffer", None)
            elif hasattr(wrapper, "_int_workspace_buffer"):
                wrapper._int_workspace_buffer = shared
            self._wrappers[key] = wrapper
            return wrapper
        else:
            if slots is not None:
                graph.update(
                    qo_indptr_buf=torch.zeros(slots + 1, dtype=_INT, device=dev),
                    kv_indptr_buf=torch.zeros(slots + 1, dtype=_INT, device=dev),
                )
            wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend, **graph)
        int_key = (shape, kind, flavour, backend)
        int_ws = self._int_workspaces.get(int_key)
        if int_ws is None:
            self._int_workspaces[int_key] = wrapper._int_workspace_buffer
        else:
            wrapper.reset_workspace_buffer(ws, int_ws)
        self._wrappers[key] = wrapper
        return wrapper

    def _plan(
        self,
        shape: _Shape,
        kind: _Kind,
        md: AttentionMetadata,
        slots: int | None,
        cache: KVCache | None,
        skip_factor: float | None,
    ) -> _Plan:
        backend = DENSE_BACKEND if skip_factor is None else SKIP_SOFTMAX_BACKEND
        common = dict(sm_scale=shape.scale, q_data_type=shape.dtype, **_mask_args(shape))
        if kind[0] == "mla":
            assert cache is not None
            wrapper = self._plan_mla(shape, kind, md, slots, cache)
            kv_rows = 0
        elif kind[0] == "cache":
            assert cache is not None
            # The decode wrapper takes one head dim for k and v; other shapes use the prefill one.
            decode = md.is_decode_only and shape.head_dim == shape.v_head_dim
            rows = slots if slots is not None else md.num_tokens
            idx = _paged_indices(md, slots, rows, decode).for_plan(shape.device)
            max_pages = 2 * cache.num_pages + 2 * (slots or 0) + 1
            if slots is not None and idx.kv_indices.numel() > max_pages:
                raise ValueError(
                    f"flashinfer: the batch reads {idx.kv_indices.numel()} pages, more than a CUDA-graph plan holds "
                    f"({max_pages}); requests share too many pages for captured attention, run it uncaptured"
                )
            wrapper = self._wrapper(shape, kind, decode, slots, max_pages, backend)
            kv_dtype = dict(kv_data_type=cache.k.dtype)
            if decode:
                wrapper.plan(
                    idx.kv_indptr, idx.kv_indices, idx.last_page_len, shape.num_qo_heads, shape.num_kv_heads,
                    shape.head_dim, md.page_size, **common, **kv_dtype,
                )
            else:
                wrapper.plan(
                    idx.qo_indptr, idx.kv_indptr, idx.kv_indices, idx.last_page_len, shape.num_qo_heads,
                    shape.num_kv_heads, shape.head_dim, md.page_size, head_dim_vo=shape.v_head_dim, causal=True,
                    **common, **kv_dtype,
                )
            kv_rows = 0
        else:
            rows = slots if slots is not None else md.num_tokens
            idx = _ragged_indices(md, kind, slots, rows).for_plan(shape.device)
            wrapper = self._wrapper(shape, kind, False, slots, 0, backend)
            causal = kind[0] == "ragged" and kind[1]
            wrapper.plan(
                idx.qo_indptr, idx.kv_indptr, shape.num_qo_heads, shape.num_kv_heads, shape.head_dim,
                head_dim_vo=shape.v_head_dim, causal=causal, **common,
            )
            kv_rows = int(idx.kv_indptr[-1])
        plan = _Plan(wrapper, weakref.ref(md), slots, kv_rows, backend)
        self._plans[(shape, kind, slots, backend)] = plan
        return plan

    def _plan_mla(
        self, shape: _Shape, kind: _Kind, md: AttentionMetadata, slots: int | None, cache: KVCache
    ) -> object:
        """The MLA wrapper for this batch (CUDA-graph one with ``slots``), planned: every request
        over its prefix and new tokens, causal; padding requests as the paged wrappers have them."""
        rows = slots if slots is not None else md.num_tokens
        idx = _paged_indices(md, slots, rows, md.is_decode_only).for_plan(shape.device)
        max_pages = 2 * cache.num_pages + 2 * (slots or 0) + 1
        if slots is not None and idx.kv_indices.numel() > max_pages:
            raise ValueError(
                f"flashinfer: the batch reads {idx.kv_indices.numel()} pages, more than a CUDA-graph plan holds "
                f"({max_pages}); requests share too many pages for captured attention, run it uncaptured"
            )
        q_lens = (idx.qo_indptr[1:] - idx.qo_indptr[:-1]).tolist()
        bound = flashinfer_mla.schedule_bound(q_lens, shape.num_qo_heads, flashinfer_mla.num_sms(_index(shape.device)))
        if bound > flashinfer_mla.MAX_WORK_ITEMS:  # refused earlier (serves/forward); never hand it to FlashInfer
            raise ValueError(
                f"flashinfer: this batch's MLA schedule may need {bound} work items, more than the "
                f"{flashinfer_mla.MAX_WORK_ITEMS} a FlashInfer plan holds; run fewer tokens per step, or use "
                "attention_impl='triton' or 'reference'"
            )
        wrapper = self._wrapper(shape, kind, False, slots, max_pages, self._mla_backend_for(shape.device))
        lens = flashinfer_mla.kv_lens(idx.kv_indptr, idx.last_page_len, md.page_size)
        if shape.device.type == "cuda":
            lens = lens.pin_memory()  # (see _Indices.for_plan)
        first = self._mla_launches.get(id(wrapper)) if slots is not None else None
        launch = flashinfer_mla.plan(
            wrapper, idx.qo_indptr, idx.kv_indptr, idx.kv_indices, lens, num_heads=shape.num_qo_heads,
            page_size=md.page_size, scale=shape.scale, dtype=shape.dtype, launch=first,
        )
        if slots is not None and first is None:
            self._mla_launches[id(wrapper)] = launch
        return wrapper

    def _mla_schedule_fits(self, shape: _Shape, md: AttentionMetadata, slots: int | None) -> bool:
        """Whether MLA calls of ``shape`` are served at this batch's size (the work-item bound
        :meth:`_mla_refusal` applies)."""
        items = self._mla_work_items(shape.num_qo_heads, md, slots, _index(shape.device))
        return items <= flashinfer_mla.MAX_WORK_ITEMS

    def _mla_backend_for(self, device: torch.device) -> str:
        if self.mla_backend is not None:
            return self.mla_backend
        return flashinfer_mla.backend_for(flashinfer_mla.capability(_index(device)))

    def _planned(
        self, call: AttentionCall, ctx: ForwardContext, shape: _Shape, kind: _Kind, cache: KVCache | None,
        skip_factor: float | None,
    ) -> _Plan:
        """The plan for this call's batch: a CUDA-graph one for this padded size if made,
        else an exact one, planned now if needed (never during capture)."""
        md = ctx.metadata
        self._known.setdefault(shape, set()).add(kind)
        backend = DENSE_BACKEND if skip_factor is None else SKIP_SOFTMAX_BACKEND
        for slots in (call.q.shape[0], None):
            plan = self._plans.get((shape, kind, slots, backend))
            if plan is not None and plan.metadata() is md:
                return plan
        if _capturing():
            raise RuntimeError(
                f"fullcg.{call.op} (layer {call.layer_id}) with attention_impl='flashinfer': this batch was not "
                "planned before CUDA graph capture. Run one eager step of this model first (so the implementation "
                "knows its attention shapes), then call plan(ctx) for the batch outside capture"
            )
        slots = _padded_size(ctx)
        if slots != call.q.shape[0] or skip_factor is not None:
            slots = None
        return self._plan(shape, kind, md, slots, cache, skip_factor)

    # ------------------------------------------------------------------ skip-softmax

    @staticmethod
    def _skip_factor(
        call: AttentionCall, ctx: ForwardContext, cache: KVCache | None, fmha: bool
    ) -> tuple[float | None, Exception | None]:
        """The skip-softmax factor to pass to FlashInfer (None: dense attention), or the
        error that refuses, rather than ignores, a factor FlashInfer would not honour.
        ``fmha``: the call runs on FMHAv2."""
        if call.prefill_scale_factor is None and call.decode_scale_factor is None:
            return None, None  # dense: decided before the capture check, on every call of a dense step
        md = ctx.metadata
        captured = _in_captured_graph(ctx)
        # The factors this batch's requests use: prefill's for prefill/extend, decode's for
        # decode. A captured graph that is not decode-only also replays mixed batches: both.
        wanted = ([] if md.is_decode_only else [call.prefill_scale_factor]) + (
            [call.decode_scale_factor] if md.has_decode or (captured and not md.is_decode_only) else [])
        factors = {f for f in wanted if f is not None}
        if not factors:
            return None, None
        where = f"fullcg.{call.op} (layer {call.layer_id}) with attention_impl='flashinfer'"
        alternative = "use attention_impl='triton' (skip-softmax on any GPU) or 'reference'"
        if call.sliding_window is not None or call.logit_softcap is not None:
            return None, ValueError(
                f"{where}: FlashInfer honours a skip-softmax factor only through kernels that fullcg runs without a "
                "sliding window or logit soft-capping (FMHAv2 on SM90, trtllm-gen on SM100+; its FA2 kernels ignore "
                f"the factor); {alternative}, or unset the skip-softmax factors"
            )
        if cache is None:
            return None, ValueError(
                f"{where}: skip-softmax is supported for attention over the KV cache only; {alternative}")
        if fmha:
            kv_lens = [q + p for q, p in zip(md.query_lens, md.prefix_lens)]
            for factor in factors:
                refusal = fmha_v2.factor_refusal(factor, call.q.shape[2], kv_lens, where)
                if refusal is not None:
                    return None, refusal
        elif (major := torch.cuda.get_device_capability(call.q.device)[0] if call.q.is_cuda else 0) < 10:
            return None, ValueError(
                f"{where}: FlashInfer honours a skip-softmax factor only through FMHAv2 on SM90 (bfloat16 batches "
                "of prefill and extend requests only, over a cache made by KVCache.allocate, with LSE only where no "
                "request has a cached prefix, outside CUDA-graph capture) and its trtllm-gen backend on SM100+; this "
                f"call is not one of those (SM{major}x), and the factor would be silently ignored. {alternative}, "
                "or unset the skip-softmax factors"
            )
        if len(factors) > 1 or None in wanted:
            return None, ValueError(
                f"{where}: a mixed batch needs the prefill factor for prefill/extend requests and the decode factor "
                f"for decode ones, but FlashInfer takes one factor per call; {alternative}, or run decode and "
                "prefill in separate steps"
            )
        if captured:
            return None, RuntimeError(
                f"{where}: skip-softmax with the trtllm-gen backend is not CUDA-graph safe here; run these steps "
                "uncaptured (graph_mode='none' or 'piecewise')")
        return factors.pop(), None

    def serves(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache | None) -> bool:
        """Whether :meth:`forward` computes ``call`` as asked instead of refusing it: a CUDA
        call in fp16/bf16 of head dims FlashInfer takes, a sliding window except over a prefix
        chunk, and a skip-softmax factor only where FlashInfer honours it (never with a window
        or soft-cap; ``cache``: the layer's cache when the call attends over it). Over a latent
        cache: what :func:`fullcg.ops.impl.flashinfer_mla.refusal` lets through."""
        q = call.q
        if not q.is_cuda:
            return False
        if flashinfer_mla.is_latent_call(cache):
            return self._mla_refusal(call, ctx, cache, "") is None
        if q.dtype not in (torch.float16, torch.bfloat16) or self._dims_refusal(call, cache, "") is not None:
            return False
        if self._mask_refusal(call, "") is not None:
            return False
        if cache is not None and cache.k.dtype != q.dtype:
            return False
        shape, kind = self._shape_and_kind(call, cache)
        fmha = self._fmha_v2_serves(call, ctx, shape, kind, cache)
        return self._skip_factor(call, ctx, cache, fmha)[1] is None

    # ------------------------------------------------------------------ running

    def supports(self, head_dim: int, v_head_dim: int) -> bool:
        """64, 128 or 256 (q and v alike); 192/128 (over given k/v only) and 576/512 (over a
        latent cache only), which ``serves`` and ``forward`` tell apart by the call (the head
        dims alone do not say whether the cache is latent)."""
        return (head_dim in _HEAD_DIMS and v_head_dim == head_dim) or (head_dim, v_head_dim) in (
            _DEEPSEEK_MHA_DIMS, flashinfer_mla.DIMS)

    def forward(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache | None) -> torch.Tensor | None:
        """Compute ``call`` into ``call.out``; return natural-log LSE ``[T, Hq]`` iff asked."""
        q, out = call.q, call.out
        where = f"fullcg.{call.op} (layer {call.layer_id}) with attention_impl='flashinfer'"
        if not q.is_cuda:
            raise RuntimeError(f"{where}: tensors are on {q.device}; FlashInfer needs a CUDA device. "
                               "Use attention_impl='reference' on the CPU")
        if flashinfer_mla.is_latent_call(cache):
            if (refusal := self._mla_refusal(call, ctx, cache, where)) is not None:
                raise refusal
            return self._forward_mla(call, ctx, cache)
        if (refusal := self._dims_refusal(call, cache, where)) is not None:
            raise refusal
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"{where}: FlashInfer computes in float16 or bfloat16, got {q.dtype}; "
                            "cast the model or use attention_impl='reference'")
        if (refusal := self._mask_refusal(call, where)) is not None:
            raise refusal
        if cache is not None and cache.k.dtype != q.dtype:
            raise TypeError(f"{where}: the KV cache holds {cache.k.dtype} but q is {q.dtype}; "
                            "allocate the cache in q's dtype")
        md = ctx.metadata
        shape, kind = self._shape_and_kind(call, cache)
        fmha = self._fmha_v2_serves(call, ctx, shape, kind, cache)
        skip_factor, refusal = self._skip_factor(call, ctx, cache, fmha)
        if refusal is not None:
            raise refusal
        if skip_factor is not None:
            telemetry.count_unmeasured(call.layer_id)
        if fmha:
            # Known, so that plan(ctx) prepares this kind for captured steps too.
            self._known.setdefault(shape, set()).add(kind)
            return self._forward_fmha_v2(call, md, kind, cache, skip_factor)
        plan = self._planned(call, ctx, shape, kind, cache, skip_factor)

        q = q.contiguous()
        target = out if out.is_contiguous() else torch.empty_like(out)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if call.return_lse else None
        extra = {} if skip_factor is None else {"skip_softmax_threshold_scale_factor": skip_factor}
        if kind[0] == "cache":
            pages = (cache.k, cache.v)
            if isinstance(plan.wrapper, flashinfer.BatchDecodeWithPagedKVCacheWrapper):
                # The decode wrapper maps request i to row i: pass exactly its batch.
                b = plan.slots if plan.slots is not None else md.num_requests
                plan.wrapper.run(
                    q[:b], pages, out=target[:b], lse=None if lse is None else lse[:b],
                    return_lse=lse is not None, **extra,
                )
            else:
                qs, ts, ls = self._planned_rows(plan, md, q, target, lse)
                plan.wrapper.run(qs, pages, out=ts, lse=ls, return_lse=lse is not None, **extra)
        else:
            rows = call.k.shape[0] if call.key_value_num_tokens is None else call.key_value_num_tokens
            if plan.kv_rows > rows:
                raise ValueError(f"{where}: the plan reads {plan.kv_rows} rows of k/v but only {rows} are valid")
            qs, ts, ls = self._planned_rows(plan, md, q, target, lse)
            plan.wrapper.run(
                qs, call.k.contiguous(), call.v.contiguous(), out=ts, lse=ls, return_lse=lse is not None
            )

        if lse is not None:
            lse.mul_(_LN2)  # FlashInfer's log2 -> natural log
        return self._finish(call, md, target, lse)

    @staticmethod
    def _dims_refusal(call: AttentionCall, cache: KVCache | None, where: str) -> ValueError | None:
        """The error for head dims no FlashInfer kernel fullcg runs takes for this call (None:
        one does). ``cache``: the layer's cache when the call attends over it, not latent."""
        dims = (call.q.shape[2], call.v.shape[2])
        if dims[0] in _HEAD_DIMS and dims[1] == dims[0]:
            return None
        if dims == _DEEPSEEK_MHA_DIMS:
            if cache is None:
                return None
            return ValueError(
                f"{where}: FlashInfer runs head dims 192/128 (DeepSeek's decompressed keys and values) over given k/v "
                "only (its ragged prefill); over a paged KV cache use attention_impl='triton' or 'reference', or "
                "MLA's latent cache (fullcg.MLAAttention)"
            )
        if dims == flashinfer_mla.DIMS:
            return ValueError(
                f"{where}: head dims 576/512 run on FlashInfer's MLA kernel, which attends only over a latent cache "
                "(fullcg.MLAAttention's, KVCache.v_in_k) with use_kv_cache=True; use attention_impl='triton' or "
                "'reference'"
            )
        return ValueError(
            f"{where}: FlashInfer's kernels take head dims 64, 128 or 256 (q and v alike), 192/128 over given k/v and "
            f"576/512 over a latent cache, got {dims[0]} and {dims[1]}; use attention_impl='triton' or 'reference'"
        )

    def _mla_refusal(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache, where: str) -> Exception | None:
        """The error refusing an MLA call (over the latent ``cache``) FlashInfer would not
        compute as asked, or None; see :func:`fullcg.ops.impl.flashinfer_mla.refusal`."""
        factor, factor_refusal = self._skip_factor(call, ctx, cache, False)
        slots = _padded_size(ctx)
        index = _index(call.q.device)
        return flashinfer_mla.refusal(
            call, cache, where, device_capability=flashinfer_mla.capability(index),
            uses_factor=factor is not None or factor_refusal is not None,
            work_items=self._mla_work_items(call.num_q_heads, ctx.metadata, slots if slots == call.q.shape[0] else None,
                                            index),
        )

    @staticmethod
    def _mla_work_items(heads: int, md: AttentionMetadata, slots: int | None, index: int) -> int:
        """The schedule bound MLA calls of ``heads`` query heads are judged by: a CUDA-graph
        plan (``slots``) by its worst case at its padded size, so that its capture and every
        replay agree; an exact plan by the batch."""
        sms = flashinfer_mla.num_sms(index)
        if slots is not None:
            return flashinfer_mla.padded_schedule_bound(slots, heads, sms)
        return flashinfer_mla.schedule_bound(md.query_lens, heads, sms)

    def _forward_mla(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache) -> torch.Tensor | None:
        md = ctx.metadata
        shape, kind = self._shape_and_kind(call, cache)
        plan = self._planned(call, ctx, shape, kind, cache, None)
        q = call.q.contiguous()
        target = call.out if call.out.is_contiguous() else torch.empty_like(call.out)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if call.return_lse else None
        # A CUDA-graph plan covers every row (padding requests included); an exact one only
        # the real tokens, leaving the rest to _finish.
        flashinfer_mla.run(plan.wrapper, q, cache, target, lse)
        if lse is not None:
            lse.mul_(_LN2)  # FlashInfer's log2 -> natural log
        return self._finish(call, md, target, lse)

    @staticmethod
    def _mask_refusal(call: AttentionCall, where: str) -> ValueError | None:
        """The error for a sliding window FlashInfer cannot place (None: it can): over a
        prefix chunk, whose keys end a different distance before each request's queries."""
        if call.sliding_window is None or call.prefix_chunk is None:
            return None
        return ValueError(
            f"{where}: a sliding window over a prefix chunk is measured from each query's position in the whole "
            "sequence, but FlashInfer measures it back from the end of each request's keys with one window_left per "
            "plan, and a chunk's keys end a different distance before each request's queries; use "
            "attention_impl='triton' or 'auto' (which runs these calls on Triton)"
        )

    @staticmethod
    def _shape_and_kind(call: AttentionCall, cache: KVCache | None) -> tuple[_Shape, _Kind]:
        q = call.q
        softcap = None if call.logit_softcap is None else float(call.logit_softcap)
        shape = _Shape(q.device, call.num_q_heads, call.num_kv_heads, q.shape[2], call.v.shape[2], q.dtype,
                       float(call.scale), call.sliding_window, softcap)
        if cache is not None:
            return shape, ("mla",) if cache.v_in_k else ("cache",)
        if call.prefix_chunk is not None:
            return shape, ("chunk", call.prefix_chunk)
        return shape, ("ragged", bool(call.causal))

    def _finish(
        self, call: AttentionCall, md: AttentionMetadata, target: torch.Tensor, lse: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Zero the dead rows (LSE -inf) and move the result into ``call.out``."""
        dead = self._dead_rows(call, md, target.shape[0], target.device)
        target.masked_fill_(dead[:, None, None], 0)
        if target is not call.out:
            call.out.copy_(target)
        if lse is None:
            return None
        lse.masked_fill_(dead[:, None], float("-inf"))
        return lse

    # ------------------------------------------------------------------ FMHAv2

    def _fmha_v2_serves(
        self, call: AttentionCall, ctx: ForwardContext, shape: _Shape, kind: _Kind, cache: KVCache | None
    ) -> bool:
        """Whether this call runs on FMHAv2 (the calls :mod:`fullcg.ops.impl.fmha_v2` lists)."""
        if not self.use_fmha_v2 or shape.dtype != torch.bfloat16:
            return False
        if shape.sliding_window is not None or shape.logit_softcap is not None:
            return False  # FA2 serves these (fmha_v2's docstring says why)
        md = ctx.metadata
        if kind[0] == "cache":
            if md.has_decode:
                return False
            if not self._cache_as_rows(call, md) and (
                call.return_lse or not fmha_v2.page_size_fits(md.page_size, shape.head_dim)
                or fmha_v2.v_offset_pages(cache) is None
            ):
                return False
        elif kind[0] == "ragged":
            rows = call.k.shape[0] if call.key_value_num_tokens is None else call.key_value_num_tokens
            if not md.num_tokens <= rows <= call.q.shape[0]:
                return False
        else:
            return False
        if shape.head_dim != shape.v_head_dim or shape.head_dim not in fmha_v2.HEAD_DIMS:
            return False
        if shape.num_qo_heads % shape.num_kv_heads:
            return False
        # Last, being the dearest check (decode steps leave above): a full graph at a capture
        # size is captured after one warm-up run, which must take the path the capture takes
        # (it plans FA2 for the capture); attention between pieces is never captured.
        if _in_captured_graph(ctx):
            return False
        return fmha_v2.available(shape.device.index or 0)

    @staticmethod
    def _cache_as_rows(call: AttentionCall, md: AttentionMetadata) -> bool:
        """Whether FMHAv2 attends over the call's own k/v rather than the cache's pages: no
        request has a cached prefix and the call saves its k/v, so the cache holds exactly
        those keys; taken where rows pay (a skip-softmax factor: faster over rows) or are
        needed (LSE: FMHAv2 has softmax statistics for rows only)."""
        if not call.save_kv_cache or not (call.return_lse or call.prefill_scale_factor is not None):
            return False
        if any(md.prefix_lens):
            return False
        rows = call.k.shape[0] if call.key_value_num_tokens is None else call.key_value_num_tokens
        return md.num_tokens <= rows <= call.q.shape[0]

    def _fmha_batch_of(self, md: AttentionMetadata) -> _FmhaBatch:
        batch = self._fmha_batch
        if batch is None or batch.metadata() is not md:
            kv_lens = [q + p for q, p in zip(md.query_lens, md.prefix_lens)]
            cu_kv = torch.zeros(md.num_requests + 1, dtype=_INT, device=md.seq_lens.device)
            torch.cumsum(md.seq_lens, 0, out=cu_kv[1:])
            batch = self._fmha_batch = _FmhaBatch(weakref.ref(md), cu_kv, max(md.query_lens), max(kv_lens), {})
        return batch

    def _forward_fmha_v2(
        self, call: AttentionCall, md: AttentionMetadata, kind: _Kind, cache: KVCache | None, factor: float | None
    ) -> torch.Tensor | None:
        q = call.q.contiguous()
        target = call.out if call.out.is_contiguous() else torch.empty_like(call.out)
        ws = self._fmha_workspaces.get(q.device)
        if ws is None:
            with torch.inference_mode(False):  # a normal tensor, as the FA2 workspace
                ws = self._fmha_workspaces[q.device] = torch.zeros(fmha_v2.WORKSPACE_BYTES, dtype=torch.uint8,
                                                                   device=q.device)
        batch = self._fmha_batch_of(md)
        cu_q = md.query_start_loc
        if kind[0] == "cache" and not self._cache_as_rows(call, md):
            offset = fmha_v2.v_offset_pages(cache)
            tables = batch.tables.get(offset)
            if tables is None:
                tables = batch.tables[offset] = fmha_v2.paged_tables(md.page_table, offset)
            fmha_v2.attend_paged(q, target, cache, tables, cu_q, batch.cu_kv, batch.max_q_len, batch.max_kv_len,
                                 float(call.scale), factor, ws)
            lse = None
        else:
            # Attention over the cache is causal (a new token sees its prefix and itself).
            causal = kind[0] == "cache" or bool(call.causal)
            lse = fmha_v2.attend_contiguous(
                q, call.k, call.v, md.num_tokens, target, cu_q, batch.max_q_len, causal, float(call.scale),
                call.return_lse, ws, factor,
            )
        return self._finish(call, md, target, lse)

    @staticmethod
    def _planned_rows(
        plan: _Plan, md: AttentionMetadata, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The rows a prefill plan covers: all (padded) rows for a CUDA-graph plan, the real
        tokens for an exact one (FlashInfer checks q's rows against the plan's last indptr;
        the padding rows are zeroed afterwards as dead rows)."""
        if plan.slots is not None or q.shape[0] == md.num_tokens:
            return q, out, lse
        n = md.num_tokens
        return q[:n], out[:n], None if lse is None else lse[:n]

    @staticmethod
    def _dead_rows(call: AttentionCall, md: AttentionMetadata, num_rows: int, device: torch.device) -> torch.Tensor:
        """``bool [T]``: rows past the real tokens, and (prefix chunks) rows whose request has
        no keys in the chunk. Built on the device from metadata tensors (CUDA-graph safe)."""
        rows = torch.arange(num_rows, device=device, dtype=torch.int32)
        dead = rows >= md.num_tokens_tensor.to(device)
        if call.prefix_chunk is None:
            return dead
        loc = md.prefix_chunks[call.prefix_chunk].kv_start_loc.to(device)
        lens = loc[1:] - loc[:-1]
        qloc = md.query_start_loc.to(device)
        req = torch.searchsorted(qloc, rows, right=True) - 1
        req = req.clamp(0, lens.shape[0] - 1)
        return dead | (lens[req] == 0)


register_implementation(FlashInferAttention())
