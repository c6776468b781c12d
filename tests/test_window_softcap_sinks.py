"""Sliding-window attention, logit soft-capping and attention sinks: what they compute, in
every graph mode, and the errors around them (the reference implementation; the kernels
are checked against it in their own tests)."""

from __future__ import annotations

import pytest
import torch

import fullcg
from fullcg.models.llama import LlamaConfig, LlamaModel
from batches import make_batch, naive_attention, oracle, side_by_side

BATCHES = {
    "prefill": ([9, 3], [0, 0]),
    "extend": ([5, 4], [6, 11]),
    "decode": ([1, 1, 1], [9, 2, 17]),
    "mixed": ([6, 1, 4, 1], [0, 12, 5, 3]),
}

OPTIONS = {
    "window1": dict(sliding_window=1),
    "window4": dict(sliding_window=4),
    "window_longer_than_context": dict(sliding_window=100),
    "softcap": dict(logit_softcap=2.0),
    "window_and_softcap": dict(sliding_window=5, logit_softcap=1.5),
}


def _naive_options(options: dict) -> dict:
    return {"window": options.get("sliding_window"), "softcap": options.get("logit_softcap")}


@pytest.mark.parametrize("name", list(BATCHES))
@pytest.mark.parametrize("option", list(OPTIONS))
def test_cache_attention_with_a_window_or_softcap_equals_float64_softmax(name, option):
    q_lens, p_lens = BATCHES[name]
    b = make_batch(q_lens, p_lens, seed=len(name), key_bias=1.0, **OPTIONS[option])
    with fullcg.forward_context(b.metadata, b.layer):
        out, lse = b.layer(b.q, b.k, b.v, return_lse=True)
    want_out, want_lse = oracle(b, **_naive_options(OPTIONS[option]))
    torch.testing.assert_close(out.double(), want_out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-6, rtol=1e-5)


def test_a_window_of_w_sees_the_query_itself_and_w_minus_one_keys_before_it():
    # One-hot values: the output says exactly which keys each query saw (uniform scores).
    layer = fullcg.Attention(1, 8, layer_id=0, sliding_window=3)
    layer.allocate_kv_cache(4, 4)
    md = fullcg.AttentionMetadata.build([6], [0], torch.tensor([[0, 1]], dtype=torch.int32), 4)
    q = torch.zeros(6, 1, 8)
    k = torch.zeros(6, 1, 8)
    v = torch.eye(8)[:6, None, :]
    with fullcg.forward_context(md, layer):
        out = layer(q, k, v)
    for j in range(6):
        seen = (out[j, 0] > 0).nonzero().flatten().tolist()
        assert seen == list(range(max(0, j - 2), j + 1)), f"query {j} saw keys {seen}"


@pytest.mark.parametrize("option", ["window4", "window_and_softcap"])
def test_causal_attention_over_given_kv_honours_the_window_from_each_requests_start(option):
    b = make_batch([7, 5], [0, 0], seed=3, **OPTIONS[option])
    with fullcg.forward_context(b.metadata, b.layer):
        out, lse = b.layer(b.q, b.k, b.v, return_lse=True, use_kv_cache=False, save_kv_cache=False)
    want_out, want_lse = oracle(b, **_naive_options(OPTIONS[option]))
    torch.testing.assert_close(out.double(), want_out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("option", ["window4", "softcap", "window_and_softcap", "sinks"])
def test_the_chunked_prefix_pattern_merges_to_the_whole_with_windows_softcap_and_sinks(option):
    # New tokens over themselves (LSE), then every prefix chunk merged in: the window is
    # measured from each new token's position into the chunk's keys, and sinks count once.
    opts = {} if option == "sinks" else OPTIONS[option]
    b = make_batch([5, 3, 1], [13, 6, 9], seed=11, prefix_chunk_tokens=8, key_bias=0.5, **opts)
    sinks = torch.randn(4) if option == "sinks" else None
    with fullcg.forward_context(b.metadata, b.layer):
        assert b.metadata.num_prefix_chunks > 1
        out, lse = b.layer(b.q, b.k, b.v, return_lse=True, use_kv_cache=False, save_kv_cache=True, sinks=sinks)
        b.layer.merge_prefix_chunks(b.q, out, lse)
    want_out, want_lse = oracle(b, sinks=sinks, **_naive_options(opts))
    torch.testing.assert_close(out.double(), want_out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("name", list(BATCHES))
def test_sinks_are_an_extra_softmax_column_without_a_value(name):
    q_lens, p_lens = BATCHES[name]
    b = make_batch(q_lens, p_lens, seed=5, sliding_window=6)
    sinks = torch.tensor([0.5, -1.0, 3.0, 8.0])
    with fullcg.forward_context(b.metadata, b.layer):
        out, lse = b.layer(b.q, b.k, b.v, return_lse=True, sinks=sinks)
    want_out, want_lse = oracle(b, window=6, sinks=sinks)
    torch.testing.assert_close(out.double(), want_out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-6, rtol=1e-5)


def test_a_layer_with_learned_sinks_applies_them_and_a_call_may_override_them():
    b = make_batch([4, 1], [0, 6], seed=2)
    layer = fullcg.Attention(4, 16, 2, layer_id=0, sinks=True)
    layer.kv_cache = b.layer.kv_cache
    assert layer.sinks.shape == (4,) and "sinks=True" in repr(layer)
    with torch.no_grad():
        layer.sinks.copy_(torch.tensor([1.0, 2.0, -3.0, 0.0]))
    with fullcg.forward_context(b.metadata, layer), torch.no_grad():
        out = layer(b.q, b.k, b.v)
        overridden = layer(b.q, b.k, b.v, sinks=torch.full((4,), -1e4))  # a sink too small to take any weight
    torch.testing.assert_close(out.double(), oracle(b, sinks=layer.sinks.detach())[0], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(overridden.double(), oracle(b)[0], atol=2e-6, rtol=1e-5)


def test_skip_softmax_with_a_window_visits_only_the_windows_tiles():
    # Decode over 200 cached keys with a 16-key window and 16-key tiles: at most two tiles
    # per KV head can hold a key the query sees, whatever the context length.
    b = make_batch([1], [200], page_size=16, sliding_window=16, seed=9)
    config = fullcg.FullCGConfig(skip_softmax=fullcg.SkipSoftmaxConfig(decode_scale_factor=1.0, tile_kv=16))
    fullcg.reset_skip_softmax_stats()
    with fullcg.forward_context(b.metadata, b.layer, config=config):
        out = b.layer(b.q, b.k, b.v)
    stats = fullcg.skip_softmax_stats()[0]
    assert 0 < stats.decode_visited <= 2 * 2  # two tiles, two KV heads
    torch.testing.assert_close(out.double(), oracle(b, window=16)[0], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("factor", [0.5, 4.0])
def test_skip_softmax_with_a_window_and_softcap_stays_close_to_dense(factor):
    b = make_batch([24, 1], [40, 70], page_size=8, sliding_window=32, logit_softcap=3.0, seed=4, sink=6.0)
    config = fullcg.FullCGConfig(skip_softmax=fullcg.SkipSoftmaxConfig(
        prefill_scale_factor=factor, decode_scale_factor=factor, tile_kv=16))
    with fullcg.forward_context(b.metadata, b.layer, config=config):
        out = b.layer(b.q, b.k, b.v)
    want = oracle(b, window=32, softcap=3.0)[0]
    assert (out.double() - want).abs().max() < 0.05


GRAPH_MODES = ["none", "piecewise", "full", "full_and_piecewise"]


@pytest.mark.parametrize("graph_mode", GRAPH_MODES)
@pytest.mark.parametrize("chunked_prefix", [False, True], ids=["cache", "chunked_prefix"])
def test_a_windowed_softcapped_model_with_sinks_compiles_to_eager_in_every_graph_mode(graph_mode, chunked_prefix):
    torch._dynamo.reset()
    cfg = LlamaConfig.tiny(sliding_window=5, full_attention_every=2, logit_softcap=4.0, attention_sinks=True,
                           chunked_prefix=chunked_prefix)
    eager, model = LlamaModel(cfg), LlamaModel(cfg)
    for m in (eager, model):
        m.allocate_kv_cache(64, 4)
    config = fullcg.FullCGConfig(graph_mode=graph_mode, compiler="eager")
    compiled = fullcg.compile(model, config)
    worst, modes = side_by_side(eager, model, compiled, config, [[1, 2, 3, 4, 5, 6, 7, 8, 9], [7, 8, 9, 10, 11]],
                                max_new_tokens=8, prefill_chunk=4, prefix_chunk_tokens=4)
    assert worst < 1e-5
    assert {"extend"} <= set().union(*modes) and {"decode"} <= set().union(*modes)


def test_a_windowed_model_runs_without_a_compiler_equal_to_eager():
    cfg = LlamaConfig.tiny(sliding_window=3, logit_softcap=4.0, attention_sinks=True)
    eager, model = LlamaModel(cfg), LlamaModel(cfg)
    for m in (eager, model):
        m.allocate_kv_cache(64, 4)
    config = fullcg.FullCGConfig(compiler="none")
    run = fullcg.compile(model, config)
    worst, _ = side_by_side(eager, model, run, config, [[1, 2, 3, 4, 5, 6, 7], [9, 8]], max_new_tokens=5)
    assert worst < 1e-5


def test_a_window_changes_the_result_once_the_context_exceeds_it():
    cfg = LlamaConfig.tiny(sliding_window=3)
    windowed, full = LlamaModel(cfg), LlamaModel(LlamaConfig.tiny())
    for m in (windowed, full):
        m.allocate_kv_cache(64, 4)
    md = fullcg.AttentionMetadata.build([8], [0], torch.arange(4, dtype=torch.int32)[None], 4)
    ids, pos = torch.arange(8), torch.arange(8)
    with torch.inference_mode():
        with fullcg.forward_context(md, windowed):
            a = windowed(ids, pos)
        with fullcg.forward_context(md, full):
            b = full(ids, pos)
    torch.testing.assert_close(a[:3], b[:3])  # the first three tokens see everything either way
    assert (a[3:] - b[3:]).abs().max() > 1e-3


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -2, True, 2.5])
def test_a_window_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        fullcg.Attention(2, 8, layer_id=0, sliding_window=bad)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_a_softcap_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError, match="logit_softcap must be a positive finite number"):
        fullcg.Attention(2, 8, layer_id=0, logit_softcap=bad)


def test_the_op_refuses_a_window_on_non_causal_given_kv():
    b = make_batch([4], [0], sliding_window=2)
    with fullcg.forward_context(b.metadata, b.layer), pytest.raises(ValueError, match="non-causal attention"):
        b.layer(b.q, b.k, b.v, use_kv_cache=False, causal=False, save_kv_cache=False)


def test_sinks_of_the_wrong_shape_are_refused():
    b = make_batch([4], [0])
    with fullcg.forward_context(b.metadata, b.layer), pytest.raises(ValueError, match=r"sinks must be \[4\]"):
        b.layer(b.q, b.k, b.v, sinks=torch.zeros(2))


def test_a_per_call_scale_overrides_the_layers():
    b = make_batch([5, 1], [0, 4], seed=8)
    with fullcg.forward_context(b.metadata, b.layer):
        out = b.layer(b.q, b.k, b.v, scale=1.0)
    outs = [naive_attention(b.q[s:e], b.full_k[r], b.full_v[r], 1.0, p)[0]
            for r, (s, e, p) in enumerate(zip(b.metadata.query_starts, b.metadata.query_starts[1:], [0, 4]))]
    torch.testing.assert_close(out.double(), torch.cat(outs), atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        with fullcg.forward_context(b.metadata, b.layer):
            b.layer(b.q, b.k, b.v, scale=0.0)


def test_a_gradient_through_attention_raises_instead_of_being_wrong():
    b = make_batch([4, 1], [0, 3])
    q = b.q.clone().requires_grad_()
    with fullcg.forward_context(b.metadata, b.layer):
        out = b.layer(q, b.k, b.v)
    with pytest.raises(RuntimeError, match=r"fullcg.Attention \(layer 0\) has no backward"):
        out.sum().backward()


def test_an_eager_layer_saving_different_kv_twice_in_one_step_is_refused():
    # As a module calling attention twice per layer on two halves of v would (DiffLlama).
    b = make_batch([4], [0])
    with fullcg.forward_context(b.metadata, b.layer):
        b.layer(b.q, b.k, b.v)
        b.layer(b.q, b.k, b.v)  # the same k/v again: nothing differs, allowed
        with pytest.raises(RuntimeError, match="saved new k/v twice in one step"):
            b.layer(b.q, b.k, b.v * 2)


class _TwoSavesPerLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = fullcg.Attention(2, 8, layer_id=0)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q = x.view(-1, 2, 8)
        a = self.attn(q, q, q)
        b = self.attn(q, q, q * 2)
        return (a + b).flatten(1)


def test_a_compiled_graph_saving_kv_twice_for_one_layer_is_refused_at_compile_time():
    torch._dynamo.reset()
    model = _TwoSavesPerLayer()
    model.attn.allocate_kv_cache(8, 4)
    compiled = fullcg.compile(model, compiler="eager")
    md = fullcg.AttentionMetadata.build([3], [0], torch.tensor([[0]], dtype=torch.int32), 4)
    with torch.inference_mode(), fullcg.forward_context(md, model):
        with pytest.raises(Exception, match="both save new k/v for layer 0"):
            compiled(torch.randn(3, 16), torch.arange(3))


# --- positions --------------------------------------------------------------------------------


def test_the_metadata_knows_every_new_tokens_position():
    md = fullcg.AttentionMetadata.build([3, 1, 2], [0, 7, 4], torch.arange(12, dtype=torch.int32).view(3, 4), 4)
    assert md.positions.tolist() == [0, 1, 2, 7, 4, 5]
    md.check_positions(torch.tensor([0, 1, 2, 7, 4, 5, 0, 0]))  # padding rows past the tokens are not read


def _decode_step_at(position: int):
    model = LlamaModel(LlamaConfig.tiny())
    model.allocate_kv_cache(16, 4)
    md = fullcg.AttentionMetadata.build([1], [5], torch.arange(4, dtype=torch.int32)[None], 4)
    return model, md, torch.tensor([3]), torch.tensor([position])


def test_an_eager_decode_at_the_wrong_position_is_refused():
    model, md, ids, pos = _decode_step_at(8)
    with torch.inference_mode(), fullcg.forward_context(md, model):
        with pytest.raises(fullcg.errors.InvalidBatchError, match="at position 8 but the metadata puts it at 5"):
            model(ids, pos)


@pytest.mark.parametrize("compiler", ["eager", "none"])
def test_a_compiled_step_checks_positions_under_debug_checks(compiler):
    torch._dynamo.reset()
    model, md, ids, pos = _decode_step_at(8)
    checked = fullcg.compile(model, fullcg.FullCGConfig(compiler=compiler, debug_checks=True))
    with torch.inference_mode(), fullcg.forward_context(md, model):
        with pytest.raises(fullcg.errors.InvalidBatchError, match="at position 8 but the metadata puts it at 5"):
            checked(ids, pos)
        checked(ids, torch.tensor([5]))


def test_the_mapping_form_of_the_context_serves_a_layers_own_cache_and_refuses_another():
    b = make_batch([3], [0])
    own = b.layer.kv_cache
    other = fullcg.KVCache.allocate(own.k.shape[0], own.page_size, own.num_kv_heads, own.head_dim)
    with fullcg.forward_context(b.metadata, {0: own}):
        b.layer(b.q, b.k, b.v)
    with fullcg.forward_context(b.metadata, {0: other}):
        with pytest.raises(RuntimeError, match="the mapping form is for layers and op calls that own no cache"):
            b.layer(b.q, b.k, b.v)
