"""Skip-softmax in the reference implementation follows the skip rule of docs/ops.md exactly."""

from __future__ import annotations

import math

import pytest
import torch

import fullcg
from fullcg.ops.impl.reference import attend_dense, attend_tiled
from batches import make_batch, oracle


@pytest.fixture(autouse=True)
def _fresh_counters():
    fullcg.reset_skip_softmax_stats()
    yield
    fullcg.reset_skip_softmax_stats()


def _run(b, skip: fullcg.SkipSoftmaxConfig):
    config = fullcg.FullCGConfig(attention_impl="reference", skip_softmax=skip)
    with fullcg.forward_context(b.metadata, b.layer, config=config):
        return b.layer(b.q, b.k, b.v, return_lse=True)


def _tiles(q_len, prefix, tile_q, tile_kv, kv_heads):
    """Tiles a causal loop visits for one request: per row block, the tiles up to its last row's last key."""
    total = 0
    for start in range(0, q_len, tile_q):
        last_row = min(q_len, start + tile_q) - 1
        total += math.ceil((prefix + last_row + 1) / tile_kv)
    return total * kv_heads


def test_no_factor_is_bit_identical_to_dense():
    b = make_batch([40, 1], [0, 50], key_bias=3.0)
    dense = _run(b, fullcg.SkipSoftmaxConfig())
    b2 = make_batch([40, 1], [0, 50], key_bias=3.0)
    same = _run(b2, fullcg.SkipSoftmaxConfig(None, None, tile_kv=8, tile_q=4))
    assert torch.equal(dense[0], same[0]) and torch.equal(dense[1], same[1])
    assert fullcg.skip_softmax_stats().get(0, fullcg.SkipSoftmaxStats()).visited == 0


def test_largest_factor_skips_every_tile_but_the_first_of_each_request():
    # The largest factor that still skips is just under the shortest kv_len (lambda just
    # under 1): with an attention sink in the first tile, every later tile is negligible.
    skip = fullcg.SkipSoftmaxConfig(11.9, 11.9, tile_kv=8, tile_q=4)
    b = make_batch([12, 1, 5], [0, 40, 20], sink=20.0)
    out, _ = _run(b, skip)
    stats = fullcg.skip_softmax_stats()[0]
    # Every visited tile is skipped except tile 0 of every (kv head, row block).
    blocks = {"prefill": 3 * 2, "decode": 1 * 2, "extend": 2 * 2}
    assert stats.prefill_visited == _tiles(12, 0, 4, 8, 2) + _tiles(5, 20, 4, 8, 2)
    assert stats.prefill_skipped == stats.prefill_visited - blocks["prefill"] - blocks["extend"]
    assert stats.decode_visited == _tiles(1, 40, 4, 8, 2)
    assert stats.decode_skipped == stats.decode_visited - blocks["decode"]
    # What remains is attention over the first tile alone.
    starts = b.metadata.query_starts
    for r, pl in enumerate(b.metadata.prefix_lens):
        q = b.q[starts[r] : starts[r + 1]]
        first = slice(0, 8)
        expected, _ = attend_dense(q, b.full_k[r][first], b.full_v[r][first], b.layer.scale, pl)
        torch.testing.assert_close(out[starts[r] : starts[r + 1]], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("factor", [34.0, 1e30], ids=["equal-to-kv-len", "enormous"])
def test_factor_at_or_above_kv_len_disables_skipping(factor):
    # lambda = factor / L >= 1 whenever L <= factor: nothing may be skipped, results stay dense.
    skip = fullcg.SkipSoftmaxConfig(factor, factor, tile_kv=8, tile_q=4)
    b = make_batch([30, 1], [0, 33], sink=20.0)  # L = 30 and 34
    out, lse = _run(b, skip)
    stats = fullcg.skip_softmax_stats()[0]
    assert stats.visited > 0 and stats.skipped == 0
    expected_out, expected_lse = oracle(b)
    torch.testing.assert_close(out.double(), expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("which", ["prefill", "decode"])
def test_mixed_batch_uses_each_requests_own_factor(which):
    prefill_factor, decode_factor = (15.0, None) if which == "prefill" else (None, 15.0)
    skip = fullcg.SkipSoftmaxConfig(prefill_factor, decode_factor, tile_kv=8, tile_q=4)
    b = make_batch([16, 1, 6, 1], [0, 40, 30, 25], sink=20.0)
    _run(b, skip)
    stats = fullcg.skip_softmax_stats()[0]
    if which == "prefill":
        assert stats.prefill_skipped > 0
        assert stats.decode_visited == 0 and stats.decode_skipped == 0, "decode must not use the prefill factor"
    else:
        assert stats.decode_skipped > 0
        assert stats.prefill_visited == 0 and stats.prefill_skipped == 0, "prefill must not use the decode factor"


def test_moderate_factor_skips_some_tiles_with_small_error_on_peaky_attention():
    skip = fullcg.SkipSoftmaxConfig(2.0, 2.0, tile_kv=8, tile_q=4)
    b = make_batch([48, 1, 1], [0, 120, 90], key_bias=0.0, seed=5)
    # Make attention peaky: a few heavy keys near the start of every request.
    for k in b.full_k:
        k[:3] *= 6.0
    b.k = torch.cat([fk[pl:] for fk, pl in zip(b.full_k, b.metadata.prefix_lens)])
    for r, pl in enumerate(b.metadata.prefix_lens):
        for pos in range(pl):
            page = int(b.metadata.page_table[r, pos // 4])
            b.layer.kv_cache.k[page, pos % 4] = b.full_k[r][pos]
    b.q = b.q + 4.0 * b.full_k[0][0].mean(0)
    out, _ = _run(b, skip)
    stats = fullcg.skip_softmax_stats()[0]
    assert 0 < stats.skipped < stats.visited
    expected, _ = oracle(b)
    rel = (out.double() - expected).norm() / expected.norm()
    assert rel < 0.05


def test_decode_splits_never_skip_their_first_tile():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 16)
    k, v = torch.randn(64, 2, 16), torch.randn(64, 2, 16)
    # Keys outside the first tile of each split (tiles 0, 3, 6) point away from their queries,
    # so every other tile is negligible against the running max of its own split.
    away = -q.view(2, 2, 16).mean(1)
    away = 3.0 * away / away.norm(dim=-1, keepdim=True)
    for t in (1, 2, 4, 5, 7):
        k[t * 8 : (t + 1) * 8] = away
    _, _, visited, skipped = attend_tiled(q, k, v, 0.25, 63, 32.0, tile_kv=8, tile_q=1, split_tiles=3)
    assert visited == 8 * 2
    assert skipped == visited - 3 * 2  # exactly the first tile of each of the 3 splits survives
    # Without skipping, splitting is exact.
    o_split, lse_split, _, _ = attend_tiled(q, k, v, 0.25, 63, 0.0, tile_kv=8, tile_q=1, split_tiles=3)
    o_dense, lse_dense = attend_dense(q, k, v, 0.25, 63)
    torch.testing.assert_close(o_split, o_dense, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse_split, lse_dense, atol=1e-6, rtol=1e-5)


def test_stats_reset_zeroes_counters():
    b = make_batch([9], [0], sink=20.0)
    _run(b, fullcg.SkipSoftmaxConfig(8.0, None, tile_kv=4, tile_q=4))
    assert fullcg.skip_softmax_stats()[0].skipped > 0
    fullcg.reset_skip_softmax_stats()
    assert fullcg.skip_softmax_stats()[0].visited == 0


def test_the_end_to_end_benchmark_measures_skipping_and_the_logits_it_moves_in_smoke_mode():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "skip_softmax_e2e.py"
    spec = importlib.util.spec_from_file_location("benchmark_skip_softmax_e2e", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--smoke"])
    assert [r["factor"] for r in result["decode"]] == [16.0, 80.0]
    small, large = result["decode"]
    # A larger factor skips more, and what it skips moves the logits; nothing skipped, nothing moves.
    assert 0.0 <= small["skipped_fraction"] < large["skipped_fraction"] <= 1.0
    assert large["max_rel_change"] > 1e-3
    unskipped = [r for r in result["prefill"] if r["skipped_fraction"] == 0.0]
    assert unskipped and all(r["max_rel_change"] < 1e-4 and r["same_top1"] == 1.0 for r in unskipped)
    assert result["nearest_to_target"]["decode"] is large


# --- per-layer factors -----------------------------------------------------------------------


def test_per_layer_factors_are_stored_sorted_and_override_the_global_pair():
    skip = fullcg.SkipSoftmaxConfig(100.0, 4.0, per_layer={3: (None, 1.0), 1: (50.0, None)})
    assert skip.per_layer == ((1, 50.0, None), (3, None, 1.0))
    assert skip.factors_for(1) == (50.0, None) and skip.factors_for(3) == (None, 1.0)
    assert skip.factors_for(0) == (100.0, 4.0)
    assert fullcg.SkipSoftmaxConfig(per_layer={0: (None, None)}).enabled is False
    assert fullcg.SkipSoftmaxConfig(per_layer={0: (5.0, None)}).enabled is True
    assert hash(skip) == hash(fullcg.SkipSoftmaxConfig(100.0, 4.0, per_layer=((1, 50.0, None), (3, None, 1.0))))


@pytest.mark.parametrize(
    "per_layer, message",
    [
        ({-1: (1.0, 1.0)}, "layer ids must be integers >= 0"),
        ({0: 5.0}, r"each layer needs a layer id and a \(prefill_factor, decode_factor\) pair, got \(0, 5.0\)"),
        ([()], r"each layer needs a layer id and a \(prefill_factor, decode_factor\) pair, got \(\)"),
        ({0: (float("nan"), None)}, r"per_layer\[0\] prefill factor must be a finite number"),
        ([(0, 1.0, 1.0), (0, 2.0, 2.0)], "layer 0 is given twice"),
        ("fast", "must be a dict"),
    ],
)
def test_bad_per_layer_factors_are_refused_naming_the_layer(per_layer, message):
    with pytest.raises((fullcg.errors.InvalidConfigError, fullcg.errors.ConfigTypeError), match=message):
        fullcg.SkipSoftmaxConfig(per_layer=per_layer)


def _tiny_prefill(skip: fullcg.SkipSoftmaxConfig, compiler: str | None, graph_mode: str = "full"):
    from fullcg.models.llama import LlamaConfig, LlamaModel

    torch._dynamo.reset()
    model = LlamaModel(LlamaConfig.tiny(), seed=0)
    model.allocate_kv_cache(16, 8)
    config = fullcg.FullCGConfig(attention_impl="reference", skip_softmax=skip, graph_mode=graph_mode,
                                 **({"compiler": compiler} if compiler else {}))
    run = fullcg.compile(model, config) if compiler else model
    md = fullcg.AttentionMetadata.build([48], [0], torch.arange(6, dtype=torch.int32)[None], 8)
    fullcg.reset_skip_softmax_stats()
    with torch.inference_mode(), fullcg.forward_context(md, model, config=config):
        logits = run(torch.arange(3, 51), torch.arange(48))
    return logits, fullcg.skip_softmax_stats()


@pytest.mark.parametrize("compiler, graph_mode", [(None, "full"), ("eager", "full"), ("eager", "piecewise")],
                         ids=["eager-model", "compiled-full", "compiled-piecewise"])
def test_a_dense_layer_among_skipping_ones_counts_no_tiles_in_every_graph_mode(compiler, graph_mode):
    skip = fullcg.SkipSoftmaxConfig(40.0, None, tile_kv=8, tile_q=4, per_layer={0: (None, None)})
    logits, stats = _tiny_prefill(skip, compiler, graph_mode)
    assert stats.get(0, fullcg.SkipSoftmaxStats()).visited == 0 and stats[1].prefill_visited > 0
    # The same as skipping in layer 1 alone, written the other way round.
    other = fullcg.SkipSoftmaxConfig(None, None, tile_kv=8, tile_q=4, per_layer={1: (40.0, None)})
    logits2, stats2 = _tiny_prefill(other, compiler, graph_mode)
    assert torch.equal(logits, logits2) and stats[1] == stats2[1]


def test_per_layer_factors_for_a_layer_the_model_lacks_warn_once_naming_it():
    from fullcg.models.llama import LlamaConfig, LlamaModel

    model = LlamaModel(LlamaConfig.tiny(), seed=0)
    model.allocate_kv_cache(16, 8)
    config = fullcg.FullCGConfig(skip_softmax=fullcg.SkipSoftmaxConfig(per_layer={1: (40.0, None), 12: (40.0, None)}))
    md = fullcg.AttentionMetadata.build([4], [0], torch.arange(2, dtype=torch.int32)[None], 8)
    with pytest.warns(UserWarning, match=r"per_layer names layers \[12\], which LlamaModel .* has no KV cache for \(its layers: \[0, 1\]\)"):
        with fullcg.forward_context(md, model, config=config):
            pass
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fullcg.forward_context(md, model, config=config):
            pass
