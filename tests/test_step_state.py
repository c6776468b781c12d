"""Per-step and per-model state is typed and owned: a step's shared facts live in its
context's StepState, a compiled model counts its own steps, one-time diagnostics are told
once, and the private torch APIs fullcg leans on work on this torch."""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings

import pytest
import torch

import fullcg
from fullcg import compat, context, diagnostics
from fullcg.context import StepState
from fullcg.frontend import device_of
from fullcg.models.llama import LlamaConfig, LlamaModel


def _model() -> LlamaModel:
    model = LlamaModel(LlamaConfig.tiny())
    model.allocate_kv_cache(32, 4)
    return model


def _step(model, run, q_lens, p_lens):
    table = torch.arange(len(q_lens) * 8, dtype=torch.int32).view(len(q_lens), 8)  # 8 pages per request
    md = fullcg.AttentionMetadata.build(q_lens, p_lens, table, 4)
    ids = torch.arange(sum(q_lens)) % 100
    pos = md.positions
    with torch.inference_mode(), fullcg.forward_context(md, model):
        return run(ids, pos)


def test_a_step_shares_what_its_calls_work_out_in_typed_slots():
    model = _model()
    seen: list[StepState] = []
    md = fullcg.AttentionMetadata.build([3], [0], torch.tensor([[0, 1]], dtype=torch.int32), 4)
    with torch.inference_mode(), fullcg.forward_context(md, model) as ctx:
        model(torch.tensor([1, 2, 3]), md.positions)
        seen.append(ctx.step)
    state = seen[0]
    assert isinstance(state, StepState)
    assert not hasattr(ctx, "memo"), "no untyped blackboard"
    (impl,) = state.implementations.values()
    assert state.resolved() == (impl,)
    assert set(state.checked_caches) == {a.layer_id for a in model.attention_layers()}
    assert set(state.saved_kv) == set(state.checked_caches), "each layer saved once"
    state.clear()
    assert all(not getattr(state, f.name) for f in dataclasses.fields(state))


def test_the_forward_context_takes_no_split_choice():
    model = _model()
    md = fullcg.AttentionMetadata.build([3], [0], torch.tensor([[0, 1]], dtype=torch.int32), 4)
    with pytest.raises(TypeError, match="breakable"):
        with fullcg.forward_context(md, model, breakable=True):
            pass
    assert "breakable" not in context.STATIC_FACTS


def test_each_compiled_model_counts_its_own_steps_and_the_process_total_is_their_sum():
    torch._dynamo.reset()
    fullcg.reset_graph_mode_counts()
    models = [_model(), _model()]
    runs = [fullcg.compile(m, compiler="eager") for m in models]
    for _ in range(2):
        _step(models[0], runs[0], [3], [0])
    _step(models[1], runs[1], [2, 1], [0, 0])
    first, second = runs[0].step_counts(), runs[1].step_counts()
    assert sum(first.values()) == 2 and sum(second.values()) == 1
    assert fullcg.graph_mode_counts() == first + second
    fullcg.reset_graph_mode_counts()
    assert not runs[0].step_counts() and not fullcg.graph_mode_counts()


def test_a_model_run_without_a_compiler_counts_its_own_steps_too():
    fullcg.reset_graph_mode_counts()
    model = _model()
    run = fullcg.compile(model, compiler="none")
    _step(model, run, [3], [0])
    assert sum(run.step_counts().values()) == 1
    assert fullcg.graph_mode_counts() == run.step_counts()


def test_a_diagnostic_is_told_once_per_key():
    diagnostics.forget_told("test key")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            diagnostics.warn_once("test key", "fullcg: something worth saying")
    assert len(record) == 1
    logger = logging.getLogger("fullcg.test")
    diagnostics.forget_told("test log key")
    calls = []
    logger.log = lambda level, msg, *args: calls.append(msg % args)  # type: ignore[method-assign]
    for _ in range(3):
        diagnostics.log_once("test log key", logger, logging.INFO, "told %d", 1)
    assert calls == ["told 1"]


def test_the_step_device_skips_parameters_leading_a_graphs_inputs():
    weight = torch.nn.Parameter(torch.zeros(2, device="meta"))
    assert device_of([weight, torch.zeros(2)]) == torch.device("cpu")
    assert device_of([weight]) == torch.device("meta")
    assert device_of([1, "x"]) == torch.device("cpu")


def test_the_private_torch_apis_fullcg_uses_work_on_this_torch(monkeypatch):
    read = compat.env_reader(["FULLCG_TEST_SET", "FULLCG_TEST_UNSET"])
    monkeypatch.setenv("FULLCG_TEST_SET", "1")
    monkeypatch.delenv("FULLCG_TEST_UNSET", raising=False)
    set_value, unset_value = read()
    assert set_value in ("1", b"1") and unset_value is None
    monkeypatch.setenv("FULLCG_TEST_SET", "2")
    assert read()[0] in ("2", b"2"), "the reader sees the environment as it is now"
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.add, (x, 1)))
    with compat.lazy_graph_modules():
        gm = compat.make_graph_module(torch.nn.Module(), graph)
    assert torch.equal(gm(torch.ones(2)), torch.full((2,), 2.0))
    compat.enable_size_oblivious()
    import torch.fx.experimental._config as fx_config

    assert getattr(fx_config, "backed_size_oblivious", True)
    if torch.cuda.is_available():
        assert isinstance(compat.current_raw_stream(compat.current_device_index()), int)
    assert os.environ.get("FULLCG_TEST_SET") == "2"
