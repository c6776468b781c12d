"""Attention.forward reaches the right one of the four ops, eagerly and under torch.compile."""

from __future__ import annotations

import pytest
import torch

import fullcg
from fullcg.ops.impl import register_implementation
from fullcg.ops.impl.reference import ReferenceAttention
from batches import make_batch


class RecordingAttention(ReferenceAttention):
    """The reference implementation, remembering which op called it."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def forward(self, call, ctx, cache):
        self.calls.append(call.op)
        return super().forward(call, ctx, cache)


@pytest.fixture
def recorder():
    rec = RecordingAttention()
    register_implementation(rec)
    return rec


EXPECTED = {False: "attention", True: "attention_with_lse"}
CONFIG = fullcg.FullCGConfig(attention_impl="recording")


def _step(layer, q, k, v, return_lse):
    return layer(q, k, v, return_lse=return_lse)


@pytest.mark.parametrize("return_lse", list(EXPECTED), ids=list(EXPECTED.values()))
def test_eager_dispatch_calls_the_plain_op(recorder, return_lse):
    b = make_batch([3, 1], [0, 4])
    with fullcg.forward_context(b.metadata, b.layer, config=CONFIG):
        result = _step(b.layer, b.q, b.k, b.v, return_lse)
    assert recorder.calls == [EXPECTED[return_lse]]
    assert isinstance(result, tuple) == return_lse


@pytest.mark.parametrize("return_lse", list(EXPECTED), ids=list(EXPECTED.values()))
def test_compiled_dispatch_puts_the_plain_op_in_the_graph_and_runs_it(recorder, return_lse):
    """Split points are the fullcg backend's to mark (fullcg.passes.split); any other
    compiler sees the plain op the layer emits."""
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.common import aot_autograd
        from functorch.compile import make_boxed_func

        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)

    compiled = torch.compile(_step, backend=backend, fullgraph=True)
    b = make_batch([3, 1], [0, 4])
    with fullcg.forward_context(b.metadata, b.layer, config=CONFIG):
        result = compiled(b.layer, b.q, b.k, b.v, return_lse)
        expected = _step(b.layer, b.q, b.k, b.v, return_lse)
    op = EXPECTED[return_lse]
    assert recorder.calls == [op, op]
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert f"fullcg.{op}.default" in targets
    assert not [t for t in targets if t.startswith("fullcg.") and t != f"fullcg.{op}.default"]
    if return_lse:
        torch.testing.assert_close(result[0], expected[0])
        torch.testing.assert_close(result[1], expected[1])
    else:
        torch.testing.assert_close(result, expected)


@pytest.mark.parametrize("op", ["attention", "attention_with_lse", "breakable_attention", "breakable_attention_with_lse"])
def test_the_four_ops_compute_the_same_attention(recorder, op):
    """The breakable forms (split points of compiled graphs) differ from the plain ones only
    in name and tags: each reaches the implementation under its own name, with one result."""
    b = make_batch([3, 1], [0, 4])
    with fullcg.forward_context(b.metadata, b.layer, config=CONFIG):
        expected, expected_lse = b.layer(b.q, b.k, b.v, return_lse=True)
    b = make_batch([3, 1], [0, 4])  # the same batch over a fresh cache
    out = torch.empty_like(expected)
    with fullcg.forward_context(b.metadata, b.layer, config=CONFIG):
        lse = getattr(torch.ops.fullcg, op).default(b.q, b.k, b.v, out, b.layer.layer_id, scale=b.layer.scale,
                                                     kv_cache_id=b.layer.kv_cache.uid)
    assert recorder.calls[-1] == op
    torch.testing.assert_close(out, expected)
    if op.endswith("with_lse"):
        torch.testing.assert_close(lse, expected_lse)
    else:
        assert lse is None


@pytest.mark.parametrize("return_lse", [False, True])
def test_aot_eager_matches_eager_across_batches(return_lse):
    torch._dynamo.reset()
    compiled = torch.compile(_step, backend="aot_eager", dynamic=True)
    for seed, (q_lens, p_lens) in enumerate([([3, 1], [0, 4]), ([5, 1, 2], [0, 7, 3]), ([1, 1], [6, 2])]):
        b = make_batch(q_lens, p_lens, seed=seed)
        with fullcg.forward_context(b.metadata, b.layer):
            got = compiled(b.layer, b.q, b.k, b.v, return_lse)
            want = _step(b.layer, b.q, b.k, b.v, return_lse)
        if return_lse:
            torch.testing.assert_close(got[0], want[0])
            torch.testing.assert_close(got[1], want[1])
        else:
            torch.testing.assert_close(got, want)


def test_one_layer_compiles_once_for_changing_batches():
    torch._dynamo.reset()
    b0 = make_batch([4, 2], [0, 3], seed=1)
    layer = b0.layer
    layer.allocate_kv_cache(64, b0.layer.kv_cache.page_size)
    compiled = torch.compile(lambda q, k, v: layer(q, k, v), backend="aot_eager", dynamic=True)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for seed, (q_lens, p_lens) in enumerate([([4, 2], [0, 3]), ([1, 1, 1], [2, 5, 1]), ([6], [0]), ([2, 1], [3, 4])]):
        b = make_batch(q_lens, p_lens, seed=seed)
        # The layer keeps its cache (a new cache is a new graph: captured graphs hold its address).
        layer.kv_cache.k[: b.layer.kv_cache.num_pages].copy_(b.layer.kv_cache.k)
        layer.kv_cache.v[: b.layer.kv_cache.num_pages].copy_(b.layer.kv_cache.v)
        with fullcg.forward_context(b.metadata, layer):
            torch.testing.assert_close(compiled(b.q, b.k, b.v), layer(b.q, b.k, b.v))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1
