"""What fullcg does around FlashInfer's FMHAv2 without running it: the statistics it returns
become the natural-log LSE, V pages are addressed from K's pointer, page sizes it cannot
tile are recognised, and skip-softmax calls on kernels that count nothing are reported as
unmeasured, never as zero skipped. The kernel itself is tested on the GPU in
``test_flashinfer.py``.
"""

from __future__ import annotations

import copy
import logging
import math
import sys
import types

import pytest
import torch

import fullcg
from fullcg import telemetry
from fullcg.ops.impl import fmha_v2


def test_softmax_statistics_become_the_natural_log_lse_of_the_scaled_scores():
    g = torch.Generator().manual_seed(0)
    head_dim, scale = 128, 0.0883
    raw = torch.randn(5, 3, 40, generator=g, dtype=torch.float64) * 20  # q . k per row, head, key
    row_max = raw.max(-1).values
    # As FMHAv2 stores them: the raw maximum over sqrt(head_dim), and the sum of exp(scale * (s - max)).
    stats = torch.stack((row_max / math.sqrt(head_dim), torch.exp(scale * (raw - row_max[..., None])).sum(-1)), -1)
    lse = fmha_v2.stats_to_lse(stats, scale, head_dim)
    torch.testing.assert_close(lse, torch.logsumexp(scale * raw, -1), rtol=1e-12, atol=1e-12)


def test_an_allocated_cache_is_one_allocation_with_v_a_whole_number_of_pages_after_k():
    cache = fullcg.KVCache.allocate(12, 16, 2, 64, dtype=torch.bfloat16)
    assert fmha_v2.v_offset_pages(cache) == 12
    assert cache.k.is_contiguous() and cache.v.is_contiguous()
    # A copy of the model's cache keeps that layout (and is a cache of its own).
    copied = copy.deepcopy(cache)
    assert fmha_v2.v_offset_pages(copied) == 12 and copied.k.data_ptr() != cache.k.data_ptr()


def test_a_cache_whose_tensors_are_replaced_finds_its_layout_again():
    cache = fullcg.KVCache.allocate(12, 16, 2, 64)
    assert cache.v_offset_pages == 12
    cache.v = torch.zeros_like(cache.v)
    assert cache.v_offset_pages is None


def test_caches_fmha_v2_cannot_address_are_recognised():
    separate = fullcg.KVCache(torch.zeros(8, 16, 2, 64), torch.zeros(8, 16, 2, 64))
    assert fmha_v2.v_offset_pages(separate) is None
    both = torch.zeros(2, 8, 16, 2, 64)
    assert fmha_v2.v_offset_pages(fullcg.KVCache(both[1], both[0])) is None  # V before K
    other_v_dim = fullcg.KVCache.allocate(8, 16, 2, 64, v_head_dim=32)
    assert fmha_v2.v_offset_pages(other_v_dim) is None


def test_paged_tables_list_k_pages_then_the_same_pages_shifted_to_v():
    table = torch.tensor([[3, 1, 0], [2, 5, 4]], dtype=torch.int32)
    tables = fmha_v2.paged_tables(table, 10)
    assert tables.shape == (2, 2, 3) and tables.dtype == torch.int32 and tables.is_contiguous()
    assert torch.equal(tables[:, 0], table) and torch.equal(tables[:, 1], table + 10)


@pytest.mark.parametrize(("page_size", "head_dim", "fits"), [
    (16, 128, True), (128, 128, True), (256, 128, True), (512, 64, True), (12, 128, False), (48, 64, False),
])
def test_page_sizes_must_be_powers_of_two_that_tile_the_kv_tile(page_size, head_dim, fits):
    assert fmha_v2.page_size_fits(page_size, head_dim) is fits


def test_a_batch_with_a_request_longer_than_one_kv_tile_but_not_the_factor_is_refused():
    """fullcg attends densely to a request of at most ``factor`` keys; FMHAv2 would skip
    its tiles past the first."""
    assert fmha_v2.factor_refusal(128.0, 128, [100, 5000], "here") is None  # factor within one tile
    assert fmha_v2.factor_refusal(500.0, 128, [100, 5000], "here") is None  # 100 keys: one tile, never skipped
    with pytest.raises(ValueError, match="request 1 has 300 keys.*at most 128"):
        raise fmha_v2.factor_refusal(500.0, 128, [5000, 300], "here")
    with pytest.raises(ValueError, match="at most 64"):
        raise fmha_v2.factor_refusal(100.0, 256, [80], "here")


def test_skip_softmax_calls_that_count_no_tiles_are_reported_unmeasured():
    fullcg.reset_skip_softmax_stats()
    telemetry.count_unmeasured(7)
    telemetry.count_unmeasured(7)
    stats = fullcg.skip_softmax_stats()[7]
    assert stats.unmeasured_calls == 2 and not stats.measured
    assert stats.visited == 0  # not "0% skipped": the fraction covers counted calls only
    with telemetry.counts_discarded():
        telemetry.count_unmeasured(7)
    assert fullcg.skip_softmax_stats()[7].unmeasured_calls == 2
    fullcg.reset_skip_softmax_stats()
    assert fullcg.skip_softmax_stats().get(7, fullcg.SkipSoftmaxStats()) == fullcg.SkipSoftmaxStats()


@pytest.mark.parametrize("compiled", [False, True])
def test_the_first_build_of_an_fmha_v2_module_is_announced_once(monkeypatch, caplog, tmp_path, compiled):
    """FlashInfer compiles FMHAv2 on first use for minutes: the user is told, once, unless
    its JIT cache already holds the module."""
    env = types.ModuleType("flashinfer.jit.env")
    env.FLASHINFER_JIT_DIR, env.FLASHINFER_AOT_DIR = tmp_path / "jit", tmp_path / "aot"
    uri = "trtllm_fmha_v2_q_paged_kv_nhd_bf16_bf16"
    if compiled:
        (tmp_path / "jit" / uri).mkdir(parents=True)
        (tmp_path / "jit" / uri / f"{uri}.so").write_bytes(b"")
    jit = types.ModuleType("flashinfer.jit")
    jit.env = env
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.jit", jit)
    monkeypatch.setitem(sys.modules, "flashinfer.jit.env", env)
    fmha_v2.announce_build.cache_clear()
    with caplog.at_level(logging.WARNING, logger="fullcg.ops.impl.fmha_v2"):
        for _ in range(3):
            fmha_v2.announce_build("Q_PAGED_KV_NHD", torch.bfloat16)
    fmha_v2.announce_build.cache_clear()
    warned = [r for r in caplog.records if "compiling its FMHAv2" in r.getMessage()]
    assert len(warned) == (0 if compiled else 1)
