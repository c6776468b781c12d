"""Skip-softmax measured and calibrated: SkipSoftmaxProbe's measures and
calibrate_skip_softmax's targets, on a tiny random model and on the real one."""

from __future__ import annotations

import functools

import pytest
import torch

import fullcg
from fullcg.integrations import smollm2
from fullcg.models.llama import LlamaConfig, LlamaModel

REFERENCE = fullcg.FullCGConfig(attention_impl="reference", skip_softmax=fullcg.SkipSoftmaxConfig(tile_kv=8, tile_q=4))


def tiny(num_pages: int = 64) -> LlamaModel:
    model = LlamaModel(LlamaConfig.tiny(num_layers=3), seed=0)
    model.allocate_kv_cache(num_pages, 16)
    return model


def sequences(count: int = 3, length: int = 160) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(count)]


def test_a_dense_config_measures_as_dense_and_counts_no_tiles():
    probe = fullcg.SkipSoftmaxProbe(tiny(), sequences(), config=REFERENCE, decode_steps=6)
    for phase in ("prefill", "decode"):
        m = probe.measure(phase, fullcg.SkipSoftmaxConfig())
        assert m.skipped_fraction == 0.0 and m.top1_agreement == 1.0 and abs(m.kl) < 1e-9
        assert m.perplexity == pytest.approx(m.dense_perplexity, rel=1e-6)


def test_a_factor_skips_tiles_per_layer_and_costs_what_it_skips():
    probe = fullcg.SkipSoftmaxProbe(tiny(), sequences(), config=REFERENCE, decode_steps=6)
    small = probe.measure("prefill", fullcg.SkipSoftmaxConfig(prefill_scale_factor=80.0))
    large = probe.measure("prefill", fullcg.SkipSoftmaxConfig(prefill_scale_factor=150.0))
    assert 0 < small.skipped_fraction < large.skipped_fraction
    assert small.kl < large.kl
    assert set(large.layer_skipped) == {0, 1, 2}
    visited = sum(v for v, _ in large.layer_tiles.values())
    assert large.skipped_fraction == pytest.approx(sum(s for _, s in large.layer_tiles.values()) / visited)
    decode = probe.measure("decode", fullcg.SkipSoftmaxConfig(decode_scale_factor=100.0))
    assert decode.skipped_fraction > 0 and decode.phase == "decode" and decode.factor == 100.0


def test_measuring_leaves_the_users_own_counters_as_they_were():
    model = tiny()
    fullcg.reset_skip_softmax_stats()
    md = fullcg.AttentionMetadata.build([40], [0], torch.arange(3, dtype=torch.int32)[None], 16)
    config = fullcg.FullCGConfig(attention_impl="reference",
                                 skip_softmax=fullcg.SkipSoftmaxConfig(30.0, tile_kv=8, tile_q=4))
    with torch.inference_mode(), fullcg.forward_context(md, model, config=config):
        model(torch.arange(40), torch.arange(40))
    before = fullcg.skip_softmax_stats()
    fullcg.SkipSoftmaxProbe(model, sequences(1), config=REFERENCE, decode_steps=4).measure(
        "prefill", fullcg.SkipSoftmaxConfig(prefill_scale_factor=100.0))
    assert fullcg.skip_softmax_stats() == before


def test_the_decode_phase_reprefills_when_another_probe_wrote_over_its_dense_prefix():
    model = tiny()
    a = fullcg.SkipSoftmaxProbe(model, sequences(2), config=REFERENCE, decode_steps=6)
    skip = fullcg.SkipSoftmaxConfig(decode_scale_factor=50.0)
    first = a.measure("decode", skip)
    b = fullcg.SkipSoftmaxProbe(model, sequences(2, 100), config=REFERENCE, decode_steps=6)
    b.measure("decode", skip)
    a.measure("prefill", fullcg.SkipSoftmaxConfig(prefill_scale_factor=50.0))
    assert a.measure("decode", skip).row() == first.row()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "give target_skipped"),
        ({"target_skipped": 1.5}, r"target_skipped must be a fraction in \(0, 1\]"),
        ({"min_top1": 0}, r"min_top1 must be a fraction in \(0, 1\]"),
        ({"min_top1": 0.9, "phases": ("prefill", "verify")}, "phases must be distinct names"),
        ({"min_top1": 0.9, "decode_steps": 0}, "decode_steps must be a positive integer"),
        ({"min_top1": 0.9, "decode_steps": 200}, "needs at least decode_steps \\+ 2 = 202"),
    ],
)
def test_bad_calibration_requests_are_refused_naming_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fullcg.calibrate_skip_softmax(tiny(), sequences(), config=REFERENCE, **kwargs)


def test_a_cache_too_small_for_every_sequence_or_missing_is_refused():
    with pytest.raises(ValueError, match="need 30 KV-cache pages .* the cache has 8"):
        fullcg.SkipSoftmaxProbe(tiny(num_pages=8), sequences(), config=REFERENCE)
    with pytest.raises(ValueError, match="have no KV cache; allocate one first"):
        fullcg.SkipSoftmaxProbe(LlamaModel(LlamaConfig.tiny(), seed=0), sequences(), config=REFERENCE)


def test_calibration_to_a_skipped_fraction_lands_just_under_it():
    cal = fullcg.calibrate_skip_softmax(tiny(), sequences(), target_skipped=0.3, config=REFERENCE, decode_steps=6)
    for m in (cal.prefill, cal.decode):
        assert 0.25 <= m.skipped_fraction <= 0.3
    assert cal.config.prefill_scale_factor == cal.prefill.factor and cal.config.decode_scale_factor == cal.decode.factor
    assert (cal.config.tile_kv, cal.config.tile_q) == (8, 4)
    assert cal.prefill in cal.history and cal.decode in cal.history


def test_calibration_to_a_top1_floor_keeps_it_and_per_layer_factors_only_where_they_skip_more():
    model, seqs = tiny(), sequences()
    glob = fullcg.calibrate_skip_softmax(model, seqs, min_top1=0.97, config=REFERENCE, decode_steps=6,
                                         phases=("prefill",))
    assert glob.prefill.top1_agreement >= 0.97 and glob.prefill.skipped_fraction > 0 and glob.decode is None
    assert glob.config.decode_scale_factor is None and glob.config.per_layer == ()
    layered = fullcg.calibrate_skip_softmax(model, seqs, min_top1=0.97, config=REFERENCE, decode_steps=6,
                                            phases=("prefill",), per_layer=True)
    m = layered.prefill
    assert m.top1_agreement >= 0.97
    if layered.config.per_layer:  # chosen only for more skipping at no more KL
        assert m.skipped_fraction > glob.prefill.skipped_fraction and m.kl <= glob.prefill.kl
        assert all(d is None for _, _, d in layered.config.per_layer)
    else:
        assert m == glob.prefill


# --- the real model ---------------------------------------------------------------------------

needs_model = pytest.mark.skipif(smollm2.missing() is not None, reason=smollm2.missing() or "")


@functools.cache
def real_step():
    from fullcg.integrations import transformers as fhf

    return fhf.prepare(smollm2.load_model(), num_pages=2 * 1024 // 16, page_size=16)


@needs_model
def test_a_skipped_fraction_calibrated_on_real_text_holds_on_held_out_text():
    """SmolLM2 at 1024 tokens: calibrated on two windows, 30% asked, within 5 points on two others."""
    config = fullcg.FullCGConfig(attention_impl="reference")
    cal = fullcg.calibrate_skip_softmax(real_step(), smollm2.text_sequences(1024, 2), target_skipped=0.3,
                                        phases=("prefill",), config=config)
    assert 0.27 <= cal.prefill.skipped_fraction <= 0.3
    held = fullcg.SkipSoftmaxProbe(real_step(), smollm2.text_sequences(1024, 2, held_out=True), config=config)
    checked = held.measure("prefill", cal.config)
    assert abs(checked.skipped_fraction - 0.3) <= 0.05
    assert checked.top1_agreement > 0.95


def test_a_finished_probe_is_freed_with_its_dense_results():
    import gc
    import weakref

    probe = fullcg.SkipSoftmaxProbe(tiny(), sequences(1), config=REFERENCE, decode_steps=4)
    probe.measure("decode", fullcg.SkipSoftmaxConfig(decode_scale_factor=50.0))
    gone = weakref.ref(probe)
    del probe
    gc.collect()
    assert gone() is None


def test_the_search_stays_below_the_smallest_sliding_window_where_larger_factors_skip_nothing():
    model = LlamaModel(LlamaConfig.tiny(num_layers=2, sliding_window=24), seed=0)
    model.allocate_kv_cache(64, 16)
    cal = fullcg.calibrate_skip_softmax(model, sequences(2), target_skipped=0.95, config=REFERENCE,
                                        phases=("prefill",))
    assert cal.prefill.factor <= 0.99 * 24 and cal.prefill.skipped_fraction > 0
