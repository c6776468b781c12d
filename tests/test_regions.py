"""A repeated layer is traced once: layer identity is a run-time value, and fullcg.compile
marks a model's layers as nested compile regions that the backend inlines again."""

from __future__ import annotations

import copy

import pytest
import torch

import fullcg
from batches import side_by_side
from fullcg.models.llama import LlamaConfig, LlamaModel
from fullcg.ops.attention import LAYER_FROM_KEY
from fullcg.errors import RegionReuseError
from fullcg.regions import check_region_calls, inline_regions, mark_repeated_layers, regions_supported

needs_regions = pytest.mark.skipif(
    not regions_supported(), reason="this torch does not reuse a nested compile region's trace (torch 2.13 and later do)"
)
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8]]


def _model(**changes: object) -> LlamaModel:
    model = LlamaModel(LlamaConfig.tiny(**{"num_layers": 4, **changes}), seed=0)
    model.allocate_kv_cache(num_pages=64, page_size=4)
    return model


def _run(model: LlamaModel, **options: object) -> tuple[float, fullcg.CompiledModel]:
    """Prefill, extend and decode the compiled model beside an eager copy; the largest logit difference."""
    torch._dynamo.reset()
    eager = copy.deepcopy(model)
    compiled = fullcg.compile(model, graph_mode="piecewise", compiler="eager", compile_cache=False, **options)
    worst, modes = side_by_side(eager, model, compiled, compiled.config, PROMPTS, max_new_tokens=3, prefill_chunk=4)
    assert sum(compiled.step_counts().values()) == len(modes)  # every step ran compiled
    return worst, compiled


@needs_regions
def test_dynamo_traces_one_layer_for_all_four_and_the_steps_equal_eager():
    worst, compiled = _run(_model())
    assert worst < 1e-5
    assert [r.regions for r in compiled.runners] == [(4, 1)]  # 4 layer calls, 1 traced region
    assert "layers traced: 1 traced layer region(s) served 4 layer calls" in compiled.runners[0].report


@needs_regions
def test_chunked_prefix_layers_are_traced_once_too():
    worst, compiled = _run(_model(chunked_prefix=True))
    assert worst < 1e-5
    assert [r.regions for r in compiled.runners] == [(4, 1)]


@needs_regions
def test_layers_that_differ_get_a_region_each_kind_and_stay_exact():
    # Sliding layers 0 and 2, full-attention layers 1 and 3: two kinds of layer graph.
    worst, compiled = _run(_model(sliding_window=3, full_attention_every=2))
    assert worst < 1e-5
    assert [r.regions for r in compiled.runners] == [(4, 2)]


def test_with_trace_layers_once_off_every_layer_is_traced_and_nothing_is_marked():
    model = _model()
    worst, compiled = _run(model, trace_layers_once=False)
    assert worst < 1e-5
    assert [r.regions for r in compiled.runners] == [(0, 0)]
    assert "layers traced: each on its own" in compiled.runners[0].report
    assert all("forward" not in layer.__dict__ for layer in model.layers)


@needs_regions
def test_marking_twice_keeps_the_first_marks_and_eager_calls_are_unchanged():
    model = _model()
    assert mark_repeated_layers(model) == 4
    first = [layer.forward for layer in model.layers]
    assert mark_repeated_layers(model) == 4  # counted as marked, not marked again
    assert all(layer.forward is f for layer, f in zip(model.layers, first))
    unmarked = _model()
    ids, pos = torch.tensor([1, 2, 3]), torch.arange(3)
    md = fullcg.AttentionMetadata.build([3], [0], torch.tensor([[0]]), 4)
    with torch.inference_mode():
        with fullcg.forward_context(md, model):
            a = model(ids, pos)
        with fullcg.forward_context(md, unmarked):
            b = unmarked(ids, pos)
    assert torch.equal(a, b)


def test_a_layer_key_names_the_layer_and_the_cache_it_owns_now():
    attn = fullcg.Attention(4, 16, 2, layer_id=7)
    assert attn.layer_key.tolist() == [7, 0]
    cache = attn.allocate_kv_cache(4, 4)
    assert attn.layer_key.tolist() == [7, cache.uid]
    copied = copy.deepcopy(attn)  # a copy holds another cache, with its own uid
    assert copied.layer_key.tolist() == [7, copied.kv_cache.uid] and copied.kv_cache.uid != cache.uid
    assert attn.layer_key.tolist() == [7, cache.uid]
    attn.layer_id = 3
    assert attn.layer_key.tolist() == [3, cache.uid]
    attn.to(torch.float64)  # a plain attribute: never cast or moved with the model
    assert attn.layer_key.dtype == torch.int64 and attn.layer_key.device.type == "cpu"
    attn.kv_cache = None
    assert attn.layer_key.tolist() == [3, 0]
    with pytest.raises(ValueError, match="layer_id must be a non-negative integer"):
        attn.layer_id = -1


def test_a_layer_built_under_inference_mode_can_take_a_cache_outside_it():
    with torch.inference_mode():
        attn = fullcg.Attention(4, 16, 2, layer_id=0)
    cache = attn.allocate_kv_cache(4, 4)
    assert attn.layer_key.tolist() == [0, cache.uid]


def _op_args() -> tuple[torch.Tensor, ...]:
    q = torch.randn(3, 4, 16)
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    return q, k, v, torch.empty_like(q)


def test_an_op_call_names_its_layer_one_way_only():
    layer = fullcg.Attention(4, 16, 2, layer_id=0)
    layer.allocate_kv_cache(8, 4)
    md = fullcg.AttentionMetadata.build([3], [0], torch.tensor([[0]]), 4)
    op = torch.ops.fullcg.attention.default
    with torch.inference_mode(), fullcg.forward_context(md, layer):
        with pytest.raises(ValueError, match="a call names its layer one way"):
            op(*_op_args(), 0, layer=layer.layer_key)
        with pytest.raises(ValueError, match="layer_id must be a non-negative integer"):
            op(*_op_args(), LAYER_FROM_KEY)  # -1 without a key
        with pytest.raises(ValueError, match="an int64 CPU tensor"):
            op(*_op_args(), LAYER_FROM_KEY, layer=layer.layer_key.int())
        q, k, v, out = _op_args()
        op(q, k, v, out, LAYER_FROM_KEY, layer=layer.layer_key)  # the key names layer 0 and its cache
    layer.allocate_kv_cache(8, 4)  # a fresh cache for the same call, named by the ints
    expected = torch.empty_like(out)
    with torch.inference_mode(), fullcg.forward_context(md, layer):
        op(q, k, v, expected, 0, kv_cache_id=layer.kv_cache.uid)
    assert torch.equal(out, expected)


def test_a_key_of_another_models_layer_is_refused_naming_the_fix():
    layer, other = (fullcg.Attention(4, 16, 2, layer_id=0) for _ in range(2))
    layer.allocate_kv_cache(8, 4)
    other.allocate_kv_cache(8, 4)
    md = fullcg.AttentionMetadata.build([3], [0], torch.tensor([[0]]), 4)
    with torch.inference_mode(), fullcg.forward_context(md, layer):
        with pytest.raises(RuntimeError, match="another model"):
            torch.ops.fullcg.attention.default(*_op_args(), LAYER_FROM_KEY, layer=other.layer_key)


@needs_regions
def test_layers_given_new_caches_run_on_them_without_compiling_again():
    model = _model()
    worst, compiled = _run(model)
    assert worst < 1e-5
    model.allocate_kv_cache(num_pages=64, page_size=4)  # new caches (new uids) for every layer
    eager = copy.deepcopy(model)
    worst, _ = side_by_side(eager, model, compiled, compiled.config, PROMPTS, max_new_tokens=2)
    assert worst < 1e-5
    assert len(compiled.runners) == 1  # the same graph: the ops read each layer's cache when they run
    caches = {a.layer_id: a.kv_cache.uid for a in model.attention_layers()}
    assert dict(compiled.runners[0]._cache_uids) == caches


def test_inlining_a_graph_without_regions_returns_it_unchanged():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert inline_regions(gm, lambda root, graph: torch.fx.GraphModule(root, graph)) is gm


@needs_regions
def test_inlined_regions_compute_what_the_regions_did():
    region = torch.compiler.nested_compile_region(lambda x, w: torch.relu(x @ w) + 1)
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(x, ws):
        for w in ws:
            x = region(x, w)
        return x

    torch._dynamo.reset()
    x, ws = torch.randn(3, 4), [torch.randn(4, 4) for _ in range(3)]
    torch.compile(f, backend=keep, fullgraph=True)(x, ws)
    (gm,) = graphs
    flat = inline_regions(gm, lambda root, graph: torch.fx.GraphModule(root, graph))
    assert not any("invoke_subgraph" in str(n.target) for n in flat.graph.nodes)
    out = flat(x, *ws)  # Dynamo's inputs: x, then the weights
    assert torch.allclose(out[0] if isinstance(out, (tuple, list)) else out, f(x, ws))


def _step_beside_eager(model: torch.nn.Module) -> fullcg.CompiledModel:
    """One prefill step of ``model`` (layers with 2 heads of 16 over a 32-wide input)
    compiled and beside an eager copy, asserted equal; the compiled model."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    for layer in model.layers:
        layer.attn.allocate_kv_cache(8, 4)
    eager = copy.deepcopy(model)
    compiled = fullcg.compile(model, compiler="eager", graph_mode="piecewise")
    md = fullcg.AttentionMetadata.build([3], [0], torch.tensor([[0]]), 4)
    x = torch.randn(3, 32)
    with torch.inference_mode():
        with fullcg.forward_context(md, model):
            got = compiled(x)
        with fullcg.forward_context(md, eager):
            expected = eager(x)
    torch.testing.assert_close(got, expected)
    return compiled


class _IndexedLayer(torch.nn.Module):
    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(32, 96)
        self.attn = fullcg.Attention(2, 16, layer_id=layer_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).view(-1, 6, 16).split([2, 2, 2], dim=1)
        return x + self.attn(q, k, v).flatten(1)


class _IndexedModel(torch.nn.Module):
    """Layers called with one plain tensor argument (a region called so, without a keyword,
    is stamped out by torch 2.13's Dynamo with the first layer's tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_IndexedLayer(i) for i in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](self.layers[0](x))


@needs_regions
def test_layers_called_with_one_plain_tensor_share_a_region_each_on_its_own_tensors(caplog):
    compiled = _step_beside_eager(_IndexedModel())  # every layer on its own weights and cache
    # One region serves both layers: the region is called with a keyword, which keeps
    # Dynamo off the path that would hand the second layer the first one's tensors.
    assert [r.regions for r in compiled.runners] == [(2, 1)]
    assert "as compile regions failed" not in caplog.text


class _SharingLayer(torch.nn.Module):
    """Hands its keys to the next layer through a list, as Gemma 4 shares k/v between layers."""

    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(32, 96)
        self.attn = fullcg.Attention(2, 16, layer_id=layer_id)

    def forward(self, x: torch.Tensor, shared: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = self.proj(x).view(-1, 6, 16).split([2, 2, 2], dim=1)
        if shared:
            k = shared[-1]
        shared.append(k)
        return x + self.attn(q, k, v).flatten(1)


class _SharingModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_SharingLayer(i) for i in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared: list[torch.Tensor] = []
        for layer in self.layers:
            x = layer(x * 1, shared)
        return x


@needs_regions
def test_layers_dynamo_cannot_hold_as_regions_are_traced_on_their_own_with_one_warning(caplog):
    compiled = _step_beside_eager(_SharingModel())
    assert [r.regions for r in compiled.runners] == [(0, 0)]
    warnings = [r for r in caplog.records if "as compile regions failed" in r.getMessage()]
    assert len(warnings) == 1 and "InternalTorchDynamoError" in warnings[0].getMessage()


def test_an_error_of_the_model_itself_is_raised_not_retried():
    model = _model()
    compiled = fullcg.compile(model, compiler="eager", graph_mode="piecewise")
    with torch.inference_mode(), pytest.raises(RuntimeError, match="forward context"):
        compiled(torch.tensor([1, 2]), torch.arange(2))  # no forward context entered
    assert compiled._marked == regions_supported()  # still marked: the model's error is not the regions'


def _region_graph(keys: list[torch.Tensor]) -> tuple[torch.fx.GraphModule, list[object]]:
    """Dynamo's graph of one attention region called once per key (what the backend receives)."""
    region = torch.compiler.nested_compile_region(
        lambda q, key: torch.ops.fullcg.attention_with_lse.default(
            q, q, q, torch.empty_like(q), -1, use_kv_cache=False, layer=key))
    graphs = []

    def keep(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    def f(q, keys):
        return [region(q, key) for key in keys]

    torch._dynamo.reset()
    md = fullcg.AttentionMetadata.build([3], [0], torch.tensor([[0]]), 4)
    with torch.inference_mode(), fullcg.forward_context(md):
        torch.compile(f, backend=keep, fullgraph=True)(torch.randn(3, 2, 16), keys)
    return graphs[0][0], list(graphs[0][1])


@needs_regions
def test_region_calls_reading_one_layers_key_are_refused_and_distinct_keys_pass():
    a, b = torch.tensor([0, 0]), torch.tensor([1, 0])
    check_region_calls(*_region_graph([a, b]))
    with pytest.raises(RegionReuseError, match="read one attention layer's key"):
        check_region_calls(*_region_graph([a, a]))


@needs_regions
def test_a_copy_of_a_marked_model_is_checked_and_traced_once_too():
    model = _model()
    mark_repeated_layers(model)
    copied = copy.deepcopy(model)  # its layers carry marked forwards of their own
    copied.allocate_kv_cache(num_pages=64, page_size=4)
    worst, compiled = _run(copied)
    assert worst < 1e-5 and compiled._marked
    assert [r.regions for r in compiled.runners] == [(4, 1)]


def test_trace_layers_once_off_unmarks_layers_an_earlier_compile_marked():
    model = _model()
    mark_repeated_layers(model)
    fullcg.compile(model, trace_layers_once=False)
    assert all("forward" not in layer.__dict__ for layer in model.layers)


@needs_regions
def test_an_error_the_backend_raises_is_raised_once_not_retried_without_regions(caplog, monkeypatch):
    import fullcg.backend
    from fullcg.errors import InvalidConfigError

    def refuse(*args, **kwargs):
        raise InvalidConfigError("refused for the test")

    monkeypatch.setattr(fullcg.backend, "_cached_compile", refuse)
    torch._dynamo.reset()
    model = _model()
    compiled = fullcg.compile(model, compiler="eager", graph_mode="piecewise")
    md = fullcg.AttentionMetadata.build([3], [0], torch.tensor([[0]]), 4)
    with torch.inference_mode(), fullcg.forward_context(md, model), pytest.raises(InvalidConfigError, match="refused"):
        compiled(torch.tensor([1, 2, 3]), torch.arange(3))
    assert compiled._marked and "as compile regions failed" not in caplog.text


def test_a_runner_drops_its_full_graphs_when_the_caches_change():
    from fullcg.context import forward_context

    model = _model()
    compiled = fullcg.compile(model, compiler="eager", graph_mode="full_and_piecewise")
    md = fullcg.AttentionMetadata.build([3], [0], torch.tensor([[0]]), 4)
    with torch.inference_mode():
        with forward_context(md, model):
            compiled(torch.tensor([1, 2, 3]), torch.arange(3))
        (runner,) = compiled.runners
        runner.full_graphs[(1, True)] = object()  # stands for a graph captured on the old caches
        with forward_context(md, model):
            compiled(torch.tensor([1, 2, 3]), torch.arange(3))
        assert runner.full_graphs  # same caches: kept
        model.allocate_kv_cache(num_pages=64, page_size=4)
        with forward_context(md, model):
            compiled(torch.tensor([1, 2, 3]), torch.arange(3))
    assert not runner.full_graphs
    assert dict(runner._cache_uids) == {a.layer_id: a.kv_cache.uid for a in model.attention_layers()}


@needs_regions
def test_a_pickled_or_copied_marked_model_runs_unmarked_until_compiled_again():
    import pickle

    model = _model()
    mark_repeated_layers(model)
    for restored in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert all(layer.forward.region is None for layer in restored.layers)  # a plain call
        restored.allocate_kv_cache(num_pages=64, page_size=4)
        worst, compiled = _run(restored)
        assert worst < 1e-5
        assert [r.regions for r in compiled.runners] == [(4, 1)]
        assert all(layer.forward.region is not None for layer in restored.layers)
