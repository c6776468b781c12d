"""The compile cache: a second process compiling the same graph loads it back.

fullcg keeps one entry per graph Dynamo hands to the backend, under the cache directory
(``FullCGConfig.cache_dir``, else ``$FULLCG_CACHE_DIR``, else ``~/.cache/fullcg``):

- ``graphs/<key>.bin``: the cache artifacts that compiling the graph produced or used,
  serialized by PyTorch's own ``torch.compiler.save_cache_artifacts`` (Inductor's FX graph
  cache entries, autotuning results, AOTAutograd entries) and loaded back with
  ``torch.compiler.load_cache_artifacts`` before the graph is compiled again, so Inductor
  finds everything in its caches; before them, one JSON line of what the compiling process
  learnt about its machine (:class:`HostFacts`), so a process that loads the entry need
  not learn it again;
- ``warm/<key>.bin``: the graphs Dynamo traced for a model and how its steps map onto
  them, for warm starts without Dynamo's tracing (:mod:`fullcg.warm_start`);
- ``inductor/``: Inductor's (and, through it, Triton's) cache directory while fullcg
  compiles, unless ``TORCHINDUCTOR_CACHE_DIR`` was set by the user. Compiled kernels
  (C++ shared objects on the CPU, Triton binaries on the GPU) live there, so a warm start
  does not rebuild them.

The key covers the graph's code and inputs, the pass uuid, the config, the torch, triton
and fullcg versions and the source files the graph was traced from. Inductor keys its own
entries on the graph it compiles, so a loaded artifact can never stand in for a different
graph. Entries are written to a temporary file and renamed into place, so concurrent
processes never see a half-written entry; a truncated, corrupt or unloadable one gives one
warning and a recompile.

Loading an entry runs the code in it, and Inductor runs what it finds in its directory, so
both are trusted only as far as :mod:`fullcg.cache_trust` allows: the directories fullcg
creates are mode 0700 and entries 0600; before an entry is read, the root, ``graphs/`` and
the entry (the very file descriptor it is read from) must each be owned by you or root and
writable by neither group nor others, and so must the root and ``inductor/`` before
Inductor is pointed at it. An entry that fails is warned about once, left alone unless it
is yours, and compiled anew; a directory that fails is neither read nor written (Inductor
then works in a private directory of this process). ``trust_shared_cache=True`` (or
``FULLCG_TRUST_SHARED_CACHE=1``) skips these checks for a cache shared on purpose. With a
secret in ``FULLCG_CACHE_KEY`` every entry is signed (HMAC-SHA256 over its key and
payload) and loaded only when the signature verifies, whoever wrote it; ``inductor/`` is
still checked, since no key covers what Inductor writes there. :func:`cache_stats` counts
hits, misses, stores, bad and untrusted entries, and sessions that gave Inductor a private
directory.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import re
import stat
import sys
import tempfile
import threading
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx

from fullcg import cache_trust
from fullcg.cache_trust import ENV_CACHE_KEY
from fullcg.config import FullCGConfig
from fullcg.diagnostics import log_once
from fullcg.errors import InvalidConfigError
from fullcg.passes.piece_key import input_signature

__all__ = [
    "ENV_CACHE_DIR",
    "ENV_CACHE_KEY",
    "ENV_DISABLE_COMPILE_CACHE",
    "ENV_TRUST_SHARED_CACHE",
    "DEFAULT_CACHE_DIR",
    "CompileCache",
    "cache_for",
    "cache_stats",
    "compiled_config",
    "count",
    "file_digest",
    "fullcg_sources",
    "package_versions",
    "reset_cache_stats",
    "traced_source_files",
    "uncached_compile",
]

ENV_CACHE_DIR = "FULLCG_CACHE_DIR"
ENV_DISABLE_COMPILE_CACHE = "FULLCG_DISABLE_COMPILE_CACHE"
ENV_TRUST_SHARED_CACHE = "FULLCG_TRUST_SHARED_CACHE"
DEFAULT_CACHE_DIR = "~/.cache/fullcg"

# Bump when the entry format or what an entry means changes. The format is part of every
# key, so an older process's entries are never even looked up: a clean miss.
# 2: a signature line (HMAC-SHA256 under FULLCG_CACHE_KEY, or _UNSIGNED) after the checksum.
# 3: a graph entry's payload starts with one JSON line of host facts (HostFacts).
_FORMAT = 3
_MAGIC = f"fullcg-compile-cache {_FORMAT}\n".encode()
_UNSIGNED = b"-" * 64
# An entry is opened without blocking (a FIFO planted in its place must not hang the
# process) and without leaking its descriptor into subprocesses Inductor starts.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
#: Entry kinds, each a subdirectory of the root: compiled graphs' artifacts, and traced
#: graphs for warm starts without Dynamo (:mod:`fullcg.warm_start`), whose counts in
#: :func:`cache_stats` carry the prefix ``warm_``.
GRAPHS = "graphs"
WARM = "warm"
_PREFIX = {GRAPHS: "", WARM: "warm_"}
_SHARE_HINT = ("to share a cache on purpose, see 'Caches and trust' in docs/configuration.md "
               f"(trust_shared_cache=True or {ENV_TRUST_SHARED_CACHE}=1, or a signing key in {ENV_CACHE_KEY})")

logger = logging.getLogger(__name__)
_stats: collections.Counter[str] = collections.Counter()
_stats_lock = threading.Lock()
_FILE_RE = re.compile(r'File "([^"]+)", line \d+')


def cache_stats() -> collections.Counter[str]:
    """What the compile cache did in this process, by outcome.

    Per entry looked up, one of ``hit``, ``miss``, ``bad`` (corrupt, truncated or
    unloadable) and ``untrusted`` (it, or a directory above it, failed the ownership and
    permission check, or with ``FULLCG_CACHE_KEY`` set its signature did not verify); the
    last two are warned about and compiled anew. Also ``store`` per entry written,
    ``vec_isa_known`` per hit that took the CPU's instruction set from the entry
    (:class:`HostFacts`), and ``inductor_private`` per compile whose Inductor cache was a
    private directory of this process because ``inductor/`` failed the check or could not
    be written.

    Warm-start entries (:mod:`fullcg.warm_start`) count as ``warm_hit``, ``warm_miss``,
    ``warm_bad``, ``warm_untrusted`` and ``warm_store``, and ``warm_stale`` for an entry
    traced from source files that have changed since.
    """
    with _stats_lock:
        return collections.Counter(_stats)


def reset_cache_stats() -> None:
    """Forget the counts :func:`cache_stats` reports."""
    with _stats_lock:
        _stats.clear()


def count(what: str) -> None:
    """Count one outcome in :func:`cache_stats`."""
    with _stats_lock:
        _stats[what] += 1


def _warn_once(path: Path, message: str, *args: Any) -> None:
    log_once(("compile cache", str(path)), logger, logging.WARNING, message, *args)


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
    torch in use cannot save and load cache artifacts. Like ``FULLCG_CACHE_DIR``,
    ``FULLCG_TRUST_SHARED_CACHE`` (on when it or ``config.trust_shared_cache`` is) and
    ``FULLCG_CACHE_KEY`` are read here, when a graph is compiled.
    """
    if not config.compile_cache or config.compiler == "eager" or _truthy_env(ENV_DISABLE_COMPILE_CACHE):
        return None
    if not (hasattr(torch.compiler, "save_cache_artifacts") and hasattr(torch.compiler, "load_cache_artifacts")):
        logger.info("fullcg: this torch (%s) cannot save compile cache artifacts; compile cache off", torch.__version__)
        return None
    root, trust_shared = cache_root(config)
    return CompileCache(root, trust_shared=trust_shared, secret=cache_trust.secret_from_env())


def cache_root(config: FullCGConfig) -> tuple[Path, bool]:
    """(the fullcg cache's root, whether it is shared on purpose): ``config.cache_dir``, else
    ``$FULLCG_CACHE_DIR``, else ``~/.cache/fullcg``; shared when ``config.trust_shared_cache``
    or ``FULLCG_TRUST_SHARED_CACHE`` says so. Read when called."""
    root = config.cache_dir or os.environ.get(ENV_CACHE_DIR, "").strip() or DEFAULT_CACHE_DIR
    return Path(root).expanduser(), config.trust_shared_cache or _truthy_env(ENV_TRUST_SHARED_CACHE)


def package_versions() -> tuple[str, str]:
    """The torch and triton versions (``"none"`` without triton) every key covers."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return torch.__version__, triton_version


def file_digest(path: str) -> str:
    """The SHA-256 of a file's bytes, ``"unreadable"`` when it cannot be read."""
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


def fullcg_sources() -> list[str]:
    """fullcg's own source files, which every key covers."""
    root = Path(__file__).parent
    return sorted(str(p) for p in root.rglob("*.py"))


def _encode_entry(key: str, payload: bytes, secret: bytes | None) -> bytes:
    """An entry's bytes: magic and format, key, SHA-256 of the payload (against truncation
    and corruption), signature (against forgery: over the header and the payload, so a
    signed payload cannot be moved to another key's entry), payload."""
    header = _MAGIC + key.encode() + b"\n"
    signature = cache_trust.sign(secret, header, payload).encode() if secret is not None else _UNSIGNED
    return header + hashlib.sha256(payload).hexdigest().encode() + b"\n" + signature + b"\n" + payload


def compiled_config(config: FullCGConfig) -> FullCGConfig:
    """``config`` with the fields that do not change what is compiled set to their defaults:
    where dumps and the cache go, whom the cache trusts, and whether warm starts are kept.
    The compile cache's keys and warm starts' keys both read this."""
    return config.replace(dump_dir=None, cache_dir=None, trust_shared_cache=False, warm_start=True)


class CompileCache:
    """fullcg's compile cache in directory ``root`` (see the module docstring).

    ``trust_shared``: skip the ownership and permission checks (a cache shared on purpose)
    and create directories and entries as the umask allows. ``secret``: sign every entry
    written and load only entries whose signature verifies, whoever owns them (directories
    and entries are then created as the umask allows too, for others to read).
    """

    def __init__(self, root: Path, *, trust_shared: bool = False, secret: bytes | None = None) -> None:
        self.root = Path(root)
        self.trust_shared = trust_shared
        self.secret = secret
        # With a key the signature vouches for an entry, so who owns its path does not matter.
        self._check_entry_owners = not trust_shared and secret is None
        self._shared_modes = trust_shared or secret is not None
        # Keys whose load found that nothing may be written in their place (see store).
        self._keep_out: set[str] = set()

    def key(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: FullCGConfig, pass_uuid: str) -> str:
        """The entry key of compiling ``gm`` under ``config``: everything the result depends on."""
        relevant = compiled_config(config)
        sources = [(f, file_digest(f)) for f in sorted({*traced_source_files(gm), *fullcg_sources()})]
        text = repr((_FORMAT, pass_uuid, repr(relevant), package_versions(), gm.code,
                     input_signature(example_inputs), sources))
        return hashlib.sha256(text.encode()).hexdigest()

    def entry_path(self, key: str, kind: str = GRAPHS) -> Path:
        """Where entry ``key`` of ``kind`` (:data:`GRAPHS` or :data:`WARM`) lives."""
        return self.root / kind / f"{key}.bin"

    def load(self, key: str) -> bool:
        """Load entry ``key`` into torch's caches. False on a miss, and (after one warning)
        for an entry that is bad or not trusted."""
        return self._load(key) is not None

    def _load(self, key: str) -> HostFacts | None:
        """:meth:`load`: the entry's host facts on a hit, None otherwise."""
        facts, may_store = self._lookup(key)
        if may_store or facts is not None:
            self._keep_out.discard(key)
        else:
            self._keep_out.add(key)
        return facts

    def _lookup(self, key: str) -> tuple[HostFacts | None, bool]:
        """:meth:`_load`, and whether a fresh entry may be written in its place after a miss:
        never under an untrusted directory, nor over a refused file that is not ours."""
        payload, may_store = self.read(key)
        if payload is None:
            return None, may_store
        path = self.entry_path(key)
        replaceable = self._replaceable(path)
        line, _, artifacts = payload.partition(b"\n")
        facts = HostFacts.decode(line)
        if facts is None:
            return None, self._bad(path, "truncated or not a fullcg cache entry", replaceable)
        try:
            info = torch.compiler.load_cache_artifacts(artifacts)
        except Exception as exc:  # a torch that cannot read it: recompile rather than fail
            return None, self._bad(path, f"not loadable by torch {torch.__version__} ({type(exc).__name__}: {exc})",
                                   replaceable)
        if info is None:
            return None, self._bad(path, "not loadable (torch could not deserialize its artifacts)", replaceable)
        count("hit")
        logger.info("fullcg: compile cache hit: %s", path)
        return facts, False

    def read(self, key: str, kind: str = GRAPHS) -> tuple[bytes | None, bool]:
        """The payload of entry ``key`` of ``kind`` once every check passed (None on a miss
        and, after one warning, for an entry that is bad or not trusted), and whether a
        fresh entry may be written in its place. Counted in :func:`cache_stats` as
        ``miss``, ``bad`` or ``untrusted`` (with ``kind``'s prefix, see :data:`WARM`);
        the caller counts the hit once it could use the payload."""
        path = self.entry_path(key, kind)
        prefix = _PREFIX[kind]
        if self._check_entry_owners:
            problem = cache_trust.check_path(self.root, path.parent)
            if problem is not None:
                count(prefix + "untrusted")
                self._warn_directory(problem)
                return None, False
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError:
            count(prefix + "miss")
            return None, True
        except OSError as exc:
            return None, self._bad(path, f"unreadable ({exc}: let this user read the cache, or give it a cache of "
                                         "its own)", self._replaceable(path), prefix)
        # Judged on the descriptor that is read: a file swapped in after a check of the path
        # would otherwise be loaded unchecked.
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            replaceable = self.trust_shared or cache_trust.owned_by_me(st)
            if not stat.S_ISREG(st.st_mode):
                return None, self._bad(path, "not a regular file", replaceable, prefix)
            if self._check_entry_owners and (why := cache_trust.why_untrusted(st)) is not None:
                return None, self._refuse(path, why, self._fix_for(path, why), replaceable, prefix)
            data = f.read()
        fields = data.split(b"\n", 4)
        if (len(fields) < 5 or fields[0] + b"\n" != _MAGIC or fields[1] != key.encode() or len(fields[2]) != 64
                or len(fields[3]) != 64):
            return None, self._bad(path, "truncated or not a fullcg cache entry", replaceable, prefix)
        digest, signature, payload = fields[2], fields[3], fields[4]
        if hashlib.sha256(payload).hexdigest().encode() != digest:
            return None, self._bad(path, "corrupt (checksum mismatch)", replaceable, prefix)
        if self.secret is not None and not cache_trust.verify(self.secret, signature, _MAGIC + key.encode() + b"\n",
                                                              payload):
            why = f"not signed with the key in {ENV_CACHE_KEY} (unsigned, altered, or signed with another key)"
            return None, self._refuse(path, why, "remove it; entries written while the key is set are signed",
                                      replaceable, prefix)
        return payload, False

    def replaceable(self, key: str, kind: str = GRAPHS) -> bool:
        """Whether fullcg may write entry ``key`` of ``kind`` over the one in its place: when
        that one is ours, or the cache is shared on purpose."""
        return self._replaceable(self.entry_path(key, kind))

    def _replaceable(self, path: Path) -> bool:
        """Whether fullcg may delete or overwrite the entry at ``path``: when it is ours, or
        when the cache is shared on purpose."""
        if self.trust_shared:
            return True
        try:
            return cache_trust.owned_by_me(os.lstat(path))
        except OSError:
            return False

    def _bad(self, path: Path, why: str, replaceable: bool, prefix: str = "") -> bool:
        count(prefix + "bad")
        if replaceable:
            _warn_once(path, "fullcg: compile cache entry %s is %s; compiling anew and replacing it", path, why)
            with contextlib.suppress(OSError):
                path.unlink()
        else:
            _warn_once(path, "fullcg: compile cache entry %s is %s; compiling anew (it is left in place: it is not "
                       "yours to replace)", path, why)
        return replaceable

    def _refuse(self, path: Path, why: str, fix: str, replaceable: bool, prefix: str = "") -> bool:
        """An entry that failed the trust check: ignored, and deleted only when it is ours."""
        count(prefix + "untrusted")
        what = "compiling anew and replacing it" if replaceable else "compiling anew and leaving it in place"
        _warn_once(path, "fullcg: not trusting compile cache entry %s: it is %s, and loading an entry runs the code in "
                   "it; %s. To fix: %s; %s", path, why, what, fix, _SHARE_HINT)
        if replaceable:
            with contextlib.suppress(OSError):
                path.unlink()
        return replaceable

    def _fix_for(self, path: Path, why: str) -> str:
        if why.startswith("writable"):
            return f"make it writable only by its owner (chmod go-w {path})"
        return (f"remove it, or keep the cache where only you can write (FullCGConfig(cache_dir=...) or "
                f"{ENV_CACHE_DIR})")

    def _warn_directory(self, problem: cache_trust.Untrusted) -> None:
        """One warning for a cache directory that failed the trust check, saying what of the
        cache that costs: a directory under ``graphs/`` its entries, one under ``inductor/``
        Inductor's kernels, the root both."""
        part = problem.path.relative_to(self.root).parts[:1]
        if not part:
            effect = ("nothing in it is read or written: graphs are compiled anew, and Inductor caches in a private "
                      "directory of this process")
        elif part[0] == "inductor":
            effect = "Inductor caches in a private directory of this process instead, compiling its kernels anew"
        else:
            effect = "no entry in it is read or written: graphs are compiled anew"
        _warn_once(problem.path, "fullcg: not trusting compile cache directory %s: it is %s, and loading from a cache "
                   "runs the code in it; %s. To fix: %s; %s", problem.path, problem.reason, effect,
                   self._fix_for(problem.path, problem.reason), _SHARE_HINT)

    def discard(self, key: str, kind: str = GRAPHS) -> None:
        """Remove entry ``key`` (it loaded, but compiling from it failed), when it is ours to remove."""
        path = self.entry_path(key, kind)
        if self._replaceable(path):
            with contextlib.suppress(OSError):
                path.unlink()

    def store(self, key: str) -> None:
        """Write the artifacts recorded since :meth:`session` began as entry ``key``; nothing
        when :meth:`load` found its place untrusted (under a directory that failed the check,
        or taken by a refused file that is not ours)."""
        if key in self._keep_out:
            logger.info("fullcg: compile cache entry %s not stored: its place is not trusted", self.entry_path(key))
            return
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            logger.info("fullcg: compiling produced no cache artifacts; nothing stored")
            return
        self.write(key, HostFacts.learnt().encode() + b"\n" + saved[0])

    def write(self, key: str, payload: bytes, kind: str = GRAPHS) -> None:
        """Write ``payload`` as entry ``key`` of ``kind`` (temp file and rename; signed under
        a key). A failure to write is a warning: it costs the next start, not this one."""
        path = self.entry_path(key, kind)
        try:
            cache_trust.make_cache_dir(path.parent, shared=self._shared_modes)
            # Temp file + rename: a concurrent reader sees the old entry or the new one, never half.
            # mkstemp creates it 0600, the private mode.
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:16]}.", suffix=".tmp")
            try:
                if self._shared_modes:
                    os.fchmod(fd, cache_trust.entry_mode(shared=True))
                with os.fdopen(fd, "wb") as f:
                    f.write(_encode_entry(key, payload, self.secret))
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:  # a read-only or full disk costs the next start, not this one
            logger.warning("fullcg: could not write compile cache entry %s: %s", path, exc)
            return
        count(_PREFIX[kind] + "store")
        logger.info("fullcg: compile cache stored: %s (%d bytes)", path, len(payload))

    def inductor_dir(self) -> Path:
        """The directory this cache hands to Inductor as its cache directory: ``inductor/``
        under the root when it passes the trust check (or the cache is shared on purpose)
        and can be written; else a private directory of this process (warned about when
        untrusted: no signing key covers what Inductor writes there)."""
        usable = cache_trust.usable_dir(self.root, self.root / "inductor", trust_shared=self.trust_shared,
                                        shared_modes=self._shared_modes)
        if isinstance(usable, Path):
            return usable
        if isinstance(usable, cache_trust.Untrusted):
            self._warn_directory(usable)
        else:
            logger.info("fullcg: %s; Inductor caches in a private directory of this process", usable)
        return self._private_inductor_dir()

    @staticmethod
    def _private_inductor_dir() -> Path:
        count("inductor_private")
        return cache_trust.private_dir("inductor")

    @contextlib.contextmanager
    def session(self, key: str) -> Iterator[bool]:
        """Compile inside this: loads entry ``key`` (yields whether it was a hit), points
        Inductor's cache directory into the cache (:meth:`inductor_dir`), and stores the
        entry after a miss (where :meth:`store` may)."""
        with self._inductor_cache_dir(), _fresh_artifact_record():
            facts = self._load(key)
            if facts is None:
                yield False
                self.store(key)
                return
            with facts.applied():
                yield True

    @contextlib.contextmanager
    def _inductor_cache_dir(self) -> Iterator[None]:
        """Inductor's cache directory is :meth:`inductor_dir` inside, unless the user chose
        one (theirs to choose, and to trust)."""
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        current = os.environ.get(_INDUCTOR_ENV)
        # Inductor writes its default into the environment on first use: that is not a choice.
        if current is not None and os.path.abspath(current) != os.path.abspath(default_cache_dir()):
            yield
            return
        os.environ[_INDUCTOR_ENV] = str(self.inductor_dir())
        try:
            yield
        finally:
            if current is None:
                os.environ.pop(_INDUCTOR_ENV, None)
            else:
                os.environ[_INDUCTOR_ENV] = current


@dataclasses.dataclass(frozen=True)
class HostFacts:
    """What compiling a graph taught Inductor about this machine that loading it would
    otherwise make Inductor learn again, once per process, before the first CPU piece runs.

    ``vec_isa``: the vector instruction set Inductor chose, by probing, for C++ kernels. To
    choose, it compiles a test library per instruction set the CPU reports and loads each
    in a fresh Python process (0.4 s on a 2-core AVX2 host, 1 s on an AVX-512 one, every
    process); the loaded pieces' libraries are built for the set chosen here.
    ``vec_isa_flags`` are that set's build flags and ``vec_isa_verdicts`` the probe's
    verdicts on its extensions that pick them (AVX-512's bf16 check, say). A process that
    loads the entry offers Inductor that set alone, unprobed, with those verdicts, when its
    CPU reports the set and every extension a verdict names, and the set rebuilt from them
    has the recorded flags: the libraries' keys stay the entry's. Otherwise, and always for
    AMX sets, Inductor probes as usual (:func:`_recorded_vec_isa`).
    """

    vec_isa: str | None = None
    vec_isa_flags: str | None = None
    vec_isa_verdicts: tuple[str, ...] = ()

    @classmethod
    def learnt(cls) -> HostFacts:
        """The facts this process has learnt so far by probing (none it would have to learn)."""
        isa_module = sys.modules.get("torch._inductor.cpu_vec_isa")
        probed = getattr(isa_module, "valid_vec_isa_list", None)
        if probed is None or not hasattr(probed, "cache_info") or probed.cache_info().currsize == 0:
            return cls()  # nothing chose an instruction set (no C++ kernels): nothing to keep
        try:
            from torch._inductor import config as inductor_config

            if inductor_config.cpp.vec_isa_ok is not None or inductor_config.is_fbcode():
                return cls()  # the set was taken on trust, not probed: not a fact for another process
            isa = isa_module.pick_vec_isa()
            return cls(vec_isa=str(isa), vec_isa_flags=str(isa.build_arch_flags()),
                       vec_isa_verdicts=tuple(sorted(_verdicts(isa))))
        except Exception:  # noqa: BLE001 - a fact not kept is learnt again by the next process
            return cls()

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, line: bytes) -> HostFacts | None:
        """The facts in an entry's first payload line; None when it is not such a line."""
        try:
            fields = json.loads(line)
        except ValueError:
            return None
        if not isinstance(fields, dict):
            return None
        isa, flags, verdicts = fields.get("vec_isa"), fields.get("vec_isa_flags"), fields.get("vec_isa_verdicts", [])
        if (not isinstance(isa, (str, type(None))) or not isinstance(flags, (str, type(None)))
                or not isinstance(verdicts, list) or not all(isinstance(v, str) for v in verdicts)):
            return None
        return cls(vec_isa=isa, vec_isa_flags=flags, vec_isa_verdicts=tuple(verdicts))

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Inside, while the entry's graph compiles from the caches it filled: Inductor takes
        these facts instead of learning them, and prepares no precompiled header. A header
        only speeds up building a library, and a hit's libraries are built; preparing one
        runs the C++ preprocessor over torch's headers (0.2 s a process), and a piece that
        still has to build compiles without it, to the same library.

        Both are Inductor's module functions swapped for the compile, not its config: its
        config is part of every key it looks up, which must stay the ones the entry holds.
        A torch without these functions compiles as it would without the facts."""
        try:
            from torch._inductor import codecache, cpu_vec_isa
        except ImportError:
            yield
            return
        # The swaps are process-wide: compiles from the cache in other threads wait.
        with _swap_lock, contextlib.ExitStack() as stack:
            if callable(getattr(codecache, "_precompile_header", None)):
                stack.enter_context(_swapped(codecache, "_precompile_header", _no_precompiled_header))
            if self.vec_isa is not None and stack.enter_context(_recorded_vec_isa(cpu_vec_isa, self)):
                count("vec_isa_known")
            yield


_swap_lock = threading.RLock()


def _no_precompiled_header(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def _swapped(module: types.ModuleType, name: str, value: Any) -> Iterator[None]:
    """``module.name`` is ``value`` inside (callers look it up when they call it)."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        if getattr(module, name) is value:
            setattr(module, name, original)


def _verdict_names(isa: Any) -> list[str]:
    """The probe verdicts an instruction set's class keeps on the set (``_is_..._supported``
    flags that its probe sets and its build flags read)."""
    return [name for name in dir(type(isa)) if name.startswith("_is_") and isinstance(getattr(type(isa), name), bool)]


def _verdicts(isa: Any) -> list[str]:
    """The verdicts that came out true on ``isa``."""
    return [name for name in _verdict_names(isa) if getattr(isa, name) is True]


def _cpu_confirms(verdict: str) -> bool:
    """Whether this CPU has the extension a probe verdict names: ``torch.cpu`` answers for
    each by the same name (``_is_avx512_bf16_supported``); a verdict it cannot answer for
    is not taken."""
    check = getattr(torch.cpu, verdict, None)
    try:
        return callable(check) and check() is True
    except Exception:  # noqa: BLE001 - not confirmed: Inductor probes
        return False


def probe_caches(classes: Any) -> list[Any]:
    """Inductor's per-process caches of probe results and verdicts on instruction sets of
    ``classes`` (and the classes they derive from): the cached methods they define, such as
    ``__bool__`` and ``is_avx512_bf16_supported``. Keyed by set, so a copy's entries answer
    for the set it copies."""
    found = {id(f): f for klass in {k for c in classes for k in c.__mro__} for f in vars(klass).values()
             if hasattr(f, "cache_clear") and hasattr(f, "cache_info")}
    return list(found.values())


#: The probe verdicts whose probes :func:`_recorded_vec_isa` knows how to answer from an
#: entry (the AVX-512 sets' bf16 check); a set with any other keeps Inductor's probe.
_ANSWERABLE_VERDICTS = frozenset({"_is_avx512_bf16_supported"})


@contextlib.contextmanager
def _recorded_vec_isa(cpu_vec_isa: types.ModuleType, facts: HostFacts) -> Iterator[bool]:
    """Inside, Inductor's ``valid_vec_isa_list`` offers only the x86 instruction set the
    facts record (see :class:`HostFacts`), unprobed: a copy of Inductor's set with the
    recorded verdicts on it, whose probe (should code generation ask, ``bool(set)``)
    answers from the entry; yields whether it does. It does not (Inductor probes as usual)
    when the user chose (``TORCHINDUCTOR_VEC_ISA_OK``, ``ATEN_CPU_CAPABILITY``,
    ``cpp.simdlen``), this process probed already (a probe's list or cached verdicts exist),
    this CPU does not report the set or an extension a verdict says it has, the set has
    verdicts other than the ones answered here, the copy's build flags are not the recorded
    ones, or the set is an AMX one (its probe is also what asks the kernel for the AMX
    registers, which AMX code needs). An entry without recorded flags offers only sets that
    have no verdicts. Inductor's own set objects are not changed, and its per-class caches
    of verdicts and probe results, empty on the way in, are emptied on the way out (a copy
    is equal to Inductor's set, so what it left there would answer for the real one; while
    the copy is offered, a probe in another thread shares those entries with it)."""
    from torch._inductor import config as inductor_config

    probed = getattr(cpu_vec_isa, "valid_vec_isa_list", None)
    base = getattr(cpu_vec_isa, "VecISA", None)
    if (base is None or not hasattr(probed, "cache_info") or probed.cache_info().currsize
            or inductor_config.cpp.vec_isa_ok is not None or inductor_config.cpp.simdlen is not None
            or os.environ.get("ATEN_CPU_CAPABILITY") or platform.machine() not in ("x86_64", "AMD64")):
        yield False
        return
    isa = next((i for i in getattr(cpu_vec_isa, "supported_vec_isa_list", ()) if str(i) == facts.vec_isa), None)
    try:
        reported = cpu_vec_isa.x86_isa_checker() if isa is not None else []
    except Exception:  # noqa: BLE001 - a torch without this machinery probes as usual
        reported = []
    if isa is None or "amx" in str(isa) or not all(flag in reported for flag in str(isa).split()):
        yield False
        return
    names = _verdict_names(isa)
    if facts.vec_isa_flags is None:  # an entry from before flags were recorded
        if names or not all(getattr(type(isa), f) is getattr(base, f) for f in ("__bool__", "build_arch_flags")):
            yield False
            return
    elif (not set(names) <= _ANSWERABLE_VERDICTS or not set(facts.vec_isa_verdicts) <= set(names)
          or not all(map(_cpu_confirms, facts.vec_isa_verdicts))):
        yield False
        return
    caches = probe_caches([type(isa)])
    if any(f.cache_info().currsize for f in caches):
        yield False
        return
    offered = copy.copy(isa)
    for name in names:
        setattr(offered, name, name in facts.vec_isa_verdicts)
    # The probe's answers as the entry recorded them: the set builds and loads, and bf16
    # (the one verdict answered, _ANSWERABLE_VERDICTS) as recorded.
    bf16_code = getattr(type(isa), "_avx512_bf16_code", None)
    has_bf16 = "_is_avx512_bf16_supported" in facts.vec_isa_verdicts
    offered.check_build = lambda code: code != bf16_code or has_bf16
    try:
        if facts.vec_isa_flags is not None and str(offered.build_arch_flags()) != facts.vec_isa_flags:
            yield False
            return
        with _swapped(cpu_vec_isa, "valid_vec_isa_list", functools.cache(lambda: [offered])):
            yield True
    finally:
        for f in caches:
            f.cache_clear()


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
