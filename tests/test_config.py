"""Configuration: explicit values win over the environment; bad values name what to fix."""

from __future__ import annotations

import pytest

import fullcg
from fullcg.config import ENV_SKIP_SOFTMAX_DECODE, ENV_SKIP_SOFTMAX_PREFILL


def test_defaults_are_dense():
    cfg = fullcg.FullCGConfig.from_env(environ={})
    assert cfg.skip_softmax.prefill_scale_factor is None
    assert cfg.skip_softmax.decode_scale_factor is None
    assert not cfg.skip_softmax.enabled


def test_factors_are_read_from_the_environment():
    env = {ENV_SKIP_SOFTMAX_PREFILL: "587", ENV_SKIP_SOFTMAX_DECODE: "16.5"}
    skip = fullcg.FullCGConfig.from_env(environ=env).skip_softmax
    assert (skip.prefill_scale_factor, skip.decode_scale_factor) == (587.0, 16.5)


def test_explicit_config_wins_over_the_environment():
    env = {ENV_SKIP_SOFTMAX_PREFILL: "587", ENV_SKIP_SOFTMAX_DECODE: "16.5"}
    skip = fullcg.SkipSoftmaxConfig.from_env(prefill_scale_factor=3.0, decode_scale_factor=None, environ=env)
    assert (skip.prefill_scale_factor, skip.decode_scale_factor) == (3.0, None)
    explicit = fullcg.SkipSoftmaxConfig(1.0, 2.0)
    assert fullcg.FullCGConfig.from_env(environ=env, skip_softmax=explicit).skip_softmax is explicit


def test_forward_context_reads_the_environment_when_no_config_is_given(monkeypatch):
    from batches import make_batch

    monkeypatch.setenv(ENV_SKIP_SOFTMAX_DECODE, "2.5")
    b = make_batch([1], [3])
    with fullcg.forward_context(b.metadata, b.layer) as ctx:
        assert ctx.config.skip_softmax.decode_scale_factor == 2.5
        assert fullcg.context.skip_softmax_factors() == (None, 2.5)


def test_a_context_without_a_config_follows_the_environment_as_it_changes(monkeypatch):
    # The config is built once per distinct set of FULLCG_* values (building one per step
    # would cost more than the rest of the context entry), yet never goes stale.
    from batches import make_batch

    b = make_batch([1], [3])
    seen = []
    for value in ("2.5", "4", "2.5"):
        monkeypatch.setenv(ENV_SKIP_SOFTMAX_DECODE, value)
        with fullcg.forward_context(b.metadata, b.layer) as ctx:
            seen.append(ctx.config)
    assert [c.skip_softmax.decode_scale_factor for c in seen] == [2.5, 4.0, 2.5]
    assert seen[0] is seen[2], "the same environment reuses its config"
    monkeypatch.delenv(ENV_SKIP_SOFTMAX_DECODE)
    with fullcg.forward_context(b.metadata, b.layer) as ctx:
        assert ctx.config.skip_softmax.decode_scale_factor is None


@pytest.mark.parametrize("var", [ENV_SKIP_SOFTMAX_PREFILL, ENV_SKIP_SOFTMAX_DECODE])
@pytest.mark.parametrize("raw", ["-1", "nan", "inf", "-inf", "lots"])
def test_invalid_environment_values_name_the_variable(var, raw):
    with pytest.raises(ValueError, match=var):
        fullcg.FullCGConfig.from_env(environ={var: raw})


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), "3", True])
def test_invalid_explicit_factors_are_rejected(bad):
    with pytest.raises((ValueError, TypeError), match="prefill_scale_factor"):
        fullcg.SkipSoftmaxConfig(prefill_scale_factor=bad)


def test_empty_environment_value_means_dense():
    assert fullcg.FullCGConfig.from_env(environ={ENV_SKIP_SOFTMAX_PREFILL: " "}).skip_softmax.prefill_scale_factor is None


@pytest.mark.parametrize("field", ["tile_kv", "tile_q", "decode_split_tiles"])
def test_tile_sizes_must_be_positive(field):
    with pytest.raises(ValueError, match=f"SkipSoftmaxConfig.{field} must be a positive integer"):
        fullcg.SkipSoftmaxConfig(**{field: 0})
