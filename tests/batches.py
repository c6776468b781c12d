"""Random batches and a float64 oracle shared by the tests."""

from __future__ import annotations

import dataclasses
import math

import torch

import fullcg
from fullcg.metadata import AttentionMetadata, ForwardMode


@dataclasses.dataclass
class Batch:
    """One step of a random batch: metadata, the cache holding each prefix, the new q/k/v,
    and each request's full (prefix + new) k/v for the oracle."""

    metadata: AttentionMetadata
    layer: fullcg.Attention
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    full_k: list[torch.Tensor]
    full_v: list[torch.Tensor]

    def to(self, device: torch.device) -> "Batch":
        """This batch with its metadata tensors, KV cache and q/k/v on ``device``."""
        md = self.metadata
        # Built anew on the device, as an engine builds it (not edited: edits are re-verified).
        moved = fullcg.AttentionMetadata.build(
            md.query_lens, md.prefix_lens, md.page_table, md.page_size, md.forward_modes,
            prefix_chunk_tokens=md.prefix_chunk_tokens, device=device,
        )
        cache = self.layer.kv_cache
        if cache.k.shape == cache.v.shape:  # one allocation, V after K, as KVCache.allocate makes it
            both = torch.stack((cache.k, cache.v)).to(device)
            self.layer.kv_cache = fullcg.KVCache(both[0], both[1])
        else:
            self.layer.kv_cache = fullcg.KVCache(cache.k.to(device), cache.v.to(device))
        return dataclasses.replace(
            self, metadata=moved, q=self.q.to(device), k=self.k.to(device),
            v=self.v.to(device),
        )


def make_batch(
    query_lens: list[int],
    prefix_lens: list[int],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    page_size: int = 4,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    modes: list[ForwardMode] | None = None,
    layer_id: int = 0,
    prefix_chunk_tokens: int = 4096,
    spare_pages: int = 5,
    key_bias: float = 0.0,
    sink: float = 0.0,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> Batch:
    """A batch with a random (shuffled) page table whose prefixes are already in the cache.

    ``key_bias`` adds a shared direction to q and k so that attention is peaky (as real
    attention is), which is what skip-softmax needs to skip anything.
    """
    g = torch.Generator().manual_seed(seed)
    pages_needed = [math.ceil((q + p) / page_size) for q, p in zip(query_lens, prefix_lens)]
    num_pages = sum(pages_needed) + spare_pages
    perm = torch.randperm(num_pages, generator=g)
    page_table = torch.zeros(len(query_lens), max(pages_needed) + 1, dtype=torch.int32)
    used = 0
    for r, n in enumerate(pages_needed):
        page_table[r, :n] = perm[used : used + n]
        used += n
    layer = fullcg.Attention(num_heads, head_dim, num_kv_heads, layer_id=layer_id, sliding_window=sliding_window,
                             logit_softcap=logit_softcap)
    cache = layer.allocate_kv_cache(num_pages, page_size, dtype=dtype)
    cache.k.normal_(generator=g)  # garbage everywhere a request does not own
    cache.v.normal_(generator=g)
    md = AttentionMetadata.build(
        query_lens, prefix_lens, page_table, page_size, modes, prefix_chunk_tokens=prefix_chunk_tokens
    )
    direction = torch.randn(head_dim, generator=g)
    full_k, full_v, new_k, new_v = [], [], [], []
    for r, (ql, pl) in enumerate(zip(query_lens, prefix_lens)):
        k = torch.randn(pl + ql, num_kv_heads, head_dim, generator=g) + key_bias * direction
        v = torch.randn(pl + ql, num_kv_heads, head_dim, generator=g)
        if sink:
            k[0] = sink * direction / direction.norm()
        k, v = k.to(dtype), v.to(dtype)
        for pos in range(pl):
            page = int(page_table[r, pos // page_size])
            cache.k[page, pos % page_size] = k[pos]
            cache.v[page, pos % page_size] = v[pos]
        full_k.append(k)
        full_v.append(v)
        new_k.append(k[pl:])
        new_v.append(v[pl:])
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g) + key_bias * direction
    if sink:
        q = q + 6.0 * direction / direction.norm()
    q = q.to(dtype)
    return Batch(md, layer, q, torch.cat(new_k), torch.cat(new_v), full_k, full_v)


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int | None,
    *, window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 softmax attention of one request, the obvious way: out [n, Hq, Dv], lse [n, Hq].

    ``window``: query ``j`` (at key position ``causal_offset + j``) sees the ``window`` keys
    ending at itself; ``softcap``: scores ``c * tanh(s / c)``; ``sinks [Hq]``: an extra
    softmax column per head, with no value (as transformers' eager gpt-oss attention does it).
    """
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q, k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    n, length = q.shape[0], k.shape[0]
    kpos, qpos = torch.arange(length)[None, :], torch.arange(n)[:, None] + (causal_offset or 0)
    if causal_offset is not None:
        s = s.masked_fill(~(kpos <= qpos), float("-inf"))
    if window is not None:
        s = s.masked_fill(~(kpos > qpos - window), float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None, None].expand(-1, n, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1)
    if sinks is not None:
        p = p[..., :-1]
    return torch.einsum("hnl,lhd->nhd", p, v), lse.transpose(0, 1)


def oracle(batch: Batch, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """Expected out and LSE of cache attention over each request's prefix + new tokens
    (``options``: those of :func:`naive_attention`)."""
    outs, lses = [], []
    starts = batch.metadata.query_starts
    for r, pl in enumerate(batch.metadata.prefix_lens):
        o, lse = naive_attention(
            batch.q[starts[r] : starts[r + 1]], batch.full_k[r], batch.full_v[r], batch.layer.scale, pl, **options
        )
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def side_by_side(
    eager: torch.nn.Module,
    compiled_model: torch.nn.Module,
    compiled_fn,
    config: fullcg.FullCGConfig,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    prefill_chunk: int = 1 << 30,
    prefix_chunk_tokens: int = 4096,
    num_pages: int = 64,
    page_size: int = 4,
    device: str = "cpu",
    eager_config: fullcg.FullCGConfig | None = None,
    relative: bool = False,
) -> tuple[float, list[set[str]]]:
    """Drive an eager model and a compiled copy through the same steps (both follow the eager
    model's greedy tokens); the largest logit difference (relative to the eager logits' largest
    magnitude with ``relative``) and each step's forward modes. The eager model runs under
    ``eager_config`` (default ``config``)."""
    from fullcg.models.generate import Scheduler

    s_eager, s_comp = (
        Scheduler(prompts, max_new_tokens, num_pages=num_pages, page_size=page_size, prefill_chunk=prefill_chunk,
                  prefix_chunk_tokens=prefix_chunk_tokens, device=device)
        for _ in range(2)
    )
    worst, modes = 0.0, []
    with torch.inference_mode():
        while (step := s_eager.next_step()) is not None:
            step_c = s_comp.next_step()
            with fullcg.forward_context(step.metadata, eager, config=eager_config or config):
                expected = eager(step.input_ids, step.positions)
            with fullcg.forward_context(step_c.metadata, compiled_model, config=config):
                got = compiled_fn(step_c.input_ids, step_c.positions)
            diff = (expected.float() - got.float()).abs().max().item()
            worst = max(worst, diff / expected.float().abs().max().item() if relative else diff)
            modes.append({m.value for m in step.modes})
            s_eager.commit(step, expected)
            s_comp.commit(step_c, expected)
    return worst, modes


def cuda_side_by_side(eager, model, run, config, prompts, *, prefill_chunk: int = 16,
                      max_new_tokens: int = 6) -> tuple[float, int]:
    """:func:`side_by_side` as the GPU tests run it: 128 pages of 16 on the GPU, 32-token
    prefix chunks, the eager model without CUDA graphs; (worst relative difference, steps)."""
    worst, modes = side_by_side(
        eager, model, run, config, prompts, max_new_tokens=max_new_tokens, prefill_chunk=prefill_chunk,
        prefix_chunk_tokens=32, num_pages=128, page_size=16, device="cuda",
        eager_config=config.replace(graph_mode="none"), relative=True,
    )
    return worst, len(modes)


def run_steps_against_eager(model, compiled, reference, steps) -> None:
    """Each ``(query_lens, prefix_lens)`` step of ``steps`` through ``compiled`` (stepping
    ``model``) and through ``reference``, on CPU caches of 64 pages of 4; the logits must agree."""
    table = torch.arange(64, dtype=torch.int32).view(4, 16)
    for q_lens, p_lens in steps:
        md = fullcg.AttentionMetadata.build(q_lens, p_lens, table[: len(q_lens)], 4)
        ids = torch.randint(0, 100, (sum(q_lens),))  # plain tensors: nothing marked dynamic
        pos = torch.cat([torch.arange(p, p + q) for q, p in zip(q_lens, p_lens)])
        with torch.inference_mode():
            with fullcg.forward_context(md, model):
                got = compiled(ids, pos)
            with fullcg.forward_context(md, reference):
                want = reference(ids, pos)
        torch.testing.assert_close(got, want)
