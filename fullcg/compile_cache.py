"""The compile cache: a second process compiling the same graph loads it back.

fullcg keeps one entry per graph Dynamo hands to the backend, under the cache directory
(``FullCGConfig.cache_dir``, else ``$FULLCG_CACHE_DIR``, else ``~/.cache/fullcg``):

- ``graphs/<key>.bin``: the cache artifacts that compiling the graph produced or used,
  serialized by PyTorch's own ``torch.compiler.save_cache_artifacts`` (Inductor's FX graph
  cache entries, autotuning results, AOTAutograd entries) and loaded back with
  ``torch.compiler.load_cache_artifacts`` before the graph is compiled again, so Inductor
  finds everything in its caches;
- ``inductor/``: Inductor's (and, through it, Triton's) cache directory while fullcg
  compiles, unless ``TORCHINDUCTOR_CACHE_DIR`` was set by the user. Compiled kernels
  (C++ shared objects on the CPU, Triton binaries on the GPU) live there, so a warm start
  does not rebuild them.

The key covers the graph's code and inputs, the pass uuid, the config, the torch, triton
and fullcg versions and the source files the graph was traced from. Inductor keys its own
entries on the graph it compiles, so a loaded artifact can never stand in for a different
graph. Entries are written to a temporary file and renamed into place, so concurrent
processes never see a half-written entry; a truncated, corrupt or unloadable one gives one
warning and a recompile. :func:`cache_stats` counts hits, misses, stores and bad entries.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import os
import re
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx

from fullcg.config import FullCGConfig
from fullcg.errors import InvalidConfigError
from fullcg.passes.piece_key import input_signature

__all__ = [
    "ENV_CACHE_DIR",
    "ENV_DISABLE_COMPILE_CACHE",
    "DEFAULT_CACHE_DIR",
    "CompileCache",
    "cache_for",
    "cache_stats",
    "reset_cache_stats",
    "traced_source_files",
    "uncached_compile",
]

ENV_CACHE_DIR = "FULLCG_CACHE_DIR"
ENV_DISABLE_COMPILE_CACHE = "FULLCG_DISABLE_COMPILE_CACHE"
DEFAULT_CACHE_DIR = "~/.cache/fullcg"

# Bump when the entry format or what an entry means changes.
_FORMAT = 1
_MAGIC = b"fullcg-compile-cache\n"

logger = logging.getLogger(__name__)
_stats: collections.Counter[str] = collections.Counter()
_stats_lock = threading.Lock()
_warned: set[str] = set()
_FILE_RE = re.compile(r'File "([^"]+)", line \d+')


def cache_stats() -> collections.Counter[str]:
    """Entries by outcome in this process: ``hit``, ``miss``, ``store``, ``bad`` (corrupt,
    truncated or unloadable: warned about and recompiled)."""
    with _stats_lock:
        return collections.Counter(_stats)


def reset_cache_stats() -> None:
    with _stats_lock:
        _stats.clear()


def _count(what: str) -> None:
    with _stats_lock:
        _stats[what] += 1


def _warn_once(path: Path, message: str, *args: Any) -> None:
    if str(path) not in _warned:
        _warned.add(str(path))
        logger.warning(message, *args)


def _truthy_env(name: str) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "0", "false"):
        return False
    if raw in ("1", "true"):
        return True
    raise InvalidConfigError(f"{name} must be 0 or 1, got {os.environ[name]!r}")


def cache_for(config: FullCGConfig) -> CompileCache | None:
    """The compile cache a compile under ``config`` uses, or None when it is off.

    Off with ``FullCGConfig(compile_cache=False)``, with ``FULLCG_DISABLE_COMPILE_CACHE=1``
    (read at compile time), with ``compiler="eager"`` (nothing is compiled), or when the
    torch in use cannot save and load cache artifacts.
    """
    if not config.compile_cache or config.compiler == "eager" or _truthy_env(ENV_DISABLE_COMPILE_CACHE):
        return None
    if not (hasattr(torch.compiler, "save_cache_artifacts") and hasattr(torch.compiler, "load_cache_artifacts")):
        logger.info("fullcg: this torch (%s) cannot save compile cache artifacts; compile cache off", torch.__version__)
        return None
    root = config.cache_dir or os.environ.get(ENV_CACHE_DIR, "").strip() or DEFAULT_CACHE_DIR
    return CompileCache(Path(root).expanduser())


def _package_versions() -> tuple[str, str]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return torch.__version__, triton_version


def _file_digest(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return "unreadable"


def traced_source_files(gm: torch.fx.GraphModule) -> list[str]:
    """The source files the graph was traced from (the model's code, fullcg's layer), as
    recorded in its nodes' stack traces."""
    files = set()
    for node in gm.graph.nodes:
        files.update(_FILE_RE.findall(node.meta.get("stack_trace") or ""))
    return sorted(files)


def _fullcg_sources() -> list[str]:
    root = Path(__file__).parent
    return sorted(str(p) for p in root.rglob("*.py"))


class CompileCache:
    """fullcg's compile cache in directory ``root`` (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def key(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: FullCGConfig, pass_uuid: str) -> str:
        """The entry key of compiling ``gm`` under ``config``: everything the result depends on."""
        # Where dumps and the cache go does not change what is compiled.
        relevant = config.replace(dump_dir=None, cache_dir=None)
        sources = [(f, _file_digest(f)) for f in sorted({*traced_source_files(gm), *_fullcg_sources()})]
        text = repr((_FORMAT, pass_uuid, repr(relevant), _package_versions(), gm.code,
                     input_signature(example_inputs), sources))
        return hashlib.sha256(text.encode()).hexdigest()

    def entry_path(self, key: str) -> Path:
        return self.root / "graphs" / f"{key}.bin"

    def load(self, key: str) -> bool:
        """Load entry ``key`` into torch's caches; False (after one warning) when it is bad."""
        path = self.entry_path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            _count("miss")
            return False
        except OSError as exc:
            return self._bad(path, f"unreadable ({exc})")
        header = _MAGIC + key.encode() + b"\n"
        if not data.startswith(header) or len(data) < len(header) + 65:
            return self._bad(path, "truncated or not a fullcg cache entry")
        digest, payload = data[len(header):len(header) + 64], data[len(header) + 65:]
        if hashlib.sha256(payload).hexdigest().encode() != digest:
            return self._bad(path, "corrupt (checksum mismatch)")
        try:
            info = torch.compiler.load_cache_artifacts(payload)
        except Exception as exc:  # a torch that cannot read it: recompile rather than fail
            return self._bad(path, f"not loadable by torch {torch.__version__} ({type(exc).__name__}: {exc})")
        if info is None:
            return self._bad(path, "not loadable (torch could not deserialize its artifacts)")
        _count("hit")
        logger.info("fullcg: compile cache hit: %s", path)
        return True

    def _bad(self, path: Path, why: str) -> bool:
        _count("bad")
        _warn_once(path, "fullcg: compile cache entry %s is %s; compiling anew and replacing it", path, why)
        with contextlib.suppress(OSError):
            path.unlink()
        return False

    def discard(self, key: str) -> None:
        """Remove entry ``key`` (it loaded, but compiling from it failed)."""
        with contextlib.suppress(OSError):
            self.entry_path(key).unlink()

    def store(self, key: str) -> None:
        """Write the artifacts recorded since :meth:`session` began as entry ``key``."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            logger.info("fullcg: compiling produced no cache artifacts; nothing stored")
            return
        payload = saved[0]
        path = self.entry_path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Temp file + rename: a concurrent reader sees the old entry or the new one, never half.
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:16]}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(_MAGIC + key.encode() + b"\n" + hashlib.sha256(payload).hexdigest().encode() + b"\n")
                    f.write(payload)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:  # a read-only or full disk costs the next start, not this one
            logger.warning("fullcg: could not write compile cache entry %s: %s", path, exc)
            return
        _count("store")
        logger.info("fullcg: compile cache stored: %s (%d bytes)", path, len(payload))

    @contextlib.contextmanager
    def session(self, key: str) -> Iterator[bool]:
        """Compile inside this: loads entry ``key`` (yields whether it was a hit), points
        Inductor's cache directory into the cache, and stores the entry after a miss."""
        with _inductor_cache_dir(self.root / "inductor"), _fresh_artifact_record():
            hit = self.load(key)
            yield hit
            if not hit:
                self.store(key)


@contextlib.contextmanager
def _inductor_cache_dir(directory: Path) -> Iterator[None]:
    """Inductor's cache directory is ``directory`` inside, unless the user chose one."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    # Inductor writes its default into the environment on first use: that is not a choice.
    if current is not None and os.path.abspath(current) != os.path.abspath(default_cache_dir()):
        yield
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    try:
        yield
    finally:
        if current is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = current


@contextlib.contextmanager
def _fresh_artifact_record() -> Iterator[None]:
    """Record only this compile's artifacts (the entry would otherwise hold every graph the
    process compiled so far). ``with_fresh_cache`` is private and may be missing on other
    torch versions; without it an entry holds more than it needs, which is still correct."""
    try:
        from torch.compiler._cache import CacheArtifactManager

        fresh = CacheArtifactManager.with_fresh_cache
    except (ImportError, AttributeError):
        yield
        return
    with fresh():
        yield


def uncached_compile() -> contextlib.AbstractContextManager[None]:
    """Inductor's and AOTAutograd's caches off: the recompile after a bad cache hit."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    stack = contextlib.ExitStack()
    stack.enter_context(inductor_config.patch({
        k: False for k in ("fx_graph_cache", "fx_graph_remote_cache", "autotune_local_cache")
        if hasattr(inductor_config, k)
    }))
    if hasattr(functorch_config, "enable_autograd_cache"):
        stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
    return stack
