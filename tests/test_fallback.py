"""No step of a compiled model leaves fullcg unseen: one graph serves every prefix-chunk
count, and steps Dynamo runs eagerly anyway are counted."""

from __future__ import annotations

import logging

import pytest
import torch

import fullcg
from fullcg import context
from fullcg.models.llama import LlamaAttention, LlamaConfig, LlamaModel


def _chunked_prefix_step(compiled, model, n: int) -> None:
    """A decode after a prefix of ``4 n`` tokens in 4-token chunks: ``n`` prefix chunks."""
    table = torch.arange(64, dtype=torch.int32)[None]
    md = fullcg.AttentionMetadata.build([1], [4 * n], table, 4, prefix_chunk_tokens=4)
    ids, pos = torch.tensor([7]), torch.tensor([4 * n])
    torch._dynamo.mark_dynamic(ids, 0)
    torch._dynamo.mark_dynamic(pos, 0)
    with torch.inference_mode(), fullcg.forward_context(md, model):
        compiled(ids, pos)


def test_the_chunked_prefix_model_compiles_one_graph_for_every_chunk_count():
    torch._dynamo.reset()
    model = LlamaModel(LlamaConfig.tiny(chunked_prefix=True))
    model.allocate_kv_cache(64, 4)
    backend = fullcg.Backend(fullcg.FullCGConfig(graph_mode="piecewise", compiler="eager"))
    compiled = torch.compile(model, backend=backend)
    fullcg.reset_graph_mode_counts()
    for n in range(1, 13):  # past Dynamo's default recompile limit of 8
        _chunked_prefix_step(compiled, model, n)
    assert len(backend.runners) == 1
    assert fullcg.graph_mode_counts() == {"piecewise:eager": 12}


def _explicit_chunk_loop(self, q, k, v):
    """The chunked-prefix pattern written as a Python loop over the step's chunks (as a model
    that transforms each gathered chunk must): Dynamo traces one graph per chunk count."""
    out, lse = self.attn(q, k, v, return_lse=True, use_kv_cache=False, causal=True, save_kv_cache=True)
    for c in range(context.num_prefix_chunks()):
        k_c, v_c = self.attn.gather_prefix_chunk(c)
        out_c, lse_c = self.attn(q, k_c, v_c, return_lse=True, use_kv_cache=False, causal=False, prefix_chunk=c)
        merged, merged_lse = torch.empty_like(out), torch.empty_like(lse)
        torch.ops.fullcg.merge_attn_states.default(merged, out_c, lse_c, out, lse, merged_lse)
        out, lse = merged, merged_lse
    return out


@pytest.fixture
def explicit_chunk_loop(monkeypatch):
    monkeypatch.setattr(LlamaAttention, "_chunked_prefix_attention", _explicit_chunk_loop)


def test_steps_past_dynamos_recompile_limit_are_counted_as_fallback_and_logged_once(caplog, explicit_chunk_loop):
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=3):
        _run_past_the_limit(caplog)


def _run_past_the_limit(caplog) -> None:
    model = LlamaModel(LlamaConfig.tiny(chunked_prefix=True))
    model.allocate_kv_cache(64, 4)
    backend = fullcg.Backend(fullcg.FullCGConfig(graph_mode="piecewise", compiler="eager"))
    compiled = torch.compile(model, backend=backend)
    fullcg.reset_graph_mode_counts()
    with caplog.at_level(logging.WARNING, logger="fullcg.telemetry"):
        for n in range(1, 7):  # each chunk count is a graph of its own: 4..6 are past the limit
            _chunked_prefix_step(compiled, model, n)
    counts = fullcg.graph_mode_counts()
    assert len(backend.runners) == 3
    assert counts["piecewise:eager"] == 3 and counts["fallback"] == 3, counts
    assert sum(counts.values()) == 6, "every step is counted, through fullcg or not"
    assert caplog.text.count("ran its attention outside the compiled graph") == 1, "logged once"


def test_an_uncompiled_model_is_never_a_fallback():
    model = LlamaModel(LlamaConfig.tiny(chunked_prefix=True))
    model.allocate_kv_cache(64, 4)
    fullcg.reset_graph_mode_counts()
    _chunked_prefix_step(model, model, 2)
    assert fullcg.graph_mode_counts() == {}
