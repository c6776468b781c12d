"""Bad input never corrupts a cache: each case fails with fullcg's own error type, a first
line that names the problem and the fix, and the KV cache exactly as it was."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

import fullcg
from fullcg import context, errors
from fullcg.engine import BatchScheduler
from fullcg.models.llama import LlamaConfig, LlamaModel

PAGES, PAGE = 16, 4


def _model(**cfg) -> LlamaModel:
    model = LlamaModel(LlamaConfig.tiny(**cfg), seed=0)
    model.allocate_kv_cache(num_pages=PAGES, page_size=PAGE)
    g = torch.Generator().manual_seed(1)
    for attn in model.attention_layers():  # something to overwrite, so a stray write shows
        attn.kv_cache.k.copy_(torch.randn(attn.kv_cache.k.shape, generator=g))
        attn.kv_cache.v.copy_(torch.randn(attn.kv_cache.v.shape, generator=g))
    return model


def _snapshot(model: LlamaModel) -> list[torch.Tensor]:
    return [t.clone() for a in model.attention_layers() for t in (a.kv_cache.k, a.kv_cache.v)]


def _assert_untouched(model: LlamaModel, before: list[torch.Tensor]) -> None:
    after = [t for a in model.attention_layers() for t in (a.kv_cache.k, a.kv_cache.v)]
    assert all(torch.equal(a, b) for a, b in zip(after, before)), "a refused step wrote into the KV cache"


def _first_line(excinfo: pytest.ExceptionInfo) -> str:
    return str(excinfo.value).splitlines()[0]


def _step(model, run, query_lens, prefix_lens, table, positions=None):
    """One step; ``positions`` (else the right ones) go to the model and to ``build`` to be checked."""
    if positions is None:
        positions = torch.cat([torch.arange(p, p + q) for q, p in zip(query_lens, prefix_lens)])
    table = torch.tensor(table, dtype=torch.int32)
    md = fullcg.AttentionMetadata.build(query_lens, prefix_lens, table, PAGE, positions=positions)
    ids = torch.arange(sum(query_lens)) % 200
    with torch.no_grad(), fullcg.forward_context(md, model):
        return run(ids, positions)


def _compiled(model, **options):
    return torch.compile(model, backend="fullcg", options={"compiler": "eager", "graph_mode": "piecewise", **options})


@pytest.fixture
def model():
    return _model()


def test_two_requests_writing_one_page_are_refused_at_build(model):
    before = _snapshot(model)
    with pytest.raises(errors.PageConflictError) as e:
        _step(model, model, [3, 3], [0, 0], [[12], [12]])
    assert _first_line(e).startswith("page 12 is written by request 0 but used by requests [0, 1] of the batch")
    assert "give each request its own pages" in _first_line(e)
    _assert_untouched(model, before)


def test_a_new_request_writing_a_page_another_row_reads_is_refused_at_build(model):
    before = _snapshot(model)  # request 0 reads its prefix on page 0; request 1 would prefill into page 0
    with pytest.raises(errors.PageConflictError, match=r"^page 0 is written by request 1 but used by requests \[0, 1\]"):
        _step(model, model, [1, 2], [4, 0], [[0, 1], [0, 0]])
    _assert_untouched(model, before)


def test_pages_that_are_only_read_may_be_shared():
    # A shared prompt prefix on page 0, each request writing its own page: valid.
    md = fullcg.AttentionMetadata.build([1, 1], [4, 4], torch.tensor([[0, 1], [0, 2]], dtype=torch.int32), PAGE)
    assert md.slot_mapping.tolist() == [4, 8]


def test_the_ownership_guard_catches_a_new_request_given_a_live_requests_page(model):
    owners = fullcg.PageOwnership(PAGES)
    owners.claim(0, [0])  # request 0 lives on page 0
    with pytest.raises(errors.PageOwnershipError) as e:
        owners.claim(1, [0])
    assert _first_line(e).startswith("page 0 is given to request 1 but live request 0 owns it")
    md = fullcg.AttentionMetadata.build([3], [0], torch.tensor([[0]], dtype=torch.int32), PAGE)
    before = _snapshot(model)
    with pytest.raises(errors.PageOwnershipError, match=r"^row 0 \(request 1\) uses page 0, which request 0 owns"):
        owners.check(md, [1])  # the engine checks before it runs the step
        with fullcg.forward_context(md, model), torch.no_grad():
            model(torch.tensor([1, 2, 3]), torch.arange(3))
    _assert_untouched(model, before)


def test_the_scheduler_ownership_guard_catches_a_live_page_handed_out_again():
    sched = BatchScheduler([[1, 2, 3], [4, 5, 6]], 3, num_pages=8, page_size=PAGE, max_num_seqs=1,
                           check_page_ownership=True)
    step = sched.next_step()
    live = step.requests[0].pages[0]
    sched._free_pages.appendleft(live)  # a free-list bug: a live request's page is free again
    sched.advance(step, [7])
    sched.max_num_seqs = 2
    with pytest.raises(errors.PageOwnershipError, match=rf"^page {live} is given to request 1 but live request 0 owns it"):
        sched.next_step()


def test_a_negative_page_for_new_tokens_is_refused_not_taken_for_padding():
    model = _model(chunked_prefix=True)
    before = _snapshot(model)
    with pytest.raises(errors.PageOutOfRangeError) as e:
        _step(model, model, [2], [4], [[0, -1]])
    assert _first_line(e).startswith("request 0 reads or writes page -1 (page_table[0, 1]), outside page ids >= 0")
    _assert_untouched(model, before)


def test_a_negative_prefix_page_is_named_as_such(model):
    before = _snapshot(model)
    with pytest.raises(errors.PageOutOfRangeError, match=r"^request 0 reads or writes page -1 \(page_table\[0, 0\]\)"):
        _step(model, model, [1], [4], [[-1, 1]])
    _assert_untouched(model, before)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_new_token_page_past_the_cache_is_refused_before_the_step(model, compiled):
    run = _compiled(model) if compiled else model
    _step(model, run, [2], [0], [[3]])  # compile on a valid step first
    before = _snapshot(model)
    with pytest.raises(errors.PageOutOfRangeError) as e:
        _step(model, run, [2], [0], [[10_000]])
    assert _first_line(e).startswith(
        "request 0 reads or writes page 10000 (page_table[0, 0]), outside the KV cache's pages 0..15")
    assert isinstance(e.value, IndexError)  # what indexing past the cache used to raise
    _assert_untouched(model, before)


def test_build_checks_the_page_range_itself_when_given_the_cache_size():
    with pytest.raises(errors.PageOutOfRangeError, match=r"^request 1 reads or writes page 64 .* pages 0..63"):
        fullcg.AttentionMetadata.build([1, 1], [3, 3], torch.tensor([[0], [64]], dtype=torch.int32), PAGE, num_pages=64)


def test_a_scheduler_with_more_pages_than_the_cache_is_refused_at_the_first_step_past_it(model):
    # Five requests of four pages each: the fifth gets pages 16..19 of a 16-page cache.
    sched = BatchScheduler([list(range(1, 13))] * 5, 4, num_pages=64, page_size=PAGE)
    step = sched.next_step()
    before = _snapshot(model)
    with pytest.raises(errors.PageOutOfRangeError) as e:
        with fullcg.forward_context(step.metadata, model), torch.no_grad():
            model(step.input_ids, step.positions)
    assert _first_line(e).startswith("request 4 reads or writes page 16 (page_table[4, 0]), outside the KV cache's pages 0..15")
    _assert_untouched(model, before)


def test_out_overlapping_q_by_one_row_is_refused_and_exact_aliasing_is_allowed():
    layer = fullcg.Attention(2, 8, layer_id=0)
    cache = layer.allocate_kv_cache(4, PAGE)
    md = fullcg.AttentionMetadata.build([3], [0], torch.tensor([[1]], dtype=torch.int32), PAGE)
    buf = torch.randn(4, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    before = cache.k.clone()
    with fullcg.forward_context(md, layer), torch.no_grad():
        with pytest.raises(errors.OverlappingOutputError) as e:
            torch.ops.fullcg.attention(buf[0:3], k, v, buf[1:4], 0)
        assert _first_line(e).startswith("fullcg.attention (layer 0): out overlaps q without being exactly q")
        assert torch.equal(cache.k, before)
        q = buf[0:3].clone()
        expected = torch.empty_like(q)
        torch.ops.fullcg.attention(q, k, v, expected, 0)
        torch.ops.fullcg.attention(q, k, v, q, 0)  # out is q: in place, correct
    torch.testing.assert_close(q, expected)


def test_positions_that_disagree_with_the_metadata_are_refused(model):
    before = _snapshot(model)
    with pytest.raises(errors.InvalidBatchError) as e:
        _step(model, model, [1], [4], [[0, 1]], positions=torch.tensor([7]))
    assert _first_line(e).startswith("token 0 (request 0) is at position 7 but the metadata puts it at 4")
    _assert_untouched(model, before)


def test_an_eager_step_with_autograd_warns_once_and_never_gives_the_cache_history(model, monkeypatch):
    fullcg.diagnostics.forget_told(context.GRAD_WARNING)
    with pytest.warns(UserWarning, match="fullcg: a step runs with autograd enabled") as record:
        for prefix in (0, 3):
            md = fullcg.AttentionMetadata.build([3], [prefix], torch.tensor([[0, 1]], dtype=torch.int32), PAGE)
            with fullcg.forward_context(md, model):
                model(torch.tensor([1, 2, 3]), torch.arange(prefix, prefix + 3))
    assert sum("autograd enabled" in str(w.message) for w in record) == 1
    for attn in model.attention_layers():
        assert not attn.kv_cache.k.requires_grad and attn.kv_cache.k.grad_fn is None
        assert not attn.kv_cache.v.requires_grad and attn.kv_cache.v.grad_fn is None


def test_max_capture_size_is_bounded():
    with pytest.raises(errors.InvalidConfigError) as e:
        fullcg.FullCGConfig(max_capture_size=10**10)
    assert _first_line(e).startswith(f"max_capture_size must be at most {fullcg.config.MAX_CAPTURE_SIZE}, got 10000000000")
    with pytest.raises(errors.InvalidConfigError, match="^capture sizes must be at most"):
        fullcg.FullCGConfig(capture_sizes=(1, 10**6))


@pytest.mark.parametrize("bad", [0, -8, 12.5, True, "128"])
def test_auto_full_max_tokens_must_be_a_positive_integer_or_none(bad):
    with pytest.raises(errors.InvalidConfigError) as e:
        fullcg.FullCGConfig(auto_full_max_tokens=bad)
    assert _first_line(e) == f"auto_full_max_tokens must be a positive integer, got {bad!r}"
    assert fullcg.FullCGConfig(auto_full_max_tokens=None).auto_full_max_tokens is None


def test_capture_sizes_must_be_a_sequence():
    with pytest.raises(TypeError) as e:
        fullcg.FullCGConfig(capture_sizes=8)
    assert isinstance(e.value, errors.ConfigTypeError)
    assert _first_line(e).startswith("capture_sizes must be a sequence of positive integers such as (1, 2, 4, 8)")


def test_metadata_edited_after_build_is_refused(model):
    md = fullcg.AttentionMetadata.build([3], [0], torch.tensor([[0]], dtype=torch.int32), PAGE)
    with pytest.raises(errors.MetadataChangedError) as e:
        dataclasses.replace(md, query_lens=(5,))
    assert _first_line(e).startswith("AttentionMetadata fields disagree: slot_mapping has (3,) slots for 5 new tokens")
    before = _snapshot(model)
    moved = dataclasses.replace(md, page_table=torch.tensor([[40]], dtype=torch.int32))  # re-checked on entry
    with pytest.raises(errors.PageOutOfRangeError, match=r"^request 0 reads or writes page 40"):
        with fullcg.forward_context(moved, model):
            pass
    stale = dataclasses.replace(md, slot_mapping=torch.tensor([8, 9, 10]))
    with pytest.raises(errors.MetadataChangedError, match="^AttentionMetadata fields disagree: slot_mapping does not"):
        with fullcg.forward_context(stale, model):
            pass
    _assert_untouched(model, before)


def test_a_non_contiguous_kv_cache_is_refused():
    k = torch.zeros(4, PAGE, 2, 16)[..., :8]
    with pytest.raises(errors.KVCacheError) as e:
        fullcg.KVCache(k, k)
    assert _first_line(e).startswith("KV cache k must be contiguous")


def test_metadata_on_the_meta_device_is_refused():
    with pytest.raises(errors.InvalidBatchError, match="^metadata cannot live on the meta device"):
        fullcg.AttentionMetadata.build([3], [0], torch.tensor([[0]], dtype=torch.int32), PAGE, device="meta")


def test_triton_without_triton_names_the_missing_package(model, monkeypatch):
    from fullcg.ops import impl

    monkeypatch.setitem(sys.modules, "triton", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "fullcg.ops.impl.triton", raising=False)
    monkeypatch.delitem(impl._registry, "triton", raising=False)
    md = fullcg.AttentionMetadata.build([3], [0], torch.tensor([[0]], dtype=torch.int32), PAGE)
    before = _snapshot(model)
    with pytest.raises(errors.ImplementationUnavailableError) as e:
        with fullcg.forward_context(md, model, config=fullcg.FullCGConfig(attention_impl="triton")), torch.no_grad():
            model(torch.tensor([1, 2, 3]), torch.arange(3))
    assert _first_line(e).startswith("attention implementation 'triton' cannot be imported: triton is not installed")
    _assert_untouched(model, before)


def test_a_cache_made_under_inference_mode_needs_inference_mode_steps():
    with torch.inference_mode():
        model = _model()
    md = fullcg.AttentionMetadata.build([3], [0], torch.tensor([[0]], dtype=torch.int32), PAGE)
    before = _snapshot(model)
    with pytest.raises(errors.InferenceTensorError) as e:
        with fullcg.forward_context(md, model), torch.no_grad():
            model(torch.tensor([1, 2, 3]), torch.arange(3))
    assert _first_line(e).startswith("the KV caches of LlamaModel")
    assert "run steps under `with torch.inference_mode():`" in _first_line(e)
    _assert_untouched(model, before)
    with torch.inference_mode(), fullcg.forward_context(md, model):
        model(torch.tensor([1, 2, 3]), torch.arange(3))


def test_a_bad_graph_mode_variable_is_named_also_through_torch_compile(model, monkeypatch):
    monkeypatch.setenv("FULLCG_GRAPH_MODE", "fastest")
    with pytest.raises(errors.InvalidConfigError, match="^FULLCG_GRAPH_MODE must be one of none, piecewise"):
        fullcg.FullCGConfig.from_env()
    before = _snapshot(model)
    with pytest.raises(errors.InvalidConfigError) as e:
        _step(model, torch.compile(model, backend="fullcg"), [3], [0], [[0]])
    assert _first_line(e).startswith("FULLCG_GRAPH_MODE must be one of none, piecewise")
    _assert_untouched(model, before)


def test_backend_option_errors_reach_the_user_as_themselves(model):
    torch._dynamo.reset()
    with pytest.raises(errors.InvalidConfigError) as e:
        _step(model, _compiled(model, graph_mode="fastest"), [3], [0], [[0]])
    assert _first_line(e).startswith("graph_mode must be one of none, piecewise")
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("q_dtype,cache_dtype", [(torch.float32, torch.float16), (torch.float16, torch.float32)])
def test_q_and_kv_cache_dtypes_must_match(q_dtype, cache_dtype):
    layer = fullcg.Attention(2, 8, layer_id=0)
    cache = layer.allocate_kv_cache(4, PAGE, dtype=cache_dtype)
    md = fullcg.AttentionMetadata.build([3], [0], torch.tensor([[1]], dtype=torch.int32), PAGE)
    q = torch.randn(3, 2, 8, dtype=q_dtype)
    before = cache.k.clone()
    with fullcg.forward_context(md, layer), torch.no_grad():
        with pytest.raises(errors.DtypeMismatchError) as e:
            layer(q, q, q)
    assert _first_line(e).startswith(f"fullcg.attention (layer 0): q is {q_dtype} but the KV cache is {cache_dtype}")
    assert torch.equal(cache.k, before)



def _decodes(table, prefix=5, **kwargs):
    """A decode step for every row of ``table`` (int32), each on a prefix of ``prefix`` tokens."""
    table = torch.tensor(table, dtype=torch.int32)
    return fullcg.AttentionMetadata.build([1] * table.shape[0], [prefix] * table.shape[0], table, PAGE, **kwargs)


@pytest.mark.parametrize("base", [0, 100_000, 50_000_000], ids=["small-ids", "spread-ids", "huge-ids"])
def test_written_pages_are_checked_alike_whatever_the_page_ids(base):
    # Ids of a small cache, spread over a large one, or past any lookup array: same verdicts.
    a, b, c, d, e = (base + i for i in range(5))
    md = _decodes([[a, b], [c, d], [a, e]])  # page a is read by two rows and written by none
    assert md.slot_mapping.tolist() == [b * PAGE + 1, d * PAGE + 1, e * PAGE + 1]
    with pytest.raises(errors.PageConflictError, match=rf"^page {b} is written by request 0 but used by requests \[0, 2\]"):
        _decodes([[a, b], [c, d], [e, b]])  # two rows write page b
    with pytest.raises(errors.PageConflictError, match=rf"^page {b} is written by request 0 but used by requests \[0, 1\]"):
        _decodes([[a, b], [b, d], [c, e]])  # row 1 reads the page row 0 writes


def test_a_written_page_repeated_in_padding_is_fine_but_a_reader_of_it_is_not():
    md = _decodes([[3, 0, 9], [1, 2, 0]], prefix=4)  # row 1's unused last column repeats page 0
    assert md.slot_mapping.tolist() == [0 * PAGE, 2 * PAGE]  # position 4: column 1, offset 0
    with pytest.raises(errors.PageConflictError, match=r"^page 0 is written by request 0 but used by requests \[0, 1\]"):
        _decodes([[3, 0, 9], [0, 2, 0]], prefix=4)


def test_negative_padding_is_fine_and_the_range_check_still_names_the_entry():
    md = _decodes([[2, 3, -1], [4, 5, -1]], num_pages=8)
    assert md.slot_mapping.tolist() == [3 * PAGE + 1, 5 * PAGE + 1]
    with pytest.raises(errors.PageOutOfRangeError, match=r"^request 1 reads or writes page 9 \(page_table\[1, 1\]\)"):
        _decodes([[2, 3, -1], [4, 9, -1]], num_pages=8)
