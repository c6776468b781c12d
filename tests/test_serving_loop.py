"""A random serving loop gives the same logits eager and compiled, in every graph mode,
with one compiled graph and every step counted."""

from __future__ import annotations

import pytest
import torch

import fullcg
from fullcg.config import GraphMode
from fullcg.models.llama import LlamaConfig, LlamaModel
from serving import ServingLoop, play_side_by_side


def _pair(loop: ServingLoop, dtype: torch.dtype = torch.float32) -> tuple[LlamaModel, LlamaModel]:
    models = []
    for _ in range(2):  # same seed, same weights; each with its own cache
        model = LlamaModel(LlamaConfig.tiny(), seed=0, dtype=dtype, device=loop.device)
        model.allocate_kv_cache(num_pages=loop.num_pages, page_size=loop.page_size)
        models.append(model)
    return models[0], models[1]


def _play(loop: ServingLoop, config: fullcg.FullCGConfig, *, atol: float = 0.0) -> fullcg.Backend:
    eager, compiled_model = _pair(loop)
    torch._dynamo.reset()
    backend = fullcg.Backend(config)
    compiled = torch.compile(compiled_model, backend=backend)
    fullcg.reset_graph_mode_counts()
    play_side_by_side(loop, eager, compiled_model, compiled, config, atol=atol)
    return backend


def test_the_serving_loop_exercises_chunked_prefill_decodes_mixed_steps_and_page_reuse():
    loop = ServingLoop(seed=0, num_steps=300)
    for step in loop:
        assert step.metadata.num_tokens <= loop.max_num_tokens
        assert len(step.requests) <= loop.max_num_seqs
    s = loop.stats
    assert s["steps"] == 300
    assert s["prefill"] and s["extend"] and s["decode"] and s["mixed"], s
    assert s["finished"] >= 10 and s["page_reuse"] >= 5, s


@pytest.mark.parametrize("mode", [m.value for m in GraphMode])
def test_compiled_serving_loop_matches_eager_with_one_graph_and_every_step_counted(mode):
    loop = ServingLoop(seed=1, num_steps=300)
    config = fullcg.FullCGConfig(compiler="eager", graph_mode=mode, attention_impl="reference")
    backend = _play(loop, config)
    assert len(backend.runners) == 1, f"{len(backend.runners)} graphs compiled: a step recompiled"
    counts = fullcg.graph_mode_counts()
    assert sum(counts.values()) == loop.stats["steps"] == 300, counts
    assert loop.stats["page_reuse"] > 0 and loop.stats["extend"] > 0


@pytest.mark.cuda
@pytest.mark.parametrize("mode, auto_full_max_tokens", [
    ("piecewise", None), ("full_and_piecewise", None), ("auto", None), ("auto", 8),
])
def test_compiled_serving_loop_matches_eager_with_cuda_graphs(mode, auto_full_max_tokens):
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    loop = ServingLoop(seed=2, num_steps=300, device="cuda")
    config = fullcg.FullCGConfig(compiler="inductor", graph_mode=mode, capture_sizes=(1, 2, 4, 8, 16, 24),
                                 auto_full_max_tokens=auto_full_max_tokens)
    backend = _play(loop, config, atol=2e-4)
    assert len(backend.runners) == 1
    counts = fullcg.graph_mode_counts()
    assert sum(counts.values()) == 300, counts
    assert sum(n for k, n in counts.items() if k.endswith(":captured")) == 300, counts
    if auto_full_max_tokens is not None:
        assert counts["full:captured"] and counts["piecewise:captured"], (
            f"auto with a limit of {auto_full_max_tokens} tokens runs small batches full and larger ones piecewise"
        )
