"""No step of a compiled model leaves fullcg unseen: steps Dynamo runs eagerly are counted."""

from __future__ import annotations

import logging

import torch

import fullcg
from fullcg.models.llama import LlamaConfig, LlamaModel


def _chunked_prefix_step(compiled, model, n: int) -> None:
    """A decode after a prefix of ``4 n`` tokens in 4-token chunks: ``n`` prefix chunks."""
    table = torch.arange(64, dtype=torch.int32)[None]
    md = fullcg.AttentionMetadata.build([1], [4 * n], table, 4, prefix_chunk_tokens=4)
    ids, pos = torch.tensor([7]), torch.tensor([4 * n])
    torch._dynamo.mark_dynamic(ids, 0)
    torch._dynamo.mark_dynamic(pos, 0)
    with torch.inference_mode(), fullcg.forward_context(md, model):
        compiled(ids, pos)


def test_steps_past_dynamos_recompile_limit_are_counted_as_fallback_and_logged_once(caplog):
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
