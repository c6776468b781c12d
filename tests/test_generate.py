"""fullcg.generate and its continuous-batching scheduler."""

from __future__ import annotations

import pytest
import torch

import fullcg
from fullcg.engine import BatchScheduler, Sampler
from fullcg.models.generate import greedy_generate
from fullcg.models.llama import LlamaConfig, LlamaModel

PROMPTS = [list(range(3, 16)), [7, 19, 31, 43, 55], [11, 23, 35], [90, 91, 92, 93, 94, 95, 96]]
EAGER = fullcg.FullCGConfig(compiler="eager", graph_mode="full_and_piecewise")


def _llama(num_pages: int = 64, page_size: int = 4) -> LlamaModel:
    model = LlamaModel(LlamaConfig.tiny(), seed=0)
    model.allocate_kv_cache(num_pages=num_pages, page_size=page_size)
    return model


def _drive(sched: BatchScheduler, token: int = 5) -> list:
    """Run the scheduler to the end without a model (every sampled token is ``token``); the steps."""
    steps = []
    while (step := sched.next_step()) is not None:
        steps.append(step)
        sched.advance(step, [token if r is not None else None for r in step.sample_rows])
    return steps


# --- the scheduler ---


def test_no_step_exceeds_the_token_budget_and_every_decoding_request_gets_its_token_first():
    sched = BatchScheduler(PROMPTS, 4, num_pages=64, page_size=4, max_num_tokens=6)
    while (step := sched.next_step()) is not None:
        decoding = [r for r in sched.running if not r.in_prompt]
        assert step.metadata.num_tokens <= 6
        assert all(r in step.requests for r in decoding)  # prompts only get what decodes leave
        sched.advance(step, [5 if r is not None else None for r in step.sample_rows])


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks():
    sched = BatchScheduler([list(range(1, 14))], 2, num_pages=16, page_size=4, max_num_tokens=5)
    steps = _drive(sched)
    assert [(s.modes[0].value, s.metadata.query_lens[0]) for s in steps[:3]] == [
        ("prefill", 5), ("extend", 5), ("extend", 3)]
    assert steps[2].sample_rows == [2] and steps[0].sample_rows == [None]  # a token only once the prompt is in


def test_requests_join_as_others_finish_within_the_request_limit():
    sched = BatchScheduler(PROMPTS, [2, 6, 3, 2], num_pages=64, page_size=4, max_num_seqs=2)
    seen_together = []
    while (step := sched.next_step()) is not None:
        assert len(step.requests) <= 2
        seen_together.append({sched.requests.index(r) for r in step.requests})
        sched.advance(step, [5 if r is not None else None for r in step.sample_rows])
    assert seen_together[0] == {0, 1}
    assert {1, 2} in seen_together  # request 2 joined when request 0 finished, while 1 still ran
    assert [len(r.generated) for r in sched.requests] == [2, 6, 3, 2]


def test_pages_of_finished_requests_are_freed_and_reused():
    # Room for one request at a time: each needs 3 or 4 of the 4 pages (prompt + 3 cached new tokens).
    long_prompts = [list(range(1, 10)), list(range(20, 33)), list(range(40, 50))]
    sched = BatchScheduler(long_prompts, 4, num_pages=4, page_size=4)
    pages_seen = []
    while (step := sched.next_step()) is not None:
        assert len(step.requests) == 1
        pages_seen.append(tuple(step.requests[0].pages))
        sched.advance(step, [5 if r is not None else None for r in step.sample_rows])
    assert set(pages_seen[-1]) & set(pages_seen[0])  # the last request runs on pages the first one freed
    assert sched.num_free_pages == 4 and all(r.pages == [] for r in sched.requests)


def test_a_stop_token_ends_a_request_and_is_kept():
    sched = BatchScheduler([[1, 2, 3]], 10, num_pages=8, page_size=4, stop_token_ids=[5])
    _drive(sched, token=5)
    assert sched.requests[0].generated == [5]


def test_a_request_larger_than_the_cache_is_refused_with_the_fix():
    with pytest.raises(RuntimeError, match="request 1 needs 5 KV-cache pages.*allocate more pages"):
        BatchScheduler([[1], list(range(17))], 4, num_pages=4, page_size=4)


@pytest.mark.parametrize("bad", [dict(max_num_tokens=0), dict(max_num_seqs=-1), dict(prefill_chunk=0)])
def test_non_positive_limits_are_refused(bad):
    with pytest.raises(ValueError, match="must be a positive integer"):
        BatchScheduler([[1]], 1, num_pages=4, page_size=4, **bad)


def test_one_max_new_tokens_per_prompt_must_match_the_prompts():
    with pytest.raises(ValueError, match="one per prompt"):
        BatchScheduler([[1], [2]], [3], num_pages=4, page_size=4)


# --- the sampler ---


def test_greedy_sampling_of_half_precision_logits_picks_what_float32_picks_without_widening_them(monkeypatch):
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16):
        logits = torch.randn(5, 300, generator=g).to(dtype)
        logits[1, 7] = logits[1, 8] = logits[1].max() + 1  # a tie: the first index, as float32's argmax
        widened = []
        float_ = torch.Tensor.float
        monkeypatch.setattr(torch.Tensor, "float", lambda self: (widened.append(1), float_(self))[1])
        picked = Sampler()(logits)
        monkeypatch.undo()
        assert torch.equal(picked, logits.float().argmax(-1)) and picked[1] == 7
        assert not widened, "greedy reads the logits as they are: no float32 copy of [rows, vocab]"


def test_sampling_with_top_k_1_or_a_tiny_top_p_is_greedy():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(-1)
    assert torch.equal(Sampler(temperature=1.0, top_k=1, seed=0)(logits), greedy)
    assert torch.equal(Sampler(temperature=1.0, top_p=1e-6, seed=0)(logits), greedy)


def test_top_k_and_top_p_only_ever_pick_allowed_tokens():
    logits = torch.randn(2000, 20, generator=torch.Generator().manual_seed(1)) * 3
    picked = Sampler(temperature=1.0, top_k=3, seed=0)(logits)
    assert (logits.gather(1, picked[:, None]) >= logits.topk(3).values[:, -1:]).all()
    probs = logits.softmax(-1)
    picked = Sampler(temperature=1.0, top_p=0.5, seed=0)(logits)
    # A token is allowed iff the tokens more likely than it hold less than top_p.
    more_likely = (probs * (probs > probs.gather(1, picked[:, None]))).sum(-1)
    assert (more_likely < 0.5).all()


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampling_settings_are_refused(bad):
    with pytest.raises(ValueError):
        Sampler(**bad)


# --- generate on a fullcg model ---


def test_greedy_generate_equals_step_by_step_greedy_decoding_of_the_eager_model():
    model = _llama()
    expected = greedy_generate(model, PROMPTS, 5)
    got = fullcg.generate(model, PROMPTS, 5, max_num_tokens=8, max_num_seqs=2, config=EAGER, progress=False)
    assert got == expected


def test_generate_returns_outputs_in_prompt_order_whatever_order_requests_finish_in():
    model = _llama()
    lengths = [6, 1, 4, 2]
    got = fullcg.generate(model, PROMPTS, lengths, max_num_tokens=8, max_num_seqs=2, config=EAGER, progress=False)
    assert [len(g) for g in got] == lengths
    alone = [fullcg.generate(model, [p], n, config=EAGER, progress=False)[0] for p, n in zip(PROMPTS, lengths)]
    assert got == alone


def test_generate_through_a_small_cache_waits_for_pages_and_gives_the_same_tokens():
    big, small = _llama(num_pages=64), _llama(num_pages=5)
    expected = fullcg.generate(big, PROMPTS, 5, compile=False, progress=False)
    assert fullcg.generate(small, PROMPTS, 5, compile=False, progress=False) == expected


def test_generate_stops_at_a_stop_token_and_keeps_it():
    model = _llama()
    full = fullcg.generate(model, PROMPTS, 6, compile=False, progress=False)
    stop = full[0][2]
    got = fullcg.generate(model, PROMPTS, 6, stop_token_ids=[stop], compile=False, progress=False)
    for g, f in zip(got, full):
        assert g == (f[: f.index(stop) + 1] if stop in f else f)


def test_seeded_sampling_is_reproducible_and_depends_on_the_seed():
    model = _llama()
    kw = dict(temperature=1.0, top_k=50, top_p=0.95, max_num_tokens=8, config=EAGER, progress=False)
    a = fullcg.generate(model, PROMPTS, 8, seed=1, **kw)
    assert fullcg.generate(model, PROMPTS, 8, seed=1, **kw) == a
    assert fullcg.generate(model, PROMPTS, 8, seed=2, **kw) != a


def test_generate_compiles_once_per_model_and_config():
    torch._dynamo.reset()
    model = _llama()
    fullcg.reset_graph_mode_counts()
    fullcg.generate(model, PROMPTS[:2], 3, config=EAGER, progress=False)
    first = fullcg.graph_mode_counts()
    assert first["full:eager"] > 0 and first["piecewise:eager"] > 0  # compiled: decode steps full, others piecewise
    with torch._dynamo.config.patch(error_on_recompile=True):
        fullcg.generate(model, PROMPTS[2:], 3, config=EAGER, progress=False)


def test_generate_without_a_kv_cache_names_the_fix():
    with pytest.raises(RuntimeError, match="allocate_kv_cache"):
        fullcg.generate(LlamaModel(LlamaConfig.tiny()), [[1, 2]], 2, progress=False)


@pytest.mark.parametrize("page_size, num_pages", [(1, 8), (4, 8), (16, 1), (1, 1)])
@pytest.mark.parametrize("graph_mode", ["none", "auto"])
def test_the_stand_in_steps_are_valid_two_then_one_token_prefills_for_any_cache(page_size, num_pages, graph_mode):
    # generate's first compiled steps on a GPU are these stand-ins: two tokens (one where the
    # cache holds only one), then one, so a graph Inductor guarded to "more than one token"
    # gets its one-token sibling compiled and captured before the first real step.
    from fullcg.engine import _first_step

    model = _llama(num_pages=num_pages, page_size=page_size)
    seen = []

    def run(ids, pos):
        md = fullcg.context.get_forward_context().metadata
        seen.append((ids.tolist(), pos.tolist(), md.query_lens, md.is_decode_only))
        return model(ids, pos)

    with torch.inference_mode():
        _first_step(run, model, model.attention_layers()[0].kv_cache, fullcg.FullCGConfig(graph_mode=graph_mode))
    counts = [2, 1] if page_size * num_pages >= 2 else [1]
    assert [s[2] for s in seen] == [(n,) for n in counts]
    assert seen == [([0] * n, list(range(n)), (n,), False) for n in counts]


# --- overlap: step n + 1 prepared and launched before step n's tokens are read ---


def test_overlapped_scheduling_takes_decode_inputs_from_the_step_in_flight():
    sched = BatchScheduler([[1, 2, 3], [4, 5]], 3, num_pages=8, page_size=4)
    first = sched.next_step()  # both prompts
    assert first.fill_rows is None
    sched.launched(first)  # their tokens are on the device, unread
    second = sched.next_step()
    assert second.modes == (fullcg.ForwardMode.DECODE,) * 2
    assert second.fill_rows.tolist() == [0, 1] and second.fill_from.tolist() == [0, 1]
    assert second.positions.tolist() == [3, 2]
    second.fill_inputs(torch.tensor([40, 50]))
    assert second.input_ids.tolist() == [40, 50]
    sched.launched(second)
    assert sched.record(first, [40, 50]) == []
    assert [r.generated for r in sched.requests] == [[40], [50]]


def test_a_stop_token_seen_one_step_late_drops_the_extra_token_and_frees_the_pages_once():
    sched = BatchScheduler([[1, 2, 3]], 5, num_pages=4, page_size=4, stop_token_ids=[9])
    first = sched.next_step()
    sched.launched(first)
    second = sched.next_step()  # scheduled before the stop token is read
    sched.launched(second)
    assert sched.record(first, [9]) == [sched.requests[0]]  # stopped: finished, pages back
    assert sched.num_free_pages == 4 and sched.next_step() is None
    assert sched.record(second, [7]) == []  # the extra token is dropped
    assert sched.requests[0].generated == [9] and sched.finished


def test_max_new_tokens_in_flight_are_never_scheduled_past():
    sched = BatchScheduler([[1, 2]], 2, num_pages=4, page_size=4)
    first = sched.next_step()
    sched.launched(first)
    second = sched.next_step()
    sched.launched(second)
    assert sched.next_step() is None  # two tokens in flight reach max_new_tokens: wait for them
    sched.record(first, [5])
    assert sched.next_step() is None
    assert sched.record(second, [6]) == [sched.requests[0]] and sched.finished


MANY = [list(range(3 + i, 9 + 2 * i)) for i in range(7)]


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=1.0, top_k=40, top_p=0.9, seed=3)],
                         ids=["greedy", "seeded"])
def test_overlap_gives_what_the_synchronous_loop_gives(sampling):
    # Chunked prefill (budget 6, chunks of 4), requests joining as others finish (at most
    # 3 at once), and stop tokens: the overlapped loop sees them one step late.
    model = _llama()
    kw = dict(max_num_tokens=6, max_num_seqs=3, prefill_chunk=4, compile=False, progress=False, **sampling)
    plain = fullcg.generate(model, MANY, [5, 2, 7, 3, 6, 1, 4], overlap=False, **kw)
    stop = plain[2][1]
    sync = fullcg.generate(model, MANY, [5, 2, 7, 3, 6, 1, 4], overlap=False, stop_token_ids=[stop], **kw)
    assert any(len(s) < len(p) for s, p in zip(sync, plain))  # the stop token ended some request early
    overlapped = fullcg.generate(model, MANY, [5, 2, 7, 3, 6, 1, 4], overlap=True, stop_token_ids=[stop], **kw)
    assert overlapped == sync


def test_overlap_gives_what_the_synchronous_loop_gives_when_compiled():
    model = _llama()
    kw = dict(max_num_tokens=6, max_num_seqs=3, config=EAGER, progress=False)
    assert fullcg.generate(model, MANY, 4, overlap=True, **kw) == fullcg.generate(model, MANY, 4, overlap=False, **kw)


def test_a_seeded_request_draws_the_same_tokens_alone_or_in_a_batch():
    model = _llama()
    kw = dict(temperature=1.0, seed=11, compile=False, progress=False)
    batched = fullcg.generate(model, MANY[:4], 6, max_num_tokens=5, **kw)
    alone = [fullcg.generate(model, [p], 6, **kw)[0] for p in MANY[:4]]
    # Request numbers key the draws: alone, every request is request 0, so compare request 0.
    assert batched[0] == alone[0]


def test_generate_reports_steps_tokens_and_host_time():
    model = _llama()
    out, stats = fullcg.generate(model, PROMPTS, 3, compile=False, progress=False, return_stats=True)
    assert isinstance(stats, fullcg.GenerateStats)
    assert stats.tokens == sum(len(o) for o in out) == 3 * len(PROMPTS)
    assert stats.steps >= 3 and stats.host_ms_per_step > 0 and stats.wall_s > 0
    assert stats.gpu_idle_fraction is None and stats.overlap  # CPU: no GPU to be idle
    with pytest.raises(TypeError, match="overlap must be True or False"):
        fullcg.generate(model, PROMPTS, 3, compile=False, progress=False, overlap="yes")


def test_stats_count_only_the_tokens_returned_when_a_stop_is_seen_late():
    model = _llama()
    full = fullcg.generate(model, MANY, 6, compile=False, progress=False)
    stop = full[1][1]
    out, stats = fullcg.generate(model, MANY, 6, compile=False, progress=False, stop_token_ids=[stop],
                                 return_stats=True)
    assert stats.tokens == sum(len(o) for o in out)


def test_record_refuses_a_token_list_that_does_not_fit_the_step_before_changing_anything():
    sched = BatchScheduler([[1, 2], [3]], 3, num_pages=8, page_size=4)
    step = sched.next_step()
    sched.launched(step)
    with pytest.raises(ValueError, match="one token per request"):
        sched.record(step, [5])
    with pytest.raises(ValueError, match="one token per request"):
        sched.record(step, [5, None])
    assert [r.in_flight for r in sched.requests] == [1, 1]
    sched.record(step, [5, 6])
    assert [r.generated for r in sched.requests] == [[5], [6]]


def test_a_seeded_sampler_without_keys_draws_anew_each_call_and_seeds_must_fit_64_bits():
    logits = torch.zeros(4, 1000)
    sampler = Sampler(temperature=1.0, seed=5)
    draws = [sampler(logits).tolist() for _ in range(3)]
    assert draws[0] != draws[1] != draws[2]
    assert Sampler(temperature=1.0, seed=5)(logits).tolist() == draws[0]  # reproducible from the seed
    with pytest.raises(ValueError, match="64-bit"):
        Sampler(temperature=1.0, seed=2**64)


def test_keyed_noise_lies_strictly_inside_zero_and_one():
    from fullcg.engine import _keyed_uniform

    keys = torch.stack([torch.arange(64), torch.arange(64) * 3], 1)
    for seed in (0, -1, 2**63 - 1, -(2**63)):
        u = _keyed_uniform(seed, keys, 4096)
        assert (u > 0).all() and (u < 1).all()
        assert abs(u.mean().item() - 0.5) < 0.01
