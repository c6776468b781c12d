"""The startup benchmark's own contract: fresh processes, the figures others read, profiles."""

from __future__ import annotations

import json
import pstats
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_startup_benchmark_times_fresh_processes_and_writes_the_results_shape(tmp_path):
    out = tmp_path / "startup.json"
    profiles = tmp_path / "profiles"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "startup.py"), "--kinds", "no_compiler", "no_compiler_warm",
         "--repeats", "1", "--profile-dir", str(profiles), "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    # The keys docs/benchmarks.md and the recorded results use; a kind not run is null, with why.
    for kind in ("cold", "warm", "no_compiler", "no_compiler_warm", "compiler_eager"):
        assert f"{kind}_s" in result
    assert result["no_compiler_s"] > 0 and result["no_compiler_warm_s"] > 0
    assert result["cold_s"] is None and result["cold_reason"] == "not run (--kinds)"
    run = next(r for r in result["runs"] if r["kind"] == "no_compiler")
    # The phases add up to the figure: nothing of the start is left out.
    phases = ("python_start_s", "script_s", "import_torch_s", "import_fullcg_s", "cuda_init_s", "kv_cache_s",
              "torch_compile_s", "first_prefill_s", "capture_and_first_decode_s")
    assert abs(sum(run[p] for p in phases) - run["startup_s"]) < 1e-6
    # Without a compiler nothing of Dynamo runs; the reference implementation compiles no Triton kernel.
    assert run["frames_compiled"] == 0 and run["torch_compile_s"] < 0.05
    assert run["triton_kernels"] == {"first_prefill": {}, "capture_and_first_decode": {}, "second_decode": {}}
    assert set(result["breakdown"]) == {"no_compiler", "no_compiler_warm"}
    # The floor every engine pays (import torch, the CUDA context, the weights) and each
    # kind's time over it, each run against its own process's floor.
    assert abs(run["floor_s"] - (run["import_torch_s"] + run["cuda_init_s"] + run["weights_s"])) < 1e-6
    assert abs(run["over_floor_s"] - (run["total_s"] - run["floor_s"])) < 1e-6
    assert result["floor_s"] > 0 and result["no_compiler_over_floor_s"] > 0
    assert result["cold_over_floor_s"] is None, "a kind not run has no figure over the floor"
    # --profile-dir: one profile per process and phase, as text naming the phase's entry
    # point and as a pstats file.
    names = sorted(p.name for p in profiles.iterdir())
    assert names == [f"cpu_tiny_{kind}_0_{phase}.{ext}" for kind in ("no_compiler", "no_compiler_warm")
                     for phase in ("capture_and_first_decode", "first_prefill") for ext in ("prof", "txt")]
    assert "capture" in (profiles / "cpu_tiny_no_compiler_0_capture_and_first_decode.txt").read_text()
    stats = pstats.Stats(str(profiles / "cpu_tiny_no_compiler_0_capture_and_first_decode.prof"))
    assert any("capture" in func[2] for func in stats.stats), "the pstats file holds the phase's calls"


def test_a_warm_kind_without_its_cold_one_is_refused_with_the_fix():
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "startup.py"), "--kinds", "warm"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 2
    assert "--kinds warm needs cold too" in proc.stderr
