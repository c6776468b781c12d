"""Whom a cache that runs code trusts: you, and root.

Loading a compile-cache entry unpickles it and runs the code it holds, and Inductor runs
whatever it finds in its cache directory. Whoever can write to either can run code in the
process that loads it, so fullcg keeps its caches private and checks them before use:

- **Private by default.** Every directory fullcg creates for a cache (:func:`make_cache_dir`)
  is mode 0700, every entry 0600 (:func:`entry_mode`). Sharing, opted into with
  ``trust_shared_cache`` or a signing key, leaves directory modes to the umask and makes
  entries 0644, for the others to read.
- **Checked before use.** :func:`check_path` stats each directory from the cache root down
  to a path, and :func:`why_untrusted` judges one ``stat`` result: trusted when owned by the
  current user or by root (a read-only cache baked into an image) and writable by neither
  group nor others. A directory that passes lets nobody else add or replace what is inside
  it, so the chain from the root down vouches for the entry at its end; the entry itself is
  judged on the file descriptor it is read from, so a file swapped in after the check is
  never the one that is loaded.
- **Signed, for a shared cache.** With a secret in ``FULLCG_CACHE_KEY``
  (:func:`secret_from_env`) every entry carries an HMAC-SHA256 (:func:`sign`), and an entry
  is trusted exactly when it verifies (:func:`verify`), whoever wrote the file.

A check is a handful of ``os.stat`` calls, microseconds; nothing is cached between checks,
so a path changed after an earlier check is judged as it is now.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import os
import shutil
import stat
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

from fullcg.errors import InvalidConfigError

__all__ = [
    "ENV_CACHE_KEY",
    "MIN_KEY_LENGTH",
    "Untrusted",
    "check_path",
    "entry_mode",
    "make_cache_dir",
    "owned_by_me",
    "private_dir",
    "secret_from_env",
    "sign",
    "verify",
    "why_untrusted",
]

ENV_CACHE_KEY = "FULLCG_CACHE_KEY"
#: A shorter key can be guessed; 32 random bytes as hex (64 characters) is the suggestion.
MIN_KEY_LENGTH = 16

_private_dirs: dict[str, Path] = {}
_private_lock = threading.Lock()


class Untrusted(NamedTuple):
    """A path that failed the check, and why (``reason`` reads after "it is")."""

    path: Path
    reason: str


def _describe_uid(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def owned_by_me(st: os.stat_result) -> bool:
    """Whether the current (effective) user owns what ``st`` describes."""
    return not hasattr(os, "geteuid") or st.st_uid == os.geteuid()


def why_untrusted(st: os.stat_result) -> str | None:
    """Why a file or directory with this ``stat`` result must not be trusted, or None.

    Trusted: owned by the current user or by root, and writable by neither its group nor
    others. Without POSIX ownership (no ``os.geteuid``) everything is trusted.
    """
    if not hasattr(os, "geteuid"):
        return None
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return f"owned by {_describe_uid(st.st_uid)}, not by you ({_describe_uid(me)}) or root"
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable:
        who = {stat.S_IWGRP: "its group", stat.S_IWOTH: "others"}.get(writable, "its group and others")
        return f"writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def check_path(root: Path, path: Path) -> Untrusted | None:
    """The first of ``root`` and each path below it down to ``path`` (included) that fails
    :func:`why_untrusted`, or None when all pass.

    The walk stops, trusting, at the first path that does not exist: nothing can be loaded
    from below it, and a trusted directory above it lets nobody else create it later.
    ``path`` must be ``root`` or lie below it.
    """
    # Strings, not pathlib: a check runs on every load, and pathlib's joins cost more than the stats.
    top, bottom = os.fspath(root), os.fspath(path)
    rest = bottom[len(top):]
    if not bottom.startswith(top) or (rest and not rest.startswith(os.sep) and not top.endswith(os.sep)):
        raise ValueError(f"{bottom} is not inside the cache root {top}")
    current = top
    for part in (None, *filter(None, rest.split(os.sep))):
        if part is not None:
            current = os.path.join(current, part)
        try:
            st = os.stat(current)
        except OSError:
            # Missing, or not even visible to this user: nothing below it can be opened either.
            return None
        reason = why_untrusted(st)
        if reason is not None:
            return Untrusted(Path(current), reason)
    return None


def make_cache_dir(path: Path, *, shared: bool = False) -> Path:
    """Create ``path`` and any missing directory above it, each mode 0700 (``shared``: as
    the umask allows, for a cache others use too); existing ones are left as they are.

    For every cache directory fullcg makes: ``mkdir -p`` would give the parents the
    umask's mode (typically 0755), and Inductor's own ``makedirs`` would do the same.
    """
    mode = 0o777 if shared else 0o700
    missing: list[Path] = []
    p = path
    while not os.path.isdir(p):
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            pass  # another process made it first; the checks judge it like any other
    return path


def usable_dir(root: Path, path: Path, *, trust_shared: bool, shared_modes: bool) -> Path | Untrusted | str:
    """``path`` (below ``root``), created if missing, when it passes :func:`check_path`
    (unless ``trust_shared``) and this user can write to it; else why not: the
    :class:`Untrusted` path, or a sentence (it cannot be created, it is read-only).
    ``shared_modes``: create it with the umask's modes (:func:`make_cache_dir`)."""
    # Checked before creating it (nothing is made inside an untrusted root) and after
    # (whoever made it first, this process or another).
    for _ in range(2):
        problem = None if trust_shared else check_path(root, path)
        if problem is not None:
            return problem
        if os.path.isdir(path):  # False, not an error, where it cannot even be looked at
            break
        try:
            make_cache_dir(path, shared=shared_modes)
        except OSError as exc:
            return f"cannot create {path} ({exc})"
    # As the effective user, the one whose files will be written (and the one checked above).
    effective = os.access in os.supports_effective_ids
    if not os.access(path, os.W_OK | os.X_OK, effective_ids=effective):  # a read-only cache baked into an image
        return f"{path} is read-only"
    return path


def entry_mode(shared: bool = False) -> int:
    """The mode an entry file is written with: 0600, or 0644 for a cache others read too
    (only the writer may change it either way; others replace it only through the directory)."""
    return 0o644 if shared else 0o600


def private_dir(purpose: str) -> Path:
    """A directory only this process uses (mode 0700, removed at exit), one per ``purpose``:
    where a cache goes when the shared one cannot be trusted or written."""
    with _private_lock:
        directory = _private_dirs.get(purpose)
        if directory is None or not os.path.isdir(directory):
            directory = Path(tempfile.mkdtemp(prefix=f"fullcg-{purpose}-"))  # mkdtemp: 0700, a fresh name
            atexit.register(shutil.rmtree, directory, True)
            _private_dirs[purpose] = directory
        return directory


def secret_from_env() -> bytes | None:
    """The signing key in ``FULLCG_CACHE_KEY`` (stripped), or None when unset or blank.

    Raises :class:`~fullcg.errors.InvalidConfigError` for a key shorter than
    :data:`MIN_KEY_LENGTH` characters.
    """
    raw = os.environ.get(ENV_CACHE_KEY, "").strip()
    if not raw:
        return None
    if len(raw) < MIN_KEY_LENGTH:
        raise InvalidConfigError(
            f"{ENV_CACHE_KEY} must be at least {MIN_KEY_LENGTH} characters, got {len(raw)}: a short key can be "
            "guessed, and whoever guesses it can run code in every process that loads the cache. Use a random one, "
            "for example the output of python -c 'import secrets; print(secrets.token_hex(32))'"
        )
    return raw.encode()


def sign(secret: bytes, *parts: bytes) -> str:
    """HMAC-SHA256 of ``parts`` (concatenated) under ``secret``, as 64 hex digits."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.hexdigest()


def verify(secret: bytes, signature: bytes | str, *parts: bytes) -> bool:
    """Whether ``signature`` is :func:`sign` of ``parts`` under ``secret`` (constant time)."""
    if isinstance(signature, bytes):
        try:
            signature = signature.decode("ascii")
        except UnicodeDecodeError:
            return False
    return hmac.compare_digest(sign(secret, *parts), signature)
