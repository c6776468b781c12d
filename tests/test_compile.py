"""fullcg.compile owns the token dimension: one compiled graph from the first step, no mark_dynamic."""

from __future__ import annotations

import pytest
import torch

import fullcg
from fullcg.models.llama import LlamaConfig, LlamaModel
from batches import run_steps_against_eager


def _steps():
    """Batches of 5, 1, 4, 3 and 8 tokens: prefill, decode, mixed."""
    return [([5], [0]), ([1], [5]), ([3, 1], [0, 6]), ([1, 1, 1], [3, 7, 2]), ([8], [0])]


def _models() -> tuple[LlamaModel, LlamaModel]:
    """(a tiny Llama to compile, an identical one to run eagerly), each with its KV cache."""
    pair = LlamaModel(LlamaConfig.tiny()), LlamaModel(LlamaConfig.tiny())
    for m in pair:
        m.allocate_kv_cache(64, 4)
    return pair


def _run_steps_against_eager(model: LlamaModel, compiled, reference: LlamaModel) -> None:
    """Every batch of ``_steps()`` through ``compiled`` and ``reference``; the logits must agree."""
    run_steps_against_eager(model, compiled, reference, _steps())


def test_fullcg_compile_serves_every_token_count_with_the_first_graph_and_matches_eager():
    torch._dynamo.reset()
    model, reference = _models()
    compiled = fullcg.compile(model, compiler="eager")
    _run_steps_against_eager(model, compiled, reference)
    assert len(compiled.backend.runners) == 1, "the second step (and every later one) reuses the first graph"
    assert "graph_mode=auto" in repr(compiled)


def test_options_reach_the_backend_config():
    compiled = fullcg.compile(torch.nn.Linear(2, 2), fullcg.FullCGConfig(graph_mode="piecewise"), compiler="eager")
    assert compiled.backend.config.graph_mode is fullcg.config.GraphMode.PIECEWISE
    assert compiled.backend.config.compiler == "eager"


def test_a_piece_inductor_fails_on_runs_as_traced_and_the_split_report_names_it(monkeypatch, tmp_path, caplog):
    # Inductor can fail on a piece (torch 2.11 cannot tile some reductions over size-oblivious
    # token counts); the model must still run, each such piece as traced, and say so. With the
    # compile cache on, only the failing piece is tried once more with the caches off: the
    # graph is not compiled a second time.
    import fullcg.backend

    attempts = []

    def broken_inductor(name, gm, example_inputs):
        attempts.append(name)
        raise RuntimeError(f"CantSplit in {name}\ndetails")

    monkeypatch.setattr(fullcg.backend, "_inductor_piece", broken_inductor)
    monkeypatch.delenv("FULLCG_DISABLE_COMPILE_CACHE")  # the suite turns the cache off; this test needs it on
    torch._dynamo.reset()
    model, reference = _models()
    compiled = fullcg.compile(model, compiler="inductor", graph_mode="full_and_piecewise", cache_dir=str(tmp_path))
    with caplog.at_level("WARNING", logger="fullcg"):
        _run_steps_against_eager(model, compiled, reference)
    (runner,) = compiled.backend.runners
    assert "runs as traced; RuntimeError: CantSplit in submod_0" in runner.report
    messages = [r.getMessage() for r in caplog.records]
    assert not any("compiling with the compile cache failed" in m for m in messages)
    assert any("Inductor failed on submod_0" in m for m in messages)
    assert attempts.count("submod_0") == 2 + len(fullcg.backend.TILING_RETRIES), (
        "once in the cache session, once with the caches off, once per tiling setting"
    )


def test_a_piece_inductor_can_tile_only_with_other_settings_is_compiled_with_them(monkeypatch, caplog):
    # torch 2.11's Inductor can fail to tile a fused kernel over a symbolic token count
    # (CantSplit); other fusion and tiling settings may compile it, which keeps more of
    # Inductor than running the piece as traced.
    import torch._inductor.config as inductor_config

    import fullcg.backend

    real = fullcg.backend._inductor_piece
    settings_seen = []

    def inductor_that_needs_other_tiling(name, gm, example_inputs):
        settings_seen.append(inductor_config.loop_ordering_after_fusion)
        if inductor_config.loop_ordering_after_fusion:
            raise RuntimeError("InductorError: CantSplit: 256 not divisible by 256*s72")
        return real(name, gm, example_inputs)

    monkeypatch.setattr(fullcg.backend, "_inductor_piece", inductor_that_needs_other_tiling)
    torch._dynamo.reset()
    model, reference = _models()
    compiled = fullcg.compile(model, compiler="inductor", graph_mode="piecewise")
    with caplog.at_level("WARNING", logger="fullcg"), inductor_config.patch(loop_ordering_after_fusion=True):
        _run_steps_against_eager(model, compiled, reference)
    (runner,) = compiled.backend.runners
    assert "runs as traced" not in runner.report
    assert False in settings_seen
    assert any("compiled it with Inductor settings {'loop_ordering_after_fusion': False}" in r.getMessage()
               for r in caplog.records)


def test_a_piece_that_compiles_only_with_the_caches_off_blames_the_cache_and_discards_its_entry(monkeypatch, tmp_path,
                                                                                                 caplog):
    import torch._inductor.config as inductor_config

    import fullcg.backend
    from fullcg import compile_cache

    real = fullcg.backend._inductor_piece

    def broken_while_cached(name, gm, example_inputs):
        if inductor_config.fx_graph_cache:
            raise RuntimeError("a corrupt cache artifact")
        return real(name, gm, example_inputs)

    monkeypatch.setattr(fullcg.backend, "_inductor_piece", broken_while_cached)
    monkeypatch.delenv("FULLCG_DISABLE_COMPILE_CACHE")
    discarded = []
    monkeypatch.setattr(compile_cache.CompileCache, "discard", lambda self, key: discarded.append(key))
    torch._dynamo.reset()
    model, reference = _models()
    compiled = fullcg.compile(model, compiler="inductor", graph_mode="piecewise", cache_dir=str(tmp_path))
    # Inductor's FX graph cache on, as in a default install (config.patch: monkeypatch would
    # delete the option on undo).
    with caplog.at_level("WARNING", logger="fullcg"), inductor_config.patch(fx_graph_cache=True):
        _run_steps_against_eager(model, compiled, reference)
    (runner,) = compiled.backend.runners
    assert "runs as traced" not in runner.report, "every piece compiled, with the caches off"
    assert len(discarded) == 1
    assert any("compiled only with the caches off" in r.getMessage() for r in caplog.records)


def test_outside_a_cache_session_a_failing_piece_falls_back_at_once(monkeypatch):
    import fullcg.backend

    attempts = []

    def boom(*args):
        attempts.append(1)
        raise RuntimeError("boom")

    monkeypatch.setattr(fullcg.backend, "_inductor_piece", boom)
    fallbacks = fullcg.backend.PieceFallbacks()
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    fullcg.backend._compile_piece("p", gm, [torch.ones(1, 2)], "inductor", fallbacks)
    assert dict(fallbacks) == {"p": "RuntimeError: boom"} and len(attempts) == 1


def test_fullcg_errors_raised_while_inductor_traces_are_not_taken_for_compiler_failures(monkeypatch):
    import fullcg.backend
    from fullcg.errors import InvalidConfigError

    def refusing(*args):
        raise InvalidConfigError("skip-softmax factor out of range")

    monkeypatch.setattr(fullcg.backend, "_inductor_piece", refusing)
    fallbacks = fullcg.backend.PieceFallbacks(in_cache_session=True)
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(InvalidConfigError):  # the user's error, not a traced piece
        fullcg.backend._compile_piece("p", gm, [torch.ones(1, 2)], "inductor", fallbacks)
    assert dict(fallbacks) == {}
