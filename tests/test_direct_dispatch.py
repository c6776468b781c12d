"""fullcg.compile's steps skip Dynamo once it has compiled their graph, and go back to it
whenever a step is not one the learned graph was made for."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fullcg
from fullcg.models.llama import LlamaConfig, LlamaModel
from batches import run_steps_against_eager

TABLE = torch.arange(64, dtype=torch.int32).view(4, 16)
STEPS = [([5], [0]), ([1], [5]), ([3, 1], [0, 6]), ([1, 1, 1], [3, 7, 2]), ([8], [0]), ([1], [8])]


class DynamoCalls:
    """Counts the steps that reach Dynamo (the compiled model's torch.compile wrapper)."""

    def __init__(self, compiled: fullcg.backend.CompiledModel) -> None:
        self.calls = 0
        self._inner = compiled._compiled
        compiled._compiled = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._inner(*args, **kwargs)


def _step(q_lens, p_lens):
    md = fullcg.AttentionMetadata.build(q_lens, p_lens, TABLE[: len(q_lens)], 4)
    ids = torch.randint(0, 100, (sum(q_lens),))
    pos = torch.cat([torch.arange(p, p + q) for q, p in zip(q_lens, p_lens)])
    return md, ids, pos


def _compiled(**options):
    torch._dynamo.reset()
    model, reference = LlamaModel(LlamaConfig.tiny()), LlamaModel(LlamaConfig.tiny())
    for m in (model, reference):
        m.allocate_kv_cache(64, 4)
    compiled = fullcg.compile(model, compiler="eager", **options)
    return model, reference, compiled, DynamoCalls(compiled)


def test_steps_after_the_first_reach_the_runner_without_dynamo_and_equal_eager():
    model, reference, compiled, dynamo = _compiled()
    run_steps_against_eager(model, compiled, reference, STEPS)
    assert dynamo.calls == 1, "only the first step goes through Dynamo"
    assert len(compiled.backend.runners) == 1


def test_steps_the_learned_graph_was_not_made_for_go_through_dynamo():
    model, _, compiled, dynamo = _compiled()
    md, ids, pos = _step([3], [0])
    with torch.inference_mode():
        with fullcg.forward_context(md, model):
            compiled(ids, pos)
        with fullcg.forward_context(md, model):
            compiled(ids, pos)
        assert dynamo.calls == 1
        with fullcg.forward_context(md, model):
            compiled(ids, positions=pos)
        assert dynamo.calls == 2, "keyword arguments: Dynamo binds them"
        with fullcg.forward_context(md, model):
            compiled(ids.int(), pos)
        assert dynamo.calls == 3, "another dtype: Dynamo's guards decide"
        graphs = len(compiled.backend.runners)
        factors = fullcg.FullCGConfig(skip_softmax=fullcg.SkipSoftmaxConfig(prefill_scale_factor=64.0))
        with fullcg.forward_context(md, model, config=factors):
            compiled(ids, pos)
        assert dynamo.calls == 4, "other static facts (the skip-softmax factors traced code reads): another graph"
        assert len(compiled.backend.runners) == graphs + 1
        with fullcg.forward_context(md, model, config=factors):
            compiled(ids, pos)
        assert dynamo.calls == 4, "and that graph is learned too"
        other = LlamaModel(LlamaConfig.tiny())
        other.allocate_kv_cache(64, 4)
        with pytest.raises(Exception, match="LlamaModel"), fullcg.forward_context(md, other):
            compiled(ids, pos)  # another model's caches: Dynamo, where attention names both models
        assert dynamo.calls == 5


def test_a_token_count_the_graph_does_not_admit_goes_through_dynamo():
    # A graph guarded to some token counts (torch 2.11's Inductor guards "more than one
    # token" on some graphs) must not take steps of other counts behind Dynamo's back.
    model, _, compiled, dynamo = _compiled()
    with torch.inference_mode():
        for q_lens, p_lens in [([2], [0]), ([1], [2]), ([1], [3])]:
            if dynamo.calls:
                compiled.backend.runners[0].stager.admits = lambda n: n != 1
            md, ids, pos = _step(q_lens, p_lens)
            with fullcg.forward_context(md, model):
                compiled(ids, pos)
    assert dynamo.calls == 3


def test_debug_checks_keep_every_step_on_dynamos_guards():
    model, _, compiled, dynamo = _compiled(debug_checks=True)
    with torch.inference_mode():
        for q_lens, p_lens in STEPS[:3]:
            md, ids, pos = _step(q_lens, p_lens)
            with fullcg.forward_context(md, model):
                compiled(ids, pos)
    assert dynamo.calls == 3


def test_a_graph_reading_per_layer_skip_factors_is_learned_and_a_new_factor_goes_through_dynamo():
    skip = fullcg.SkipSoftmaxConfig(None, None, tile_kv=8, tile_q=4, per_layer={1: (30.0, None)})
    model, _, compiled, dynamo = _compiled(attention_impl="reference", skip_softmax=skip)
    md, ids, pos = _step([3], [0])
    with torch.inference_mode():
        for _ in range(2):
            with fullcg.forward_context(md, model):
                compiled(ids, pos)
        assert dynamo.calls == 1, "the per-layer factors are a static fact the route knows"
        other = fullcg.FullCGConfig(attention_impl="reference", skip_softmax=dataclasses.replace(skip, per_layer={1: (60.0, None)}))
        with fullcg.forward_context(md, model, config=other):
            compiled(ids, pos)
        assert dynamo.calls == 2, "another layer factor: another graph"


def test_after_a_cache_is_replaced_only_routes_learned_on_the_new_caches_are_taken():
    # The graphs learned before a layer got a new cache hold the old cache's identity: a step
    # on the new caches that the new graph does not admit must go to Dynamo, not to them.
    model, _, compiled, dynamo = _compiled()
    with torch.inference_mode():
        md, ids, pos = _step([2], [0])
        with fullcg.forward_context(md, model):
            compiled(ids, pos)
        model.allocate_kv_cache(64, 4)  # new caches for every layer
        md, ids, pos = _step([2], [0])
        with fullcg.forward_context(md, model):
            compiled(ids, pos)
        assert dynamo.calls == 2
        compiled.backend.runners[-1].stager.admits = lambda n: n != 1  # the new graph: not one token
        md, ids, pos = _step([1], [2])
        with fullcg.forward_context(md, model):
            compiled(ids, pos)
        assert dynamo.calls == 3, "the old caches' graph admits one token but must not take the step"
