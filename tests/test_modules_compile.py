"""Every module of the package compiles, including those only a GPU imports (FlashInfer,
Triton kernels): a syntax error there would otherwise first show on a GPU machine."""

from __future__ import annotations

import pathlib
import py_compile

import pytest

import fullcg

MODULES = sorted(pathlib.Path(fullcg.__file__).parent.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(pathlib.Path(fullcg.__file__).parent)))
def test_module_compiles(path, tmp_path):
    py_compile.compile(str(path), cfile=str(tmp_path / "out.pyc"), doraise=True)
