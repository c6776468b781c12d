"""The ``triton`` implementation computes what the reference computes, skip decisions included.

Small sizes run on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set here
before triton is imported) so that CI checks the kernels' logic; on a machine with a GPU
the same tests run the compiled kernels, and the ``cuda`` tests add real sizes and CUDA
graph capture. Every comparison uses the reference at the same tile sizes, so dense
results, LSE, tiles visited and tiles skipped must all agree.
"""

from __future__ import annotations

import dataclasses
import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`

pytest.importorskip("triton", reason="triton is not installed; `pip install triton` runs these tests on the CPU")

import fullcg  # noqa: E402
from fullcg import runner  # noqa: E402
import fullcg.ops.impl.triton  # noqa: E402,F401  (registers the "triton" implementation)
import fullcg.ops.device_facts  # noqa: E402
from fullcg import telemetry  # noqa: E402
from fullcg.config import FullCGConfig, SkipSoftmaxConfig  # noqa: E402
from fullcg.ops.kernels import decode_attention  # noqa: E402

from batches import Batch, make_batch, oracle  # noqa: E402

# Triton 3.6's interpreter converts 1-element arrays to loop bounds (deprecated by NumPy).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Small tiles so that short sequences span many tiles and row blocks.
TILES = dict(tile_kv=16, tile_q=4)

BATCHES = {
    "prefill": ([21, 9], [0, 0]),
    "extend": ([7, 12], [40, 23]),
    "decode": ([1, 1, 1], [70, 5, 33]),
    "long_decode": ([1, 1], [700, 130]),
    "mixed": ([13, 1, 6, 1], [0, 50, 37, 16]),
}
HEADS = {"gqa2": (4, 2), "gqa4": (4, 1)}
# Structured (peaky) inputs: queries share a direction and key 0 is a sink, so some tiles
# skip and some do not (random inputs skip nothing).
PEAKY = dict(key_bias=2.0, sink=4.0)


def on_device(b: Batch) -> Batch:
    """The batch with its metadata, cache and tensors on DEVICE."""
    return b if DEVICE.type == "cpu" else b.to(DEVICE)


def with_sink(b: Batch, strength: float) -> Batch:
    """Make key 0 of every request an attention sink (as real attention has): aligned with
    the request's mean query, ``strength`` times its length. Tiles far from the sink then
    fall below the skip threshold, so skip decisions are not all-or-nothing."""
    md, cache = b.metadata, b.layer.kv_cache
    starts = md.query_starts
    nkv = b.k.shape[1]
    for r, pl in enumerate(md.prefix_lens):
        q_mean = b.q[starts[r] : starts[r + 1]].float().mean(0)  # [Hq, D]
        sink = (strength * q_mean.view(nkv, -1, q_mean.shape[-1]).mean(1)).to(b.k.dtype)
        b.full_k[r][0] = sink.cpu()
        if pl > 0:
            page = int(md.page_table[r, 0])
            cache.k[page, 0] = sink.to(cache.k.device)
        else:
            b.k[starts[r]] = sink
    return b


def oracle_cpu(b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 oracle (computed on the CPU, where the batch keeps each request's k/v)."""
    return oracle(dataclasses.replace(b, q=b.q.cpu()))


def batch(name: str, heads: str = "gqa2", sink: float | None = None, **kw) -> Batch:
    q_lens, p_lens = BATCHES[name]
    nh, nkv = HEADS[heads]
    b = on_device(make_batch(q_lens, p_lens, num_heads=nh, num_kv_heads=nkv, seed=len(name), **kw))
    return with_sink(b, sink) if sink is not None else b


def run(b: Batch, impl: str, skip: SkipSoftmaxConfig, **kwargs):
    """``(out, lse, stats)`` of one attention call; writing the new k/v again is idempotent."""
    telemetry.reset_skip_softmax_stats()
    cfg = FullCGConfig(attention_impl=impl, skip_softmax=skip)
    with fullcg.forward_context(b.metadata, b.layer, config=cfg):
        out, lse = b.layer(b.q, b.k, b.v, return_lse=True, **kwargs)
    stats = telemetry.skip_softmax_stats().get(b.layer.layer_id, telemetry.SkipSoftmaxStats())
    return out, lse, stats


def assert_same(b: Batch, skip: SkipSoftmaxConfig, atol: float = 2e-5, **kwargs) -> telemetry.SkipSoftmaxStats:
    ref_out, ref_lse, ref_stats = run(b, "reference", skip, **kwargs)
    out, lse, stats = run(b, "triton", skip, **kwargs)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=atol)
    torch.testing.assert_close(lse, ref_lse, atol=atol, rtol=atol)
    assert stats == ref_stats, "tiles visited/skipped differ from the reference at the same tile sizes"
    return stats


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("name", list(BATCHES))
def test_dense_cache_attention_and_lse_match_the_reference(name, heads):
    b = batch(name, heads)
    assert_same(b, SkipSoftmaxConfig(**TILES))
    out, lse, _ = run(b, "triton", SkipSoftmaxConfig(**TILES))
    expected_out, expected_lse = oracle_cpu(b)
    torch.testing.assert_close(out.double().cpu(), expected_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double().cpu(), expected_lse, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("name", list(BATCHES))
def test_skip_decisions_and_counters_match_the_reference(name, heads):
    b = batch(name, heads, **PEAKY)
    skip = SkipSoftmaxConfig(prefill_scale_factor=4.0, decode_scale_factor=4.0, decode_split_tiles=2, **TILES)
    stats = assert_same(b, skip)
    assert 0 < stats.skipped < stats.visited, "the batch should exercise both decisions"


def test_peaky_inputs_skip_tiles_and_results_stay_close_to_dense():
    b = batch("extend", "gqa4", **PEAKY)
    skip = SkipSoftmaxConfig(prefill_scale_factor=4.0, decode_scale_factor=4.0, **TILES)
    stats = assert_same(b, skip)
    assert stats.prefill_skipped > 0, "structured inputs must skip some tiles"
    dense_out, _, _ = run(b, "triton", SkipSoftmaxConfig(**TILES))
    skip_out, _, _ = run(b, "triton", skip)
    assert (skip_out - dense_out).abs().max() < 0.05


def test_each_request_uses_the_factor_of_its_forward_mode():
    b = batch("mixed", **PEAKY)
    only_prefill = SkipSoftmaxConfig(prefill_scale_factor=4.0, decode_scale_factor=None, **TILES)
    stats = assert_same(b, only_prefill)
    assert stats.prefill_visited > 0 and stats.decode_visited == 0
    only_decode = SkipSoftmaxConfig(prefill_scale_factor=None, decode_scale_factor=4.0, decode_split_tiles=2, **TILES)
    stats = assert_same(b, only_decode)
    assert stats.decode_visited > 0 and stats.prefill_visited == 0


def test_decode_never_skips_the_first_tile_of_a_split():
    b = batch("decode", **PEAKY)
    one_tile_runs = SkipSoftmaxConfig(decode_scale_factor=1000.0, decode_split_tiles=1, **TILES)
    stats = assert_same(b, one_tile_runs)
    assert stats.decode_visited > 0 and stats.decode_skipped == 0


def test_decode_without_a_configured_split_walks_all_keys_in_one_run():
    b = batch("decode", **PEAKY)
    assert_same(b, SkipSoftmaxConfig(decode_scale_factor=4.0, **TILES))


def _decode_kernel(b: Batch, num_splits: int | None, num_tokens: int | None = None, workspace: dict | None = None):
    """``(out, lse)`` of the dense decode kernel called directly on ``b``'s cache."""
    md, cache = b.metadata, b.layer.kv_cache
    out = torch.full_like(b.q, float("nan"))
    lse = torch.full(b.q.shape[:2], float("nan"), device=DEVICE)
    n = torch.tensor([md.num_tokens if num_tokens is None else num_tokens], dtype=torch.int32, device=DEVICE)
    decode_attention(
        b.q, cache.k, cache.v, out, lse, None, query_start_loc=md.query_start_loc, is_decode=md.is_decode,
        scale=b.layer.scale, factor=None, tile_kv=TILES["tile_kv"], split_tiles=None,
        max_kv_len=md.page_table.shape[1] * cache.page_size, page_table=md.page_table, seq_lens=md.seq_lens,
        num_tokens=n, num_splits=num_splits, workspace=workspace,
    )
    return out, lse


@pytest.mark.parametrize("num_splits", [1, 2, 3, 64, None])
def test_dense_decode_divides_each_request_into_its_own_runs(num_splits):
    # Requests of 5, 1 and 3 tiles: more runs than tiles, fewer, and uneven divisions.
    b = batch("decode")
    ref_out, ref_lse, _ = run(b, "reference", SkipSoftmaxConfig(**TILES))
    out, lse = _decode_kernel(b, num_splits)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("use_kv_cache", [True, False], ids=["cache", "ragged"])
def test_dense_decode_spread_over_many_sms_matches_the_reference(monkeypatch, use_kv_cache):
    # The CPU reports one SM, so the layer path would use one run; pretend to be an H200.
    monkeypatch.setattr(fullcg.ops.device_facts, "sm_count", lambda device: 132)
    assert_same(batch("mixed"), SkipSoftmaxConfig(**TILES), use_kv_cache=use_kv_cache)
    assert_same(batch("decode"), SkipSoftmaxConfig(**TILES), use_kv_cache=use_kv_cache)


def test_dense_decode_runs_of_a_long_request_are_at_least_a_fraction_of_sqrt_tiles(monkeypatch):
    # With 132 SMs the grid has room for 64 runs per request; the 44- and 9-tile requests
    # are cut into runs of at least 0.4 * sqrt(tiles) tiles instead (2 and 1 tiles: 22 and
    # 9 runs, where one run per tile would be 44 and 9), and still merge to the reference.
    monkeypatch.setattr(fullcg.ops.device_facts, "sm_count", lambda device: 132)
    b = batch("long_decode")
    ref_out, ref_lse, _ = run(b, "reference", SkipSoftmaxConfig(**TILES))
    workspace: dict = {}
    _decode_kernel(b, num_splits=None, workspace=workspace)
    (part_out, part_lse, arrivals), = workspace.values()
    part_lse.fill_(float("nan"))  # every run the next launch writes becomes a number
    out, lse = _decode_kernel(b, num_splits=None, workspace=workspace)
    runs = (~part_lse.isnan()).all(dim=2).sum(dim=1)
    assert runs.tolist() == [22, 9]
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


def test_decode_rows_past_the_real_token_count_are_zero():
    # CUDA-graph padding: stand-in decode requests own the rows past the real count.
    b = batch("decode")
    ref_out, ref_lse, _ = run(b, "reference", SkipSoftmaxConfig(**TILES))
    out, lse = _decode_kernel(b, num_splits=2, num_tokens=2)
    torch.testing.assert_close(out[:2].float(), ref_out[:2].float(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse[:2], ref_lse[:2], atol=2e-5, rtol=2e-5)
    assert torch.equal(out[2:], torch.zeros_like(out[2:])) and torch.isneginf(lse[2:]).all()


def test_a_factor_at_or_above_the_key_count_disables_skipping():
    b = batch("prefill", **PEAKY)
    stats = assert_same(b, SkipSoftmaxConfig(prefill_scale_factor=1000.0, **TILES))
    assert stats.prefill_visited > 0 and stats.prefill_skipped == 0


@pytest.mark.parametrize("factor", [None, 4.0], ids=["dense", "skip"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attention_over_given_ragged_kv(causal, factor):
    b = batch("mixed", **PEAKY)
    skip = SkipSoftmaxConfig(prefill_scale_factor=factor, decode_scale_factor=factor, **TILES)
    assert_same(b, skip, use_kv_cache=False, causal=causal)


@pytest.mark.parametrize("page_size", [16, 32], ids=["page=tile", "page=2tiles"])
def test_pages_holding_whole_tiles_take_the_one_lookup_path(page_size):
    q_lens, p_lens = BATCHES["mixed"]
    b = with_sink(on_device(make_batch(q_lens, p_lens, page_size=page_size, key_bias=2.0, seed=5)), 4.0)
    assert_same(b, SkipSoftmaxConfig(prefill_scale_factor=4.0, decode_scale_factor=4.0, decode_split_tiles=2, **TILES))


def _chunked_prefix(b: Batch, impl: str, skip: SkipSoftmaxConfig):
    """Suffix over itself plus each prefix chunk, merged by LSE (the chunked-prefix pattern)."""
    cfg = FullCGConfig(attention_impl=impl, skip_softmax=skip)
    with fullcg.forward_context(b.metadata, b.layer, config=cfg):
        out, lse = b.layer(b.q, b.k, b.v, return_lse=True, use_kv_cache=False, causal=True)
        for c in range(fullcg.context.num_prefix_chunks()):
            kc, vc = b.layer.gather_prefix_chunk(c)
            oc, lc = b.layer(b.q, kc, vc, return_lse=True, use_kv_cache=False, causal=False, prefix_chunk=c)
            merged, merged_lse = torch.empty_like(out), torch.empty_like(lse)
            fullcg.merge_attn_states(merged, oc, lc, out, lse, merged_lse)
            out, lse = merged, merged_lse
    return out, lse


@pytest.mark.parametrize("chunk_tokens", [1000, 24], ids=["one-chunk", "several-chunks"])
def test_merging_prefix_chunks_is_exact(chunk_tokens):
    q_lens, p_lens = [5, 1, 9], [40, 29, 0]
    b = with_sink(on_device(make_batch(q_lens, p_lens, prefix_chunk_tokens=chunk_tokens, key_bias=2.0, seed=3)), 4.0)
    dense = SkipSoftmaxConfig(**TILES)
    out, lse = _chunked_prefix(b, "triton", dense)
    expected_out, expected_lse = oracle_cpu(b)
    assert (out.double().cpu() - expected_out).abs().max() < 2e-5
    assert (lse.double().cpu() - expected_lse).abs().max() < 2e-5
    # With skipping, each chunk call skips as the reference does on that chunk.
    skip = SkipSoftmaxConfig(prefill_scale_factor=4.0, decode_scale_factor=4.0, **TILES)
    ref_out, ref_lse = _chunked_prefix(b, "reference", skip)
    out, lse = _chunked_prefix(b, "triton", skip)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", list(BATCHES))
def test_padded_rows_of_kv_are_never_read_and_padded_outputs_are_zero(name):
    b = batch(name)
    rows, pad = b.k.shape[0], 3
    k = torch.cat([b.k, torch.full((pad, *b.k.shape[1:]), float("nan"), device=DEVICE)])
    v = torch.cat([b.v, torch.full((pad, *b.v.shape[1:]), 1e30, device=DEVICE)])
    q = torch.cat([b.q, torch.full((pad, *b.q.shape[1:]), float("nan"), device=DEVICE)])
    padded = dataclasses.replace(b, q=q, k=k, v=v)
    for use_kv_cache in (True, False):
        out, lse, _ = run(padded, "triton", SkipSoftmaxConfig(**TILES), key_value_num_tokens=rows, use_kv_cache=use_kv_cache)
        ref_out, ref_lse, _ = run(b, "reference", SkipSoftmaxConfig(**TILES), use_kv_cache=use_kv_cache)
        torch.testing.assert_close(out[:rows], ref_out, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse[:rows], ref_lse, atol=2e-5, rtol=2e-5)
        assert torch.equal(out[rows:], torch.zeros_like(out[rows:])), "padded output rows must be zero"
        assert torch.isneginf(lse[rows:]).all(), "padded LSE rows must be -inf"


@pytest.mark.parametrize("name", ["decode", "mixed"])
def test_padded_static_metadata_gives_the_real_rows_and_zero_padding(name):
    # What a full CUDA graph replays: the batch padded with stand-in and empty requests.
    b = batch(name)
    n, size = b.metadata.num_tokens, b.metadata.num_tokens + 3
    static = runner.StaticMetadata(size, runner.StaticTables(size, b.metadata.page_table.shape[1] + 2, DEVICE), DEVICE)
    padded_md = static.fill(b.metadata)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, torch.full((size - n, *t.shape[1:]), float("nan"), dtype=t.dtype, device=DEVICE)])

    ref_out, ref_lse, _ = run(b, "reference", SkipSoftmaxConfig(**TILES))
    padded = dataclasses.replace(b, metadata=padded_md, q=pad(b.q), k=pad(b.k), v=pad(b.v))
    out, lse, _ = run(padded, "triton", SkipSoftmaxConfig(**TILES))
    torch.testing.assert_close(out[:n], ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse[:n], ref_lse, atol=2e-5, rtol=2e-5)
    assert torch.equal(out[n:], torch.zeros_like(out[n:])) and torch.isneginf(lse[n:]).all()


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float16,
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(
                DEVICE.type == "cpu", reason="Triton's CPU interpreter has no bfloat16 arithmetic (NumPy lacks it)"
            ),
        ),
    ],
    ids=["fp16", "bf16"],
)
def test_half_precision_matches_the_reference(dtype):
    q_lens, p_lens = BATCHES["mixed"]
    b = with_sink(on_device(make_batch(q_lens, p_lens, dtype=dtype, key_bias=2.0, seed=7)), 4.0)
    skip = SkipSoftmaxConfig(prefill_scale_factor=4.0, decode_scale_factor=4.0, decode_split_tiles=2, **TILES)
    ref_out, ref_lse, ref_stats = run(b, "reference", skip)
    out, lse, stats = run(b, "triton", skip)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    assert stats == ref_stats


def test_head_dim_64_matches_the_reference():
    b = with_sink(on_device(make_batch([6, 1], [10, 30], head_dim=64, key_bias=2.0, seed=11)), 4.0)
    assert_same(b, SkipSoftmaxConfig(prefill_scale_factor=4.0, decode_scale_factor=4.0, decode_split_tiles=1, **TILES))


def test_unsupported_shapes_fail_with_the_fix_in_the_message():
    b = batch("prefill")
    with pytest.raises(ValueError, match="tile_kv must be a power of two"):
        run(b, "triton", SkipSoftmaxConfig(tile_kv=24, tile_q=4))


# ---- real sizes on a GPU -------------------------------------------------------------------


def _big_batch(query_lens, prefix_lens, num_heads, num_kv_heads, seed=0):
    b = make_batch(query_lens, prefix_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=128,
                   page_size=64, dtype=torch.bfloat16, key_bias=1.5, seed=seed, spare_pages=0)
    return with_sink(on_device(b), 1.5)


def _assert_close_counts(stats, ref_stats):
    # bf16 scores summed in another order can move a row across the threshold by an ulp:
    # allow a handful of flipped decisions out of thousands, never a different tile count.
    assert stats.visited == ref_stats.visited
    assert abs(stats.skipped - ref_stats.skipped) <= max(2, ref_stats.visited // 1000)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("heads", [(64, 4), (32, 8)], ids=["64q4kv", "32q8kv"])
def test_real_size_prefill_and_decode_match_the_reference_on_gpu(heads):
    b = _big_batch([2048, 1, 1, 700], [0, 3000, 5000, 1500], *heads)
    skip = SkipSoftmaxConfig(prefill_scale_factor=100.0, decode_scale_factor=4.0, decode_split_tiles=8,
                             tile_kv=64, tile_q=128 // (heads[0] // heads[1]))
    ref_out, ref_lse, ref_stats = run(b, "reference", skip)
    out, lse, stats = run(b, "triton", skip)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    _assert_close_counts(stats, ref_stats)
    assert stats.skipped > 0
    dense_out, dense_lse, _ = run(b, "triton", dataclasses.replace(skip, prefill_scale_factor=None, decode_scale_factor=None))
    expected_out, expected_lse = oracle_cpu(b)
    torch.testing.assert_close(dense_out.double().cpu(), expected_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(dense_lse.double().cpu(), expected_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_decode_replays_under_cuda_graph_capture_with_counters():
    b = _big_batch([1] * 8, [4000, 100, 2500, 700, 64, 1, 3333, 1024], 32, 8)
    skip = SkipSoftmaxConfig(decode_scale_factor=4.0, decode_split_tiles=4, tile_kv=64, tile_q=16)
    cfg = FullCGConfig(attention_impl="triton", skip_softmax=skip)
    ref_out, _, ref_stats = run(b, "reference", skip)
    with fullcg.forward_context(b.metadata, b.layer, config=cfg):
        b.layer(b.q, b.k, b.v)  # warm-up: compiles kernels, creates the counters
        telemetry.reset_skip_softmax_stats()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = b.layer(b.q, b.k, b.v)
        telemetry.reset_skip_softmax_stats()
        out.zero_()
        graph.replay()
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    stats = telemetry.skip_softmax_stats()[b.layer.layer_id]
    assert stats.decode_visited == 2 * ref_stats.decode_visited, "each replay adds its tiles to the counters"
    assert abs(stats.decode_skipped - 2 * ref_stats.decode_skipped) <= 4


# Decode batches whose newest keys sit mid-tile, end a tile (its tile is then full) and start one.
SAVE_BATCHES = {
    "mid-tile": [70, 5, 33],
    "newest-key-ends-a-tile": [63, 15, 31],
    "newest-key-starts-a-tile": [64, 16, 1],
}


@pytest.mark.parametrize("prefixes", list(SAVE_BATCHES.values()), ids=list(SAVE_BATCHES))
@pytest.mark.parametrize("splits", [1, 3], ids=["one-run", "three-runs"])
def test_decode_only_steps_write_the_new_kv_inside_the_decode_kernel(monkeypatch, splits, prefixes):
    # The decode kernel's last run of each request puts the request's new token into the
    # cache before reading its tile; no separate save launch runs. Poisoned slots prove the write.
    monkeypatch.setattr(fullcg.ops.device_facts, "sm_count", lambda device: splits * 3)
    b = on_device(make_batch([1] * len(prefixes), prefixes, num_heads=4, num_kv_heads=2, seed=6))
    cache, slots = b.layer.kv_cache, b.metadata.slot_mapping.long()
    expected_out, expected_lse = oracle_cpu(b)
    for pages in (cache.k, cache.v):
        pages.view(-1, *pages.shape[2:])[slots] = float("nan")
    saves = []
    monkeypatch.setattr(fullcg.ops.impl.triton, "save_new_kv", lambda *a: saves.append(a))
    out, lse, _ = run(b, "triton", SkipSoftmaxConfig(**TILES))
    assert not saves, "decode-only steps need no save launch"
    assert torch.equal(cache.k.view(-1, *cache.k.shape[2:])[slots], b.k)
    assert torch.equal(cache.v.view(-1, *cache.v.shape[2:])[slots], b.v)
    torch.testing.assert_close(out.double().cpu(), expected_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double().cpu(), expected_lse, atol=2e-5, rtol=1e-4)


def test_runs_merged_in_the_decode_kernel_leave_its_arrival_counts_at_zero():
    # The last program to finish a request's runs merges them and resets the count, so one
    # workspace serves every layer of a step and every replay of a graph.
    b = batch("decode")
    md, cache = b.metadata, b.layer.kv_cache
    workspace: dict = {}
    out, lse = torch.empty_like(b.q), torch.empty(b.q.shape[:2], device=DEVICE)
    options = dict(query_start_loc=md.query_start_loc, is_decode=md.is_decode, scale=b.layer.scale, factor=None,
                   tile_kv=TILES["tile_kv"], split_tiles=None, max_kv_len=md.page_table.shape[1] * cache.page_size,
                   page_table=md.page_table, seq_lens=md.seq_lens, num_splits=4, workspace=workspace)
    ref_out, ref_lse, _ = run(b, "reference", SkipSoftmaxConfig(**TILES))
    for _ in range(2):
        out.fill_(float("nan"))
        decode_attention(b.q, cache.k, cache.v, out, lse, None, **options)
        torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)
        (arrivals,) = [parts[2] for parts in workspace.values()]
        assert not arrivals.any(), "every arrival count is reset by the program that merged"


@pytest.mark.parametrize("by_key", [False, True], ids=["ids", "layer_key"])
def test_compiled_steps_bind_and_check_the_first_call_of_each_shape_only(monkeypatch, by_key):
    # Later layers of a compiled step run the plan the first one left; a layer whose cache
    # is not its own still goes the checked way and is refused. Layers name themselves by
    # ints or, as fullcg.Attention does, by their key.
    from fullcg.context import derived_context

    ops = importlib.import_module("fullcg.ops.attention")  # the package's `attention` is the op
    layers = [batch("decode").layer for _ in range(3)]
    b = batch("decode")
    for i, layer in enumerate(layers):
        layer.layer_id = i
    model = torch.nn.ModuleList(layers)
    binds = []
    real_bind = ops._bind
    monkeypatch.setattr(ops, "_bind", lambda *a: binds.append(a[0]) or real_bind(*a))
    kernel = ops.EAGER_KERNELS[ops.breakable_attention]
    cfg = FullCGConfig(attention_impl="triton", skip_softmax=SkipSoftmaxConfig(**TILES))
    outs = []
    for step in range(2):
        binds.clear()
        with fullcg.forward_context(b.metadata, model, config=cfg) as user, \
                derived_context(user, config=cfg, variant="piecewise", padded_size=None):
            for layer in layers:
                out = torch.empty_like(b.q)
                identity = (-1, layer.layer_key) if by_key else (layer.layer_id, None)
                kernel(b.q, b.k, b.v, out, identity[0], None, None, None, layer.scale, True, True, None, True,
                       None, None, 0 if by_key else layer.kv_cache.uid, identity[1])
                outs.append(out)
            if step == 1:
                assert len(binds) == 1, "the second step checks each cache once, then plans once"
                with pytest.raises(RuntimeError, match="owns KV cache"):
                    foreign = torch.tensor([0, layers[1].kv_cache.uid])  # layer 0, another layer's cache
                    kernel(b.q, b.k, b.v, torch.empty_like(b.q), -1 if by_key else 0, None, None, None,
                           layers[0].scale, True, True, None, True, None, None,
                           0 if by_key else layers[1].kv_cache.uid, foreign if by_key else None)
    ref_out, _, _ = run(batch("decode"), "reference", SkipSoftmaxConfig(**TILES))
    for out in outs:
        torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("heads", [(64, 4), (32, 8)], ids=["64q4kv", "32q8kv"])
def test_runs_merged_in_one_launch_give_the_same_bits_every_time_on_gpu(heads):
    # Hundreds of programs race to be the last run of their request: a missing barrier or
    # fence would show as results that change between launches on the same inputs.
    torch.manual_seed(0)
    lens = torch.randint(1, 9000, (48,)).tolist()
    b = _big_batch([1] * len(lens), lens, *heads, seed=3)
    md, cache = b.metadata, b.layer.kv_cache
    options = dict(query_start_loc=md.query_start_loc, is_decode=md.is_decode, scale=b.layer.scale, factor=None,
                   tile_kv=64, split_tiles=None, max_kv_len=md.page_table.shape[1] * cache.page_size,
                   page_table=md.page_table, seq_lens=md.seq_lens, num_splits=64, workspace={})
    first_out, first_lse = torch.empty_like(b.q), torch.empty(b.q.shape[:2], device=DEVICE)
    decode_attention(b.q, cache.k, cache.v, first_out, first_lse, None, **options)
    expected_out, expected_lse = oracle_cpu(b)
    torch.testing.assert_close(first_out.double().cpu(), expected_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(first_lse.double().cpu(), expected_lse, atol=1e-3, rtol=1e-3)
    out, lse = torch.empty_like(first_out), torch.empty_like(first_lse)
    for _ in range(50):
        out.fill_(float("nan"))
        decode_attention(b.q, cache.k, cache.v, out, lse, None, **options)
        assert torch.equal(out, first_out) and torch.equal(lse, first_lse)


def test_layers_of_one_query_shape_but_different_kv_heads_share_no_arrival_counts():
    # One step's workspace serves every layer; the arrival counts are per KV head, so a layer
    # with more KV heads must not count into a smaller layer's buffer.
    workspace: dict = {}
    for kv_heads, seed in ((1, 1), (4, 2), (1, 3)):
        b = on_device(make_batch([1, 1, 1], [70, 5, 33], num_heads=4, num_kv_heads=kv_heads, seed=seed))
        md, cache = b.metadata, b.layer.kv_cache
        ref_out, ref_lse, _ = run(b, "reference", SkipSoftmaxConfig(**TILES))  # also saves the new k/v
        out, lse = torch.full_like(b.q, float("nan")), torch.empty(b.q.shape[:2], device=DEVICE)
        decode_attention(
            b.q, cache.k, cache.v, out, lse, None, query_start_loc=md.query_start_loc, is_decode=md.is_decode,
            scale=b.layer.scale, factor=None, tile_kv=TILES["tile_kv"], split_tiles=None,
            max_kv_len=md.page_table.shape[1] * cache.page_size, page_table=md.page_table, seq_lens=md.seq_lens,
            num_splits=2, workspace=workspace,
        )
        torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)
    assert all(not parts[2].any() for parts in workspace.values())
    assert len(workspace) == 2, "one workspace per KV-head count"


def test_a_call_of_another_dtype_does_not_take_the_plan_of_the_first(monkeypatch):
    # Calls over given k/v carry no cache whose fit would tell dtypes apart: the plan's key does.
    from fullcg.context import derived_context

    ops = importlib.import_module("fullcg.ops.attention")
    binds = []
    real_bind = ops._bind
    monkeypatch.setattr(ops, "_bind", lambda *a: binds.append(a[0]) or real_bind(*a))
    kernel = ops.EAGER_KERNELS[ops.breakable_attention]
    cfg = FullCGConfig(attention_impl="triton", skip_softmax=SkipSoftmaxConfig(**TILES))
    b = batch("prefill")
    with fullcg.forward_context(b.metadata, b.layer, config=cfg) as user, \
            derived_context(user, config=cfg, variant="piecewise", padded_size=None):
        for dtype in (torch.float32, torch.float16, torch.float16):
            q, k, v = b.q.to(dtype), b.k.to(dtype), b.v.to(dtype)
            out = torch.empty_like(q)
            kernel(q, k, v, out, 0, None, None, None, b.layer.scale, False, True, None, False, None, None,
                   b.layer.kv_cache.uid)
            ref_out, _, _ = run(b, "reference", SkipSoftmaxConfig(**TILES), use_kv_cache=False)
            torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    assert binds.count("breakable_attention") == 2, "each dtype's first call plans; the second fp16 call runs its plan"
