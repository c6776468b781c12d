"""One attention op call, as every attention implementation receives it, and its checks.

The checks live here once so that every implementation (and the fake, at trace time)
rejects the same bad input with the same message.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from fullcg import telemetry
from fullcg.config import check_scale_factor
from fullcg.context import ForwardContext
from fullcg.errors import DtypeMismatchError, OverlappingOutputError
from fullcg.kv_cache import KVCache
from fullcg.metadata import ForwardMode

__all__ = ["AttentionCall", "check_tensors", "check_no_overlap", "check_against_context", "layer_cache"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# Not frozen, with slots: one is built per attention call, and a frozen dataclass's
# __init__ (object.__setattr__ per field) costs microseconds on the per-layer path.
# Keyword-only: sixteen fields, several of them flags, read wrong when given by position.
@dataclasses.dataclass(eq=False, slots=True, kw_only=True)
class AttentionCall:
    """The arguments of one attention op call (implementations read, never change them).

    ``op`` is the op's name (``attention``, ``attention_with_lse``, ``breakable_attention``,
    ``breakable_attention_with_lse``); implementations may record it but compute the same
    thing for all four. ``kv_cache_id`` is the ``uid`` of the KV cache the calling layer
    owns (0: not said), checked against the forward context's cache for ``layer_id``.
    """

    op: str
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [Tkv, Hkv, D]
    v: torch.Tensor  # [Tkv, Hkv, Dv]
    out: torch.Tensor  # [T, Hq, Dv], written in place
    layer_id: int | None  # None only in the fake, for a layer named by a key
    key_value_num_tokens: int | None
    prefill_scale_factor: float | None
    decode_scale_factor: float | None
    scale: float
    use_kv_cache: bool
    causal: bool
    prefix_chunk: int | None
    save_kv_cache: bool
    return_lse: bool
    kv_cache_id: int = 0
    sliding_window: int | None = None  # a query sees itself and the sliding_window - 1 keys before it
    logit_softcap: float | None = None  # scores become c * tanh(scores / c) before the softmax

    @property
    def num_q_heads(self) -> int:
        return self.q.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    def scale_factor_for(self, mode: ForwardMode) -> float | None:
        """The skip-softmax factor a request in ``mode`` uses: decode's for decode, else prefill's."""
        return self.decode_scale_factor if mode is ForwardMode.DECODE else self.prefill_scale_factor


def _shape(t: torch.Tensor) -> tuple[object, ...]:
    return tuple(t.shape)


def check_tensors(call: AttentionCall) -> None:
    """Shape, dtype, device and attribute checks that need no forward context.

    Runs in the fake implementation too, so bad input fails at trace time.
    """
    q, k, v, out, layer_id = call.q, call.k, call.v, call.out, call.layer_id
    # None: the layer is named by a key whose value is read only when the op runs (the fake).
    where = f"fullcg.{call.op} (layer {'?' if layer_id is None else layer_id})"
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.dim() != 3:
            raise ValueError(f"{where}: {name} must be 3-D [tokens, heads, head_dim], got shape {_shape(t)}")
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{where}: q must be float16, bfloat16 or float32, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{where}: q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if out.dtype != q.dtype:
        raise TypeError(f"{where}: out must have q's dtype {q.dtype}, got {out.dtype}")
    for name, t in (("k", k), ("v", v), ("out", out)):
        if t.device != q.device:
            raise ValueError(f"{where}: {name} is on {t.device} but q is on {q.device}; move them to one device")
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"{where}: query heads ({num_q_heads}) must be a multiple of key/value heads ({num_kv_heads})"
        )
    if v.shape[1] != num_kv_heads or v.shape[0] != k.shape[0]:
        raise ValueError(f"{where}: k {_shape(k)} and v {_shape(v)} must agree on tokens and heads")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"{where}: q head_dim {q.shape[2]} differs from k head_dim {k.shape[2]}")
    expected_out = (q.shape[0], num_q_heads, v.shape[2])
    if _shape(out) != expected_out:
        raise ValueError(f"{where}: out must have shape {expected_out} [tokens, q_heads, v_head_dim], got {_shape(out)}")
    if layer_id is not None and (isinstance(layer_id, bool) or not isinstance(layer_id, int) or layer_id < 0):
        raise ValueError(f"{where}: layer_id must be a non-negative integer, got {layer_id!r}")
    kv_tokens = call.key_value_num_tokens
    if kv_tokens is not None:
        message = f"{where}: key_value_num_tokens must lie in [0, {k.shape[0]}] (rows of k/v), got {kv_tokens}"
        if isinstance(kv_tokens, int) and isinstance(k.shape[0], int):
            if not 0 <= kv_tokens <= k.shape[0]:
                raise ValueError(message)
        else:  # symbolic while tracing: a runtime assertion instead of a guard on the value
            torch._check(kv_tokens >= 0, lambda: message)
            torch._check(kv_tokens <= k.shape[0], lambda: message)
    check_scale_factor(call.prefill_scale_factor, "skip_softmax_prefill_scale_factor")
    check_scale_factor(call.decode_scale_factor, "skip_softmax_decode_scale_factor")
    window, softcap = call.sliding_window, call.logit_softcap
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ValueError(f"{where}: sliding_window must be a positive integer (keys a query sees, itself included), got {window!r}")
    if window is not None and not call.causal and call.prefix_chunk is None:
        raise ValueError(
            f"{where}: a sliding window is measured back from each query's position, which non-causal attention over "
            "given k/v does not have; pass causal=True, attend over the KV cache, or drop sliding_window"
        )
    if softcap is not None and not (isinstance(softcap, (int, float)) and not isinstance(softcap, bool)
                                    and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"{where}: logit_softcap must be a positive finite number, got {softcap!r}")
    if call.use_kv_cache and (not call.causal or call.prefix_chunk is not None):
        raise ValueError(
            f"{where}: attention over the KV cache is always causal over the request's prefix and new tokens; "
            "pass use_kv_cache=False to attend over given k/v (non-causal or a prefix chunk)"
        )
    if call.use_kv_cache and not call.save_kv_cache:
        raise ValueError(
            f"{where}: attention over the KV cache needs the new tokens' k/v in it; "
            "save_kv_cache=False is only for attention over given k/v"
        )
    if call.prefix_chunk is not None and (call.prefix_chunk < 0 or call.causal or call.save_kv_cache):
        raise ValueError(
            f"{where}: prefix_chunk must be >= 0, and a chunk is attended without a causal mask (every new token "
            "sees the whole prefix) and never saved (it is already cached); got prefix_chunk="
            f"{call.prefix_chunk}, causal={call.causal}, save_kv_cache={call.save_kv_cache}"
        )


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return 0, 0
    start = t.data_ptr()
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    return start, start + span * t.element_size()


def check_no_overlap(call: AttentionCall) -> None:
    """``out`` may be exactly ``q`` (or ``k``/``v``), but must not overlap them otherwise.

    Implementations write ``out`` request by request while still reading the inputs, so a
    shifted overlap reads rows already overwritten. Needs real tensors (not in the fake);
    runs with :func:`check_tensors` on eagerly run calls, where ``out`` may come from the caller.
    """
    out = call.out
    o_start, o_end = _byte_range(out)
    for name, t in (("q", call.q), ("k", call.k), ("v", call.v)):
        start, end = _byte_range(t)
        if start < o_end and o_start < end and not (
            start == o_start and t.shape == out.shape and t.stride() == out.stride()
        ):
            raise OverlappingOutputError(
                f"fullcg.{call.op} (layer {call.layer_id}): out overlaps {name} without being exactly {name} "
                f"(bytes {o_start:#x}..{o_end:#x} vs {start:#x}..{end:#x}): pass a separate out tensor, or {name} "
                "itself to write in place"
            )


def check_against_context(call: AttentionCall, ctx: ForwardContext) -> KVCache | None:
    """Checks of a call against the step's metadata; returns the layer's KV cache if used.

    What depends only on the layer and the step (the cache's fit) is checked once per step
    and layer; what the call's tensors decide is checked every call (a few comparisons).
    """
    md = ctx.metadata
    if call.q.shape[0] < md.num_tokens:
        raise ValueError(
            f"fullcg.{call.op} (layer {call.layer_id}): q has {call.q.shape[0]} tokens but the batch has "
            f"{md.num_tokens} new tokens"
        )
    if call.prefix_chunk is not None:
        if call.prefix_chunk >= len(md.prefix_chunks):
            raise ValueError(
                f"fullcg.{call.op} (layer {call.layer_id}): prefix_chunk {call.prefix_chunk} is out of range; "
                f"this batch has {len(md.prefix_chunks)} prefix chunks"
            )
        rows = md.prefix_chunks[call.prefix_chunk].offsets[-1]
    else:
        rows = md.num_tokens
    available = call.k.shape[0] if call.key_value_num_tokens is None else call.key_value_num_tokens
    if available < rows:
        raise ValueError(
            f"fullcg.{call.op} (layer {call.layer_id}): the batch reads {rows} rows of k/v but only {available} "
            "are valid (k.shape[0] or key_value_num_tokens)"
        )
    if not (call.use_kv_cache or call.save_kv_cache):
        return None
    return layer_cache(call, ctx)


def layer_cache(call: AttentionCall, ctx: ForwardContext) -> KVCache:
    """The step's KV cache for the call's layer, checked to be the calling layer's own and
    to fit the call (once per step and layer; later calls take the remembered answer)."""
    cache = ctx.kv_caches.get(call.layer_id)
    if cache is not None and call.kv_cache_id and cache.uid == call.kv_cache_id and \
            ctx.step.checked_caches.get(call.layer_id) is cache:
        return cache
    return _check_cache(call, ctx, cache)


def _check_cache(call: AttentionCall, ctx: ForwardContext, cache: KVCache | None) -> KVCache:
    md = ctx.metadata
    where = f"fullcg.{call.op} (layer {call.layer_id})"
    if cache is None:
        raise RuntimeError(
            f"{where}: no KV cache for this layer in the forward context; allocate one "
            "(Attention.allocate_kv_cache) and pass the model as forward_context(metadata, model)"
        )
    if call.kv_cache_id and cache.uid != call.kv_cache_id and ctx.source == "a mapping of KV caches":
        raise RuntimeError(
            f"{where}: the running layer owns KV cache #{call.kv_cache_id}, but the forward context was entered with "
            f"a mapping of KV caches, whose layer {call.layer_id} entry is cache #{cache.uid}. A layer that owns a "
            "cache runs on it alone (captured graphs hold its addresses): pass the model, "
            "`with fullcg.forward_context(metadata, model):`; the mapping form is for layers and op calls that own "
            "no cache"
        )
    if call.kv_cache_id and cache.uid != call.kv_cache_id:
        raise RuntimeError(
            f"{where}: the running layer owns KV cache #{call.kv_cache_id}, but the forward context was entered "
            f"with {ctx.source}, whose layer {call.layer_id} owns cache #{cache.uid}: another model. Pass the "
            "model that runs: `with fullcg.forward_context(metadata, model): model(...)`"
        )
    if cache.num_kv_heads != call.num_kv_heads or cache.head_dim != call.k.shape[2] or cache.v_head_dim != call.v.shape[2]:
        raise ValueError(
            f"{where}: KV cache pages {tuple(cache.k.shape)} do not fit k {tuple(call.k.shape)}; "
            "the cache needs [pages, page_size, kv_heads, head_dim]"
        )
    if cache.k.device != call.q.device:
        raise ValueError(f"{where}: KV cache is on {cache.k.device} but q is on {call.q.device}")
    # Refused rather than cast: a silent cast would round fp32 k/v into an fp16 cache (or
    # widen them) on every step, and kernels read the cache in q's dtype.
    if cache.k.dtype != call.q.dtype:
        raise DtypeMismatchError(
            f"{where}: q is {call.q.dtype} but the KV cache is {cache.k.dtype}: allocate the cache in the model's "
            f"dtype (allocate_kv_cache(..., dtype={call.q.dtype})) or run the model in {cache.k.dtype}"
        )
    if cache.page_size != md.page_size:
        raise ValueError(f"{where}: metadata page_size {md.page_size} differs from the cache's {cache.page_size}")
    step = ctx.step
    if cache.compiled_counts is not None and not ctx.compiled and not step.fallback_counted:
        step.fallback_counted = True  # once per step
        telemetry.count_fallback(cache.compiled_counts, ctx.source)
    step.checked_caches[call.layer_id] = cache
    fit = (cache.num_kv_heads, cache.head_dim, cache.v_head_dim, cache.k.dtype, cache.k.device, md.page_size)
    cache.fit = _fits.setdefault(fit, fit)
    return cache


# One object per distinct fit, so "this cache passed the checks for calls like this one"
# is an identity test on the per-layer path (an interning cache: a handful of entries).
_fits: dict[tuple[object, ...], tuple[object, ...]] = {}
