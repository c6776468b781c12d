"""CUDA graphs on a GPU: every graph mode replays exactly what eager computes.

Skipped without CUDA (CPU CI); run on a GPU with ``pytest -m cuda``.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

import fullcg
from fullcg.models.generate import Scheduler
from fullcg.models.llama import LlamaConfig, LlamaModel
from batches import cuda_side_by_side

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA graphs)"),
]

IMPLS = ["triton"] + (["flashinfer"] if importlib.util.find_spec("flashinfer") else [])
# Prompt lengths change between steps, so replays see other lengths than their capture.
PROMPTS = [list(range(3, 40)), list(range(50, 55)), list(range(60, 77)), [7] * 9]


def _pair(size: str, chunked_prefix: bool = False, dtype=torch.bfloat16):
    # Head dim 64: FlashInfer has no kernels for the tiny model's 16.
    extra = {"head_dim": 64} if size == "tiny" else {}
    cfg = LlamaConfig.preset(size, chunked_prefix=chunked_prefix, **extra)
    eager = LlamaModel(cfg, seed=0, dtype=dtype, device="cuda")
    compiled = copy.deepcopy(eager)
    for m in (eager, compiled):
        m.allocate_kv_cache(num_pages=128, page_size=16)
    return eager, compiled


def _run(eager, model, compiled_fn, config, *, prefill_chunk=16, max_new_tokens=6):
    return cuda_side_by_side(eager, model, compiled_fn, config, PROMPTS, prefill_chunk=prefill_chunk,
                             max_new_tokens=max_new_tokens)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("graph_mode", ["piecewise", "full", "full_and_piecewise"])
@pytest.mark.parametrize("size", ["tiny", "mid"])
def test_every_graph_mode_matches_eager_with_changing_lengths(impl, graph_mode, size):
    torch._dynamo.reset()
    fullcg.reset_graph_mode_counts()
    compiles = []
    config = fullcg.FullCGConfig(attention_impl=impl, graph_mode=graph_mode, capture_sizes=(1, 2, 4, 8, 16, 32, 64),
                                 debug_graph_inputs=True)
    backend = fullcg.Backend(config)

    def counting(gm, example_inputs, **kw):
        compiles.append(gm)
        return backend(gm, example_inputs, **kw)

    eager, model = _pair(size)
    worst, steps = _run(eager, model, torch.compile(model, backend=counting), config)
    assert worst < 3e-2, f"relative difference {worst}"
    counts = fullcg.graph_mode_counts()
    captured = sum(v for k, v in counts.items() if k.endswith(":captured"))
    assert captured == steps, counts  # every step fits a capture size: nothing ran uncaptured
    if graph_mode == "full_and_piecewise":
        assert counts["full:captured"] > 0 and counts["piecewise:captured"] > 0, counts
    assert len(compiles) == 1, "no recompiles across steps"


@pytest.mark.parametrize("graph_mode", ["auto", "piecewise", "full"])
def test_fullcg_compile_dispatches_captured_steps_without_dynamo_and_matches_eager(graph_mode):
    torch._dynamo.reset()
    fullcg.reset_graph_mode_counts()
    config = fullcg.FullCGConfig(attention_impl="triton", graph_mode=graph_mode, capture_sizes=(1, 2, 4, 8, 16, 32, 64))
    eager, model = _pair("tiny")
    compiled = fullcg.compile(model, config)
    through_dynamo = []
    inner = compiled._compiled

    def dynamo(*args, **kwargs):
        through_dynamo.append(args[0].shape[0])
        return inner(*args, **kwargs)

    compiled._compiled = dynamo
    worst, steps = _run(eager, model, compiled, config)
    assert worst < 3e-2, f"relative difference {worst}"
    counts = fullcg.graph_mode_counts()
    assert sum(v for k, v in counts.items() if k.endswith(":captured")) == steps, counts
    assert len(through_dynamo) == 1 < steps, "only the first step goes through Dynamo"


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_prefix_pattern_under_cuda_graphs(impl):
    torch._dynamo.reset()
    fullcg.reset_graph_mode_counts()
    config = fullcg.FullCGConfig(attention_impl=impl, graph_mode="full_and_piecewise", capture_sizes=(1, 2, 4, 8, 16, 32, 64))
    eager, model = _pair("tiny", chunked_prefix=True)
    worst, _ = _run(eager, model, torch.compile(model, backend=fullcg.Backend(config)), config)
    assert worst < 3e-2
    counts = fullcg.graph_mode_counts()
    assert counts["piecewise:captured"] > 0
    # The full graph gathers prefix chunks on the host, so decode steps say they ran uncaptured.
    assert counts["full:eager"] > 0 and counts["full:captured"] == 0, counts


def test_batches_above_the_largest_capture_size_run_uncaptured():
    torch._dynamo.reset()
    fullcg.reset_graph_mode_counts()
    config = fullcg.FullCGConfig(attention_impl="triton", graph_mode="piecewise", capture_sizes=(1, 2, 4, 8))
    eager, model = _pair("tiny")
    worst, _ = _run(eager, model, torch.compile(model, backend=fullcg.Backend(config)), config, prefill_chunk=64)
    assert worst < 3e-2
    counts = fullcg.graph_mode_counts()
    assert counts["piecewise:eager"] > 0 and counts["piecewise:captured"] > 0, counts


def test_capture_up_front_then_replay_without_new_captures():
    torch._dynamo.reset()
    config = fullcg.FullCGConfig(attention_impl="triton", graph_mode="full_and_piecewise", capture_sizes=(1, 4, 16, 64))
    backend = fullcg.Backend(config)
    eager, model = _pair("tiny")
    compiled = torch.compile(model, backend=backend)
    step = Scheduler([[1, 2, 3]], 1, num_pages=128, page_size=16, device="cuda").next_step()
    fullcg.capture(compiled, step.metadata, model, step.input_ids, step.positions)
    runner = backend.runners[0]
    full_before = dict(runner.full_graphs)
    assert {size for size, _ in full_before} == {1, 4, 16, 64}
    for layer in model.attention_layers():  # capture wrote nothing: slots were -1
        layer.kv_cache.k.zero_()
    worst, _ = _run(eager, model, compiled, config)
    assert worst < 3e-2
    assert runner.full_graphs.keys() == full_before.keys(), "no capture after the up-front one"


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_ops_pass_opcheck_on_cuda(impl):
    from batches import make_batch

    b = make_batch([5, 1, 3], [0, 6, 4], dtype=torch.float16, head_dim=64, num_heads=4, num_kv_heads=2)
    cache = b.layer.kv_cache
    b.layer.kv_cache = fullcg.KVCache(cache.k.cuda(), cache.v.cuda())
    md = fullcg.AttentionMetadata.build(b.metadata.query_lens, b.metadata.prefix_lens, b.metadata.page_table,
                                        b.metadata.page_size, device="cuda")
    q, k, v = b.q.cuda(), b.k.cuda(), b.v.cuda()
    config = fullcg.FullCGConfig(attention_impl=impl)
    with fullcg.forward_context(md, b.layer, config=config):
        for op in fullcg.ops.ATTENTION_OPS.values():
            torch.library.opcheck(op, (q, k, v, torch.empty_like(q), 0))


@pytest.mark.parametrize("graph_mode", ["full", "full_and_piecewise"])
def test_full_graphs_are_captured_again_when_the_layers_get_new_caches(graph_mode):
    # The layers' ops read their caches when they run (nothing compiled depends on them);
    # captured full graphs hold the old caches' addresses and must not replay on the new ones.
    torch._dynamo.reset()
    fullcg.reset_graph_mode_counts()
    config = fullcg.FullCGConfig(attention_impl="triton", graph_mode=graph_mode, capture_sizes=(1, 2, 4, 8, 16, 32, 64))
    eager, model = _pair("tiny")
    compiled = fullcg.compile(model, config)
    worst, _ = _run(eager, model, compiled, config)
    assert worst < 3e-2
    captured = len(compiled.runners[0].full_graphs)
    assert captured > 0
    for m in (eager, model):
        m.allocate_kv_cache(num_pages=96, page_size=16)  # new caches, of another size
    worst, steps = _run(eager, model, compiled, config)
    assert worst < 3e-2, f"relative difference {worst}"
    assert len(compiled.runners) == 1  # not compiled again
    counts = fullcg.graph_mode_counts()
    assert counts["full:captured"] > 0, counts
