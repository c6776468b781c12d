"""The compile cache: a second process loads what the first compiled; a bad entry costs a
warning and a recompile, never a crash or a wrong result; concurrent processes both succeed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fullcg
from fullcg import compile_cache
from fullcg.compile_cache import CompileCache, cache_for

WORKER = Path(__file__).with_name("compile_cache_worker.py")
REPO = Path(__file__).resolve().parents[1]


def _worker_env(cache_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("FULLCG_DISABLE_COMPILE_CACHE", None)  # the suite turns the cache off; these tests need it on
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # Inductor's caches go inside FULLCG_CACHE_DIR
    env["FULLCG_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _parse(proc: subprocess.CompletedProcess[str] | subprocess.Popen[str], out: str, err: str) -> dict:
    assert proc.returncode == 0, f"worker failed:\n{err}"
    result = json.loads(out.strip().splitlines()[-1])
    result["stderr"] = err
    assert result["max_abs_diff"] < 1e-4, "compiled steps must equal eager ones"
    return result


def _run_worker(cache_dir: Path) -> dict:
    proc = subprocess.run([sys.executable, str(WORKER)], env=_worker_env(cache_dir), capture_output=True,
                          text=True, timeout=300)
    return _parse(proc, proc.stdout, proc.stderr)


def _entries(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "graphs").iterdir())


def test_a_second_process_loads_the_cache_and_bad_entries_are_recompiled(tmp_path, monkeypatch):
    first = _run_worker(tmp_path)
    assert first["fullcg"] == {"miss": 1, "store": 1}
    assert first["inductor"].get("fxgraph_cache_miss", 0) == 3, "3 distinct pieces are compiled"
    [entry] = _entries(tmp_path)

    second = _run_worker(tmp_path)
    assert second["fullcg"] == {"hit": 1}
    assert second["inductor"].get("fxgraph_cache_hit", 0) == 3 and "fxgraph_cache_miss" not in second["inductor"]
    assert "compile cache entry" not in second["stderr"]

    good = entry.read_bytes()
    corrupt = bytearray(good)
    corrupt[-100] ^= 0xFF
    for damaged, why in [(bytes(corrupt), "corrupt (checksum mismatch)"),
                         (good[: len(good) // 2], "corrupt (checksum mismatch)"),
                         (good[:30], "truncated or not a fullcg cache entry")]:
        entry.write_bytes(damaged)
        result = _run_worker(tmp_path)
        assert result["fullcg"] == {"bad": 1, "store": 1}
        assert result["stderr"].count(f"is {why}; compiling anew") == 1, result["stderr"]
        assert _entries(tmp_path) == [entry], "the entry is rewritten in place"
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "loader"))
        compile_cache.reset_cache_stats()
        assert CompileCache(tmp_path).load(entry.stem), "and loads"
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")


def test_two_processes_starting_at_once_both_succeed_and_leave_a_valid_entry(tmp_path, monkeypatch):
    procs = [subprocess.Popen([sys.executable, str(WORKER)], env=_worker_env(tmp_path), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        results.append(_parse(proc, out, err))
    assert all("compile cache entry" not in r["stderr"] for r in results)
    [entry] = _entries(tmp_path)  # one entry, no temporary files left behind
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "loader"))
    compile_cache.reset_cache_stats()
    assert CompileCache(tmp_path).load(entry.stem)
    assert compile_cache.cache_stats() == {"hit": 1}


def test_an_entry_torch_cannot_read_is_a_warning_not_a_crash(tmp_path, caplog):
    cache = CompileCache(tmp_path)
    key = "0" * 64
    payload = b"not torch cache artifacts"
    path = cache.entry_path(key)
    path.parent.mkdir(parents=True)
    path.write_bytes(compile_cache._encode_entry(key, payload, secret=None))
    compile_cache.reset_cache_stats()
    assert not cache.load(key)
    assert compile_cache.cache_stats() == {"bad": 1}
    assert "not loadable" in caplog.text and not path.exists()


def test_the_cache_is_off_when_asked_or_when_nothing_is_compiled(monkeypatch, tmp_path):
    monkeypatch.delenv("FULLCG_DISABLE_COMPILE_CACHE")
    monkeypatch.setenv("FULLCG_CACHE_DIR", str(tmp_path / "env"))
    assert cache_for(fullcg.FullCGConfig()).root == tmp_path / "env"
    assert cache_for(fullcg.FullCGConfig(cache_dir=tmp_path / "mine")).root == tmp_path / "mine"
    monkeypatch.delenv("FULLCG_CACHE_DIR")
    assert cache_for(fullcg.FullCGConfig()).root == Path("~/.cache/fullcg").expanduser()
    assert cache_for(fullcg.FullCGConfig(compile_cache=False)) is None
    assert cache_for(fullcg.FullCGConfig(compiler="eager")) is None
    monkeypatch.setenv("FULLCG_DISABLE_COMPILE_CACHE", "1")
    assert cache_for(fullcg.FullCGConfig()) is None
    monkeypatch.setenv("FULLCG_DISABLE_COMPILE_CACHE", "yes")
    with pytest.raises(ValueError, match="FULLCG_DISABLE_COMPILE_CACHE must be 0 or 1"):
        cache_for(fullcg.FullCGConfig())


def _graph() -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(torch.nn.Linear(4, 4))


def test_the_key_covers_config_pass_uuid_and_inputs_but_not_where_files_go_or_whom_they_trust(tmp_path):
    cache, gm, x = CompileCache(tmp_path), _graph(), torch.zeros(2, 4)
    base = fullcg.FullCGConfig()
    key = cache.key(gm, [x], base, "uuid-a")
    assert cache.key(gm, [x], base.replace(dump_dir=str(tmp_path), cache_dir=str(tmp_path), trust_shared_cache=True),
                     "uuid-a") == key
    assert cache.key(gm, [x], base.replace(graph_mode="piecewise"), "uuid-a") != key
    assert cache.key(gm, [x], base.replace(skip_softmax={"prefill_scale_factor": 1.0}), "uuid-a") != key
    assert cache.key(gm, [x], base, "uuid-b") != key
    assert cache.key(gm, [torch.zeros(3, 4)], base, "uuid-a") != key
    assert cache.key(gm, [x.double()], base, "uuid-a") != key


def test_the_key_covers_the_traced_source_files(tmp_path):
    model_file = tmp_path / "model.py"
    model_file.write_text("def f(x):\n    return x + 1\n")
    gm = _graph()
    next(iter(gm.graph.nodes)).meta["stack_trace"] = f'  File "{model_file}", line 2, in f\n    return x + 1\n'
    assert str(model_file) in compile_cache.traced_source_files(gm)
    cache, x, config = CompileCache(tmp_path), torch.zeros(2, 4), fullcg.FullCGConfig()
    key = cache.key(gm, [x], config, "u")
    model_file.write_text("def f(x):\n    return x + 2\n")
    assert cache.key(gm, [x], config, "u") != key
