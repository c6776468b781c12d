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
"""

from __future__ import annotations

import torch
import triton

from fullcg import telemetry
from fullcg.context import ForwardContext
from fullcg.kv_cache import KVCache
from fullcg.metadata import AttentionMetadata
from fullcg.ops.call import AttentionCall
from fullcg.ops.impl import register_implementation
from fullcg.ops.impl.base import AttentionImpl
from fullcg.ops.kernels import launch as _launch
from fullcg.ops.kernels.save_kv import SaveLaunch, plan_save, save_new_kv
from fullcg.ops.kernels.decode import DecodeLaunch, plan_decode
from fullcg.ops.kernels.prefill import PrefillLaunch, plan_prefill

__all__ = ["TritonAttention"]


def _is_pow2_at_least_16(x: int) -> bool:
    return x >= 16 and x & (x - 1) == 0


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
    if not (_is_pow2_at_least_16(d) and _is_pow2_at_least_16(dv)):
        raise ValueError(f"{where}: head dims must be powers of two >= 16 (e.g. 64, 128), got {d} and {dv}")
    tile_kv = ctx.config.skip_softmax.tile_kv
    if not _is_pow2_at_least_16(tile_kv):
        raise ValueError(f"{where}: SkipSoftmaxConfig.tile_kv must be a power of two >= 16 for Triton, got {tile_kv}")
    if cache is not None and cache.k.dtype != call.q.dtype:
        raise TypeError(
            f"{where}: the KV cache holds {cache.k.dtype} but q is {call.q.dtype}; allocate the cache in q's dtype"
        )


class _Step:
    """What every attention call of one step shares: the metadata tensors on the device,
    host facts of the batch, the decode workspace (see ``decode_attention``) and the
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
        self.workspace: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}
        self.lse: dict[tuple[int, int], torch.Tensor] = {}
        self.plans: dict[tuple[object, ...], _CallPlan] = {}
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
                found = self.prefix_lens - torch.tensor(starts, dtype=torch.int32, device=self.device)
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

    def __init__(self, save: SaveLaunch | None, prefill: PrefillLaunch | None, decode: DecodeLaunch,
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


class TritonAttention(AttentionImpl):
    """Skip-softmax attention in Triton; see the module docstring."""

    name = "triton"
    capture_safe = True

    def save_kv(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache) -> None:
        """New k/v are written by a Triton kernel that skips padding slots (CUDA-graph safe);
        in decode-only batches over the cache, by the decode kernel itself."""
        if not _saves_in_decode(call, _step(ctx, call)):
            save_new_kv(call, ctx, cache)

    def forward(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache | None) -> torch.Tensor | None:
        """Compute ``call`` into ``call.out``; return natural-log LSE ``[T, Hq]`` iff asked."""
        # save_kv left the new k/v to the decode kernel where it can write them itself.
        fused = call.save_kv_cache and _saves_in_decode(call, _step(ctx, call))
        plan = self._call_plan(call, ctx, cache, cache if fused else None)
        return plan(call.q, call.k, call.v, call.out, cache, call.layer_id)

    def step_plan(self, call: AttentionCall, ctx: ForwardContext, cache: KVCache | None) -> _CallPlan:
        """The launches of this step for calls shaped like ``call``, the k/v save included
        (``cache``: the layer's own, whether the call attends over it or only saves to it)."""
        return self._call_plan(call, ctx, cache if call.use_kv_cache else None,
                               cache if call.save_kv_cache else None)

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
        save = None
        if save_to is not None and not fused_save:
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
