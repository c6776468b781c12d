"""The compile cache: a second process loads what the first compiled; a bad entry costs a
warning and a recompile, never a crash or a wrong result; concurrent processes both succeed."""

from __future__ import annotations

import dataclasses
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
from host_facts import isa_taken_from_entry

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
    assert first["learnt"]["isa_probes"] > 0 and first["learnt"]["header_builds"] > 0
    if isa_taken_from_entry(entry):
        # The entry told it the instruction set the first process probed for C++ kernels, and
        # its libraries are built: no probe, no precompiled header.
        assert second["fullcg"] == {"hit": 1, "vec_isa_known": 1}
        assert second["learnt"] == {"isa_probes": 0, "header_builds": 0}
    else:
        assert second["fullcg"] == {"hit": 1}
        assert second["learnt"]["header_builds"] == 0
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
    facts = HostFacts(vec_isa="avx512", vec_isa_flags="-mavx512f -mavx512bf16",
                      vec_isa_verdicts=("_is_avx512_bf16_supported",))
    assert HostFacts.decode(facts.encode()) == facts
    assert HostFacts.decode(HostFacts().encode()) == HostFacts()
    assert HostFacts.decode(b'{"vec_isa": "avx2"}') == HostFacts(vec_isa="avx2"), "an entry from before flags were kept"
    assert HostFacts.decode(b'{"vec_isa": 3}') is None
    assert HostFacts.decode(b'{"vec_isa": "avx2", "vec_isa_verdicts": "_is_x"}') is None
    assert HostFacts.decode(b"[]") is None
    assert HostFacts.decode(b"\xff") is None


@pytest.fixture
def vec_isa(monkeypatch):
    """Inductor's instruction-set machinery with a fake probe that counts its calls, and no
    verdict or list left behind for later tests."""
    from torch._inductor import cpu_vec_isa

    probes: list[str] = []
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", lambda isa, code: probes.append(str(isa)) or True)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    caches = [cpu_vec_isa.valid_vec_isa_list,
              *compile_cache.probe_caches([type(i) for i in cpu_vec_isa.supported_vec_isa_list])]
    for cache in caches:
        cache.cache_clear()
    compile_cache.reset_cache_stats()
    yield cpu_vec_isa, probes
    for cache in caches:
        cache.cache_clear()


def _cpu_reports(monkeypatch, cpu_vec_isa, *flags: str) -> None:
    monkeypatch.setattr(cpu_vec_isa, "x86_isa_checker", lambda: list(flags))
    monkeypatch.setattr(compile_cache.platform, "machine", lambda: "x86_64")


def test_a_recorded_avx2_is_offered_unprobed_inside_and_nothing_outside(vec_isa, monkeypatch):
    from torch._inductor import codecache

    cpu_vec_isa, probes = vec_isa
    _cpu_reports(monkeypatch, cpu_vec_isa, "avx2", "avx512")  # a CPU with more than the entry's set
    original, header = cpu_vec_isa.valid_vec_isa_list, codecache._precompile_header
    with HostFacts(vec_isa="avx2").applied():
        assert str(cpu_vec_isa.pick_vec_isa()) == "avx2", "the set the entry's libraries were built for"
        assert codecache._precompile_header("any.h", "cmd") is None
    assert probes == [] and compile_cache.cache_stats() == {"vec_isa_known": 1}
    assert cpu_vec_isa.valid_vec_isa_list is original and codecache._precompile_header is header, "only inside"
    assert original.cache_info().currsize == 0, "no list is left for later compiles"
    cpu_vec_isa.pick_vec_isa()
    assert probes, "outside, Inductor probes as usual"


def _avx512_facts(cpu_vec_isa, bf16: bool) -> HostFacts:
    """The facts a process that probed AVX-512 (its bf16 extension found or not) records."""
    avx512 = next(i for i in cpu_vec_isa.supported_vec_isa_list if str(i) == "avx512")
    flags = avx512._arch_flags + (" -mavx512bf16" if bf16 else "")
    return HostFacts(vec_isa="avx512", vec_isa_flags=flags,
                     vec_isa_verdicts=("_is_avx512_bf16_supported",) if bf16 else ())


def _cpu_has(monkeypatch, **extensions: bool) -> None:
    """What ``torch.cpu`` answers for the extensions a verdict names (``avx512_bf16=True``)."""
    for name, has in extensions.items():
        monkeypatch.setattr(torch.cpu, f"_is_{name}_supported", lambda has=has: has)


@pytest.mark.parametrize("bf16", [True, False])
def test_a_recorded_avx512_is_offered_with_its_verdicts_unprobed_and_nothing_left_outside(vec_isa, monkeypatch, bf16):
    cpu_vec_isa, probes = vec_isa
    _cpu_reports(monkeypatch, cpu_vec_isa, "avx2", "avx512", "avx512_vnni")
    _cpu_has(monkeypatch, avx512_bf16=True)
    avx512 = next(i for i in cpu_vec_isa.supported_vec_isa_list if str(i) == "avx512")
    facts = _avx512_facts(cpu_vec_isa, bf16)
    before = dict(vars(avx512))  # what an earlier probe in this process left, if any
    with facts.applied():
        picked = cpu_vec_isa.pick_vec_isa()
        assert str(picked) == "avx512", "the entry's set, though the CPU also reports AVX-512 VNNI"
        assert picked is not avx512 and vars(avx512) == before, "a copy: Inductor's own set is not changed"
        assert picked.build_arch_flags() == facts.vec_isa_flags, "the flags the entry's libraries were built with"
        assert picked.is_avx512_bf16_supported() is bf16, "code generation reads the recorded verdict"
        assert bool(picked), "code generation's own check of the set answers from the entry..."
        assert probes == [] and picked.build_arch_flags() == facts.vec_isa_flags, "...without a probe"
    assert compile_cache.cache_stats() == {"vec_isa_known": 1}
    assert vars(avx512) == before
    for cached in (type(avx512).is_avx512_bf16_supported, type(avx512).__bool__,
                   cpu_vec_isa.VecISA._VecISA__bool__impl, cpu_vec_isa.valid_vec_isa_list):
        assert cached.cache_info().currsize == 0, f"{cached} answers for Inductor's own set after the compile"


def test_a_bf16_verdict_this_cpu_does_not_confirm_leaves_the_probe_to_inductor(vec_isa, monkeypatch):
    """An entry written where AVX-512 has bf16, loaded (from a shared cache) on a CPU that
    has AVX-512 without it: its libraries would hold instructions this CPU lacks."""
    cpu_vec_isa, probes = vec_isa
    _cpu_reports(monkeypatch, cpu_vec_isa, "avx2", "avx512")
    _cpu_has(monkeypatch, avx512_bf16=False)
    original = cpu_vec_isa.valid_vec_isa_list
    with _avx512_facts(cpu_vec_isa, bf16=True).applied():
        assert cpu_vec_isa.valid_vec_isa_list is original
    with _avx512_facts(cpu_vec_isa, bf16=False).applied():  # no bf16 asked for: taken
        assert cpu_vec_isa.valid_vec_isa_list is not original
    assert probes == [] and compile_cache.cache_stats() == {"vec_isa_known": 1}


def test_a_recorded_amx_set_is_always_probed(vec_isa, monkeypatch):
    """AMX's probe is also what asks the kernel for the AMX registers: it is never skipped."""
    cpu_vec_isa, probes = vec_isa
    _cpu_reports(monkeypatch, cpu_vec_isa, "avx2", "avx512", "avx512_vnni", "amx_tile")
    _cpu_has(monkeypatch, avx512_bf16=True, amx_fp16=True)
    amx = next(i for i in cpu_vec_isa.supported_vec_isa_list if "amx" in str(i))
    original = cpu_vec_isa.valid_vec_isa_list
    facts = HostFacts(vec_isa=str(amx), vec_isa_flags=amx._arch_flags, vec_isa_verdicts=())
    with facts.applied():
        assert cpu_vec_isa.valid_vec_isa_list is original
    assert compile_cache.cache_stats() == {}


def test_recorded_flags_the_verdicts_do_not_rebuild_leave_the_probe_to_inductor(vec_isa, monkeypatch):
    cpu_vec_isa, probes = vec_isa
    _cpu_reports(monkeypatch, cpu_vec_isa, "avx2", "avx512")
    _cpu_has(monkeypatch, avx512_bf16=True)
    original = cpu_vec_isa.valid_vec_isa_list
    avx512 = next(i for i in cpu_vec_isa.supported_vec_isa_list if str(i) == "avx512")
    wrong = dataclasses.replace(_avx512_facts(cpu_vec_isa, True), vec_isa_verdicts=())  # flags say bf16, verdicts no
    unknown = dataclasses.replace(_avx512_facts(cpu_vec_isa, False), vec_isa_verdicts=("_is_something_else",))
    before = dict(vars(avx512))
    for facts in (wrong, unknown):
        with facts.applied():
            assert cpu_vec_isa.valid_vec_isa_list is original
    assert probes == [] and compile_cache.cache_stats() == {}
    assert vars(avx512) == before


@pytest.mark.parametrize("asked", ["is_avx512_bf16_supported", "__bool__"])
def test_a_verdict_already_cached_in_this_process_leaves_the_probe_to_inductor(vec_isa, monkeypatch, asked):
    cpu_vec_isa, probes = vec_isa
    _cpu_reports(monkeypatch, cpu_vec_isa, "avx2", "avx512")
    _cpu_has(monkeypatch, avx512_bf16=True)
    avx512 = next(i for i in cpu_vec_isa.supported_vec_isa_list if str(i) == "avx512")
    getattr(avx512, asked)()  # something asked already: the answer is this process's own
    original = cpu_vec_isa.valid_vec_isa_list
    with _avx512_facts(cpu_vec_isa, True).applied():
        assert cpu_vec_isa.valid_vec_isa_list is original
    assert getattr(type(avx512), asked).cache_info().currsize == 1, "left as it was"


def test_the_offered_set_is_undone_when_the_compile_inside_fails(vec_isa, monkeypatch):
    cpu_vec_isa, probes = vec_isa
    _cpu_reports(monkeypatch, cpu_vec_isa, "avx2", "avx512")
    _cpu_has(monkeypatch, avx512_bf16=True)
    original = cpu_vec_isa.valid_vec_isa_list
    with pytest.raises(RuntimeError, match="inside"), _avx512_facts(cpu_vec_isa, True).applied():
        cpu_vec_isa.pick_vec_isa().is_avx512_bf16_supported()
        raise RuntimeError("a compile inside failed")
    assert cpu_vec_isa.valid_vec_isa_list is original
    assert type(next(i for i in cpu_vec_isa.supported_vec_isa_list if str(i) == "avx512")
                ).is_avx512_bf16_supported.cache_info().currsize == 0


@pytest.mark.parametrize("recorded, flags, why", [
    ("avx512", ("avx2", "avx512"), "an entry without flags: AVX-512's extensions pick its build flags"),
    ("avx2", ("sse4_2",), "this CPU does not report the set"),
    ("not a set", ("avx2",), "no such set"),
])
def test_other_recorded_sets_leave_the_probe_to_inductor_and_probe_nothing_themselves(vec_isa, monkeypatch, recorded,
                                                                                       flags, why):
    from torch._inductor import codecache

    cpu_vec_isa, probes = vec_isa
    _cpu_reports(monkeypatch, cpu_vec_isa, *flags)
    original = cpu_vec_isa.valid_vec_isa_list
    with HostFacts(vec_isa=recorded).applied():
        assert cpu_vec_isa.valid_vec_isa_list is original, why
        assert codecache._precompile_header("any.h", "cmd") is None, "no header on a hit, whatever the facts"
    assert probes == [] and compile_cache.cache_stats() == {}
    assert original.cache_info().currsize == 0


@pytest.mark.parametrize("choice", ["TORCHINDUCTOR_VEC_ISA_OK", "ATEN_CPU_CAPABILITY", "simdlen"])
def test_a_users_own_choice_of_instruction_set_wins(vec_isa, monkeypatch, choice):
    import torch._inductor.config as inductor_config

    cpu_vec_isa, probes = vec_isa
    _cpu_reports(monkeypatch, cpu_vec_isa, "avx2")
    settings = {"TORCHINDUCTOR_VEC_ISA_OK": {"cpp.vec_isa_ok": True}, "simdlen": {"cpp.simdlen": 256}}
    if choice == "ATEN_CPU_CAPABILITY":
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    original = cpu_vec_isa.valid_vec_isa_list
    with inductor_config.patch(settings.get(choice, {})), HostFacts(vec_isa="avx2").applied():
        assert cpu_vec_isa.valid_vec_isa_list is original
    assert compile_cache.cache_stats() == {}


def test_only_a_probed_instruction_set_is_recorded(vec_isa, monkeypatch):
    import functools

    import torch._inductor.config as inductor_config

    cpu_vec_isa, _ = vec_isa
    assert HostFacts.learnt() == HostFacts(), "nothing chose a set yet"
    avx2 = next(i for i in cpu_vec_isa.supported_vec_isa_list if str(i) == "avx2")
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", functools.cache(lambda: [avx2]))
    cpu_vec_isa.valid_vec_isa_list()  # Inductor chose, by probing
    assert HostFacts.learnt() == HostFacts(vec_isa="avx2", vec_isa_flags=avx2.build_arch_flags())
    avx512 = next(i for i in cpu_vec_isa.supported_vec_isa_list if str(i) == "avx512")
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", functools.cache(lambda: [avx512]))
    monkeypatch.setattr(avx512, "_is_avx512_bf16_supported", True, raising=False)  # as its probe leaves it
    cpu_vec_isa.valid_vec_isa_list()
    assert HostFacts.learnt() == _avx512_facts(cpu_vec_isa, bf16=True)
    with inductor_config.patch({"cpp.vec_isa_ok": True}):
        assert HostFacts.learnt() == HostFacts(), "taken on trust, not probed: no fact for another process"


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
