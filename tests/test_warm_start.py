"""Warm starts without Dynamo: a second process compiles the graph the first one traced from
the compile cache and steps on it without tracing; a changed source, a bad entry or another
model is a normal compile, never a wrong step."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fullcg
from fullcg import compile_cache
from fullcg.models.llama import LlamaConfig, LlamaModel
from fullcg.warm_start import entry_key, model_fingerprint
from host_facts import isa_taken_from_entry

WORKER = Path(__file__).with_name("warm_start_worker.py")
REPO = Path(__file__).resolve().parents[1]
MODEL_SOURCE = '''import warm_helper
from fullcg.models.llama import LlamaModel


class Model(LlamaModel):
    def forward(self, input_ids, positions):
        return warm_helper.finish(super().forward(input_ids, positions))  # {note}
'''
HELPER_SOURCE = '''import warm_const


def finish(logits):
    return logits * warm_const.SCALE  # {note}
'''
CONST_SOURCE = '''SCALE = {scale}
'''


def _env(cache_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("FULLCG_DISABLE_COMPILE_CACHE", "TORCHINDUCTOR_CACHE_DIR", "FULLCG_CACHE_KEY",
                 "FULLCG_TRUST_SHARED_CACHE"):
        env.pop(name, None)  # the suite turns the cache off; these tests need it on
    env["FULLCG_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _run(cache_dir: Path, model_dir: Path, layers: int = 2, device: str = "cpu") -> dict:
    proc = subprocess.run([sys.executable, str(WORKER), str(model_dir), str(layers), device], env=_env(cache_dir),
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"worker failed:\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["stderr"] = proc.stderr
    # fp32 on both sides; on a GPU, Triton's attention and cuBLAS's TF32-free matmuls in another order.
    assert result["max_abs_diff"] < (1e-4 if device == "cpu" else 2e-3), "compiled steps must equal eager ones"
    return result


def _model_dir(path: Path, note: str = "as written", helper_note: str = "as written", scale: float = 1.0) -> Path:
    """A model whose forward calls a helper in another file, which reads a constant from a third."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "warm_model.py").write_text(MODEL_SOURCE.format(note=note))
    (path / "warm_helper.py").write_text(HELPER_SOURCE.format(note=helper_note))
    (path / "warm_const.py").write_text(CONST_SOURCE.format(scale=scale))
    return path


@pytest.fixture(scope="module")
def cold(tmp_path_factory) -> tuple[Path, Path, dict]:
    """A cache one process filled from nothing, the model's directory (left as it is), and
    what that process reported."""
    root = tmp_path_factory.mktemp("warm-start")
    cache, model_dir = root / "cache", _model_dir(root / "model")
    return cache, model_dir, _run(cache, model_dir)


@pytest.fixture
def cache(cold, tmp_path) -> Path:
    """A copy of the filled cache for one test to change."""
    copy = tmp_path / "cache"
    shutil.copytree(cold[0], copy)
    return copy


@pytest.fixture
def model_dir(cold) -> Path:
    return cold[1]


def _warm_entry(cache: Path) -> Path:
    [entry] = sorted((cache / "warm").glob("*.bin"))
    return entry


def test_the_first_process_traces_and_keeps_its_graph_for_warm_starts(cold):
    *_, result = cold
    assert result["dynamo_frames"] >= 1
    assert result["fullcg"] == {"miss": 1, "store": 1, "warm_miss": 1, "warm_store": 1}


def test_a_second_process_steps_without_dynamo_tracing(cache, model_dir):
    result = _run(cache, model_dir)
    # The graph from the warm entry, its pieces from the cache, and (where it can be) the
    # instruction set of their C++ kernels from the entry, unprobed.
    [graphs] = (cache / "graphs").iterdir()
    known = {"vec_isa_known": 1} if isa_taken_from_entry(graphs) else {}
    assert result["fullcg"] == {"warm_hit": 1, "hit": 1, **known}
    assert result["dynamo_frames"] == 0, "Dynamo traced nothing"
    assert result["graphs"] == 1 and sum(result["steps"].values()) == 3
    assert "warning" not in result["stderr"].lower()


def test_the_model_class_elsewhere_is_another_key(cache, tmp_path):
    result = _run(cache, _model_dir(tmp_path / "model"))
    assert result["fullcg"]["warm_miss"] == 1 and result["dynamo_frames"] >= 1


@pytest.mark.parametrize("change", ["the model's class", "a helper it calls", "a constant the helper reads"])
def test_a_change_the_trace_depends_on_is_never_served_from_the_entry(tmp_path, change):
    model_dir, cache = _model_dir(tmp_path / "model"), tmp_path / "cache"
    assert _run(cache, model_dir)["fullcg"]["warm_store"] == 1
    if change == "the model's class":
        _model_dir(model_dir, note="edited since the trace")
    elif change == "a helper it calls":
        _model_dir(model_dir, helper_note="edited since the trace")
    else:
        _model_dir(model_dir, scale=2.0)  # the logits double: served from the entry, they would not
    changed = _run(cache, model_dir)  # asserts the steps equal eager ones
    outcome = "warm_miss" if change == "the model's class" else "warm_stale"
    assert changed["fullcg"][outcome] == 1 and changed["dynamo_frames"] >= 1, changed["fullcg"]
    assert changed["fullcg"]["warm_store"] == 1, "the entry is written again from the new trace"
    again = _run(cache, model_dir)
    assert again["fullcg"]["warm_hit"] == 1 and again["dynamo_frames"] == 0


@pytest.mark.parametrize("damage", ["flipped byte", "not fullcg's records"])
def test_a_bad_entry_is_one_warning_and_a_normal_compile(cache, model_dir, damage):
    entry = _warm_entry(cache)
    if damage == "flipped byte":
        data = bytearray(entry.read_bytes())
        data[-50] ^= 0xFF
        entry.write_bytes(bytes(data))
        why = "is corrupt (checksum mismatch)"
    else:  # well formed and checksummed, but not what a warm entry holds
        import pickle

        entry.write_bytes(compile_cache._encode_entry(entry.stem, pickle.dumps({"not": "records"}), None))
        why = "could not be used (TypeError"
    result = _run(cache, model_dir)
    assert result["fullcg"]["warm_bad"] == 1 and result["dynamo_frames"] >= 1
    assert result["stderr"].count(why) == 1, result["stderr"]
    assert result["fullcg"]["warm_store"] == 1, "a good entry takes its place"


def test_another_model_misses_the_entry(cache, model_dir):
    result = _run(cache, model_dir, layers=3)
    assert result["fullcg"]["warm_miss"] == 1 and result["dynamo_frames"] >= 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA graphs)")
def test_a_warm_start_on_a_gpu_captures_and_replays_its_loaded_graph(tmp_path):
    model_dir, cache = _model_dir(tmp_path / "model"), tmp_path / "cache"
    cold = _run(cache, model_dir, device="cuda")
    assert cold["fullcg"]["warm_store"] == 1 and cold["dynamo_frames"] >= 1
    warm = _run(cache, model_dir, device="cuda")
    assert warm["fullcg"]["warm_hit"] == 1 and warm["dynamo_frames"] == 0
    assert warm["steps"] == cold["steps"] and any(k.startswith("full:") for k in warm["steps"]), warm["steps"]


# ---- the key, in this process


def _tiny(**changes) -> LlamaModel:
    return LlamaModel(LlamaConfig.tiny(num_layers=1, **changes), seed=0)


def test_the_fingerprint_covers_structure_and_plain_attributes_not_weight_values():
    a, b = _tiny(), _tiny()
    with torch.no_grad():
        b.lm_head.weight.add_(1.0)
    assert model_fingerprint(a) == model_fingerprint(b), "weights are graph inputs, not part of the trace"
    b.layers[0].mlp.some_flag = True
    assert model_fingerprint(a) != model_fingerprint(b), "a plain attribute the forward may read"
    assert model_fingerprint(a) != model_fingerprint(_tiny(intermediate_size=96)), "a weight of another shape"
    c = _tiny()
    c.layers[0].register_forward_hook(lambda *_: None)
    assert model_fingerprint(a) != model_fingerprint(c), "a hook is traced too"


def test_the_key_covers_the_step_arguments_and_the_config():
    model = _tiny()
    ids, pos = torch.zeros(5, dtype=torch.long), torch.arange(5)
    config = fullcg.FullCGConfig()
    key = entry_key(model, (ids, pos), config)
    assert key == entry_key(model, (ids[:3], pos[:3]), config), "the token count is not part of it"
    assert key != entry_key(model, (ids.int(), pos), config)
    assert key != entry_key(model, (ids, pos), config.replace(graph_mode="piecewise"))
    assert key == entry_key(model, (ids, pos), config.replace(cache_dir="/elsewhere")), "where the cache is is not"
    with torch.inference_mode():
        assert key != entry_key(model, (ids, pos), config), "inference mode changes the trace"


def test_with_warm_start_off_no_entry_is_written(tmp_path, monkeypatch, caplog):
    for name in ("FULLCG_DISABLE_COMPILE_CACHE", "TORCHINDUCTOR_CACHE_DIR", "FULLCG_CACHE_KEY"):
        monkeypatch.delenv(name, raising=False)
    torch._dynamo.reset()
    model = _tiny()
    model.allocate_kv_cache(16, 4)
    compiled = fullcg.compile(model, graph_mode="none", cache_dir=str(tmp_path), warm_start=False)
    md = fullcg.AttentionMetadata.build([5], [0], torch.arange(16, dtype=torch.int32)[None], 4)
    with caplog.at_level(logging.WARNING), torch.inference_mode(), fullcg.forward_context(md, model):
        compiled(torch.arange(5), torch.arange(5))
    assert (tmp_path / "graphs").is_dir() and not (tmp_path / "warm").exists()
    assert all(r.source is None for r in compiled.runners), "nothing is kept for an entry"


def _cache_on(monkeypatch) -> None:
    for name in ("FULLCG_DISABLE_COMPILE_CACHE", "TORCHINDUCTOR_CACHE_DIR", "FULLCG_CACHE_KEY",
                 "FULLCG_TRUST_SHARED_CACHE"):
        monkeypatch.delenv(name, raising=False)


def _one_step(model, compiled) -> None:
    md = fullcg.AttentionMetadata.build([5], [0], torch.arange(16, dtype=torch.int32)[None], 4)
    with torch.inference_mode(), fullcg.forward_context(md, model):
        compiled(torch.arange(5), torch.arange(5))


def test_an_entry_holds_the_graph_not_the_weights(tmp_path, monkeypatch):
    _cache_on(monkeypatch)
    torch._dynamo.reset()
    model = _tiny(vocab_size=32768)  # embedding and head: 16 MiB of fp32 weights
    model.allocate_kv_cache(16, 4)
    _one_step(model, fullcg.compile(model, graph_mode="none", cache_dir=str(tmp_path)))
    [entry] = (tmp_path / "warm").iterdir()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert entry.stat().st_size < weights / 20, (entry.stat().st_size, weights)


def test_runners_keep_their_graph_only_for_a_warm_entry(tmp_path, monkeypatch):
    """Plain torch.compile with the backend writes no warm entry, and neither does a model
    whose steps all go through Dynamo (debug_checks): their runners must not hold the graph."""
    _cache_on(monkeypatch)
    for through in ("torch.compile", "debug_checks"):
        torch._dynamo.reset()
        model = _tiny()
        model.allocate_kv_cache(16, 4)
        config = fullcg.FullCGConfig(graph_mode="none", cache_dir=str(tmp_path), debug_checks=through == "debug_checks")
        backend = fullcg.Backend(config)
        if through == "torch.compile":
            _one_step(model, torch.compile(model, backend=backend))
        else:
            compiled = fullcg.compile(model, config)
            _one_step(model, compiled)
            backend = compiled.backend
        assert backend.runners and all(r.source is None for r in backend.runners), through
    assert not (tmp_path / "warm").exists(), "neither keeps warm entries"


def test_tied_weights_are_part_of_the_fingerprint():
    a, b = _tiny(), _tiny()
    b.lm_head.weight = b.embed_tokens.weight
    assert model_fingerprint(a) != model_fingerprint(b)
