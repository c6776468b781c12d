"""The forward context is per thread and belongs to one model.

Two threads stepping two models at once see only their own batch and caches, eager and
compiled; a context entered with one model never lets another model's step write into
its caches.
"""

from __future__ import annotations

import threading

import pytest
import torch

import fullcg
from fullcg.models.generate import Scheduler
from fullcg.models.llama import LlamaConfig, LlamaModel

PROMPTS = {0: [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10]], 1: [[20, 21], [22, 23, 24, 25, 26, 27, 28, 29, 30], [31]]}
NEW_TOKENS = 5


def _model(seed: int) -> LlamaModel:
    model = LlamaModel(LlamaConfig.tiny(), seed=seed)
    model.allocate_kv_cache(num_pages=32, page_size=4)
    return model


def _steps(model: torch.nn.Module, run, prompts, barrier: threading.Barrier | None = None) -> list[torch.Tensor]:
    """Greedy generation, chunked prefill of 3 tokens: the logits of every step."""
    sched = Scheduler(prompts, NEW_TOKENS, num_pages=32, page_size=4, prefill_chunk=3)
    logits = []
    while (step := sched.next_step()) is not None:
        with fullcg.forward_context(step.metadata, model), torch.inference_mode():
            if barrier is not None:
                barrier.wait()  # both threads are inside their contexts before either runs
            out = run(step.input_ids, step.positions).clone()
        logits.append(out)
        sched.commit(step, out)
    return logits


def _run_concurrently(jobs) -> list[list[torch.Tensor]]:
    """Run each job in its own thread, all at once; re-raise the first failure."""
    results: list = [None] * len(jobs)
    errors: list[BaseException] = []

    def target(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    return results


def _assert_same_steps(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_two_threads_with_two_models_each_get_what_running_alone_gives(compiled):
    torch._dynamo.reset()
    models = {i: _model(seed=i) for i in (0, 1)}
    config = fullcg.FullCGConfig(graph_mode="piecewise", compiler="eager")
    runs = {i: torch.compile(m, backend=fullcg.Backend(config)) if compiled else m for i, m in models.items()}
    alone = {i: _steps(models[i], runs[i], PROMPTS[i]) for i in (0, 1)}  # also compiles both
    for m in models.values():  # the same caches (a new cache would be a new graph), emptied
        for layer in m.attention_layers():
            layer.kv_cache.k.zero_()
            layer.kv_cache.v.zero_()
    barrier = threading.Barrier(2, timeout=120)
    together = _run_concurrently([lambda i=i: _steps(models[i], runs[i], PROMPTS[i], barrier) for i in (0, 1)])
    for i in (0, 1):
        _assert_same_steps(together[i], alone[i])


def test_a_thread_without_a_context_never_sees_another_threads_context():
    model = _model(seed=0)
    md = fullcg.AttentionMetadata.build([3], [0], torch.arange(8, dtype=torch.int32)[None], 4)
    entered, checked = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def holder() -> None:
        with fullcg.forward_context(md, model):
            entered.set()
            checked.wait(timeout=60)

    def other() -> None:
        entered.wait(timeout=60)
        seen["has_context"] = fullcg.context.has_forward_context()
        try:
            with torch.inference_mode():
                model(torch.tensor([1, 2, 3]), torch.arange(3))
        except RuntimeError as exc:
            seen["error"] = str(exc)
        checked.set()

    _run_concurrently([holder, other])
    assert seen["has_context"] is False
    assert "no forward context is active" in seen["error"]


def test_leaving_a_context_in_one_thread_leaves_the_other_threads_context_alone():
    md_a = fullcg.AttentionMetadata.build([3], [0], torch.arange(8, dtype=torch.int32)[None], 4)
    md_b = fullcg.AttentionMetadata.build([1, 1], [2, 5], torch.arange(8, dtype=torch.int32).view(2, 4), 4)
    a_left, b_entered = threading.Event(), threading.Event()
    seen = {}

    def a() -> None:
        with fullcg.forward_context(md_a):
            b_entered.wait(timeout=60)
        a_left.set()

    def b() -> None:
        with fullcg.forward_context(md_b):
            b_entered.set()
            a_left.wait(timeout=60)
            seen["metadata"] = fullcg.get_forward_context().metadata

    _run_concurrently([a, b])
    assert seen["metadata"] is md_b


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_context_entered_with_another_model_is_an_error_and_writes_nothing(compiled):
    torch._dynamo.reset()
    running, other = _model(seed=0), _model(seed=1)
    for layer in other.attention_layers():
        layer.kv_cache.k.normal_()
        layer.kv_cache.v.normal_()
    before = [(layer.kv_cache.k.clone(), layer.kv_cache.v.clone()) for layer in other.attention_layers()]
    config = fullcg.FullCGConfig(graph_mode="piecewise", compiler="eager")
    run = torch.compile(running, backend=fullcg.Backend(config)) if compiled else running
    md = fullcg.AttentionMetadata.build([3], [0], torch.arange(8, dtype=torch.int32)[None], 4)
    ids, pos = torch.tensor([1, 2, 3]), torch.arange(3)
    with torch.inference_mode(), fullcg.forward_context(md, other):
        with pytest.raises(RuntimeError, match=r"(?s)owns KV cache #\d+, but the forward context was entered with "
                                               r"LlamaModel .*another model"):
            run(ids, pos)
    for layer, (k, v) in zip(other.attention_layers(), before):
        assert torch.equal(layer.kv_cache.k, k) and torch.equal(layer.kv_cache.v, v), "the other model's cache is intact"


def test_a_copied_model_has_caches_of_its_own():
    import copy

    model = _model(seed=0)
    twin = copy.deepcopy(model)
    for a, b in zip(model.attention_layers(), twin.attention_layers()):
        assert a.kv_cache.uid != b.kv_cache.uid and a.kv_cache.k.data_ptr() != b.kv_cache.k.data_ptr()
    md = fullcg.AttentionMetadata.build([2], [0], torch.arange(8, dtype=torch.int32)[None], 4)
    with torch.inference_mode(), fullcg.forward_context(md, model), pytest.raises(RuntimeError, match="another model"):
        twin(torch.tensor([1, 2]), torch.arange(2))
