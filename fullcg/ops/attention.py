"""The ``fullcg`` attention ops: definitions and fake (meta) implementations.

Four attention ops share one signature and differ only in name and result:

=================  ================================  ===================================
                   writes ``out``, returns nothing   also returns LSE ``float32 [T, Hq]``
=================  ================================  ===================================
non-breakable      ``fullcg::attention``              ``fullcg::attention_with_lse``
breakable          ``fullcg::breakable_attention``    ``fullcg::breakable_attention_with_lse``
=================  ================================  ===================================

Breakable ops are where the compile backend splits a graph into pieces; they are tagged
``cudagraph_unsafe`` so that Inductor's own partitioning agrees. Per-batch data comes
from the forward context, never from graph inputs. LSE is natural-log and token-major.

Also here: ``fullcg::merge_attn_states`` (exact merge of two partial results by LSE), and
for the chunked-prefix pattern ``fullcg::merge_prefix_chunks`` (attends over every chunk
of the cached prefix and merges each in, however many the step has: one graph for all
counts) and ``fullcg::gather_prefix_chunk`` (copies one chunk of every request's cached
prefix out of the paged KV cache, for models that transform a chunk before attending).
``fullcg::merge_latent_prefix_chunks`` is the chunked-prefix pattern over a latent cache
(multi-head latent attention in MHA form): it saves the step's new latents, then up-projects
each prefix chunk's latents to per-head keys and values and merges the chunk in.

Which layer calls an op can be a run-time value: a layer passes ``layer_id=-1``
(:data:`LAYER_FROM_KEY`) and ``layer``, its ``layer_key``: an int64 CPU tensor
``[layer_id, kv_cache_id]`` the op reads when it runs. A graph input rather than constants
baked into the graph, it leaves every layer of a model the same traced graph, so Dynamo can
trace a repeated layer once (``FullCGConfig.trace_layers_once``). Callers without a layer
object pass the two ints and no key.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from fullcg.context import ForwardContext, current_context, get_forward_context
from fullcg.ops import torch_ops
from fullcg.ops.call import AttentionCall, check_against_context, check_no_overlap, check_tensors, layer_cache
from fullcg.ops.impl import AttentionImpl, resolve_implementation

__all__ = [
    "attention",
    "attention_with_lse",
    "breakable_attention",
    "breakable_attention_with_lse",
    "merge_attn_states",
    "gather_prefix_chunk",
    "merge_prefix_chunks",
    "merge_latent_prefix_chunks",
    "ATTENTION_OPS",
    "ATTRIBUTE_NAMES",
    "LAYER_FROM_KEY",
    "layer_identity",
    "EAGER_KERNELS",
]

_BREAKABLE_TAGS: tuple[torch.Tag, ...] = (
    (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
)

# Ops are defined on a Library directly rather than with torch.library.custom_op: for an op
# that mutates an argument, custom_op adds a Python ADInplaceOrView kernel that re-reads the
# schema on every call (about 0.2 ms per call here), which a per-layer hot path cannot pay.
_lib = torch.library.Library("fullcg", "DEF")


#: ``op overload -> its Python kernel``. Split points of a piecewise graph call the kernel
#: directly: they run eagerly, never traced again, so the dispatcher's round trip (every
#: argument boxed and unboxed) is pure per-layer host cost there.
EAGER_KERNELS: dict[object, object] = {}


def _register(name: str, schema: str, kernel: object, fake: object, tags: tuple[torch.Tag, ...] = ()) -> object:
    """Define ``fullcg::name``, its kernel for every device, and its fake; return the overload."""
    _lib.define(name + schema, tags=(torch.Tag.pt2_compliant_tag, *tags))
    _lib.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"fullcg::{name}", fake, lib=_lib)
    overload = getattr(torch.ops.fullcg, name).default
    EAGER_KERNELS[overload] = kernel
    return overload


#: The attributes every attention op takes after ``q, k, v, out``, in schema order.
ATTRIBUTE_SCHEMA = (
    "int layer_id, SymInt? key_value_num_tokens=None, float? skip_softmax_prefill_scale_factor=None, "
    "float? skip_softmax_decode_scale_factor=None, float? scale=None, bool use_kv_cache=True, "
    "bool causal=True, int? prefix_chunk=None, bool? save_kv_cache=None, int? sliding_window=None, "
    "float? logit_softcap=None, int kv_cache_id=0, Tensor? layer=None"
)
ATTRIBUTE_NAMES = tuple(part.split("=")[0].split()[-1] for part in ATTRIBUTE_SCHEMA.split(", "))
_ATTRIBUTE_DEFAULTS = (None, None, None, None, True, True, None, None, None, None, 0, None)  # all but layer_id
_NUM_ATTRIBUTES = len(ATTRIBUTE_NAMES)
_CACHE_ID = ATTRIBUTE_NAMES.index("kv_cache_id")  # the key follows it

#: The ``layer_id`` a layer passes with its ``layer`` key: the op reads the id from the key.
LAYER_FROM_KEY = -1


def layer_identity(op: str, layer_id: int, kv_cache_id: int, layer: torch.Tensor | None) -> tuple[int, int]:
    """``(layer_id, kv_cache_id)`` of a call: read from ``layer`` (a layer's key, read on the
    host: two ints, no device sync) when given, else the ints as passed."""
    if layer is None:
        return layer_id, kv_cache_id
    if layer_id != LAYER_FROM_KEY or kv_cache_id:
        raise ValueError(
            f"fullcg.{op}: got both a layer key and layer_id={layer_id}, kv_cache_id={kv_cache_id}; a call names its "
            f"layer one way: layer_id={LAYER_FROM_KEY} and kv_cache_id=0 with the key, or the ints without one"
        )
    return tuple(layer.tolist())  # type: ignore[return-value]


def _check_layer_key(op: str, layer: torch.Tensor | None) -> None:
    """The key's form, checkable on a fake tensor too (its values are read when the op runs)."""
    if layer is not None and (layer.shape != (2,) or layer.dtype != torch.int64 or layer.device.type != "cpu"):
        raise ValueError(
            f"fullcg.{op}: layer must be a layer's layer_key, an int64 CPU tensor [layer_id, kv_cache_id]; got "
            f"{layer.dtype} {tuple(layer.shape)} on {layer.device}"
        )


def _bind(op: str, return_lse: bool, q, k, v, out, attrs: tuple, resolve: bool = True) -> AttentionCall:
    """Name the positional attributes the dispatcher passes and fill in derived defaults.

    ``resolve=False`` (the fake) leaves a key unread: its values exist only when the op runs.
    """
    if len(attrs) != len(ATTRIBUTE_NAMES):
        attrs = attrs + _ATTRIBUTE_DEFAULTS[len(attrs) - 1 :]
    layer_id, kv_tokens, prefill, decode, scale, use_kv_cache, causal, chunk, save, window, softcap, cache_id, layer = attrs
    _check_layer_key(op, layer)
    if layer is not None and not resolve:
        layer_id, cache_id = None, 0
    else:
        layer_id, cache_id = layer_identity(op, layer_id, cache_id, layer)
    return AttentionCall(
        op=op, q=q, k=k, v=v, out=out, layer_id=layer_id, key_value_num_tokens=kv_tokens,
        prefill_scale_factor=prefill, decode_scale_factor=decode,
        scale=scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        use_kv_cache=use_kv_cache, causal=causal, prefix_chunk=chunk,
        save_kv_cache=use_kv_cache if save is None else save, return_lse=return_lse, kv_cache_id=cache_id,
        sliding_window=window, logit_softcap=softcap,
    )


def step_implementation(ctx: ForwardContext, device: torch.device, head_dim: int, v_head_dim: int) -> AttentionImpl:
    """The implementation that runs this step's attention of these head dims (resolved
    once per step; the runner plans captured full graphs with what it finds here)."""
    resolved = ctx.step.implementations
    impl = resolved.get((head_dim, v_head_dim))
    if impl is None:
        impl = resolved[(head_dim, v_head_dim)] = resolve_implementation(
            ctx.config.attention_impl, device, head_dim, v_head_dim)
    return impl


def _check_saved_once(call: AttentionCall, ctx: ForwardContext) -> None:
    """A layer owns one KV cache slot per token: a second save in one step would overwrite the
    first (a module that calls attention twice per layer, e.g. on two halves of v). Compiled
    graphs are checked once at compile time instead (``AttributesPass``)."""
    saved = ctx.step.saved_kv
    first = saved.get(call.layer_id)
    if first is None:
        saved[call.layer_id] = (call.k, call.v)
        return
    # Saving the same k/v again (a step re-run in one context) overwrites nothing that differs.
    n = ctx.metadata.num_tokens
    if not (torch.equal(first[0][:n], call.k[:n]) and torch.equal(first[1][:n], call.v[:n])):
        raise RuntimeError(
            f"fullcg.{call.op} (layer {call.layer_id}): this layer saved new k/v twice in one step, so the second "
            "save overwrites the first in the layer's KV cache and later steps would read the wrong k/v. fullcg keeps "
            "one cache per layer_id: give each attention call that saves its own fullcg.Attention with its own "
            "layer_id, or pass save_kv_cache=False to the calls that attend over given k/v only"
        )


def _define(name: str, return_lse: bool, breakable: bool) -> object:
    """Define one of the four attention ops; they differ only in name, tags and result."""

    def kernel(q, k, v, out, *attrs):
        ctx = current_context()
        # Compiled steps were checked once by the fake at trace time, with these shapes; the
        # first call of each shape in a step leaves a plan that later calls (the other layers)
        # run directly, checking only that the layer's cache is its own and fits.
        plan_key = None
        if ctx is not None and ctx.compiled and len(attrs) >= _NUM_ATTRIBUTES - 1 and not ctx.config.debug_checks:
            # Every attribute but the layer's identity (the trailing key may be left out).
            plan_key = (name, attrs[1:_CACHE_ID], q.dtype, q.device, q.shape, k.shape, v.shape, q.stride(), k.stride(),
                        v.stride(), out.stride())
            planned = ctx.step.plans.get(plan_key)
            if planned is not None:
                plan, fit = planned
                key = attrs[_CACHE_ID + 1] if len(attrs) > _CACHE_ID + 1 else None
                layer_id, cache_id = key.tolist() if key is not None else (attrs[0], attrs[_CACHE_ID])
                cache = ctx.kv_caches.get(layer_id) if fit is not None else None
                if fit is None or (cache is not None and cache.uid == cache_id and cache.fit is fit):
                    return plan(q, k, v, out, cache, layer_id)
        call = _bind(name, return_lse, q, k, v, out, attrs)
        if ctx is None or not ctx.compiled or ctx.config.debug_checks:
            check_tensors(call)
            check_no_overlap(call)
            if ctx is None:
                ctx = get_forward_context()  # raises, saying how to enter one
        cache = check_against_context(call, ctx)
        if call.save_kv_cache and not ctx.compiled:
            _check_saved_once(call, ctx)
        impl = step_implementation(ctx, q.device, q.shape[2], v.shape[2])
        if cache is not None and cache.v_in_k and not impl.takes_v_in_k:
            raise NotImplementedError(
                f"fullcg.{name} (layer {call.layer_id}): attention implementation {impl.name!r} cannot attend over a "
                "latent cache (its v is the leading values of k: multi-head latent attention); run the model with "
                "attention_impl='reference'"
            )
        if call.save_kv_cache:
            impl.save_kv(call, ctx, cache)
        lse = impl.forward(call, ctx, cache if call.use_kv_cache else None)
        if return_lse and lse is None:
            raise RuntimeError(f"attention implementation {impl.name!r} returned no LSE for fullcg.{name}")
        if plan_key is not None and call.kv_cache_id and plan_key not in ctx.step.plans:
            plan = impl.step_plan(call, ctx, cache)
            if plan is not None:
                ctx.step.plans[plan_key] = (plan, cache.fit if cache is not None else None)
        return lse if return_lse else None

    def fake(q, k, v, out, *attrs):
        check_tensors(_bind(name, return_lse, q, k, v, out, attrs, resolve=False))
        return q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32) if return_lse else None

    kernel.__name__ = name
    schema = f"(Tensor q, Tensor k, Tensor v, Tensor(a!) out, {ATTRIBUTE_SCHEMA}) -> " + ("Tensor" if return_lse else "()")
    return _register(name, schema, kernel, fake, _BREAKABLE_TAGS if breakable else ())


attention = _define("attention", return_lse=False, breakable=False)
attention_with_lse = _define("attention_with_lse", return_lse=True, breakable=False)
breakable_attention = _define("breakable_attention", return_lse=False, breakable=True)
breakable_attention_with_lse = _define("breakable_attention_with_lse", return_lse=True, breakable=True)

#: ``(breakable, return_lse) -> op``: the table :class:`fullcg.Attention` dispatches on.
ATTENTION_OPS = {
    (False, False): attention,
    (False, True): attention_with_lse,
    (True, False): breakable_attention,
    (True, True): breakable_attention_with_lse,
}


def _check_merge(out, prefix_out, prefix_lse, suffix_out, suffix_lse, out_lse) -> None:
    where = "fullcg.merge_attn_states"
    for name, t in (("prefix_out", prefix_out), ("suffix_out", suffix_out)):
        if t.shape != out.shape:
            raise ValueError(f"{where}: {name} has shape {tuple(t.shape)}, out has {tuple(out.shape)}; they must match")
        if t.dtype != out.dtype or t.device != out.device:
            raise ValueError(f"{where}: {name} must share out's dtype and device ({out.dtype}, {out.device})")
    if out.dim() != 3:
        raise ValueError(f"{where}: out must be [tokens, heads, head_dim], got shape {tuple(out.shape)}")
    lse_shape = tuple(out.shape[:2])
    lses = [("prefix_lse", prefix_lse), ("suffix_lse", suffix_lse)]
    if out_lse is not None:
        lses.append(("out_lse", out_lse))
    for name, t in lses:
        if tuple(t.shape) != lse_shape or t.dtype != torch.float32 or t.device != out.device:
            raise ValueError(
                f"{where}: {name} must be float32 {lse_shape} [tokens, heads] on {out.device}, "
                f"got {t.dtype} {tuple(t.shape)} on {t.device}"
            )


def _merge_attn_states(
    out: torch.Tensor,
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_out: torch.Tensor,
    suffix_lse: torch.Tensor,
    out_lse: Optional[torch.Tensor] = None,
) -> None:
    """Write the exact merge of two partial attention results (natural-log LSE) into ``out``.

    A row whose LSE is -inf on one side (nothing attended) takes the other side; a row empty
    on both sides becomes zeros with LSE -inf. ``+inf`` LSE (some kernels' empty rows) is
    read as -inf.
    """
    _check_merge(out, prefix_out, prefix_lse, suffix_out, suffix_lse, out_lse)
    torch_ops.merge_states(out, prefix_out, prefix_lse, suffix_out, suffix_lse, out_lse)


def _merge_attn_states_fake(out, prefix_out, prefix_lse, suffix_out, suffix_lse, out_lse=None) -> None:
    _check_merge(out, prefix_out, prefix_lse, suffix_out, suffix_lse, out_lse)


merge_attn_states = _register(
    "merge_attn_states",
    "(Tensor(a!) out, Tensor prefix_out, Tensor prefix_lse, Tensor suffix_out, Tensor suffix_lse, "
    "Tensor(b!)? out_lse=None) -> ()",
    _merge_attn_states,
    _merge_attn_states_fake,
)


def _check_gather(k_out: torch.Tensor, v_out: torch.Tensor, layer_id: int | None, chunk: int) -> None:
    where = f"fullcg.gather_prefix_chunk (layer {'?' if layer_id is None else layer_id})"
    if k_out.dim() != 3 or v_out.dim() != 3 or k_out.shape[:2] != v_out.shape[:2]:
        raise ValueError(
            f"{where}: k_out and v_out must be [rows, kv_heads, head_dim] with equal rows and heads, "
            f"got {tuple(k_out.shape)} and {tuple(v_out.shape)}"
        )
    if chunk < 0:
        raise ValueError(f"{where}: chunk must be >= 0, got {chunk}")


def _gather_prefix_chunk(k_out: torch.Tensor, v_out: torch.Tensor, layer_id: int, chunk: int,
                         layer: torch.Tensor | None = None) -> None:
    """Copy chunk ``chunk`` of every request's cached prefix into ``k_out``/``v_out``, packed.

    The packing is ``metadata.prefix_chunks[chunk]``; rows past the chunk's tokens are zeroed.
    """
    _check_layer_key("gather_prefix_chunk", layer)
    layer_id, _ = layer_identity("gather_prefix_chunk", layer_id, 0, layer)
    _check_gather(k_out, v_out, layer_id, chunk)
    ctx = get_forward_context()
    md = ctx.metadata
    if chunk >= len(md.prefix_chunks):
        raise ValueError(f"fullcg.gather_prefix_chunk: chunk {chunk} is out of range; the batch has {len(md.prefix_chunks)}")
    cache = ctx.kv_caches.get(layer_id)
    if cache is None:
        raise RuntimeError(
            f"fullcg.gather_prefix_chunk: no KV cache for layer {layer_id} in the forward context; "
            "pass the model as forward_context(metadata, model)"
        )
    plan = md.prefix_chunks[chunk]
    if plan.offsets[-1] > k_out.shape[0]:
        raise ValueError(
            f"fullcg.gather_prefix_chunk: chunk {chunk} holds {plan.offsets[-1]} tokens but k_out has "
            f"{k_out.shape[0]} rows; size it metadata.prefix_chunk_tokens"
        )
    torch_ops.gather_prefix_chunk(k_out, v_out, cache, md, plan)


def _gather_prefix_chunk_fake(k_out, v_out, layer_id, chunk, layer=None) -> None:
    _check_layer_key("gather_prefix_chunk", layer)
    _check_gather(k_out, v_out, None if layer is not None else layer_id, chunk)


gather_prefix_chunk = _register(
    "gather_prefix_chunk",
    "(Tensor(a!) k_out, Tensor(b!) v_out, int layer_id, int chunk, Tensor? layer=None) -> ()",
    _gather_prefix_chunk,
    _gather_prefix_chunk_fake,
)


def _check_merge_prefix(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, layer_id: int | None) -> None:
    # None: named by a key, read only when the op runs (the fake).
    where = f"fullcg.merge_prefix_chunks (layer {'?' if layer_id is None else layer_id})"
    if q.dim() != 3 or out.dim() != 3 or out.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"{where}: q must be [tokens, heads, head_dim] and out [tokens, heads, v_head_dim] with q's tokens and "
            f"heads, got {tuple(q.shape)} and {tuple(out.shape)}"
        )
    if out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"{where}: out must share q's dtype and device ({q.dtype}, {q.device})")
    if tuple(lse.shape) != tuple(q.shape[:2]) or lse.dtype != torch.float32 or lse.device != q.device:
        raise ValueError(
            f"{where}: lse must be float32 {tuple(q.shape[:2])} [tokens, heads] on {q.device}, "
            f"got {lse.dtype} {tuple(lse.shape)} on {lse.device}"
        )
    if layer_id is not None and (isinstance(layer_id, bool) or not isinstance(layer_id, int) or layer_id < 0):
        raise ValueError(f"{where}: layer_id must be a non-negative integer, got {layer_id!r}")


def _chunk_buffers(ctx: ForwardContext, q: torch.Tensor, out: torch.Tensor, cache: Any, rows: int) -> tuple:
    """Gather and result buffers for one chunk, made once per step and shared by its layers."""
    key = (q.shape, out.shape[2], cache.num_kv_heads, cache.head_dim, cache.v_head_dim, q.dtype)
    buffers = ctx.step.chunk_buffers.get(key)
    if buffers is None:
        buffers = ctx.step.chunk_buffers[key] = (
            q.new_empty((rows, cache.num_kv_heads, cache.head_dim)),
            q.new_empty((rows, cache.num_kv_heads, cache.v_head_dim)),
            torch.empty_like(out),
        )
    return buffers


def _merge_prefix_chunks(
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    layer_id: int,
    skip_softmax_prefill_scale_factor: Optional[float] = None,
    skip_softmax_decode_scale_factor: Optional[float] = None,
    scale: Optional[float] = None,
    kv_cache_id: int = 0,
    sliding_window: Optional[int] = None,
    logit_softcap: Optional[float] = None,
    layer: Optional[torch.Tensor] = None,
) -> None:
    """Attend ``q`` over every chunk of the step's cached prefix and merge each into
    ``out``/``lse`` in place.

    ``out``/``lse`` hold a partial result (typically the new tokens attended over
    themselves, with LSE). The chunk count is read from the step's metadata when the op
    runs, so one graph serves every count: the loop the chunked-prefix pattern would
    otherwise unroll in the graph (one graph per count) runs here, eagerly, always
    between pieces. Each chunk is gathered, attended without a causal mask (every new
    token sees the whole prefix; skip-softmax factors per request's mode) and merged.
    """
    _check_layer_key("merge_prefix_chunks", layer)
    layer_id, kv_cache_id = layer_identity("merge_prefix_chunks", layer_id, kv_cache_id, layer)
    _check_merge_prefix(q, out, lse, layer_id)
    ctx = get_forward_context()
    md = ctx.metadata
    if not md.num_prefix_chunks:
        return
    where = f"fullcg.merge_prefix_chunks (layer {layer_id})"
    if q.shape[0] < md.num_tokens:
        raise ValueError(f"{where}: q has {q.shape[0]} tokens but the batch has {md.num_tokens} new tokens")
    cache = ctx.kv_caches.get(layer_id)
    if cache is None:
        raise RuntimeError(
            f"{where}: no KV cache for this layer in the forward context; pass the model as "
            "forward_context(metadata, model)"
        )
    if q.shape[2] != cache.head_dim or out.shape[2] != cache.v_head_dim or q.shape[1] % cache.num_kv_heads:
        raise ValueError(
            f"{where}: q {tuple(q.shape)} and out {tuple(out.shape)} do not fit the layer's KV cache pages "
            f"{tuple(cache.k.shape)} [pages, page_size, kv_heads, head_dim]: q needs the cache's head_dim and a "
            "multiple of its kv_heads, out its v_head_dim"
        )
    k_c, v_c, out_c = _chunk_buffers(ctx, q, out, cache, md.prefix_chunk_tokens)
    # One call object for all chunks: only the chunk index changes.
    call = AttentionCall(
        op="merge_prefix_chunks", q=q, k=k_c, v=v_c, out=out_c, layer_id=layer_id, key_value_num_tokens=None,
        prefill_scale_factor=skip_softmax_prefill_scale_factor, decode_scale_factor=skip_softmax_decode_scale_factor,
        scale=scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        use_kv_cache=False, causal=False, prefix_chunk=0, save_kv_cache=False, return_lse=True,
        kv_cache_id=kv_cache_id, sliding_window=sliding_window, logit_softcap=logit_softcap,
    )
    check_tensors(call)  # the window and soft-cap values (shapes were checked above)
    layer_cache(call, ctx)  # the calling layer's own cache, and it fits (raises naming the fix)
    impl = step_implementation(ctx, q.device, q.shape[2], out.shape[2])
    for c, plan in enumerate(md.prefix_chunks):
        torch_ops.gather_prefix_chunk(k_c, v_c, cache, md, plan)
        call.prefix_chunk = c
        lse_c = impl.forward(call, ctx, None)
        if lse_c is None:
            raise RuntimeError(f"attention implementation {impl.name!r} returned no LSE for fullcg.merge_prefix_chunks")
        torch_ops.merge_states(out, out_c, lse_c, out, lse, lse)


def _merge_prefix_chunks_fake(q, out, lse, layer_id, *attrs, layer=None) -> None:
    layer = attrs[6] if len(attrs) > 6 else layer
    _check_layer_key("merge_prefix_chunks", layer)
    _check_merge_prefix(q, out, lse, None if layer is not None else layer_id)


merge_prefix_chunks = _register(
    "merge_prefix_chunks",
    "(Tensor q, Tensor(a!) out, Tensor(b!) lse, int layer_id, float? skip_softmax_prefill_scale_factor=None, "
    "float? skip_softmax_decode_scale_factor=None, float? scale=None, int kv_cache_id=0, int? sliding_window=None, "
    "float? logit_softcap=None, Tensor? layer=None) -> ()",
    _merge_prefix_chunks,
    _merge_prefix_chunks_fake,
    _BREAKABLE_TAGS,
)


def _check_merge_latent(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, new_latent: torch.Tensor,
                        kv_b_weight: torch.Tensor, layer_id: int | None) -> None:
    _check_merge_prefix(q, out, lse, layer_id)
    where = f"fullcg.merge_latent_prefix_chunks (layer {'?' if layer_id is None else layer_id})"
    heads, v_dim = q.shape[1], out.shape[2]
    if new_latent.dim() != 2 or new_latent.shape[0] != q.shape[0]:
        raise ValueError(
            f"{where}: new_latent must be [tokens, kv_lora_rank + rope] with q's {q.shape[0]} tokens, "
            f"got {tuple(new_latent.shape)}"
        )
    if kv_b_weight.dim() != 2 or kv_b_weight.shape[0] % heads or kv_b_weight.shape[1] >= new_latent.shape[1]:
        raise ValueError(
            f"{where}: kv_b_weight must be [{heads} * (nope + {v_dim}), kv_lora_rank] (kv_b_proj.weight) with "
            f"kv_lora_rank below new_latent's {new_latent.shape[1]} values, got {tuple(kv_b_weight.shape)}"
        )
    rope = new_latent.shape[1] - kv_b_weight.shape[1]
    nope = q.shape[2] - rope
    if nope <= 0 or kv_b_weight.shape[0] != heads * (nope + v_dim):
        raise ValueError(
            f"{where}: q's head dim {q.shape[2]} less the rope dim {rope} (new_latent's values past kv_lora_rank "
            f"{kv_b_weight.shape[1]}) gives nope={nope}, so kv_b_weight must have {heads} * (nope + {v_dim}) rows, "
            f"got {kv_b_weight.shape[0]}"
        )
    for name, t in (("new_latent", new_latent), ("kv_b_weight", kv_b_weight)):
        if t.device != q.device or not t.is_floating_point():
            raise ValueError(f"{where}: {name} must be a floating-point tensor on {q.device}, got {t.dtype} on {t.device}")


def _merge_latent_prefix_chunks(
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    new_latent: torch.Tensor,
    kv_b_weight: torch.Tensor,
    layer_id: int,
    skip_softmax_prefill_scale_factor: Optional[float] = None,
    skip_softmax_decode_scale_factor: Optional[float] = None,
    scale: Optional[float] = None,
    kv_cache_id: int = 0,
    layer: Optional[torch.Tensor] = None,
) -> None:
    """Multi-head latent attention's chunked prefix: save the step's new latents, then attend
    ``q`` over every chunk of the cached prefix, up-projected, merging each into ``out``/``lse``.

    The layer's cache is a latent cache (``KVCache.v_in_k``: ``[pages, page_size, 1, rank +
    rope]``). ``new_latent [T, rank + rope]`` (the new tokens' latent then rope key) is written
    into it, as the absorbed form's attention call would. Each chunk's latents ``c`` become
    keys ``[W_UK[h] c ; k_pe]`` and values ``W_UV[h] c`` through ``kv_b_weight``
    (``kv_b_proj.weight``, ``[H * (nope + v), rank]``) in a buffer of
    ``metadata.prefix_chunk_tokens`` rows, never stored; attention over them (no causal
    mask, LSE) is merged in. One op whatever the chunk count, so one graph serves every count.
    """
    _check_layer_key("merge_latent_prefix_chunks", layer)
    layer_id, kv_cache_id = layer_identity("merge_latent_prefix_chunks", layer_id, kv_cache_id, layer)
    _check_merge_latent(q, out, lse, new_latent, kv_b_weight, layer_id)
    ctx = get_forward_context()
    md = ctx.metadata
    where = f"fullcg.merge_latent_prefix_chunks (layer {layer_id})"
    if q.shape[0] < md.num_tokens:
        raise ValueError(f"{where}: q has {q.shape[0]} tokens but the batch has {md.num_tokens} new tokens")
    rank, width = kv_b_weight.shape[1], new_latent.shape[1]
    call = AttentionCall(
        op="merge_latent_prefix_chunks", q=q, k=new_latent[:, None], v=new_latent[:, None, :rank], out=out,
        layer_id=layer_id, key_value_num_tokens=None, prefill_scale_factor=skip_softmax_prefill_scale_factor,
        decode_scale_factor=skip_softmax_decode_scale_factor,
        scale=scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        use_kv_cache=False, causal=False, prefix_chunk=None, save_kv_cache=True, return_lse=True,
        kv_cache_id=kv_cache_id,
    )
    cache = layer_cache(call, ctx)  # the calling layer's own cache (raises naming the fix)
    if not cache.v_in_k or cache.num_kv_heads != 1 or cache.head_dim != width or cache.v_head_dim != rank:
        raise ValueError(
            f"{where}: the layer's KV cache (pages {tuple(cache.k.shape)}) is not a latent cache of "
            f"{rank} + {width - rank} values per token; allocate it with fullcg.MLAAttention.allocate_kv_cache"
        )
    if not ctx.compiled:
        _check_saved_once(call, ctx)
    torch_ops.save_new_kv(call.k, call.v, md, cache)
    if not md.num_prefix_chunks:
        return
    heads, v_dim = q.shape[1], out.shape[2]
    nope = q.shape[2] - (width - rank)
    rows = md.prefix_chunk_tokens
    key = ("latent", q.shape, out.shape[2], width, q.dtype)
    buffers = ctx.step.chunk_buffers.get(key)
    if buffers is None:
        buffers = ctx.step.chunk_buffers[key] = (
            torch.empty((rows, 1, width), dtype=cache.k.dtype, device=q.device),
            q.new_empty((rows, heads, q.shape[2])),
            q.new_empty((rows, heads, v_dim)),
            torch.empty_like(out),
        )
    latent_c, k_c, v_c, out_c = buffers
    chunk_call = AttentionCall(
        op="merge_latent_prefix_chunks", q=q, k=k_c, v=v_c, out=out_c, layer_id=layer_id, key_value_num_tokens=None,
        prefill_scale_factor=skip_softmax_prefill_scale_factor, decode_scale_factor=skip_softmax_decode_scale_factor,
        scale=call.scale, use_kv_cache=False, causal=False, prefix_chunk=0, save_kv_cache=False, return_lse=True,
        kv_cache_id=kv_cache_id,
    )
    impl = step_implementation(ctx, q.device, q.shape[2], v_dim)
    weight = kv_b_weight.to(q.dtype)
    for c, plan in enumerate(md.prefix_chunks):
        torch_ops.gather_prefix_chunk(latent_c, latent_c[..., :rank], cache, md, plan)
        # Up-project the chunk: per head, [W_UK c ; k_pe] and W_UV c.
        kv = torch.nn.functional.linear(latent_c[:, 0, :rank].to(q.dtype), weight).view(rows, heads, nope + v_dim)
        k_c[..., :nope] = kv[..., :nope]
        k_c[..., nope:] = latent_c[:, :, rank:].to(q.dtype)  # the rope key, shared by every head
        v_c.copy_(kv[..., nope:])
        chunk_call.prefix_chunk = c
        lse_c = impl.forward(chunk_call, ctx, None)
        if lse_c is None:
            raise RuntimeError(f"attention implementation {impl.name!r} returned no LSE for fullcg.{chunk_call.op}")
        torch_ops.merge_states(out, out_c, lse_c, out, lse, lse)


def _merge_latent_prefix_chunks_fake(q, out, lse, new_latent, kv_b_weight, layer_id, *attrs, layer=None) -> None:
    layer = attrs[4] if len(attrs) > 4 else layer
    _check_layer_key("merge_latent_prefix_chunks", layer)
    _check_merge_latent(q, out, lse, new_latent, kv_b_weight, None if layer is not None else layer_id)


merge_latent_prefix_chunks = _register(
    "merge_latent_prefix_chunks",
    "(Tensor q, Tensor(a!) out, Tensor(b!) lse, Tensor new_latent, Tensor kv_b_weight, int layer_id, "
    "float? skip_softmax_prefill_scale_factor=None, float? skip_softmax_decode_scale_factor=None, float? scale=None, "
    "int kv_cache_id=0, Tensor? layer=None) -> ()",
    _merge_latent_prefix_chunks,
    _merge_latent_prefix_chunks_fake,
    _BREAKABLE_TAGS,
)
