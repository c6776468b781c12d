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
from fullcg.compile_cache import CompileCache, HostFacts, cache_for

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
    # The entry also told it the instruction set the first process proved for C++ kernels:
    # it did not build and load a test library per instruction set again.
    assert second["fullcg"] == {"hit": 1, "vec_isa_known": 1}
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


@pytest.mark.parametrize("payload, why", [
    (HostFacts().encode() + b"\nnot torch cache artifacts", "not loadable"),
    (b"not torch cache artifacts", "not a fullcg cache entry"),
    (b'["a list"]\n', "not a fullcg cache entry"),
])
def test_an_entry_torch_cannot_read_is_a_warning_not_a_crash(tmp_path, caplog, payload, why):
    cache = CompileCache(tmp_path)
    key = "0" * 64
    path = cache.entry_path(key)
    path.parent.mkdir(parents=True)
    path.write_bytes(compile_cache._encode_entry(key, payload, secret=None))
    compile_cache.reset_cache_stats()
    assert not cache.load(key)
    assert compile_cache.cache_stats() == {"bad": 1}
    assert why in caplog.text and not path.exists()


def test_host_facts_round_trip_and_refuse_what_is_not_theirs():
    facts = HostFacts(vec_isa="avx2")
    assert HostFacts.decode(facts.encode()) == facts
    assert HostFacts.decode(HostFacts().encode()) == HostFacts()
    assert HostFacts.decode(b'{"vec_isa": 3}') is None
    assert HostFacts.decode(b"\xff") is None


def test_a_known_instruction_set_skips_the_probe_only_inside_and_only_when_the_cpu_agrees(monkeypatch):
    from torch._inductor import codecache, cpu_vec_isa

    probes: list[str] = []
    verdicts = cpu_vec_isa.VecISA._VecISA__bool__impl  # Inductor's per-process cache of probe results
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", lambda isa, code: probes.append(str(isa)) or True)
    original, header = cpu_vec_isa.valid_vec_isa_list, codecache._precompile_header
    try:
        verdicts.cache_clear()
        original.cache_clear()
        best = str(cpu_vec_isa.pick_vec_isa())  # the CPU's best set (this fake probe passes every set)
        assert probes, "a fresh process probes to pick"
        verdicts.cache_clear()
        original.cache_clear()
        probes.clear()
        compile_cache.reset_cache_stats()
        with HostFacts(vec_isa=best).applied():
            assert str(cpu_vec_isa.pick_vec_isa()) == best
            assert codecache._precompile_header("any.h", "cmd") is None
        assert probes == [] and compile_cache.cache_stats() == {"vec_isa_known": 1}
        assert cpu_vec_isa.valid_vec_isa_list is original and codecache._precompile_header is header, "only inside"
        assert original.cache_info().currsize == 0, "no unprobed list is left for later compiles"

        with HostFacts(vec_isa="an instruction set this CPU does not have").applied():
            assert cpu_vec_isa.valid_vec_isa_list is original, "another machine's fact: Inductor probes as usual"
        with HostFacts().applied():
            assert cpu_vec_isa.valid_vec_isa_list is original
            assert codecache._precompile_header("any.h", "cmd") is None, "no header on a hit, whatever the facts"
        assert compile_cache.cache_stats() == {"vec_isa_known": 1}
    finally:  # no verdict of the fake probe outlives the test
        verdicts.cache_clear()
        original.cache_clear()
