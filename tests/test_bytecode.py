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


def test_compiled_bytecode_is_found_and_imported(package):
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


def test_the_check_runs_before_the_compilers_first_import(monkeypatch):
    monkeypatch.setattr(source_keys, "_started", False)

    def check() -> None:
        raise _Stop

    monkeypatch.setattr(bytecode, "warn_if_uncached", check)
    with pytest.raises(_Stop):
        source_keys.prefetch()


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
