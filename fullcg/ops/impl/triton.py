"""The ``triton`` attention implementation: skip-softmax prefill and decode kernels for Hopper.

FlashInfer honours a skip-softmax factor only on Blackwell; these kernels make it real on
any GPU Triton supports (and on the CPU under ``TRITON_INTERPRET=1``, which the tests use).
Decisions follow the skip rule (docs/ops.md) at the config's tile sizes, exactly as the reference
implementation walks them, so results, skip decisions and counters can be compared.

Non-decode requests (prefill, extend) go through the prefill kernel with the prefill
factor; decode requests through the split-KV decode kernel with the decode factor. Both
read metadata tensors on the device and size their grids from shapes, so ``forward`` is
safe under CUDA graph capture: no host sync and no allocation whose size depends on data.

Sliding windows and logit soft-capping are compile-time switches of both kernels (the
window's size is a runtime argument): tiles wholly outside every row's window are never
visited, so a long context with a short window costs what its window costs.

Attention over a latent cache (multi-head latent attention, :attr:`fullcg.KVCache.v_in_k`)
runs every request kind through one kernel, :mod:`fullcg.ops.kernels.mla`: the head dim
(latent plus rope, 576 for DeepSeek-V3) is no power of two, and the value is read from
the key's own tile. It is dense only: the skip rule decides per tile for all query heads
of a KV head (every head, in MLA), which its head-blocked programs do not share, so
skip-softmax factors are refused there (:meth:`TritonAttention.serves` says so), never
ignored. New rows go into a latent cache through a save that writes each row once
(latent from v, rope key from k), or inside the MLA kernel for decode-only batches.
"""

from __future__ import annotations

import numpy as np
import torch
import triton  # noqa: F401  (first, so a missing Triton names itself when the implementation is resolved)

from fullcg import telemetry
from fullcg.context import ForwardContext
from fullcg.host_copy import upload
from fullcg.kv_cache import KVCache
from fullcg.metadata import AttentionMetadata
from fullcg.ops.call import AttentionCall
from fullcg.ops.impl import register_implementation
from fullcg.ops.impl.base import AttentionImpl
from fullcg.ops.kernels import launch as _launch
from fullcg.ops.kernels.save_kv import SaveLaunch, plan_save, save_new_kv
from fullcg.ops.kernels.decode import DecodeLaunch, plan_decode
from fullcg.ops.kernels.mla import LatentSaveLaunch, MLALaunch, plan_latent_save, plan_mla
from fullcg.ops.kernels.prefill import PrefillLaunch, plan_prefill

__all__ = ["TritonAttention"]


def _is_pow2_at_least_16(x: int) -> bool:
    return x >= 16 and x & (x - 1) == 0


def _is_head_dim(x: int) -> bool:
    """A head dim the prefill and decode kernels take: a multiple of 16 up to 256. Powers of
    two fill their register tiles; others (80, 96, DeepSeek's 192) are padded to the next one."""
    return 16 <= x <= 256 and x % 16 == 0


def _is_latent_dims(head_dim: int, v_head_dim: int) -> bool:
    """Head dims the MLA kernel takes: a latent (``v_head_dim``) and a rope part
    (``head_dim - v_head_dim``), each a power of two >= 16 (DeepSeek-V3: 512 and 64)."""
    return head_dim > v_head_dim and _is_pow2_at_least_16(v_head_dim) and _is_pow2_at_least_16(head_dim - v_head_dim)


def _attends_latent(cache: KVCache | None) -> bool:
    return cache is not None and cache.v_in_k


def _where(call: AttentionCall) -> str:
    return f"fullcg.{call.op} (layer {call.layer_id}) with attention_impl='triton'"


def _check_device(call: AttentionCall) -> None:
    """Before anything launches (the k/v save included): kernels off a CUDA device run only
    under the interpreter, which must have been chosen before triton was imported."""
    if not call.q.is_cuda and not _launch._INTERPRET:
        raise RuntimeError(
            f"{_where(call)}: tensors are on {call.q.device}; the Triton kernels need a CUDA device "
            "(or TRITON_INTERPRET=1 set before triton is imported, to run them slowly on the CPU). "
            "Use attention_impl='reference' on the CPU."
        )


def _check_supported(call: AttentionCall, ctx: ForwardContext, cache: KVCache | None) -> None:
    where = _where(call)
    _check_device(call)
    d, dv = call.q.shape[2], call.v.shape[2]
    if not (_is_head_dim(d) and _is_head_dim(dv)):
        if _is_latent_dims(d, dv):
            raise ValueError(
                f"{where}: head dims {d} and {dv} (latent plus rope, and latent: multi-head latent attention) are "
                "served only over a latent cache (use_kv_cache=True on a cache from fullcg.mla.allocate_latent_cache); "
                "run attention over given k/v of these dims (use_kv_cache=False, prefix chunks) with "
                "attention_impl='reference'"
            )
        raise ValueError(f"{where}: head dims must be multiples of 16 up to 256 (e.g. 64, 80, 128, 192), got {d} "
                         f"and {dv}; use attention_impl='reference' for others")
    tile_kv = ctx.config.skip_softmax.tile_kv
    if not _is_pow2_at_least_16(tile_kv):
        raise ValueError(f"{where}: SkipSoftmaxConfig.tile_kv must be a power of two >= 16 for Triton, got {tile_kv}")
    if cache is not None and cache.k.dtype != call.q.dtype:
        raise TypeError(
            f"{where}: the KV cache holds {cache.k.dtype} but q is {call.q.dtype}; allocate the cache in q's dtype"
        )


def _mla_refusal(call: AttentionCall, cache: KVCache) -> Exception | None:
    """Why the MLA kernel would not compute ``call`` over the latent ``cache`` as asked (None: it would)."""
    where = _where(call)
    if call.prefill_scale_factor is not None or call.decode_scale_factor is not None:
        return ValueError(
            f"{where}: skip-softmax over a latent cache (multi-head latent attention) is not supported by the Triton "
            "MLA kernel: the skip rule decides per tile for all query heads sharing a KV head (every head, in MLA), "
            "which its head-blocked programs cannot share. Run the MLA layers dense (skip-softmax factors None, "
            "e.g. through SkipSoftmaxConfig.per_layer) or with attention_impl='reference'"
        )
    if call.sliding_window is not None or call.logit_softcap is not None:
        return ValueError(
            f"{where}: the Triton MLA kernel has no sliding window or logit soft-cap; run such layers with "
            "attention_impl='reference'"
        )
    d, dv = call.q.shape[2], call.v.shape[2]
    if not _is_latent_dims(d, dv):
        return ValueError(
            f"{where}: the Triton MLA kernel needs a latent (v head dim) and a rope part (head dim less v head dim) "
            f"that are powers of two >= 16 (e.g. 512 and 64), got head dims {d} and {dv}; use "
            "attention_impl='reference'"
        )
    if call.num_kv_heads != 1:
        return ValueError(
            f"{where}: the Triton MLA kernel attends over a latent cache of one KV head, got {call.num_kv_heads}; "
            "use attention_impl='reference'"
        )
    if cache.k.dtype != call.q.dtype:
        return TypeError(
            f"{where}: the KV cache holds {cache.k.dtype} but q is {call.q.dtype}; allocate the cache in q's dtype"
        )
    return None


class _Step:
    """What every attention call of one step shares: the metadata tensors on the device,
    host facts of the batch, the decode and MLA workspaces (see ``decode_attention``) and the
    launches planned for each call shape."""

    def __init__(self, ctx: ForwardContext, device: torch.device) -> None:
        md = ctx.metadata
        self.device = device
        self.query_start_loc = md.query_start_loc.to(device)
        self.is_decode = md.is_decode.to(device)
        self.page_table = md.page_table.to(device)
        self.seq_lens = md.seq_lens.to(device)
        self.prefix_lens = md.prefix_lens_tensor.to(device)
        self.num_tokens = md.num_tokens_tensor.to(device)
        self.slot_mapping = md.slot_mapping.to(device)
        # A graph captured for a batch that is not decode-only may be replayed for any mix,
        # so it holds both kernels (each skips the other's requests on the device).
        self.capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        self.decode_only = md.is_decode_only
        self.has_decode = self.capturing or md.has_decode
        self.workspace: dict[tuple[object, ...], tuple[torch.Tensor, ...]] = {}
        self.lse: dict[tuple[int, int], torch.Tensor] = {}
        self.plans: dict[tuple[object, ...], _CallPlan | _MLAPlan] = {}
        self.latent_saves: dict[tuple[object, ...], LatentSaveLaunch] = {}
        self.checked: set[tuple[object, ...]] = set()
        self.chunk_positions: dict[int, torch.Tensor] = {}

    def chunk_query_positions(self, md: AttentionMetadata, chunk: int) -> torch.Tensor:
        """``int32 [R]``: each request's first new token's position among prefix chunk
        ``chunk``'s keys (its prefix length less the chunk's first position), for windows."""
        found = self.chunk_positions.get(chunk)
        if found is None:
            starts = md.prefix_chunks[chunk].starts
            if len(set(starts)) == 1:
                found = self.prefix_lens - starts[0]
            else:
                found = self.prefix_lens - upload([np.asarray(starts, dtype=np.int32)], self.device)[0]
            found = self.chunk_positions[chunk] = found.to(torch.int32)
        return found


def _step(ctx: ForwardContext, call: AttentionCall) -> _Step:
    device = call.q.device
    state = ctx.step.kernel_state
    step = state.get("triton")
    if step is None or step.device != device:
        _check_device(call)  # first: the step's metadata copies and the save come next
        step = state["triton"] = _Step(ctx, device)
    return step


def _saves_in_decode(call: AttentionCall, step: _Step) -> bool:
    """Whether the decode kernel writes the new k/v itself: a decode-only batch over the
    cache, where each request's one new key is read by exactly one program (its last run)."""
    return call.use_kv_cache and step.decode_only


class _CallPlan:
    """The launches of one step for calls of one shape, any layer (a :class:`StepPlan`)."""

    __slots__ = ("save", "prefill", "decode", "lse", "return_lse", "skip", "use_cache", "device")

    def __init__(self, save: SaveLaunch | LatentSaveLaunch | None, prefill: PrefillLaunch | None, decode: DecodeLaunch,
                 lse: torch.Tensor | None, use_cache: bool, device: torch.device) -> None:
        self.save, self.prefill, self.decode = save, prefill, decode
        self.lse, self.return_lse, self.use_cache, self.device = lse, lse is None, use_cache, device
        # The layer's counters are looked up only if a launch counts skipped tiles.
        self.skip = decode.skip or (prefill is not None and prefill.skip)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, cache: KVCache | None,
                 layer_id: int) -> torch.Tensor | None:
        # Every row of lse is written: by the kernels for real rows, as -inf for padding.
        # Nobody reads it unless asked for, so those calls share one buffer per step.
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=self.device) if self.return_lse else self.lse
        counters = telemetry.counters(layer_id, self.device) if self.skip else None
        if self.save is not None:
            self.save(k, v, cache.k, cache.v)
        kc, vc = (cache.k, cache.v) if self.use_cache else (k, v)
        # The launches themselves (not DecodeLaunch/PrefillLaunch.__call__): one frame less per layer.
        prefill = self.prefill
        if prefill is not None:
            prefill.launch(q, kc, vc, out, lse, counters if prefill.skip else lse)
        decode = self.decode
        if decode.save:
            decode.launch(q, kc, vc, out, lse, counters if decode.skip else lse, k, v)
        else:
            decode.launch(q, kc, vc, out, lse, counters if decode.skip else lse, q, q)
        return lse if self.return_lse else None


class _MLAPlan:
    """The launches of one step for calls of one shape over a latent cache, any layer (a
    :class:`StepPlan`): the save (unless the MLA kernel writes the new rows) and the MLA kernel."""

    __slots__ = ("save", "attend", "lse", "return_lse", "device")

    def __init__(self, save: LatentSaveLaunch | None, attend: MLALaunch, lse: torch.Tensor | None,
                 device: torch.device) -> None:
        self.save, self.attend = save, attend
        self.lse, self.return_lse, self.device = lse, lse is None, device

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, cache: KVCache | None,
                 layer_id: int) -> torch.Tensor | None:
        # Every row of lse is written (padding rows as -inf); unasked-for LSE shares one buffer per step.
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=self.device) if self.return_lse else self.lse
        if self.save is not None:
            self.save(k, v, cache.k)
        attend = self.attend
        if attend.save:
            attend.launch(q, cache.k, out, lse, k, v)
        else:
            attend.launch(q, cache.k, out, lse, q, q)
        return lse if self.return_lse else None


class TritonAttention(AttentionImpl):
    """Skip-softmax attention in Triton, and dense MLA over a latent cache; see the module docstring."""

    name = "triton"
    capture_safe = True
    takes_v_in_k = True

    def supports(self, head_dim: int, v_head_dim: int) -> bool:
        """Head dims that are multiples of 16 up to 256, or MLA's latent dims (see ``_is_latent_dims``).

        Asked without the cache: latent dims are served only over a latent cache (calls over
        given k/v of those dims are refused, naming the fix)."""
        return (_is_head_dim(head_dim) and _is_head_dim(v_head_dim)) or _is_latent_dims(head_dim, v_head_dim)

    def serves(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache | None) -> bool:
        """False where :meth:`forward` would refuse: no CUDA device (nor the interpreter),
        head dims its kernels lack, and over a latent cache skip-softmax factors, a window
        or a soft-cap."""
        if not call.q.is_cuda and not _launch._INTERPRET:
            return False
        if _attends_latent(cache):
            return _mla_refusal(call, cache) is None
        return _is_head_dim(call.q.shape[2]) and _is_head_dim(call.v.shape[2])

    def save_kv(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache) -> None:
        """New k/v are written by a Triton kernel that skips padding slots (CUDA-graph safe);
        in decode-only batches over the cache, by the decode (or MLA) kernel itself."""
        step = _step(ctx, call)
        if cache.v_in_k:
            self._save_latent(call, ctx, step, cache)
        elif not _saves_in_decode(call, step):
            save_new_kv(call, ctx, cache)

    def forward(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache | None) -> torch.Tensor | None:
        """Compute ``call`` into ``call.out``; return natural-log LSE ``[T, Hq]`` iff asked."""
        # save_kv left the new k/v to the decode (MLA) kernel where it can write them itself.
        fused = call.save_kv_cache and _saves_in_decode(call, _step(ctx, call))
        if _attends_latent(cache):
            plan = self._mla_call_plan(call, ctx, cache, cache if fused else None)
        else:
            plan = self._call_plan(call, ctx, cache, cache if fused else None)
        return plan(call.q, call.k, call.v, call.out, cache, call.layer_id)

    def step_plan(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache | None) -> _CallPlan | _MLAPlan:
        """The launches of this step for calls shaped like ``call``, the k/v save included
        (``cache``: the layer's own, whether the call attends over it or only saves to it)."""
        if call.use_kv_cache and _attends_latent(cache):
            return self._mla_call_plan(call, ctx, cache, cache if call.save_kv_cache else None)
        return self._call_plan(call, ctx, cache if call.use_kv_cache else None,
                               cache if call.save_kv_cache else None)

    @staticmethod
    def _save_latent(call: AttentionCall, ctx: ForwardContext, step: _Step, cache: KVCache) -> None:
        """The new rows into a latent cache, after the checks that would refuse the call (so
        a refused call writes nothing)."""
        if call.use_kv_cache:
            refusal = _mla_refusal(call, cache)
            if refusal is not None:
                raise refusal
            if _saves_in_decode(call, step):
                return  # the MLA kernel writes them
        else:
            _check_supported(call, ctx, None)  # the attention over given k/v that follows
        key = (call.k.shape, call.k.stride(), call.v.shape, call.v.stride(), call.k.dtype)
        save = step.latent_saves.get(key)
        if save is None:
            save = step.latent_saves[key] = plan_latent_save(call.k, call.v, step.slot_mapping, cache.k)
        save(call.k, call.v, cache.k)

    def _mla_call_plan(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache,
                       save_to: KVCache | None) -> _MLAPlan:
        """The MLA launches for calls shaped like ``call`` over the latent ``cache``, saving
        into ``save_to`` (None: saved already)."""
        q = call.q
        step = _step(ctx, call)
        # Everything the launches and the refusal derive from besides the layer's own tensors.
        key = ("mla", q.shape, q.stride(), call.out.stride(), call.k.shape, call.k.stride(), call.v.shape,
               call.v.stride(), q.dtype, cache.k.dtype, cache.k.shape[1:], call.scale, call.prefill_scale_factor,
               call.decode_scale_factor, call.return_lse, save_to is not None, call.sliding_window,
               call.logit_softcap)
        plan = step.plans.get(key)
        if plan is None:
            refusal = _mla_refusal(call, cache)
            if refusal is not None:
                raise refusal
            plan = step.plans[key] = self._plan_mla(call, step, cache, save_to)
        return plan

    @staticmethod
    def _plan_mla(call: AttentionCall, step: _Step, cache: KVCache, save_to: KVCache | None) -> _MLAPlan:
        q, dev = call.q, call.q.device
        lse = None
        if not call.return_lse:
            lse = step.lse.get(q.shape[:2])
            if lse is None:
                lse = step.lse[q.shape[:2]] = torch.empty(q.shape[:2], dtype=torch.float32, device=dev)
        lse_like = lse if lse is not None else torch.empty(q.shape[:2], dtype=torch.float32, device=dev)
        fused = save_to is not None and _saves_in_decode(call, step)
        save = None
        if save_to is not None and not fused:
            save = plan_latent_save(call.k, call.v, step.slot_mapping, save_to.k)
        attend = plan_mla(
            q, cache.k, call.out, lse_like, query_start_loc=step.query_start_loc, page_table=step.page_table,
            seq_lens=step.seq_lens, scale=call.scale, num_tokens=step.num_tokens,
            slot_mapping=step.slot_mapping if fused else None, new_kv=(call.k, call.v) if fused else None,
            workspace=step.workspace,
        )
        return _MLAPlan(save, attend, lse, dev)

    def _call_plan(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache | None,
                   save_to: KVCache | None) -> _CallPlan:
        q = call.q
        step = _step(ctx, call)
        support_key = (q.shape[2], call.v.shape[2], q.dtype, cache.k.dtype if cache is not None else None)
        if support_key not in step.checked:
            _check_supported(call, ctx, cache)
            step.checked.add(support_key)
        # Everything the launches derive from besides the layer's own tensors.
        key = (q.shape, q.stride(), call.out.stride(), call.k.shape, call.k.stride(), call.v.stride(), q.dtype,
               cache is not None, call.causal, call.prefix_chunk, call.scale, call.prefill_scale_factor,
               call.decode_scale_factor, call.return_lse, save_to is not None, call.sliding_window, call.logit_softcap)
        plan = step.plans.get(key)
        if plan is None:
            plan = step.plans[key] = self._plan(call, ctx, step, cache, save_to)
        return plan

    @staticmethod
    def _plan(call: AttentionCall, ctx: ForwardContext, step: _Step, cache: KVCache | None,
              save_to: KVCache | None) -> _CallPlan:
        """The kernel launches of this step for calls shaped like ``call``: over ``cache``
        (None: over the given k/v), saving the new k/v into ``save_to`` (None: no save)."""
        md = ctx.metadata
        cfg = ctx.config.skip_softmax
        q, out, dev = call.q, call.out, call.q.device
        if cache is not None:
            k, v = cache.k, cache.v
        else:
            k, v = call.k, call.v
        lse = None
        if not call.return_lse:
            lse = step.lse.get(q.shape[:2])
            if lse is None:
                lse = step.lse[q.shape[:2]] = torch.empty(q.shape[:2], dtype=torch.float32, device=dev)
        lse_like = lse if lse is not None else torch.empty(q.shape[:2], dtype=torch.float32, device=dev)
        qloc = step.query_start_loc
        window, softcap = call.sliding_window, call.logit_softcap
        window_offsets = None
        if cache is not None:
            causal = True
            source = dict(page_table=step.page_table, seq_lens=step.seq_lens)
            max_kv_len = md.page_table.shape[1] * cache.page_size
        elif call.prefix_chunk is not None:
            causal = False
            source = dict(kv_start_loc=md.prefix_chunks[call.prefix_chunk].kv_start_loc.to(dev))
            max_kv_len = md.prefix_chunk_tokens
            if window is not None:
                window_offsets = step.chunk_query_positions(md, call.prefix_chunk)
        else:
            causal = call.causal
            source = dict(kv_start_loc=qloc)
            max_kv_len = q.shape[0]
        fused_save = save_to is not None and _saves_in_decode(call, step)
        save: SaveLaunch | LatentSaveLaunch | None = None
        if save_to is not None and not fused_save:
            if save_to.v_in_k:  # attention over given k/v saved into a latent cache
                save = plan_latent_save(call.k, call.v, step.slot_mapping, save_to.k)
            else:
                save = plan_save(call.k, call.v, step.slot_mapping, save_to.k, save_to.v)
        # Which kernels run is a host decision on the batch's modes. The decode kernel always
        # runs: it writes the padding rows (zeros, LSE -inf), reading the real token count on
        # the device, so a replay with another count is right.
        prefill = None
        if not step.decode_only:
            prefill = plan_prefill(
                q, k, v, out, lse_like,
                query_start_loc=qloc, is_decode=step.is_decode, scale=call.scale, causal=causal,
                factor=call.prefill_scale_factor, tile_q=cfg.tile_q, tile_kv=cfg.tile_kv,
                prefix_lens=step.prefix_lens if cache is not None else None, window=window, softcap=softcap,
                window_offsets=window_offsets, **source,
            )
        decode = plan_decode(
            q, k, v, out, lse_like,
            query_start_loc=qloc, is_decode=step.is_decode, scale=call.scale, factor=call.decode_scale_factor,
            tile_kv=cfg.tile_kv, split_tiles=cfg.decode_split_tiles, max_kv_len=max_kv_len,
            num_tokens=step.num_tokens, has_decode=step.has_decode, workspace=step.workspace,
            slot_mapping=step.slot_mapping if fused_save else None,
            new_kv=(call.k, call.v) if fused_save else None, window=window, softcap=softcap,
            window_offsets=window_offsets, **source,
        )
        return _CallPlan(save, prefill, decode, lse, cache is not None, dev)


register_implementation(TritonAttention())
