"""Hugging Face models on a GPU: ``fullcg.generate`` with Inductor and CUDA graphs captured
up front gives HF's own greedy tokens.

Skipped without CUDA (CPU CI); run on a GPU with ``pytest -m cuda``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import build

import fullcg
from fullcg.integrations import transformers as fhf

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA graphs)"),
]

PROMPTS = [[3, 17, 29, 41, 53, 65, 77, 89, 101, 113, 125, 9, 4], [7, 19, 31, 43, 55], [11, 23, 35],
           [60, 61, 62, 63, 64, 65, 66]]


def _pair():
    """HF's model with sdpa and a copy prepared for fullcg, fp32 on the GPU (head dim 64)."""
    ref = build("llama", hidden_size=256, intermediate_size=512).cuda()
    model = copy.deepcopy(ref)
    step = fhf.prepare(model, num_pages=64, page_size=16)
    return ref, model, step


@pytest.mark.parametrize("graph_mode", ["auto", "piecewise", "full"])
def test_generate_with_inductor_and_cuda_graphs_equals_hf_greedy_generate(graph_mode):
    # The model's first trace is generate's stand-in step; on torch 2.11 a first trace at one
    # token compiled wrongly on CUDA (a buffer sized for one token).
    torch._dynamo.reset()
    ref, model, _ = _pair()
    config = fullcg.FullCGConfig(graph_mode=graph_mode, attention_impl="triton", capture_sizes=(1, 2, 4, 8, 16))
    fullcg.reset_graph_mode_counts()
    got = fullcg.generate(model, PROMPTS, 8, max_num_tokens=8, max_num_seqs=2, stop_token_ids=(), config=config,
                          progress=False)
    with torch.no_grad():
        expected = [ref.generate(torch.tensor([p], device="cuda"), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
                    for p in PROMPTS]
    assert got == expected
    assert any(k.endswith(":captured") for k in fullcg.graph_mode_counts())


def test_a_graph_first_traced_at_one_token_serves_longer_steps_through_graphs_of_their_own():
    # A one-token first trace: on torch 2.11 Inductor guards it to exactly one token (its
    # buffers sized for one), so it must be captured at size 1 only, and longer steps get a
    # graph of their own. Every step equals the uncompiled model.
    torch._dynamo.reset()
    _, _, step = _pair()
    compiled = fullcg.compile(step, compiler="inductor", graph_mode="piecewise", attention_impl="triton",
                              capture_sizes=(1, 2, 4, 8, 16))
    table = torch.arange(16, dtype=torch.int32).view(4, 4)
    # Request 0 (table row 0) grows one step after another; request 1 (row 1) joins once.
    for q_lens, p_lens, rows in [([1], [0], [0]), ([12], [1], [0]), ([1], [13], [0]), ([5, 1], [0, 14], [1, 0]),
                                 ([1], [15], [0])]:
        md = fullcg.AttentionMetadata.build(q_lens, p_lens, table[rows], 16, device="cuda")
        ids = torch.cat([torch.randint(3, 100, (q,)) for q in q_lens]).cuda()
        pos = torch.cat([torch.arange(p, p + q) for q, p in zip(q_lens, p_lens)]).cuda()
        with torch.inference_mode(), fullcg.forward_context(md, step):
            got = compiled(ids, pos)
            want = step(ids, pos)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    for runner in compiled.backend.runners:
        assert runner.sizes, "every graph captures the sizes it serves"
