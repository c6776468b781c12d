"""The reference implementation computes exact softmax attention over the paged KV cache."""

from __future__ import annotations

import math

import pytest
import torch

import fullcg
from fullcg.metadata import ForwardMode
from batches import make_batch, naive_attention, oracle

BATCHES = {
    "prefill": ([7, 3], [0, 0]),
    "extend": ([5, 4], [6, 11]),
    "decode": ([1, 1, 1], [9, 2, 17]),
    "mixed": ([6, 1, 4, 1], [0, 12, 5, 3]),
}


@pytest.mark.parametrize("name", list(BATCHES))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa2", "mqa"])
def test_cache_attention_equals_float64_softmax(name, heads):
    q_lens, p_lens = BATCHES[name]
    b = make_batch(q_lens, p_lens, num_heads=heads[0], num_kv_heads=heads[1], seed=hash(name) % 1000)
    with fullcg.forward_context(b.metadata, b.layer):
        out, lse = b.layer(b.q, b.k, b.v, return_lse=True)
    expected_out, expected_lse = oracle(b)
    torch.testing.assert_close(out.double(), expected_out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), expected_lse, atol=2e-6, rtol=1e-5)


def test_new_tokens_are_written_to_their_cache_slots():
    b = make_batch([3, 1], [0, 5], page_size=2)
    with fullcg.forward_context(b.metadata, b.layer):
        b.layer(b.q, b.k, b.v)
    cache = b.layer.kv_cache
    for r, (ql, pl) in enumerate(zip(b.metadata.query_lens, b.metadata.prefix_lens)):
        for pos in range(pl + ql):
            page = int(b.metadata.page_table[r, pos // 2])
            torch.testing.assert_close(cache.k[page, pos % 2], b.full_k[r][pos], rtol=0, atol=0)
            torch.testing.assert_close(cache.v[page, pos % 2], b.full_v[r][pos], rtol=0, atol=0)


def test_flattened_q_gives_flattened_out_with_the_same_values():
    b = make_batch([4], [3])
    with fullcg.forward_context(b.metadata, b.layer):
        out3 = b.layer(b.q, b.k, b.v)
        out2 = b.layer(b.q.flatten(1), b.k.flatten(1), b.v.flatten(1))
    assert out2.shape == (4, 4 * 16)
    torch.testing.assert_close(out2.view_as(out3), out3, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_accumulates_in_float32(dtype):
    b = make_batch([9, 1], [0, 30], dtype=dtype)
    with fullcg.forward_context(b.metadata, b.layer):
        out, lse = b.layer(b.q, b.k, b.v, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    expected_out, expected_lse = oracle(b)
    torch.testing.assert_close(out.double(), expected_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_over_given_kv_without_a_cache(causal):
    b = make_batch([5, 3], [0, 0])
    with fullcg.forward_context(b.metadata):  # no KV cache needed
        out, lse = b.layer(b.q, b.k, b.v, return_lse=True, use_kv_cache=False, causal=causal)
    starts = b.metadata.query_starts
    for r in range(2):
        sl = slice(starts[r], starts[r + 1])
        eo, el = naive_attention(b.q[sl], b.k[sl], b.v[sl], b.layer.scale, 0 if causal else None)
        torch.testing.assert_close(out[sl].double(), eo, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(lse[sl].double(), el, atol=2e-6, rtol=1e-5)


def _chunked_prefix_attention(b, layer):
    """The chunked-prefix pattern: suffix over itself with LSE, each prefix chunk with LSE, merged."""
    out, lse = layer(b.q, b.k, b.v, return_lse=True, use_kv_cache=False, causal=True, save_kv_cache=True)
    for c in range(fullcg.context.num_prefix_chunks()):
        kc, vc = layer.gather_prefix_chunk(c)
        oc, lc = layer(b.q, kc, vc, return_lse=True, use_kv_cache=False, causal=False, prefix_chunk=c)
        merged, merged_lse = torch.empty_like(out), torch.empty_like(lse)
        fullcg.merge_attn_states(merged, oc, lc, out, lse, merged_lse)
        out, lse = merged, merged_lse
    return out, lse


@pytest.mark.parametrize("chunk_tokens", [1000, 8, 3], ids=["one-chunk", "several-chunks", "many-chunks"])
def test_chunked_prefix_merge_equals_attention_over_the_whole_sequence(chunk_tokens):
    b = make_batch([5, 3, 4], [11, 0, 6], prefix_chunk_tokens=chunk_tokens, seed=3)
    with fullcg.forward_context(b.metadata, b.layer):
        assert fullcg.context.num_prefix_chunks() == (1 if chunk_tokens == 1000 else math.ceil(11 / (chunk_tokens // 2 or 1)))
        out, lse = _chunked_prefix_attention(b, b.layer)
    expected_out, expected_lse = oracle(b)
    assert (out.double() - expected_out).abs().max() < 1e-5
    assert (lse.double() - expected_lse).abs().max() < 1e-5
    # The suffix call saved the new tokens, so plain cache attention now sees the same sequence.
    with fullcg.forward_context(b.metadata, b.layer):
        cached = b.layer(b.q, b.k, b.v, use_kv_cache=True, save_kv_cache=True)
    assert (cached.double() - expected_out).abs().max() < 1e-5
    fresh = make_batch([5, 3, 4], [11, 0, 6], prefix_chunk_tokens=chunk_tokens, seed=3)
    with fullcg.forward_context(fresh.metadata, fresh.layer):
        fresh.layer(fresh.q, fresh.k, fresh.v, return_lse=True, use_kv_cache=False, save_kv_cache=True)
    assert torch.equal(fresh.layer.kv_cache.k, b.layer.kv_cache.k)


@pytest.mark.parametrize("chunk_tokens", [1000, 8, 3], ids=["one-chunk", "several-chunks", "many-chunks"])
def test_merge_prefix_chunks_equals_the_explicit_chunk_loop_and_the_whole_sequence(chunk_tokens):
    b = make_batch([5, 3, 4, 1], [11, 0, 6, 9], prefix_chunk_tokens=chunk_tokens, seed=3)
    with fullcg.forward_context(b.metadata, b.layer):
        looped, looped_lse = _chunked_prefix_attention(b, b.layer)
    b = make_batch([5, 3, 4, 1], [11, 0, 6, 9], prefix_chunk_tokens=chunk_tokens, seed=3)
    with fullcg.forward_context(b.metadata, b.layer):
        out, lse = b.layer(b.q, b.k, b.v, return_lse=True, use_kv_cache=False, causal=True, save_kv_cache=True)
        b.layer.merge_prefix_chunks(b.q, out, lse)  # in place
    torch.testing.assert_close(out, looped, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, looped_lse, atol=1e-6, rtol=1e-6)
    expected_out, expected_lse = oracle(b)
    assert (out.double() - expected_out).abs().max() < 1e-5
    assert (lse.double() - expected_lse).abs().max() < 1e-5


def test_merge_prefix_chunks_leaves_a_batch_without_prefix_as_it_is():
    b = make_batch([5, 3], [0, 0], seed=1)
    with fullcg.forward_context(b.metadata, b.layer):
        out, lse = b.layer(b.q, b.k, b.v, return_lse=True, use_kv_cache=False, causal=True, save_kv_cache=True)
        before, before_lse = out.clone(), lse.clone()
        assert b.metadata.prefix_chunks == ()
        b.layer.merge_prefix_chunks(b.q, out, lse)
    assert torch.equal(out, before) and torch.equal(lse, before_lse)


def test_merge_prefix_chunks_applies_each_requests_factor_by_its_mode():
    # Decode rows use the decode factor, extend rows the prefill factor: an enormous decode
    # factor disables skipping for decodes only (lambda >= 1), visible in the counters.
    b = make_batch([4, 1], [40, 40], prefix_chunk_tokens=1000, seed=2, key_bias=3.0, sink=8.0)
    config = fullcg.FullCGConfig(skip_softmax=fullcg.SkipSoftmaxConfig(
        prefill_scale_factor=30.0, decode_scale_factor=1e9, tile_kv=4, tile_q=2))
    fullcg.reset_skip_softmax_stats()
    with fullcg.forward_context(b.metadata, b.layer, config=config):
        out, lse = b.layer(b.q, b.k, b.v, return_lse=True, use_kv_cache=False, causal=True, save_kv_cache=True)
        fullcg.reset_skip_softmax_stats()
        torch.ops.fullcg.merge_prefix_chunks.default(b.q, out, lse, 0, 30.0, 1e9, b.layer.scale, 0)
    stats = fullcg.skip_softmax_stats()[0]
    assert stats.prefill_visited > 0 and stats.prefill_skipped > 0, stats
    assert stats.decode_visited > 0 and stats.decode_skipped == 0, stats


def test_merge_prefix_chunks_refuses_a_context_of_another_model_and_bad_shapes():
    b = make_batch([2], [6], seed=4)
    other = make_batch([2], [6], seed=4)
    with fullcg.forward_context(b.metadata, other.layer):
        out, lse = torch.zeros_like(b.q), torch.full(b.q.shape[:2], float("-inf"))
        with pytest.raises(RuntimeError, match="another model"):
            b.layer.merge_prefix_chunks(b.q, out, lse)
    with fullcg.forward_context(b.metadata, b.layer):
        with pytest.raises(ValueError, match="lse must be float32"):
            b.layer.merge_prefix_chunks(b.q, out, lse.double())
        with pytest.raises(ValueError, match="q must be"):
            b.layer.merge_prefix_chunks(b.q[:1], out, lse)
        with pytest.raises(ValueError, match="do not fit the layer's KV cache"):  # head_dim 8, cache 16
            torch.ops.fullcg.merge_prefix_chunks.default(b.q[..., :8], out[..., :8], lse, 0)
    with pytest.raises(RuntimeError, match="no forward context"):
        b.layer.merge_prefix_chunks(b.q, out, lse)


def test_padding_rows_of_kv_are_never_read():
    b = make_batch([4, 1], [0, 7])
    rows = b.k.shape[0]
    pad = 3
    k = torch.cat([b.k, torch.full((pad, *b.k.shape[1:]), float("nan"))])
    v = torch.cat([b.v, torch.full((pad, *b.v.shape[1:]), 1e30)])
    q = torch.cat([b.q, torch.full((pad, *b.q.shape[1:]), float("nan"))])  # padded query rows too
    with fullcg.forward_context(b.metadata, b.layer):
        out, lse = b.layer(q, k, v, return_lse=True, key_value_num_tokens=rows)
    expected_out, expected_lse = oracle(b)
    torch.testing.assert_close(out[:rows].double(), expected_out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse[:rows].double(), expected_lse, atol=2e-6, rtol=1e-5)
    assert torch.equal(out[rows:], torch.zeros_like(out[rows:])), "padded output rows must be zero"
    assert torch.isneginf(lse[rows:]).all()
    assert torch.isfinite(b.layer.kv_cache.k).all(), "padding must not be written into the cache"


def test_merge_of_empty_sides_takes_the_other_side_and_never_gives_nan():
    torch.manual_seed(0)
    out_a, out_b = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    out_a[1] = float("nan")  # an empty side may hold garbage
    lse_a = torch.tensor([[0.5, 1.0], [float("-inf"), float("-inf")], [float("-inf"), 2.0]])
    lse_b = torch.tensor([[float("-inf"), 0.2], [0.3, float("-inf")], [float("inf"), float("-inf")]])
    out, out_lse = torch.empty(3, 2, 4), torch.empty(3, 2)
    fullcg.merge_attn_states(out, out_a, lse_a, out_b, lse_b, out_lse)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out[0, 0], out_a[0, 0])  # b empty
    torch.testing.assert_close(out[1, 0], out_b[1, 0])  # a empty (and NaN)
    assert torch.equal(out[1, 1], torch.zeros(4)) and torch.isneginf(out_lse[1, 1])  # both empty
    assert torch.equal(out[2, 0], torch.zeros(4)), "+inf LSE is an empty row"
    w = torch.softmax(torch.tensor([1.0, 0.2]), 0)
    torch.testing.assert_close(out[0, 1], w[0] * out_a[0, 1] + w[1] * out_b[0, 1])
    torch.testing.assert_close(out_lse[0, 1], torch.logaddexp(torch.tensor(1.0), torch.tensor(0.2)))


def test_decode_mode_is_inferred_and_validated():
    b = make_batch([1, 3, 2], [4, 0, 5])
    assert b.metadata.forward_modes == (ForwardMode.DECODE, ForwardMode.PREFILL, ForwardMode.EXTEND)
    assert not b.metadata.is_decode_only
    assert make_batch([1, 1], [2, 3]).metadata.is_decode_only


def test_merge_prefix_chunks_takes_the_calls_own_scale_like_forward():
    """A model that scales q itself passes scale=1.0 to both calls; the merged result is the
    whole-sequence attention of the scaled q at scale 1."""
    b = make_batch([5, 3], [11, 6], prefix_chunk_tokens=8, seed=4)
    expected_out, expected_lse = oracle(b)
    with fullcg.forward_context(b.metadata, b.layer):
        q = b.q * b.layer.scale
        out, lse = b.layer(q, b.k, b.v, return_lse=True, use_kv_cache=False, save_kv_cache=True, scale=1.0)
        b.layer.merge_prefix_chunks(q, out, lse, scale=1.0)
        with pytest.raises(ValueError, match="scale must be a positive finite number"):
            b.layer.merge_prefix_chunks(q, out, lse, scale=0.0)
    assert (out.double() - expected_out).abs().max() < 1e-5
    assert (lse.double() - expected_lse).abs().max() < 1e-5
