"""The bytecode cache of the packages a compiled fullcg step imports.

Python imports a module from its cached bytecode (``__pycache__/<name>.<tag>.pyc``, or the
same path under ``sys.pycache_prefix``) when one matches the source, and otherwise compiles
the source, and writes the result for the next process unless bytecode writing is off
(``PYTHONDONTWRITEBYTECODE=1``, ``python -B``: ``sys.dont_write_bytecode``). Container
images often turn it off, and packages installed that way often ship no bytecode at all.
Then every process compiles every module it imports again: torch's package and its
compiler (Dynamo, Inductor, sympy) are a few thousand modules, seconds of each process's
start before fullcg's first step, warm start or not. Python still reads bytecode that
exists when writing is off, so compiling it once, where the packages are installed, is the
fix:

- :func:`missing_bytecode` looks at a few representative modules of torch's (a few
  ``os.stat`` calls) and returns those without current bytecode;
- :func:`compile_bytecode` compiles the packages of :data:`PACKAGES` (``python -m fullcg
  compile-bytecode``), into ``sys.pycache_prefix`` where one is set;
- :func:`warn_if_uncached` logs one warning per process when writing is off and the
  bytecode is missing; fullcg calls it before it first imports torch's compiler.

fullcg never changes an interpreter setting (``sys.dont_write_bytecode``,
``sys.pycache_prefix``): it says what they cost and how to compile ahead.
"""

from __future__ import annotations

import compileall
import contextlib
import dataclasses
import importlib.util
import logging
import os
import py_compile
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from fullcg.diagnostics import log_once

__all__ = [
    "PACKAGES",
    "STARTUP_FILES",
    "UnwritableBytecodeError",
    "PackageBytecode",
    "CompileResult",
    "is_cached",
    "missing_bytecode",
    "locate",
    "survey",
    "unwritable",
    "compile_bytecode",
    "warn_if_uncached",
]

logger = logging.getLogger(__name__)

#: The import packages a compiled step imports, in the order compiled: torch's (with its
#: sibling packages), Inductor's sympy (with mpmath) and networkx, numpy, Triton, Inductor's
#: jinja2 templates, filelock, dill and tqdm (where Inductor finds them), and fullcg itself. Those not installed are skipped. Found by
#: listing ``sys.modules`` after ``import torch._inductor.compile_fx``.
PACKAGES: tuple[str, ...] = (
    "torch", "functorch", "torchgen", "sympy", "mpmath", "networkx", "numpy", "triton", "jinja2", "markupsafe",
    "filelock", "typing_extensions", "dill", "tqdm", "fullcg",
)

#: Modules whose bytecode stands for the rest (package, path inside it): ``import torch``,
#: Dynamo, and Inductor's compile entry point. One ``os.stat`` of each source and a 16-byte
#: read of each bytecode file.
STARTUP_FILES: tuple[tuple[str, str], ...] = (
    ("torch", "__init__.py"),
    ("torch", "_dynamo/__init__.py"),
    ("torch", "_inductor/compile_fx.py"),
)

#: Bytecode checked against its source's modification time and size, which the import
#: stats anyway: a package upgraded or patched in place leaves stale bytecode that Python
#: ignores rather than runs. Hash-checked bytecode would have every import read and hash
#: its source (the kind of cost this module removes), unchecked hashes would run old
#: bytecode after an edit. Given explicitly so that ``SOURCE_DATE_EPOCH`` (set by
#: reproducible image builds) does not switch ``py_compile``'s default to checked hashes.
INVALIDATION_MODE = py_compile.PycInvalidationMode.TIMESTAMP

_WARNED_KEY = "fullcg.bytecode.missing"
_checked = False


class UnwritableBytecodeError(PermissionError):
    """The bytecode of a package cannot be written where Python would read it; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class PackageBytecode:
    """One package's (or single module's) sources at ``path``, and how many have current bytecode."""

    name: str
    path: Path
    sources: int
    cached: int
    #: Where its bytecode goes (the top package's ``__pycache__``, or under ``sys.pycache_prefix``).
    cache_dir: Path

    @property
    def missing(self) -> int:
        return self.sources - self.cached


@dataclasses.dataclass(frozen=True)
class CompileResult:
    """What :func:`compile_bytecode` did: the packages as they are after it, how many sources
    it compiled, those it could not (``failed``: sources this Python cannot compile, which no
    import of these packages reaches), those whose bytecode could not be written
    (``unwritten``: a read-only folder inside a package, a full disk), and how long it took."""

    packages: tuple[PackageBytecode, ...]
    compiled: int
    failed: tuple[Path, ...]
    seconds: float
    unwritten: tuple[tuple[Path, str], ...] = ()


def is_cached(source: str | os.PathLike[str], *, verify_hash: bool = False) -> bool:
    """Whether ``source`` has bytecode this interpreter would import instead of compiling it:
    at ``importlib.util.cache_from_source(source)`` (which honours ``sys.pycache_prefix`` and
    the ``-O`` level), of this Python's magic number and known flags, and, for
    timestamp-checked bytecode, of the source's current modification time and size.
    Hash-checked bytecode is trusted unless ``verify_hash`` (then the source is read and
    hashed, as the import would: for a survey, not for a process's start)."""
    try:
        cache = importlib.util.cache_from_source(os.fspath(source))
        with open(cache, "rb", buffering=0) as f:
            header = f.read(16)
        st = os.stat(source)
    except (OSError, NotImplementedError, ValueError):
        return False
    if len(header) < 16 or header[:4] != importlib.util.MAGIC_NUMBER:
        return False
    flags = int.from_bytes(header[4:8], "little")
    if flags & ~0b11:  # bits this Python does not know: its import rejects the file
        return False
    if flags & 0b1:  # hash-based: bit 1 says whether the import checks the hash
        if not verify_hash or not flags & 0b10:
            return True
        try:
            with open(source, "rb") as f:
                return importlib.util.source_hash(f.read()) == header[8:16]
        except OSError:
            return False
    mtime, size = int.from_bytes(header[8:12], "little"), int.from_bytes(header[12:16], "little")
    return mtime == int(st.st_mtime) & 0xFFFFFFFF and size == st.st_size & 0xFFFFFFFF


def locate(name: str) -> list[Path]:
    """The directories of import package ``name`` (a single module: its file), without
    importing it; empty when it is not installed."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return [Path(p) for p in spec.submodule_search_locations if os.path.isdir(p)]
    if spec.origin and spec.origin.endswith(".py") and os.path.isfile(spec.origin):
        return [Path(spec.origin)]
    return []  # an extension module or a frozen one: no bytecode of its own


def missing_bytecode(files: Sequence[tuple[str, str]] | None = None) -> list[Path]:
    """The sources among ``files`` (default :data:`STARTUP_FILES`: package, path inside it)
    that have no current bytecode for this interpreter; packages not installed are skipped.
    Cheap enough for a process's start: a stat and a 16-byte read per file."""
    missing = []
    for package, relative in STARTUP_FILES if files is None else files:
        for root in locate(package)[:1]:
            source = root / relative
            if source.is_file() and not is_cached(source):
                missing.append(source)
    return missing


def _sources(path: Path) -> Iterator[Path]:
    """The ``.py`` files ``compileall.compile_dir`` compiles under ``path`` (symlinked folders not followed)."""
    if path.is_file():
        yield path
        return
    for folder, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                yield Path(folder, name)


def _cache_dir(path: Path) -> Path:
    """Where the bytecode of the package (or module) at ``path`` is written: its ``__pycache__``,
    or that path mirrored under ``sys.pycache_prefix``."""
    source = path if path.is_file() else path / "__init__.py"
    return Path(importlib.util.cache_from_source(os.fspath(source.absolute()))).parent


def _writable(directory: Path) -> bool:
    """Whether bytecode can be written into ``directory``, made where missing: its nearest existing folder's."""
    while not directory.exists() and directory.parent != directory:
        directory = directory.parent
    return os.access(directory, os.W_OK | os.X_OK)


def survey(packages: Iterable[str] | None = None) -> tuple[PackageBytecode, ...]:
    """Each installed package of ``packages`` (default :data:`PACKAGES`) with its source count
    and how many of them have current bytecode."""
    found = []
    for name in PACKAGES if packages is None else packages:
        for path in locate(name):
            sources = list(_sources(path))
            cached = sum(is_cached(source, verify_hash=True) for source in sources)
            found.append(PackageBytecode(name, path, len(sources), cached, _cache_dir(path)))
    return tuple(found)


def unwritable(surveyed: Iterable[PackageBytecode]) -> list[PackageBytecode]:
    """The packages among ``surveyed`` whose bytecode cannot be written where Python reads it."""
    return [p for p in surveyed if p.missing and not _writable(p.cache_dir)]


def compile_bytecode(packages: Iterable[str] | None = None, *, workers: int = 0) -> CompileResult:
    """Compile the bytecode of ``packages`` (default :data:`PACKAGES`, those installed) for
    this interpreter, where its imports read it: each package's ``__pycache__``, or under
    ``sys.pycache_prefix`` (``PYTHONPYCACHEPREFIX``) when one is set, as
    ``importlib.util.cache_from_source`` says. Current bytecode is kept. Bytecode writing
    being off (``PYTHONDONTWRITEBYTECODE``) does not stop it: that setting is the import's.

    Serving processes read it when they run the same Python with the same ``-O`` level and
    ``PYTHONPYCACHEPREFIX``. ``workers``: processes compiling (0: one per CPU, as
    ``compileall``). Raises :class:`UnwritableBytecodeError`, before compiling anything,
    when a package's bytecode cannot be written there.
    """
    start = time.perf_counter()
    packages = PACKAGES if packages is None else tuple(packages)
    before = survey(packages)
    blocked = unwritable(before)
    if blocked:
        where = "; ".join(f"{p.name}: {p.cache_dir}" for p in blocked)
        raise UnwritableBytecodeError(
            f"cannot write bytecode where Python reads it ({where}): run this as the user that installed the "
            "packages (an image build), or set PYTHONPYCACHEPREFIX to a writable directory, both here and in the "
            "environment of every process that should read the bytecode (Python then reads and writes all bytecode "
            "under that directory, and nowhere else)")
    failed: list[Path] = []
    unwritten: list[tuple[Path, str]] = []
    with _prefix_for_workers():
        for package in before:
            if not package.missing:
                continue
            # quiet=2: compileall would print each failure (from worker processes, too); the
            # sources still without current bytecode are compiled once more below, one by one.
            if package.path.is_file():
                compileall.compile_file(package.path, quiet=2, invalidation_mode=INVALIDATION_MODE)
            else:
                compileall.compile_dir(package.path, quiet=2, workers=workers, invalidation_mode=INVALIDATION_MODE)
            for source in _sources(package.path):
                if is_cached(source, verify_hash=True):
                    continue
                # What compileall skipped (its freshness check reads the modification time but
                # not the size) or could not do: compiled here, and a failure told apart, a
                # source this Python cannot compile from bytecode it cannot write.
                try:
                    py_compile.compile(os.fspath(source), doraise=True, invalidation_mode=INVALIDATION_MODE)
                except py_compile.PyCompileError:
                    failed.append(source)
                except OSError as exc:
                    unwritten.append((source, f"{type(exc).__name__}: {exc}"))
    after = survey(packages)
    compiled = sum(p.cached for p in after) - sum(p.cached for p in before)
    return CompileResult(after, compiled, tuple(failed), time.perf_counter() - start, tuple(unwritten))


@contextlib.contextmanager
def _prefix_for_workers() -> Iterator[None]:
    """``sys.pycache_prefix`` given to compileall's worker processes: a spawned or forkserver
    worker is a fresh interpreter that reads ``PYTHONPYCACHEPREFIX`` but is not passed
    ``-X pycache_prefix``, and would write next to the sources."""
    prefix = sys.pycache_prefix
    saved = os.environ.get("PYTHONPYCACHEPREFIX")
    if prefix is not None:
        os.environ["PYTHONPYCACHEPREFIX"] = os.path.abspath(prefix)
    try:
        yield
    finally:
        if prefix is not None:
            if saved is None:
                os.environ.pop("PYTHONPYCACHEPREFIX", None)
            else:
                os.environ["PYTHONPYCACHEPREFIX"] = saved


def warn_if_uncached() -> None:
    """Log one warning, once per process, when bytecode writing is off and torch's
    representative modules (:data:`STARTUP_FILES`) have no current bytecode: every process
    then compiles torch's sources as it imports them. Checked at most once per process
    (a few ``os.stat`` calls), only while ``sys.dont_write_bytecode`` is set."""
    global _checked
    if _checked or not sys.dont_write_bytecode:
        return
    _checked = True
    try:
        missing = missing_bytecode()
    except Exception as exc:  # noqa: BLE001 - a diagnostic: never the reason a compile fails
        logger.debug("fullcg: bytecode check skipped (%s: %s)", type(exc).__name__, exc)
        return
    if missing:
        log_once(
            _WARNED_KEY, logger, logging.WARNING,
            "fullcg: %s has no current bytecode for this Python (%s) and bytecode writing is off "
            "(PYTHONDONTWRITEBYTECODE or -B), so every process compiles torch's sources again as it imports them "
            "(measured on one host: import torch 3.9-5.4 s, torch's compiler 8.3-10.1 s more). Compile them once "
            "where the packages are installed (an image build): %spython -m fullcg compile-bytecode",
            missing[0], sys.implementation.cache_tag,
            f"PYTHONPYCACHEPREFIX={os.path.abspath(sys.pycache_prefix)} " if sys.pycache_prefix else "")
