"""Each distinct piece of a piecewise graph is compiled once; identical layers share it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._inductor.compile_fx

import fullcg
from fullcg.backend import Backend
from batches import side_by_side
from fullcg.models.llama import LlamaConfig, LlamaModel
from fullcg.passes.piece_key import piece_key


@pytest.fixture
def compile_fx_calls(monkeypatch) -> list[torch.fx.GraphModule]:
    """Every graph handed to Inductor's ``compile_fx`` while the test runs."""
    calls = []
    real = torch._inductor.compile_fx.compile_fx

    def counting(gm, example_inputs, *args, **kwargs):
        calls.append(gm)
        return real(gm, example_inputs, *args, **kwargs)

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", counting)
    return calls


def _compare_with_eager(model: LlamaModel, config: fullcg.FullCGConfig) -> tuple[float, Backend]:
    """Prefill two prompts and decode twice, eager and compiled; the largest logit difference."""
    eager = copy.deepcopy(model)
    backend = Backend(config)
    compiled = torch.compile(model, backend=backend)
    worst, _ = side_by_side(eager, model, compiled, config, [[1, 2, 3, 4, 5], [6, 7, 8]], max_new_tokens=3)
    return worst, backend


def _model(num_layers: int = 4) -> LlamaModel:
    model = LlamaModel(LlamaConfig.tiny(num_layers=num_layers), seed=0)
    model.allocate_kv_cache(num_pages=64, page_size=4)
    return model


def test_identical_layer_pieces_are_compiled_once_and_match_eager(compile_fx_calls):
    torch._dynamo.reset()
    config = fullcg.FullCGConfig(graph_mode="piecewise", compiler="inductor")
    worst, backend = _compare_with_eager(_model(4), config)
    assert worst < 1e-4
    # 5 compiled pieces: embedding + layer 0's projections, three identical
    # "layer i's output + layer i+1's projections" pieces, layer 3's output + the head.
    assert len(compile_fx_calls) == 3
    report = backend.runners[0].report
    assert "distinct compiled pieces: 3 of 5" in report
    assert report.count("same compilation as submod_2") == 2


def test_a_piece_whose_input_strides_differ_is_compiled_apart(compile_fx_calls):
    torch._dynamo.reset()
    model = _model(4)
    with torch.no_grad():  # same values and shape, column-major: a compiled piece must not assume row-major
        down = model.layers[2].mlp.down_proj
        down.weight = torch.nn.Parameter(down.weight.detach().t().contiguous().t())
    assert not model.layers[2].mlp.down_proj.weight.is_contiguous()
    config = fullcg.FullCGConfig(graph_mode="piecewise", compiler="inductor")
    worst, backend = _compare_with_eager(model, config)
    assert worst < 1e-4
    # Layer 2's output piece (submod_6) holds the transposed weight: compiled on its own.
    assert len(compile_fx_calls) == 4
    report = backend.runners[0].report
    assert "distinct compiled pieces: 4 of 5" in report
    assert "submod_6: compiled piece," in report and "submod_4: compiled piece, same compilation as submod_2" in report


@pytest.mark.parametrize("mode", ["full", "auto"])
def test_the_full_variant_runs_the_same_compiled_pieces(compile_fx_calls, mode):
    # No second compilation of the whole model for full graphs: they run (and capture) the
    # pieces the piecewise variant runs, with attention between them inside the graph.
    torch._dynamo.reset()
    config = fullcg.FullCGConfig(graph_mode=mode, compiler="inductor")
    worst, backend = _compare_with_eager(_model(4), config)
    assert worst < 1e-4
    assert len(compile_fx_calls) == 3
    (runner,) = backend.runners
    assert runner.full is not None and (runner.piecewise is None or runner.piecewise is runner.full)


def _two_op_graph() -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("weight_of_layer_0")
    graph.output((graph.call_function(torch.nn.functional.linear, (x, w)),))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _renamed(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x, w = graph.placeholder("hidden_2"), graph.placeholder("weight_of_layer_1")
    graph.output((graph.call_function(torch.nn.functional.linear, (x, w)),))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _sharing_storage() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs with the metadata of ``zeros(4, 8), zeros(16, 8)`` that share one storage."""
    base = torch.zeros(16, 8)
    return base[:4], base


def test_piece_key_ignores_names_and_sees_every_input_difference_that_matters():
    gm = _two_op_graph()
    x, w = torch.zeros(4, 8), torch.zeros(16, 8)
    key = piece_key(gm, [x, w])
    assert piece_key(_renamed(gm), [torch.ones(4, 8), torch.ones(16, 8)]) == key, "names and values do not matter"
    different = {
        "shape": [torch.zeros(5, 8), w],
        "dtype": [x, w.to(torch.bfloat16)],
        "strides": [x, torch.zeros(8, 16).t()],
        "requires_grad": [x, w.clone().requires_grad_()],
        "aliasing": list(_sharing_storage()),
        "a scalar input": [x, 3],
    }
    for what, inputs in different.items():
        assert piece_key(gm, inputs) != key, what
    other_code = torch.fx.Graph()
    a, b = other_code.placeholder("x"), other_code.placeholder("w")
    other_code.output((other_code.call_function(torch.matmul, (a, b)),))
    assert piece_key(torch.fx.GraphModule(torch.nn.Module(), other_code), [x, w]) != key
