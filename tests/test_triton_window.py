"""Sliding windows and logit soft-capping in the ``triton`` implementation.

The kernels must compute what the reference computes (out, LSE, and with skip-softmax the
tiles visited and skipped) for every kind of request and source: prefill, extend, decode
and mixed batches over the cache, causal attention over given k/v and prefix chunks. And a
window must make a long context cheap: tiles wholly outside every row's window are never
visited (the counters say so, and keys there may be NaN without reaching the result).

As in ``test_triton_kernels.py``, small sizes run on the CPU under Triton's interpreter;
the ``cuda`` tests at the end repeat the comparisons at real sizes in bf16 on a GPU.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`

pytest.importorskip("triton", reason="triton is not installed; `pip install triton` runs these tests on the CPU")

import fullcg  # noqa: E402
import fullcg.ops.impl.triton  # noqa: E402,F401  (registers the "triton" implementation)
from fullcg import runner, telemetry  # noqa: E402
from fullcg.config import FullCGConfig, SkipSoftmaxConfig  # noqa: E402
from fullcg.ops.kernels import launch  # noqa: E402
from fullcg.ops.kernels.decode import plan_decode, window_tiles  # noqa: E402

from batches import Batch, make_batch  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning",
    "ignore:fullcg. a step runs with autograd enabled",
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TILE_KV = 16
TILES = dict(tile_kv=TILE_KV, tile_q=4)
BATCHES = {
    "prefill": ([21, 9], [0, 0]),
    "extend": ([7, 12], [40, 23]),
    "decode": ([1, 1, 1], [70, 5, 33]),
    "mixed": ([13, 1, 6, 1], [0, 50, 37, 16]),
}
# Itself only, shorter than a tile, one tile, unaligned over two, longer than every context.
WINDOWS = [1, 5, 16, 23, 1000]
SOFTCAP = 8.0  # scores of the peaky inputs reach ~15: the cap changes them
SKIP = SkipSoftmaxConfig(prefill_scale_factor=4.0, decode_scale_factor=4.0, decode_split_tiles=2, **TILES)
DENSE = SkipSoftmaxConfig(**TILES)


def batch(name: str, window: int | None, softcap: float | None, *, sink: bool = True, **kw) -> Batch:
    """Batch ``name`` with a layer of this window and cap; peaky inputs with a sink (key 0
    of every request aligned with its queries), so that skip decisions go both ways."""
    q_lens, p_lens = BATCHES[name] if isinstance(name, str) else name
    kw = dict(key_bias=2.0, seed=len(str(name)), **kw)
    if sink:
        kw["sink"] = 4.0
    b = make_batch(q_lens, p_lens, **kw)
    b.layer.sliding_window = window
    b.layer.logit_softcap = softcap
    return b if DEVICE.type == "cpu" else b.to(DEVICE)


def run(b: Batch, impl: str, skip: SkipSoftmaxConfig, **kwargs):
    """``(out, lse, stats)`` of one attention call with the layer's window and cap."""
    telemetry.reset_skip_softmax_stats()
    cfg = FullCGConfig(attention_impl=impl, skip_softmax=skip)
    with fullcg.forward_context(b.metadata, b.layer, config=cfg), torch.no_grad():
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


def oracle(b: Batch, window: int | None, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention over each request's prefix and new tokens, the obvious way: query
    ``j`` at position ``prefix + j`` sees keys ``(prefix + j - window, prefix + j]``.
    Computed on DEVICE, returned on the CPU."""
    outs, lses = [], []
    starts = b.metadata.query_starts
    for r, pl in enumerate(b.metadata.prefix_lens):
        q = b.q[starts[r] : starts[r + 1]].double()
        group = q.shape[1] // b.full_k[r].shape[1]
        k = b.full_k[r].to(q.device).double().repeat_interleave(group, 1)
        v = b.full_v[r].to(q.device).double().repeat_interleave(group, 1)
        s = torch.einsum("nhd,lhd->hnl", q, k) * b.layer.scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        qpos = pl + torch.arange(q.shape[0], device=q.device)[:, None]
        kpos = torch.arange(k.shape[0], device=q.device)[None, :]
        seen = kpos <= qpos
        if window is not None:
            seen &= kpos > qpos - window
        s = s.masked_fill(~seen, float("-inf"))
        lses.append(torch.logsumexp(s, -1).T)
        outs.append(torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), v))
    return torch.cat(outs).cpu(), torch.cat(lses).cpu()


# ---- over the KV cache -------------------------------------------------------------------


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("name", list(BATCHES))
def test_dense_window_matches_the_reference_and_the_oracle(name, window):
    b = batch(name, window, None)
    assert_same(b, DENSE)
    out, lse, _ = run(b, "triton", DENSE)
    expected_out, expected_lse = oracle(b, window, None)
    torch.testing.assert_close(out.double().cpu(), expected_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double().cpu(), expected_lse, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("name", list(BATCHES))
def test_window_skip_decisions_and_counters_match_the_reference(name, window):
    stats = assert_same(batch(name, window, None), SKIP)
    assert stats.visited > 0


@pytest.mark.parametrize("window", [None, 5, 23])
@pytest.mark.parametrize("name", list(BATCHES))
def test_softcap_with_and_without_a_window_matches_the_reference(name, window):
    b = batch(name, window, SOFTCAP)
    assert_same(b, DENSE)
    assert_same(b, SKIP)
    out, lse, _ = run(b, "triton", DENSE)
    expected_out, expected_lse = oracle(b, window, SOFTCAP)
    torch.testing.assert_close(out.double().cpu(), expected_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double().cpu(), expected_lse, atol=2e-5, rtol=1e-4)


def test_the_softcap_changes_the_result():
    # Guards the test inputs: a cap too large to matter would test nothing.
    b = batch("extend", None, None)
    plain, _, _ = run(b, "triton", DENSE)
    b.layer.logit_softcap = SOFTCAP
    capped, _, _ = run(b, "triton", DENSE)
    assert (plain - capped).abs().max() > 1e-2


@pytest.mark.parametrize("window", [5, 23])
def test_a_window_skips_tiles_and_counts_fewer_visits(window):
    b = batch("extend", window, None)
    stats = assert_same(b, SKIP)
    full = assert_same(batch("extend", None, None), SKIP)
    assert 0 < stats.prefill_visited < full.prefill_visited


@pytest.mark.parametrize("split", [None, 1, 3], ids=["one-run", "1-tile-runs", "3-tile-runs"])
def test_decode_runs_start_at_the_windows_first_tile(split):
    b = batch(([1, 1, 1, 1], [70, 5, 33, 200]), 40, None)
    skip = SkipSoftmaxConfig(decode_scale_factor=4.0, decode_split_tiles=split, **TILES)
    assert_same(b, skip)


@pytest.mark.parametrize("page_size", [16, 32], ids=["page=tile", "page=2tiles"])
def test_pages_holding_whole_tiles_with_a_window(page_size):
    b = batch("mixed", 23, SOFTCAP, page_size=page_size)
    assert_same(b, SKIP)
    assert_same(b, DENSE)


def test_half_precision_window_and_softcap_match_the_reference():
    b = batch("mixed", 23, SOFTCAP, dtype=torch.float16)
    for skip in (DENSE, SKIP):
        ref_out, ref_lse, ref_stats = run(b, "reference", skip)
        out, lse, stats = run(b, "triton", skip)
        torch.testing.assert_close(out.float(), ref_out.float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
        assert stats == ref_stats


def test_head_dim_64_with_a_window_and_softcap():
    b = batch(([6, 1], [10, 30]), 9, SOFTCAP, head_dim=64)
    assert_same(b, SkipSoftmaxConfig(prefill_scale_factor=4.0, decode_scale_factor=4.0, decode_split_tiles=1, **TILES))


# ---- over given k/v: causal, prefix chunks ------------------------------------------------


@pytest.mark.parametrize("softcap", [None, SOFTCAP], ids=["plain", "softcap"])
@pytest.mark.parametrize("window", [1, 5, 16, 23])
def test_causal_attention_over_given_kv_with_a_window(window, softcap):
    b = batch("mixed", window, softcap)
    assert_same(b, DENSE, use_kv_cache=False, causal=True)
    assert_same(b, SKIP, use_kv_cache=False, causal=True)


def _chunked_prefix(b: Batch, impl: str, skip: SkipSoftmaxConfig, op: bool = False):
    """The new tokens over themselves, merged with each prefix chunk by LSE (with ``op``,
    through ``Attention.merge_prefix_chunks``); ``(out, lse, stats)``."""
    telemetry.reset_skip_softmax_stats()
    cfg = FullCGConfig(attention_impl=impl, skip_softmax=skip)
    with fullcg.forward_context(b.metadata, b.layer, config=cfg), torch.no_grad():
        out, lse = b.layer(b.q, b.k, b.v, return_lse=True, use_kv_cache=False, causal=True)
        if op:
            b.layer.merge_prefix_chunks(b.q, out, lse)
        else:
            for c in range(fullcg.context.num_prefix_chunks()):
                kc, vc = b.layer.gather_prefix_chunk(c)
                oc, lc = b.layer(b.q, kc, vc, return_lse=True, use_kv_cache=False, causal=False, prefix_chunk=c)
                merged, merged_lse = torch.empty_like(out), torch.empty_like(lse)
                fullcg.merge_attn_states(merged, oc, lc, out, lse, merged_lse)
                out, lse = merged, merged_lse
    stats = telemetry.skip_softmax_stats().get(b.layer.layer_id, telemetry.SkipSoftmaxStats())
    return out, lse, stats


@pytest.mark.parametrize("window, softcap", [(3, None), (16, SOFTCAP), (30, None), (1000, SOFTCAP)])
@pytest.mark.parametrize("chunk_tokens", [1000, 48], ids=["one-chunk", "several-chunks"])
def test_prefix_chunks_with_a_window_merge_to_windowed_attention(chunk_tokens, window, softcap):
    # Several chunks of 16 prefix positions per request: some lie wholly before the short
    # windows (no tile visited, LSE -inf), one holds a window's start.
    q_lens, p_lens = [5, 1, 9, 2], [40, 29, 0, 61]
    b = batch((q_lens, p_lens), window, softcap, prefix_chunk_tokens=chunk_tokens)
    expected_out, expected_lse = oracle(b, window, softcap)
    out, lse, _ = _chunked_prefix(b, "triton", DENSE)
    torch.testing.assert_close(out.double().cpu(), expected_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double().cpu(), expected_lse, atol=2e-5, rtol=1e-4)
    op_out, op_lse, _ = _chunked_prefix(b, "triton", DENSE, op=True)
    torch.testing.assert_close(op_out.double().cpu(), expected_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(op_lse.double().cpu(), expected_lse, atol=2e-5, rtol=1e-4)
    skip = SkipSoftmaxConfig(prefill_scale_factor=4.0, decode_scale_factor=4.0, decode_split_tiles=1, **TILES)
    ref_out, ref_lse, ref_stats = _chunked_prefix(b, "reference", skip)
    out, lse, stats = _chunked_prefix(b, "triton", skip)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)
    assert stats == ref_stats


# ---- only the window is read ---------------------------------------------------------------


def _poison_before_windows(b: Batch, window: int) -> int:
    """NaN into every cached key and value of a tile wholly before the first window of its
    request (as the kernels tile keys); returns how many keys were poisoned."""
    md, cache = b.metadata, b.layer.kv_cache
    poisoned = 0
    for r, pl in enumerate(md.prefix_lens):
        first_key = max(0, pl - window + 1)  # the request's first query is at position pl
        for pos in range(first_key // TILE_KV * TILE_KV):
            page = int(md.page_table[r, pos // md.page_size])
            cache.k[page, pos % md.page_size] = float("nan")
            cache.v[page, pos % md.page_size] = float("nan")
            poisoned += 1
    return poisoned


@pytest.mark.parametrize("name", ["extend", "decode", "mixed"])
def test_keys_in_tiles_outside_every_window_are_never_read(name):
    b = batch(name, 7, SOFTCAP)
    expected = {skip: run(b, "reference", skip)[:2] for skip in (DENSE, SKIP)}
    assert _poison_before_windows(b, 7) > 0
    for skip, (ref_out, ref_lse) in expected.items():
        out, lse, _ = run(b, "triton", skip)
        torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


def test_a_long_decode_with_a_short_window_visits_only_the_windows_tiles():
    # 4k and 2.5k keys (256 and 157 tiles of 16) under a window of 24: each request's one
    # query touches only the 2 or 3 tiles holding its last 24 keys, per KV head.
    window, heads, kv_heads = 24, 4, 2
    b = batch(([1, 1], [4095, 2500]), window, None, num_heads=heads, num_kv_heads=kv_heads, page_size=16, sink=False)
    expected = []
    for p in b.metadata.prefix_lens:
        lo = p - window + 1
        expected.append(p // TILE_KV - lo // TILE_KV + 1)
    for split in (None, 1):
        skip = SkipSoftmaxConfig(decode_scale_factor=4.0, decode_split_tiles=split, **TILES)
        stats = assert_same(b, skip)
        assert stats.decode_visited == sum(expected) * kv_heads
    assert_same(b, DENSE)
    ref_out, ref_lse, _ = run(b, "reference", DENSE)
    _poison_before_windows(b, window)
    out, lse, _ = run(b, "triton", DENSE)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("factor, split_tiles", [(None, None), (None, 2), (4.0, 2)], ids=["dense", "dense-runs", "skip"])
def test_a_windowed_decode_plan_over_32k_keys_launches_only_the_windows_runs(factor, split_tiles):
    # The grid (and workspace) of a decode over a 32k-key cache with a 128-key window is
    # that of a 128-key context: its runs cover the window's tiles only.
    tile_kv, window, batch_size, heads, kv_heads = 64, 128, 4, 8, 2
    q = torch.zeros(batch_size, heads, 64, device=DEVICE)
    cache = torch.zeros(batch_size * 512, 64, kv_heads, 64, device=DEVICE)
    meta = dict(query_start_loc=torch.arange(batch_size + 1, dtype=torch.int32, device=DEVICE),
                is_decode=torch.ones(batch_size, dtype=torch.bool, device=DEVICE),
                page_table=torch.arange(batch_size * 512, dtype=torch.int32, device=DEVICE).view(batch_size, 512),
                seq_lens=torch.full((batch_size,), 32768, dtype=torch.int32, device=DEVICE))
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device=DEVICE)

    def grid(window):
        plan = plan_decode(q, cache, cache, out, lse, scale=0.125, factor=factor, tile_kv=tile_kv,
                           split_tiles=split_tiles, max_kv_len=32768, num_splits=64 if factor is None else None,
                           window=window, **meta)
        return plan.launch.grid[0]

    assert window_tiles(window, tile_kv) == 3  # 128 keys from a tile's last key touch 3 tiles
    assert grid(window) <= 3 < grid(None)


# ---- steps, plans, graphs --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["decode", "mixed"])
def test_padded_static_metadata_with_a_window_gives_the_real_rows_and_zero_padding(name):
    b = batch(name, 5, SOFTCAP)
    n, size = b.metadata.num_tokens, b.metadata.num_tokens + 3
    static = runner.StaticMetadata(size, runner.StaticTables(size, b.metadata.page_table.shape[1] + 2, DEVICE),
                                      DEVICE)
    padded_md = static.fill(b.metadata)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, torch.full((size - n, *t.shape[1:]), float("nan"), dtype=t.dtype, device=DEVICE)])

    for skip in (DENSE, SKIP):
        ref_out, ref_lse, ref_stats = run(b, "reference", skip)
        out, lse, stats = run(dataclasses.replace(b, metadata=padded_md, q=pad(b.q), k=pad(b.k), v=pad(b.v)),
                              "triton", skip)
        torch.testing.assert_close(out[:n], ref_out, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse[:n], ref_lse, atol=2e-5, rtol=2e-5)
        assert torch.equal(out[n:], torch.zeros_like(out[n:])) and torch.isneginf(lse[n:]).all()
        assert stats == ref_stats


def test_compiled_steps_plan_each_window_and_cap_apart():
    # Local and global layers alternate (Gemma): calls of one shape whose windows or caps
    # differ must not run each other's plans.
    from fullcg.context import derived_context

    ops = importlib.import_module("fullcg.ops.attention")
    kernel = ops.EAGER_KERNELS[ops.breakable_attention]
    attrs = [(5, None), (None, None), (5, SOFTCAP), (23, SOFTCAP), (5, None)]
    b = batch("mixed", None, None)
    layers = [batch("mixed", None, None).layer for _ in attrs]
    for i, layer in enumerate(layers):
        layer.layer_id = i
    model = torch.nn.ModuleList(layers)
    cfg = FullCGConfig(attention_impl="triton", skip_softmax=DENSE)
    for _ in range(2):
        outs = []
        with fullcg.forward_context(b.metadata, model, config=cfg) as user, \
                derived_context(user, config=cfg, variant="piecewise", padded_size=None), torch.no_grad():
            for layer, (window, softcap) in zip(layers, attrs):
                layer.kv_cache.k.copy_(b.layer.kv_cache.k)
                layer.kv_cache.v.copy_(b.layer.kv_cache.v)
                out = torch.empty_like(b.q)
                kernel(b.q, b.k, b.v, out, layer.layer_id, None, None, None, layer.scale, True, True, None, True,
                       window, softcap, layer.kv_cache.uid)
                outs.append(out)
        for out, (window, softcap) in zip(outs, attrs):
            b.layer.sliding_window, b.layer.logit_softcap = window, softcap
            ref_out, _, _ = run(b, "reference", DENSE)
            torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)


def test_cpu_tensors_without_the_interpreter_are_refused_before_anything_launches(monkeypatch):
    # Without TRITON_INTERPRET the launcher would ask torch.cuda for the current device (an
    # AssertionError on a CPU-only torch) while saving k/v: the implementation's own message
    # must come first, naming the fix.
    monkeypatch.setattr(launch, "_INTERPRET", False)
    b = make_batch([5, 1], [0, 9])  # on the CPU, whatever the machine
    saved = b.layer.kv_cache.k.clone()
    with pytest.raises(RuntimeError, match=r"need a CUDA device.*attention_impl='reference' on the CPU"):
        run(b, "triton", DENSE)
    assert torch.equal(b.layer.kv_cache.k, saved), "nothing was written before the refusal"


# ---- real sizes on a GPU -------------------------------------------------------------------


def _big_batch(query_lens, prefix_lens, num_heads, num_kv_heads, head_dim, window, softcap, seed=0):
    b = make_batch(query_lens, prefix_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   page_size=64, dtype=torch.bfloat16, key_bias=1.5, sink=4.0, seed=seed, spare_pages=0)
    b.layer.sliding_window, b.layer.logit_softcap = window, softcap
    return b.to(DEVICE)


def _assert_close_counts(stats, ref_stats):
    # bf16 scores summed in another order can move a row across the threshold by an ulp.
    assert stats.visited == ref_stats.visited
    assert abs(stats.skipped - ref_stats.skipped) <= max(2, ref_stats.visited // 1000)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize(
    "shape", [(64, 8, 64, 128, None), (32, 16, 128, 1024, 50.0)], ids=["gpt-oss-128", "gemma-1024-softcap"]
)
def test_real_size_windowed_attention_matches_the_reference_on_gpu(shape):
    heads, kv_heads, head_dim, window, softcap = shape
    b = _big_batch([2048, 1, 1, 700, 1], [0, 3000, 5000, 1500, 9000], heads, kv_heads, head_dim, window, softcap)
    skip = SkipSoftmaxConfig(prefill_scale_factor=100.0, decode_scale_factor=4.0, decode_split_tiles=2, tile_kv=64,
                             tile_q=128 // (heads // kv_heads))
    dense = dataclasses.replace(skip, prefill_scale_factor=None, decode_scale_factor=None)
    for config in (dense, skip):
        ref_out, ref_lse, ref_stats = run(b, "reference", config)
        out, lse, stats = run(b, "triton", config)
        torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
        _assert_close_counts(stats, ref_stats)
    expected_out, expected_lse = oracle(b, window, softcap)
    out, lse, _ = run(b, "triton", dense)
    torch.testing.assert_close(out.double().cpu(), expected_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double().cpu(), expected_lse, atol=1e-3, rtol=1e-3)


def _long_decode_batch(batch_size, context, heads, kv_heads, head_dim, window, page=64, seed=0):
    """A decode batch over ``context`` cached keys per request, built in bulk (make_batch
    fills the cache one position at a time)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    pages = math.ceil((context + 1) / page)
    layer = fullcg.Attention(heads, head_dim, kv_heads, layer_id=0, sliding_window=window)
    cache = layer.allocate_kv_cache(batch_size * pages, page, dtype=torch.bfloat16, device=DEVICE)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    table = torch.arange(batch_size * pages, dtype=torch.int32).view(batch_size, pages)
    md = fullcg.AttentionMetadata.build([1] * batch_size, [context] * batch_size, table, page, device=DEVICE)
    q = torch.randn(batch_size, heads, head_dim, generator=g, device=DEVICE).to(torch.bfloat16)
    k = torch.randn(batch_size, kv_heads, head_dim, generator=g, device=DEVICE).to(torch.bfloat16)
    v = torch.randn(batch_size, kv_heads, head_dim, generator=g, device=DEVICE).to(torch.bfloat16)
    return Batch(md, layer, q, k, v, [], [])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_32k_decode_with_a_128_window_reads_only_the_window_on_gpu():
    window, context, kv_heads = 128, 32767, 8
    b = _long_decode_batch(16, context, 64, kv_heads, 64, window)
    skip = SkipSoftmaxConfig(decode_scale_factor=4.0, decode_split_tiles=1, tile_kv=64)
    ref_out, ref_lse, ref_stats = run(b, "reference", skip)
    out, lse, stats = run(b, "triton", skip)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    _assert_close_counts(stats, ref_stats)
    lo = context - window + 1  # the first key the query (at position `context`) sees
    assert stats.decode_visited == 16 * kv_heads * (context // 64 - lo // 64 + 1)
    dense = SkipSoftmaxConfig(tile_kv=64)
    dense_ref, dense_ref_lse, _ = run(b, "reference", dense)
    # Everything before the window's first tile becomes NaN: a read of it would show.
    cache, first = b.layer.kv_cache, (lo // 64) * 64
    pages = b.metadata.page_table.shape[1]
    for r in range(16):
        for page in range(first // 64):
            cache.k[r * pages + page] = float("nan")
            cache.v[r * pages + page] = float("nan")
    for config, expected_out, expected_lse in ((dense, dense_ref, dense_ref_lse), (skip, ref_out, ref_lse)):
        out, lse, _ = run(b, "triton", config)
        torch.testing.assert_close(out.float(), expected_out.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, expected_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_windowed_decode_replays_under_cuda_graph_capture_with_counters():
    b = _big_batch([1] * 8, [4000, 100, 2500, 700, 64, 1, 3333, 1024], 32, 8, 128, 256, 30.0)
    skip = SkipSoftmaxConfig(decode_scale_factor=4.0, decode_split_tiles=2, tile_kv=64, tile_q=16)
    cfg = FullCGConfig(attention_impl="triton", skip_softmax=skip)
    ref_out, _, ref_stats = run(b, "reference", skip)
    with fullcg.forward_context(b.metadata, b.layer, config=cfg), torch.no_grad():
        b.layer(b.q, b.k, b.v)  # warm-up: compiles kernels, creates the counters
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
    assert stats.decode_visited == 2 * ref_stats.decode_visited, "each replay adds its window's tiles"
    assert abs(stats.decode_skipped - 2 * ref_stats.decode_skipped) <= 4
