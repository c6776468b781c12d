"""Compiling with Inductor starts hashing torch's and Triton's sources at once, off the first
step's path; the first use of either key finds it done or waits for it."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
import torch
from torch._inductor import codecache

import fullcg
from fullcg import source_keys


class _PrefetchableKey:
    """A key as torch >= 2.13 wraps it: a cache with ``prefetch``."""

    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def prefetch(self) -> None:
        self.calls.append(self.name)

    def clear(self) -> None:
        pass

    def __call__(self) -> bytes:
        raise AssertionError("prefetch must not compute the key on the caller's thread")


@pytest.fixture
def fresh(monkeypatch):
    """A process that has not prefetched yet."""
    monkeypatch.setattr(source_keys, "_started", False)
    monkeypatch.setattr(source_keys, "_triton_started", False)
    monkeypatch.setattr(source_keys, "_triton_thread", None)
    yield
    thread = source_keys._triton_thread  # a test's background thread ends before the next test patches Triton
    if thread is not None:
        thread.join(30)


def _triton_key_spy(monkeypatch) -> tuple[list[str], threading.Event]:
    """Triton's key replaced by one that notes the thread computing it."""
    triton_cache = pytest.importorskip("triton.runtime.cache")
    threads: list[str] = []
    done = threading.Event()

    def triton_key() -> str:
        threads.append(threading.current_thread().name)
        done.set()
        return "triton"

    monkeypatch.setattr(triton_cache, "triton_key", triton_key)
    return threads, done


def test_compiling_with_inductor_prefetches_both_keys_before_the_first_step(fresh, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(codecache, "torch_key", _PrefetchableKey("torch", calls))
    monkeypatch.setattr(codecache, "triton_key", _PrefetchableKey("triton", calls), raising=False)
    fullcg.compile(torch.nn.Linear(2, 2))
    assert calls == ["torch", "triton"]
    fullcg.compile(torch.nn.Linear(2, 2))
    assert calls == ["torch", "triton"], "once per process"


@pytest.mark.parametrize("compiler", ["eager", "none"])
def test_compilers_without_inductor_do_not_hash_its_sources(fresh, monkeypatch, compiler):
    calls: list[str] = []
    monkeypatch.setattr(codecache, "torch_key", _PrefetchableKey("torch", calls))
    fullcg.compile(torch.nn.Linear(2, 2), compiler=compiler)
    assert calls == [] and not source_keys._started


def test_the_first_attention_layer_in_a_process_using_cuda_hashes_tritons_sources_in_the_background(fresh, monkeypatch):
    # Without Inductor, Triton's key is what the first kernel lookup waits for; the layers
    # are made before the weights are loaded, so the hash runs meanwhile.
    threads, done = _triton_key_spy(monkeypatch)
    monkeypatch.setattr(source_keys, "_cuda_in_use", lambda: True)
    fullcg.Attention(2, 8, layer_id=0)
    assert done.wait(30), "Triton's key was not computed"
    first = source_keys._triton_thread
    fullcg.Attention(2, 8, layer_id=1)
    assert source_keys._triton_thread is first, "once per process"
    source_keys.wait_for_triton()
    assert threads == ["fullcg-triton-key"], "on a thread of its own"


def test_the_background_thread_also_makes_tritons_driver(fresh, monkeypatch):
    # Its first use builds (on a fresh machine) and loads a C module: off the first step's path too.
    threads, _ = _triton_key_spy(monkeypatch)
    driver_module = pytest.importorskip("triton.runtime.driver")
    made: list[str] = []
    monkeypatch.setattr(type(driver_module.driver), "active",
                        property(lambda self: made.append(threading.current_thread().name)), raising=False)
    monkeypatch.setattr(source_keys, "_cuda_in_use", lambda: True)
    source_keys.prefetch_triton()
    source_keys.wait_for_triton()
    assert threads == ["fullcg-triton-key"] and made == ["fullcg-triton-key"]


def test_without_cuda_in_use_no_layer_hashes_tritons_sources(fresh, monkeypatch):
    threads, _ = _triton_key_spy(monkeypatch)
    monkeypatch.setattr(source_keys, "_cuda_in_use", lambda: False)
    fullcg.Attention(2, 8, layer_id=0)
    assert source_keys._triton_thread is None and threads == []


def test_a_process_that_prefetched_both_keys_does_not_hash_tritons_again(fresh, monkeypatch):
    threads, _ = _triton_key_spy(monkeypatch)
    monkeypatch.setattr(source_keys, "_cuda_in_use", lambda: True)
    monkeypatch.setattr(source_keys, "_started", True)
    source_keys.prefetch_triton()
    assert source_keys._triton_thread is None and threads == []


def test_keys_without_a_prefetch_of_their_own_are_computed_on_a_background_thread(fresh, monkeypatch):
    # torch 2.11 calls Triton's key directly, an lru_cache without prefetch.
    threads: list[str] = []
    done = threading.Event()

    def torch_key() -> bytes:
        threads.append(threading.current_thread().name)
        return b"torch"

    def triton_key() -> str:
        threads.append(threading.current_thread().name)
        done.set()
        return "triton"

    monkeypatch.setattr(codecache, "torch_key", torch_key)
    monkeypatch.setattr(codecache, "triton_key", triton_key, raising=False)
    source_keys.prefetch()
    assert done.wait(30), "the keys were not computed"
    assert threads == ["fullcg-source-keys"] * 2


def test_a_key_that_fails_in_the_background_is_left_to_its_first_use(fresh, monkeypatch, caplog):
    done = threading.Event()

    def broken() -> bytes:
        raise OSError("source file vanished")

    def last() -> str:
        done.set()
        return "triton"

    monkeypatch.setattr(codecache, "torch_key", broken)
    monkeypatch.setattr(codecache, "triton_key", last, raising=False)
    with caplog.at_level(logging.DEBUG, logger="fullcg.source_keys"):
        source_keys.prefetch()
        assert done.wait(30), "a failing key must not stop the next one"
    assert "source file vanished" in caplog.text


@pytest.mark.skipif(hasattr(codecache, "triton_key"), reason="torch >= 2.13 wraps Triton's key in its own cache")
def test_on_torch_2_11_the_thread_fills_the_triton_key_inductor_reads(fresh, monkeypatch):
    triton_cache = pytest.importorskip("triton.runtime.cache")
    from torch._inductor.runtime import triton_compat

    assert triton_compat.triton_key is triton_cache.triton_key, "Inductor reads Triton's own cached key"
    monkeypatch.setattr(codecache, "torch_key", lambda: b"torch")  # the cheap one: this test is about Triton's
    triton_cache.triton_key.cache_clear()
    source_keys.prefetch()
    deadline = time.monotonic() + 120
    while triton_cache.triton_key.cache_info().currsize == 0:
        assert time.monotonic() < deadline, "Triton's key was never computed"
        time.sleep(0.05)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_before_the_keys_arrive_computes_them_itself(fresh, monkeypatch):
    prefetchable_cache = getattr(pytest.importorskip("torch.utils._functools"), "prefetchable_cache", None)
    if prefetchable_cache is None:
        pytest.skip("torch 2.11 caches its keys without a background prefetch: a child computes them anyway")

    @prefetchable_cache
    def slow_key() -> bytes:
        time.sleep(2)
        return b"key"

    monkeypatch.setattr(codecache, "torch_key", slow_key)
    monkeypatch.setattr(codecache, "triton_key", _PrefetchableKey("triton", []), raising=False)
    monkeypatch.setattr(source_keys, "_prefetched", [])
    source_keys.prefetch()
    pid = os.fork()
    if pid == 0:  # the child: without the fork hook it would wait forever for the parent's thread
        signal.alarm(20)
        os._exit(0 if slow_key() == b"key" else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"the child hung or failed (status {status})"
    assert slow_key() == b"key"


def test_a_kernel_build_waits_for_the_background_hash_instead_of_hashing_beside_it(fresh, monkeypatch):
    triton_cache = pytest.importorskip("triton.runtime.cache")
    release = threading.Event()
    calls: list[str] = []

    def slow_key() -> str:
        calls.append(threading.current_thread().name)
        release.wait(30)
        return "triton"

    monkeypatch.setattr(triton_cache, "triton_key", slow_key)
    monkeypatch.setattr(source_keys, "_cuda_in_use", lambda: True)
    source_keys.prefetch_triton()
    waiter = threading.Thread(target=source_keys.wait_for_triton)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "waits while the key is being computed"
    release.set()
    waiter.join(30)
    assert not waiter.is_alive() and calls == ["fullcg-triton-key"]
    source_keys.wait_for_triton()  # done: returns at once


def test_a_process_not_yet_using_cuda_is_left_so_until_a_kv_cache_lands_on_a_gpu(fresh, monkeypatch):
    # Asking whether CUDA is available initialises it, which a parent that builds a model
    # and then forks workers must not have done: a layer made before CUDA is in use starts
    # nothing; the first KV cache on a GPU does.
    threads, done = _triton_key_spy(monkeypatch)
    asked: list[bool] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(True) or True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    fullcg.Attention(2, 8, layer_id=0)
    assert asked == [] and threads == []

    class GpuTensor(torch.Tensor):
        is_cuda = True

    monkeypatch.setattr(source_keys, "_cuda_in_use", lambda: True)
    from fullcg.kv_cache import KVCache

    KVCache(torch.zeros(1, 1, 1, 8).as_subclass(GpuTensor), torch.zeros(1, 1, 1, 8))
    assert done.wait(30) and threads == ["fullcg-triton-key"]
