"""fullcg.compile owns the token dimension: one compiled graph from the first step, no mark_dynamic."""

from __future__ import annotations

import torch

import fullcg
from fullcg.models.llama import LlamaConfig, LlamaModel


def _steps():
    """Batches of 5, 1, 4, 3 and 8 tokens: prefill, decode, mixed."""
    return [([5], [0]), ([1], [5]), ([3, 1], [0, 6]), ([1, 1, 1], [3, 7, 2]), ([8], [0])]


def test_fullcg_compile_serves_every_token_count_with_the_first_graph_and_matches_eager():
    torch._dynamo.reset()
    model = LlamaModel(LlamaConfig.tiny())
    model.allocate_kv_cache(64, 4)
    compiled = fullcg.compile(model, compiler="eager")
    reference = LlamaModel(LlamaConfig.tiny())
    reference.allocate_kv_cache(64, 4)
    table = torch.arange(64, dtype=torch.int32).view(4, 16)
    for q_lens, p_lens in _steps():
        md = fullcg.AttentionMetadata.build(q_lens, p_lens, table[: len(q_lens)], 4)
        ids = torch.randint(0, 100, (sum(q_lens),))  # plain tensors: nothing marked dynamic
        pos = torch.cat([torch.arange(p, p + q) for q, p in zip(q_lens, p_lens)])
        with torch.inference_mode():
            with fullcg.forward_context(md, model):
                got = compiled(ids, pos)
            with fullcg.forward_context(md, reference):
                want = reference(ids, pos)
        torch.testing.assert_close(got, want)
    assert len(compiled.backend.runners) == 1, "the second step (and every later one) reuses the first graph"
    assert "graph_mode=auto" in repr(compiled)


def test_options_reach_the_backend_config():
    compiled = fullcg.compile(torch.nn.Linear(2, 2), fullcg.FullCGConfig(graph_mode="piecewise"), compiler="eager")
    assert compiled.backend.config.graph_mode is fullcg.config.GraphMode.PIECEWISE
    assert compiled.backend.config.compiler == "eager"
