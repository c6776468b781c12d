"""Caches that run code trust only their owner: fullcg's cache directories are private,
and an entry or directory that someone else could have written is warned about once,
ignored and compiled anew, unless the cache is shared on purpose (``trust_shared_cache``)
or its entries are signed (``FULLCG_CACHE_KEY``)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import fullcg
from batches import run_steps_against_eager
from fullcg import cache_trust, compile_cache
from fullcg.compile_cache import CompileCache, cache_for
from fullcg.errors import ConfigTypeError, InvalidConfigError
from fullcg.models.llama import LlamaConfig, LlamaModel

pytestmark = pytest.mark.skipif(not hasattr(os, "geteuid"), reason="file ownership needs a POSIX system")

needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="giving a file to another user (os.chown) needs root; CI runs the tests as root",
)
OTHER_UID = 65534  # "nobody"
KEY = "0123456789abcdef-a-test-signing-key"
UNTRUSTED = "not trusting compile cache"

# One model pair for the whole file: the graph Dynamo hands over names the model's KV-cache
# owner, so only the same model compiles to the same graph, and so to the same entry.
_MODELS: tuple[LlamaModel, LlamaModel] | None = None


def _models() -> tuple[LlamaModel, LlamaModel]:
    global _MODELS
    if _MODELS is None:
        _MODELS = LlamaModel(LlamaConfig.tiny(num_layers=1), seed=0), LlamaModel(LlamaConfig.tiny(num_layers=1), seed=0)
        for m in _MODELS:
            m.allocate_kv_cache(64, 4)
    return _MODELS


def _cache_env(mp: pytest.MonkeyPatch) -> None:
    """The compile cache on, fullcg choosing Inductor's directory, no signing key (the suite
    sets the first two the other way)."""
    for name in ("FULLCG_DISABLE_COMPILE_CACHE", "TORCHINDUCTOR_CACHE_DIR", "FULLCG_CACHE_KEY",
                 "FULLCG_TRUST_SHARED_CACHE"):
        mp.delenv(name, raising=False)


def _compile_and_run(root: Path, **options) -> dict[str, int]:
    """Compile the tiny Llama with its cache in ``root``, run a prefill and a decode step,
    assert the logits equal eager ones, and return what the compile cache did."""
    torch._dynamo.reset()
    compile_cache.reset_cache_stats()
    model, reference = _models()
    options.setdefault("warm_start", False)  # the graphs' entries here; warm-start entries in their own test
    compiled = fullcg.compile(model, compiler="inductor", graph_mode="none", cache_dir=str(root), **options)
    run_steps_against_eager(model, compiled, reference, [([5], [0]), ([1], [5])])
    return dict(compile_cache.cache_stats())


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory) -> Iterator[Path]:
    """A cache fullcg made from nothing: one compile, one entry, Inductor's kernels."""
    root = tmp_path_factory.mktemp("warm") / "cache"
    with pytest.MonkeyPatch.context() as mp:
        _cache_env(mp)
        assert _compile_and_run(root) == {"miss": 1, "store": 1}
    yield root


@pytest.fixture
def cache(warm_cache, tmp_path, monkeypatch) -> Path:
    """A private copy of the warm cache, with the environment a user of it would have."""
    _cache_env(monkeypatch)
    root = tmp_path / "cache"
    shutil.copytree(warm_cache, root, symlinks=True)
    return root


@pytest.fixture
def loads(monkeypatch) -> list[int]:
    """Every entry handed to torch to deserialize (and so to run), by size."""
    seen: list[int] = []
    real = torch.compiler.load_cache_artifacts

    def spy(payload: bytes):
        seen.append(len(payload))
        return real(payload)

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", spy)
    return seen


def _entry(root: Path) -> Path:
    [entry] = (root / "graphs").iterdir()
    return entry


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if UNTRUSTED in r.getMessage()]


def test_a_fresh_cache_is_private_directories_0700_and_entries_0600(warm_cache):
    assert {p.name: _mode(p) for p in (warm_cache, warm_cache / "graphs", warm_cache / "inductor")} == {
        "cache": 0o700, "graphs": 0o700, "inductor": 0o700}
    assert _mode(_entry(warm_cache)) == 0o600


def test_a_copy_of_a_private_cache_is_trusted_and_loaded(cache, loads):
    assert _compile_and_run(cache) == {"hit": 1}
    assert len(loads) == 1


def test_a_warm_start_entry_is_checked_like_a_graph_entry(cache, caplog):
    assert _compile_and_run(cache, warm_start=True) == {"hit": 1, "warm_miss": 1, "warm_store": 1}
    assert _compile_and_run(cache, warm_start=True) == {"hit": 1, "warm_hit": 1}
    [entry] = (cache / "warm").iterdir()
    assert _mode(entry) == 0o600
    entry.chmod(0o666)
    with caplog.at_level(logging.WARNING, logger="fullcg"):
        stats = _compile_and_run(cache, warm_start=True)
    assert stats == {"hit": 1, "warm_untrusted": 1, "warm_store": 1}, "refused, traced with Dynamo, written anew"
    [warning] = _warnings(caplog)
    assert str(entry) in warning and "writable by its group and others" in warning
    assert _mode(entry) == 0o600, "the refused entry was ours: replaced by a private one"


def _world_writable_root(root: Path) -> Path:
    root.chmod(0o777)
    return root


def _group_writable_graphs(root: Path) -> Path:
    (root / "graphs").chmod(0o770)
    return root / "graphs"


def _entry_of_another_user(root: Path) -> Path:
    entry = _entry(root)
    os.chown(entry, OTHER_UID, OTHER_UID)
    return entry


def _group_writable_entry(root: Path) -> Path:
    entry = _entry(root)
    entry.chmod(0o660)
    return entry


@pytest.mark.parametrize("damage, reason, stats", [
    pytest.param(_world_writable_root, "writable by its group and others (mode 0777)",
                 {"untrusted": 1, "inductor_private": 1}, id="world-writable root"),
    pytest.param(_group_writable_graphs, "writable by its group (mode 0770)", {"untrusted": 1},
                 id="group-writable graphs"),
    pytest.param(_entry_of_another_user, f"owned by uid {OTHER_UID}", {"untrusted": 1},
                 id="entry owned by another uid", marks=needs_root),
    pytest.param(_group_writable_entry, "writable by its group (mode 0660)", {"untrusted": 1, "store": 1},
                 id="group-writable entry"),
])
def test_what_someone_else_could_have_written_is_warned_about_once_ignored_and_recompiled(
        cache, loads, caplog, damage, reason, stats):
    entry = _entry(cache)
    before = entry.read_bytes()
    culprit = damage(cache)
    with caplog.at_level(logging.WARNING, logger="fullcg"):
        assert _compile_and_run(cache) == stats, "compiled anew, the logits equal eager ones"
    assert loads == [], "the untrusted entry was never deserialized"
    [warning] = _warnings(caplog)
    assert str(culprit) in warning and reason in warning and "To fix:" in warning
    if damage is _group_writable_entry:  # ours: replaced by a private entry
        assert _mode(entry) == 0o600 and entry.stat().st_uid == os.geteuid()
    else:  # not ours, or under a directory not trusted: left exactly as it was
        assert entry.read_bytes() == before
        assert _entry(cache) == entry


@pytest.mark.parametrize("how", ["config", "environment"])
def test_a_cache_shared_on_purpose_is_trusted_as_it_is(cache, loads, caplog, monkeypatch, how):
    _world_writable_root(cache)
    _group_writable_graphs(cache)
    _group_writable_entry(cache)
    (cache / "inductor").chmod(0o777)
    if os.geteuid() == 0:
        _entry_of_another_user(cache)
    if how == "environment":
        monkeypatch.setenv("FULLCG_TRUST_SHARED_CACHE", "1")
    options = {"trust_shared_cache": True} if how == "config" else {}
    with caplog.at_level(logging.WARNING, logger="fullcg"):
        assert _compile_and_run(cache, **options) == {"hit": 1}
    assert len(loads) == 1 and _warnings(caplog) == []


def _tamper(entry: Path) -> None:
    """Change the payload and recompute its checksum: what the checksum alone cannot catch."""
    magic, key, _, signature, payload = entry.read_bytes().split(b"\n", 4)
    payload = payload[:-1] + bytes([payload[-1] ^ 0xFF])
    digest = hashlib.sha256(payload).hexdigest().encode()
    entry.write_bytes(b"\n".join([magic, key, digest, signature, payload]))


def test_with_a_key_entries_are_signed_and_a_tampered_one_is_refused(cache, loads, caplog, monkeypatch):
    monkeypatch.setenv("FULLCG_CACHE_KEY", KEY)
    entry = _entry(cache)
    entry.unlink()
    assert _compile_and_run(cache) == {"miss": 1, "store": 1}
    magic, key, _, signature, payload = entry.read_bytes().split(b"\n", 4)
    assert cache_trust.verify(KEY.encode(), signature, magic + b"\n" + key + b"\n", payload), "stored signed"
    assert _compile_and_run(cache) == {"hit": 1}
    _tamper(entry)
    with caplog.at_level(logging.WARNING, logger="fullcg"):
        assert _compile_and_run(cache) == {"untrusted": 1, "store": 1}, "refused, compiled anew, stored signed"
    assert len(loads) == 1, "the tampered entry was never deserialized"
    [warning] = _warnings(caplog)
    assert str(entry) in warning and "not signed with the key in FULLCG_CACHE_KEY" in warning


def test_with_a_key_a_signed_entry_is_trusted_whoever_can_write_to_it(cache, loads, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache.parent / "loader"))
    entry = _entry(cache)
    _, key, _, _, payload = entry.read_bytes().split(b"\n", 4)
    compile_cache.reset_cache_stats()
    assert not CompileCache(cache, secret=KEY.encode()).load(entry.stem), "unsigned, though private: refused"
    entry.write_bytes(compile_cache._encode_entry(key.decode(), payload, KEY.encode()))
    entry.chmod(0o666)
    _world_writable_root(cache)
    _group_writable_graphs(cache)
    if os.geteuid() == 0:
        _entry_of_another_user(cache)
    assert not CompileCache(cache).load(entry.stem), "without the key: refused"
    assert CompileCache(cache, secret=KEY.encode()).load(entry.stem), "with it: the signature vouches"
    assert not CompileCache(cache, secret=b"another-key-of-16-chars").load(entry.stem), "another key: refused"
    assert compile_cache.cache_stats() == {"untrusted": 3, "hit": 1}
    assert len(loads) == 1


def test_the_inductor_directory_handed_to_torch_is_checked_too(cache, caplog, monkeypatch):
    (cache / "inductor").chmod(0o777)
    key = _entry(cache).stem
    compile_cache.reset_cache_stats()
    with caplog.at_level(logging.WARNING, logger="fullcg"), CompileCache(cache).session(key) as hit:
        handed = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    assert handed != cache / "inductor" and not handed.is_relative_to(cache)
    assert _mode(handed) == 0o700 and handed.stat().st_uid == os.geteuid(), "a private directory of this process"
    assert hit, "the trusted entry still loads, into the private directory"
    assert compile_cache.cache_stats() == {"hit": 1, "inductor_private": 1}
    [warning] = _warnings(caplog)
    assert str(cache / "inductor") in warning and "writable by its group and others" in warning
    # A directory the user chose is theirs: fullcg neither checks nor replaces it.
    mine = cache.parent / "mine"
    mine.mkdir()
    mine.chmod(0o777)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(mine))
    with CompileCache(cache).session(key):
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(mine)


def test_every_load_checks_the_entry_as_it_is_then(cache, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache.parent / "loader"))
    entry, loader = _entry(cache), CompileCache(cache)
    assert loader.load(entry.stem)
    entry.chmod(0o666)
    assert not loader.load(entry.stem), "a file changed after an earlier check is judged anew"


def test_an_older_format_is_a_clean_miss_its_entries_are_never_looked_up(tmp_path, monkeypatch):
    gm, config, x = torch.fx.symbolic_trace(torch.nn.Linear(4, 4)), fullcg.FullCGConfig(), torch.zeros(2, 4)
    with monkeypatch.context() as mp:
        mp.setattr(compile_cache, "_FORMAT", compile_cache._FORMAT - 1)
        old_key = CompileCache(tmp_path).key(gm, [x], config, "u")
    assert CompileCache(tmp_path).key(gm, [x], config, "u") != old_key


def test_check_path_names_the_first_path_that_fails_and_why(tmp_path):
    root = tmp_path / "root"
    deep = root / "a" / "b"
    cache_trust.make_cache_dir(deep)
    assert cache_trust.check_path(root, deep / "entry.bin") is None, "a missing entry: nothing to distrust"
    (root / "a").chmod(0o757)
    deep.chmod(0o770)
    assert cache_trust.check_path(root, deep) == cache_trust.Untrusted(root / "a", "writable by others (mode 0757)")


def test_make_cache_dir_creates_every_missing_directory_0700_and_leaves_existing_ones(tmp_path):
    tmp_path.chmod(0o755)
    cache_trust.make_cache_dir(tmp_path / "x" / "y" / "z")
    assert [_mode(tmp_path / p) for p in ("x", "x/y", "x/y/z")] == [0o700] * 3
    assert _mode(tmp_path) == 0o755


def test_the_options_are_validated_and_read_when_a_graph_is_compiled(tmp_path, monkeypatch):
    with pytest.raises(ConfigTypeError, match="trust_shared_cache must be True or False"):
        fullcg.FullCGConfig(trust_shared_cache="yes")
    monkeypatch.delenv("FULLCG_DISABLE_COMPILE_CACHE")
    monkeypatch.delenv("FULLCG_TRUST_SHARED_CACHE", raising=False)
    monkeypatch.delenv("FULLCG_CACHE_KEY", raising=False)
    config = fullcg.FullCGConfig(cache_dir=tmp_path)
    cache = cache_for(config)
    assert not cache.trust_shared and cache.secret is None, "private by default"
    assert cache_for(config.replace(trust_shared_cache=True)).trust_shared
    monkeypatch.setenv("FULLCG_TRUST_SHARED_CACHE", "1")
    assert cache_for(config).trust_shared
    monkeypatch.setenv("FULLCG_TRUST_SHARED_CACHE", "sure")
    with pytest.raises(InvalidConfigError, match="FULLCG_TRUST_SHARED_CACHE must be 0 or 1"):
        cache_for(config)
    monkeypatch.delenv("FULLCG_TRUST_SHARED_CACHE")
    monkeypatch.setenv("FULLCG_CACHE_KEY", f"  {KEY}\n")
    assert cache_for(config).secret == KEY.encode()
    monkeypatch.setenv("FULLCG_CACHE_KEY", "short")
    with pytest.raises(InvalidConfigError, match="FULLCG_CACHE_KEY must be at least 16 characters"):
        cache_for(config)
