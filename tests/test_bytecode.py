"""The bytecode cache of the packages a compiled step imports: missing bytecode is found,
compiled where imports read it, warned about once where writing is off, and the deploy
command compiles it. On a small package made per test, never torch itself."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

import pytest

from fullcg import bytecode, source_keys
from fullcg.__main__ import main
from fullcg.diagnostics import forget_told


@pytest.fixture
def package(tmp_path, monkeypatch) -> Path:
    """An importable package ``bcpkg`` (a module, a subpackage) with no bytecode, standing in
    for torch: the startup check and the default package set point at it."""
    root = tmp_path / "site" / "bcpkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("VALUE = 1\n")
    (root / "sub" / "__init__.py").write_text("")
    (root / "sub" / "compiler.py").write_text("def compile():\n    return 2\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(bytecode, "STARTUP_FILES", (("bcpkg", "__init__.py"), ("bcpkg", "sub/compiler.py")))
    monkeypatch.setattr(bytecode, "PACKAGES", ("bcpkg", "not_installed_pkg"))
    return root


@pytest.fixture
def fresh_warning(monkeypatch):
    """A process that has not checked (or warned about) its bytecode yet."""
    monkeypatch.setattr(bytecode, "_checked", False)
    forget_told(bytecode._WARNED_KEY)
    yield
    forget_told(bytecode._WARNED_KEY)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fullcg.bytecode" and r.levelno == logging.WARNING]


def test_sources_without_bytecode_are_reported_missing(package):
    assert bytecode.missing_bytecode() == [package / "__init__.py", package / "sub" / "compiler.py"]
    [surveyed] = bytecode.survey(["bcpkg"])
    assert (surveyed.sources, surveyed.cached, surveyed.missing) == (3, 0, 3)


def test_packages_not_installed_are_skipped(package):
    assert bytecode.locate("not_installed_pkg") == []
    assert bytecode.missing_bytecode([("not_installed_pkg", "__init__.py")]) == []
    assert [p.name for p in bytecode.survey()] == ["bcpkg"]


def test_compiled_bytecode_is_found_where_imports_read_it(package):
    result = bytecode.compile_bytecode(workers=1)
    assert bytecode.missing_bytecode() == []
    assert result.compiled == 3 and result.failed == ()
    [surveyed] = result.packages
    assert surveyed.cached == surveyed.sources == 3
    cache = Path(importlib.util.cache_from_source(str(package / "sub" / "compiler.py")))
    assert cache.parent == package / "sub" / "__pycache__" and cache.is_file()
    again = bytecode.compile_bytecode(workers=1)
    assert again.compiled == 0, "current bytecode is kept"


def test_bytecode_goes_under_the_pycache_prefix_when_one_is_set(package, tmp_path, monkeypatch):
    prefix = tmp_path / "prefix"
    monkeypatch.setattr(sys, "pycache_prefix", str(prefix))
    bytecode.compile_bytecode(workers=1)
    assert not (package / "__pycache__").exists()
    assert list(prefix.rglob("*.pyc")) and bytecode.missing_bytecode() == []
    monkeypatch.setattr(sys, "pycache_prefix", None)
    assert len(bytecode.missing_bytecode()) == 2, "read from the prefix only, where one is set"


def test_bytecode_of_an_edited_source_is_stale(package):
    bytecode.compile_bytecode(workers=1)
    source = package / "sub" / "compiler.py"
    source.write_text("def compile():\n    return 'edited'\n")
    st = source.stat()
    os.utime(source, (st.st_atime, st.st_mtime + 5))
    assert bytecode.missing_bytecode() == [source]


def test_sources_this_python_cannot_compile_are_reported_not_raised(package):
    (package / "broken.py").write_text("def (:\n")
    result = bytecode.compile_bytecode(workers=1)
    assert result.failed == (package / "broken.py",)
    assert bytecode.missing_bytecode() == []


def test_compiling_with_worker_processes_gives_the_same_bytecode(package):
    result = bytecode.compile_bytecode(workers=2)
    assert result.compiled == 3 and bytecode.missing_bytecode() == []
    cache = Path(importlib.util.cache_from_source(str(package / "sub" / "compiler.py")))
    serial = cache.read_bytes()
    cache.unlink()
    bytecode.compile_bytecode(workers=1)
    assert cache.read_bytes() == serial


def test_compiled_bytecode_is_what_a_python_without_bytecode_writing_imports(package):
    import subprocess

    bytecode.compile_bytecode(workers=1)
    env = {**os.environ, "PYTHONPATH": str(package.parent), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPYCACHEPREFIX", None)
    out = subprocess.run([sys.executable, "-v", "-c", "import bcpkg.sub.compiler"], env=env, capture_output=True,
                         text=True, check=True).stderr
    assert f"# code object from '{importlib.util.cache_from_source(str(package / 'sub' / 'compiler.py'))}'" in out
    assert "matches" in out


def test_a_source_edited_in_place_with_its_modification_time_kept_is_compiled_again(package):
    bytecode.compile_bytecode(workers=1)
    source = package / "sub" / "compiler.py"
    st = source.stat()
    source.write_text("def compile():\n    return 'a longer body'\n")
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))  # the size alone says it changed
    assert bytecode.missing_bytecode() == [source]
    result = bytecode.compile_bytecode(workers=1)
    assert result.compiled == 1 and result.failed == () and bytecode.missing_bytecode() == []


def test_stale_hash_checked_bytecode_is_found_and_replaced(package):
    import py_compile

    source = package / "sub" / "compiler.py"
    py_compile.compile(str(source), doraise=True, invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    assert bytecode.is_cached(source, verify_hash=True)
    source.write_text("def compile():\n    return 'edited'\n")
    assert bytecode.is_cached(source), "the startup check trusts a hash (it does not read sources)"
    assert not bytecode.is_cached(source, verify_hash=True)
    bytecode.compile_bytecode(workers=1)
    assert bytecode.is_cached(source, verify_hash=True)


def test_bytecode_with_flags_this_python_does_not_know_is_not_current(package):
    bytecode.compile_bytecode(workers=1)
    source = package / "__init__.py"
    cache = Path(importlib.util.cache_from_source(str(source)))
    data = bytearray(cache.read_bytes())
    data[4] |= 0b100
    cache.write_bytes(bytes(data))
    assert not bytecode.is_cached(source)


def test_bytecode_that_cannot_be_written_is_reported_apart_from_sources_that_cannot_compile(package, monkeypatch,
                                                                                           capsys):
    import compileall
    import py_compile

    (package / "broken.py").write_text("def (:\n")
    real = py_compile.compile
    read_only = str(package / "sub" / "compiler.py")

    def compile_one(file, *args, **kwargs):
        if str(file) == read_only:
            raise PermissionError(13, "Permission denied", file)
        return real(file, *args, **kwargs)

    monkeypatch.setattr(compileall, "compile_dir", lambda *a, **k: True)  # leaves everything to the retry
    monkeypatch.setattr(py_compile, "compile", compile_one)
    result = bytecode.compile_bytecode(workers=1)
    assert result.failed == (package / "broken.py",)
    assert [source for source, _ in result.unwritten] == [package / "sub" / "compiler.py"]
    assert "PermissionError" in result.unwritten[0][1]
    assert main(["compile-bytecode", "--workers", "1"]) == 1
    assert "could not be written" in capsys.readouterr().err


def test_worker_processes_are_given_the_pycache_prefix(package, tmp_path, monkeypatch):
    import compileall

    prefix = tmp_path / "prefix"
    monkeypatch.setattr(sys, "pycache_prefix", str(prefix))
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    seen = []
    real = compileall.compile_dir

    def spy(*args, **kwargs):
        seen.append(os.environ.get("PYTHONPYCACHEPREFIX"))
        return real(*args, **kwargs)

    monkeypatch.setattr(compileall, "compile_dir", spy)
    bytecode.compile_bytecode(workers=2)
    assert seen == [str(prefix)], "a spawned worker reads the prefix from its environment"
    assert "PYTHONPYCACHEPREFIX" not in os.environ, "and the environment is restored after"


def test_an_unwritable_cache_directory_raises_naming_the_fix_before_compiling(package, monkeypatch):
    monkeypatch.setattr(bytecode, "_writable", lambda directory: False)
    with pytest.raises(bytecode.UnwritableBytecodeError, match="PYTHONPYCACHEPREFIX") as info:
        bytecode.compile_bytecode(workers=1)
    assert isinstance(info.value, PermissionError) and str(package / "__pycache__") in str(info.value)
    assert not (package / "__pycache__").exists()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_package_folder_raises_naming_the_fix(package):
    package.chmod(0o555)
    try:
        with pytest.raises(bytecode.UnwritableBytecodeError, match="PYTHONPYCACHEPREFIX"):
            bytecode.compile_bytecode(workers=1)
    finally:
        package.chmod(0o755)


def test_missing_bytecode_is_warned_about_once_when_writing_is_off(package, fresh_warning, monkeypatch, caplog):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    with caplog.at_level(logging.WARNING, logger="fullcg"):
        bytecode.warn_if_uncached()
        bytecode.warn_if_uncached()
    [warning] = _warnings(caplog)
    assert str(package / "__init__.py") in warning
    assert "PYTHONDONTWRITEBYTECODE" in warning and "python -m fullcg compile-bytecode" in warning


def test_no_warning_while_imports_write_their_bytecode(package, fresh_warning, monkeypatch, caplog):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    with caplog.at_level(logging.WARNING, logger="fullcg"):
        bytecode.warn_if_uncached()
    assert _warnings(caplog) == []
    assert not bytecode._checked, "checked later, should writing be turned off"


def test_no_warning_when_the_bytecode_is_there(package, fresh_warning, monkeypatch, caplog):
    bytecode.compile_bytecode(workers=1)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    with caplog.at_level(logging.WARNING, logger="fullcg"):
        bytecode.warn_if_uncached()
    assert _warnings(caplog) == []


def test_the_check_runs_once_per_process(package, fresh_warning, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    calls = []
    monkeypatch.setattr(bytecode, "missing_bytecode", lambda: calls.append(1) or [])
    bytecode.warn_if_uncached()
    bytecode.warn_if_uncached()
    assert calls == [1]


class _Stop(Exception):
    """Stops the prefetch where the check ran, before it imports torch's compiler."""


def test_the_check_runs_before_the_source_key_prefetch_imports_the_compiler(monkeypatch):
    monkeypatch.setattr(source_keys, "_started", False)

    def check() -> None:
        raise _Stop

    monkeypatch.setattr(bytecode, "warn_if_uncached", check)
    with pytest.raises(_Stop):
        source_keys.prefetch()


def test_the_check_runs_before_inductor_settings_are_checked(monkeypatch):
    import fullcg
    from fullcg.backend import check_inductor_config

    monkeypatch.setattr(bytecode, "warn_if_uncached", lambda: (_ for _ in ()).throw(_Stop()))
    with pytest.raises(_Stop):
        check_inductor_config(fullcg.FullCGConfig(inductor_config={"combo_kernels": True}))


def test_the_check_runs_before_torch_compile_is_made(monkeypatch):
    import torch

    import fullcg

    calls = []
    monkeypatch.setattr(bytecode, "warn_if_uncached", lambda: calls.append("checked"))
    model = torch.nn.Linear(2, 2)
    compiled = fullcg.compile(model, fullcg.FullCGConfig(compiler="eager", compile_cache=False))
    calls.clear()
    compiled._compiled
    assert calls == ["checked"]


def test_a_failing_check_is_logged_at_debug_and_never_raised(package, fresh_warning, monkeypatch, caplog):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)

    def broken(files=None):
        raise PermissionError("no")

    monkeypatch.setattr(bytecode, "missing_bytecode", broken)
    with caplog.at_level(logging.DEBUG, logger="fullcg"):
        bytecode.warn_if_uncached()
    assert _warnings(caplog) == []
    assert any("check skipped" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)


def test_the_command_lists_what_it_would_compile_and_writes_nothing(package, capsys):
    assert main(["compile-bytecode", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "bcpkg" in out and "3 without bytecode" in out and "would compile 3 of 3" in out
    assert "not installed, skipped: not_installed_pkg" in out
    assert not (package / "__pycache__").exists()


def test_the_command_compiles_the_packages(package, capsys):
    assert main(["compile-bytecode", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "compiled 3 source(s)" in out
    assert bytecode.missing_bytecode() == []


def test_the_command_exits_1_naming_the_fix_when_it_cannot_write(package, monkeypatch, capsys):
    monkeypatch.setattr(bytecode, "_writable", lambda directory: False)
    assert main(["compile-bytecode", "--workers", "1"]) == 1
    assert "PYTHONPYCACHEPREFIX" in capsys.readouterr().err


def test_the_command_refuses_a_package_that_is_not_installed(package, capsys):
    assert main(["compile-bytecode", "--package", "not_installed_pkg", "--dry-run"]) == 2
    assert "not_installed_pkg" in capsys.readouterr().err
