"""The ``flashinfer`` implementation computes what the reference computes.

Every GPU test runs the same batch through ``attention_impl="reference"`` and
``"flashinfer"`` (bf16, where FlashInfer computes) and checks both against the float64
oracle. A few tests run without FlashInfer or a GPU: choosing the implementation when
FlashInfer is missing names the install command, and what fullcg asks FlashInfer to plan
(windows, soft-caps, one plan per distinct layer shape) is recorded by stand-in wrappers.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math
import sys
import types

import pytest
import torch

import fullcg
import fullcg.ops.impl
from fullcg.config import FullCGConfig, SkipSoftmaxConfig
from fullcg.ops.call import AttentionCall
from fullcg.ops.impl import _registry, fmha_v2, resolve_implementation

from batches import Batch, make_batch, naive_attention, oracle


def test_choosing_flashinfer_without_it_installed_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` now raises ImportError
    monkeypatch.delitem(sys.modules, "fullcg.ops.impl.flashinfer", raising=False)
    monkeypatch.delitem(_registry, "flashinfer", raising=False)
    with pytest.raises(ImportError, match=r"pip install fullcg\[flashinfer\]"):
        resolve_implementation("flashinfer", torch.device("cpu"))


def test_auto_picks_the_reference_on_the_cpu():
    assert resolve_implementation("auto", torch.device("cpu")).name == "reference"


class _RecordingWrapper:
    """Stands in for a FlashInfer wrapper on the CPU: records the keyword arguments of each plan."""

    def __init__(self, float_workspace, layout, backend="auto", use_tensor_cores=False, **graph) -> None:
        self._int_workspace_buffer = torch.zeros(8, dtype=torch.uint8)
        self.backend = backend
        self.plans: list[dict] = []

    def reset_workspace_buffer(self, float_workspace, int_workspace) -> None:
        self._int_workspace_buffer = int_workspace

    def plan(self, *args, **kwargs) -> None:
        self.plans.append(kwargs)


@pytest.fixture
def over_stand_in_flashinfer(monkeypatch) -> types.ModuleType:
    """``fullcg.ops.impl.flashinfer`` loaded afresh over a stand-in ``flashinfer`` whose
    wrappers record their plans (what it registers goes to a throwaway registry)."""
    stand_in = types.ModuleType("flashinfer")
    for name in ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
                 "BatchPrefillWithRaggedKVCacheWrapper"):
        setattr(stand_in, name, type(name, (_RecordingWrapper,), {}))
    monkeypatch.setitem(sys.modules, "flashinfer", stand_in)
    monkeypatch.setattr(fullcg.ops.impl, "_registry", {})
    name = "fullcg.ops.impl._flashinfer_over_a_stand_in"
    spec = importlib.util.spec_from_file_location(name, fullcg.ops.impl.__path__[0] + "/flashinfer.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def _call(b: Batch, layer_id: int, window: int | None = None, softcap: float | None = None, *,
          use_kv_cache: bool = True, prefix_chunk: int | None = None, prefill_factor: float | None = None):
    """An attention call over ``b`` as the ops make it (over the cache, or over given k/v)."""
    chunk = prefix_chunk is not None
    return AttentionCall(
        op="attention_with_lse", q=b.q, k=b.k, v=b.v, out=torch.empty_like(b.q), layer_id=layer_id,
        key_value_num_tokens=None, prefill_scale_factor=prefill_factor, decode_scale_factor=None,
        scale=b.layer.scale, use_kv_cache=use_kv_cache, causal=not chunk, prefix_chunk=prefix_chunk,
        save_kv_cache=use_kv_cache, return_lse=True, sliding_window=window, logit_softcap=softcap,
    )


@pytest.mark.parametrize(("q_lens", "p_lens", "use_kv_cache", "wrapper"), [
    ([5, 1], [12, 30], True, "BatchPrefillWithPagedKVCacheWrapper"),
    ([1, 1], [12, 30], True, "BatchDecodeWithPagedKVCacheWrapper"),
    ([5, 3], [0, 0], False, "BatchPrefillWithRaggedKVCacheWrapper"),
])
def test_plans_carry_the_window_and_softcap_and_layers_differing_in_them_never_share_one(
    over_stand_in_flashinfer, q_lens, p_lens, use_kv_cache, wrapper
):
    """A window of W keys is FlashInfer's window_left = W - 1; layers alike share a plan
    (planned once per step), layers that differ in window or soft-cap get their own
    wrapper, plan and plan-info workspace, so alternating layers never run on another's plan."""
    impl = over_stand_in_flashinfer.FlashInferAttention()
    b = make_batch(q_lens, p_lens, num_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16)
    cache = b.layer.kv_cache if use_kv_cache else None
    masks = [(8, None), (None, None), (8, None), (4, 30.0), (None, 30.0)]
    with torch.inference_mode(), fullcg.forward_context(b.metadata, b.layer, config=config("flashinfer")) as ctx:
        plans = []
        for layer_id, (window, softcap) in enumerate(masks):
            call = _call(b, layer_id, window, softcap, use_kv_cache=use_kv_cache)
            shape, kind = impl._shape_and_kind(call, cache)
            plans.append(impl._planned(call, ctx, shape, kind, cache, None))
    assert plans[2] is plans[0]
    distinct = [plans[i] for i in (0, 1, 3, 4)]
    assert len({id(p.wrapper) for p in distinct}) == 4
    assert len({id(p.wrapper._int_workspace_buffer) for p in distinct}) == 4
    for plan, (window, softcap) in zip(distinct, [masks[i] for i in (0, 1, 3, 4)]):
        assert type(plan.wrapper).__name__ == wrapper and plan.wrapper.backend == "fa2"
        assert len(plan.wrapper.plans) == 1
        planned = plan.wrapper.plans[0]
        assert planned["window_left"] == (-1 if window is None else window - 1)
        assert planned["logits_soft_cap"] == softcap
        assert planned["sm_scale"] == b.layer.scale


def test_plans_take_the_page_table_from_the_host_and_hand_flashinfer_page_locked_arrays(over_stand_in_flashinfer):
    """Planning never reads the page table back from the device (a copy that waits for the
    GPU's queued work), and on a GPU the index arrays FlashInfer copies with
    non_blocking=True are page-locked (a copy from pageable memory waits for the stream)
    and the page list is on the device already."""
    fi = over_stand_in_flashinfer
    b = make_batch([5, 1], [12, 30], num_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    md = b.metadata
    # As a CUDA graph's static metadata has it: the device table padded and rewritten.
    static = md.with_device_tensors(**{name: getattr(md, name) for name in
                                       ("slot_mapping", "query_start_loc", "seq_lens", "prefix_lens_tensor",
                                        "is_decode", "num_tokens_tensor")},
                                    page_table=torch.zeros(8, 32, dtype=torch.int32))
    want, got = fi._paged_indices(md, None, md.num_tokens, False), fi._paged_indices(static, None, md.num_tokens, False)
    assert torch.equal(got.kv_indices, want.kv_indices) and got.kv_indices.any()
    assert want.for_plan(torch.device("cpu")) is want
    if torch.cuda.is_available():
        pinned = want.for_plan(torch.device("cuda"))
        assert all(t.is_pinned() for t in (pinned.qo_indptr, pinned.kv_indptr, pinned.last_page_len))
        assert pinned.kv_indices.is_cuda  # a CUDA-graph wrapper would copy a host page list blocking
        assert torch.equal(pinned.kv_indices.cpu(), want.kv_indices)


@pytest.mark.parametrize(("slots", "decode"), [(None, False), (None, True), (7, False), (7, True)])
def test_paged_indices_list_each_requests_pages_in_order_and_stand_ins_read_page_zero(
    over_stand_in_flashinfer, slots, decode
):
    fi = over_stand_in_flashinfer
    g = torch.Generator().manual_seed(1)
    page = 4
    q_lens = [1] * 5 if decode else [3, 1, 6, 1, 2]
    p_lens = [int(x) for x in torch.randint(0, 20, (5,), generator=g)]
    p_lens[1] = 0 if decode else p_lens[1]
    table = torch.randperm(64, generator=g)[:40].view(5, 8).to(torch.int32)
    md = fullcg.AttentionMetadata.build(q_lens, p_lens, table, page)
    padded = md.num_tokens + (2 if not decode else 0)
    idx = fi._paged_indices(md, slots, padded, decode)
    kv = [q + p for q, p in zip(q_lens, p_lens)]
    want_pages = [table[r, : -(-n // page)].tolist() for r, n in enumerate(kv)]
    want_q, want_last = list(q_lens), [n - (-(-n // page) - 1) * page for n in kv]
    if slots is not None:  # stand-ins: one token each (decode), or the first owns the padding rows
        stand_in_q = [1] * (slots - 5) if decode else [padded - md.num_tokens] + [0] * (slots - 6)
        want_q += stand_in_q
        want_pages += [[0] * -(-max(r, 1) // page) for r in stand_in_q]
        want_last += [max(r, 1) - (-(-max(r, 1) // page) - 1) * page for r in stand_in_q]
    assert idx.qo_indptr.tolist() == [0, *torch.tensor(want_q).cumsum(0).tolist()]
    assert idx.kv_indptr.tolist() == [0, *torch.tensor([len(p) for p in want_pages]).cumsum(0).tolist()]
    assert idx.kv_indices.tolist() == [x for p in want_pages for x in p]
    assert idx.last_page_len.tolist() == want_last
    assert all(t.dtype == torch.int32 for t in (idx.qo_indptr, idx.kv_indptr, idx.kv_indices, idx.last_page_len))


def test_a_window_over_a_prefix_chunk_and_a_factor_with_a_window_or_softcap_are_refused(over_stand_in_flashinfer):
    impl = over_stand_in_flashinfer.FlashInferAttention()
    b = make_batch([5, 3], [40, 20], num_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16,
                   prefix_chunk_tokens=32)
    assert impl._mask_refusal(_call(b, 0, 8), "here") is None
    assert impl._mask_refusal(_call(b, 0, None, 30.0, use_kv_cache=False, prefix_chunk=0), "here") is None
    refusal = impl._mask_refusal(_call(b, 0, 8, use_kv_cache=False, prefix_chunk=0), "here")
    assert isinstance(refusal, ValueError) and "prefix chunk" in str(refusal) and "'triton'" in str(refusal)
    cache = b.layer.kv_cache
    cfg = config("flashinfer", prefill_scale_factor=8.0)
    with torch.inference_mode(), fullcg.forward_context(b.metadata, b.layer, config=cfg) as ctx:
        for window, softcap in ((8, None), (None, 30.0)):
            factor, refusal = impl._skip_factor(_call(b, 0, window, softcap, prefill_factor=8.0), ctx, cache, False)
            assert factor is None and "sliding window or logit soft-capping" in str(refusal)
        # Without a window or soft-cap the factor is refused only for want of a kernel here (no GPU).
        _, refusal = impl._skip_factor(_call(b, 0, prefill_factor=8.0), ctx, cache, False)
        assert "sliding window" not in str(refusal)


def needs_gpu(fn):
    """A GPU test: selected by ``-m cuda``, skipped with a reason without a GPU."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer kernels need a CUDA GPU")(fn))

DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16
# bf16 inputs, float32 accumulation on both sides: compare at bf16 output precision.
TOL = dict(atol=2e-2, rtol=2e-2)
BATCHES = {
    "prefill": ([21, 9], [0, 0]),
    "extend": ([7, 12], [40, 23]),
    "decode": ([1, 1, 1], [70, 5, 33]),
    "mixed": ([13, 1, 6, 1], [0, 50, 37, 16]),
}
HEADS = {"gqa4": (8, 2), "mha": (4, 4)}


def flashinfer_impl():
    pytest.importorskip("flashinfer", reason="flashinfer is not installed: `pip install fullcg[flashinfer]`")
    return resolve_implementation("flashinfer", DEVICE)


def on_gpu(b: Batch) -> Batch:
    return b.to(DEVICE)


def batch(name: str, heads: str = "gqa4", head_dim: int = 64, **kw) -> Batch:
    q_lens, p_lens = BATCHES[name]
    nh, nkv = HEADS[heads]
    kw.setdefault("seed", len(name))
    return on_gpu(make_batch(q_lens, p_lens, num_heads=nh, num_kv_heads=nkv, head_dim=head_dim, page_size=16,
                             dtype=DTYPE, **kw))


def config(impl: str, **skip) -> FullCGConfig:
    return FullCGConfig(attention_impl=impl, skip_softmax=SkipSoftmaxConfig(**skip))


def attend(b: Batch, impl: str, q=None, k=None, v=None, **kwargs):
    q = b.q if q is None else q
    with fullcg.forward_context(b.metadata, b.layer, config=config(impl)):
        return b.layer(q, b.k if k is None else k, b.v if v is None else v, return_lse=True, **kwargs)


def assert_matches_reference(b: Batch, **kwargs):
    ref_out, ref_lse = attend(b, "reference", **kwargs)
    out, lse = attend(b, "flashinfer", **kwargs)
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    return out, lse


@needs_gpu
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("name", list(BATCHES))
def test_cache_attention_and_natural_log_lse_match_the_reference_and_oracle(name, heads):
    flashinfer_impl()
    b = batch(name, heads)
    out, lse = assert_matches_reference(b)
    expected_out, expected_lse = oracle(dataclasses.replace(b, q=b.q.cpu()))
    torch.testing.assert_close(out.double().cpu(), expected_out, **TOL)
    # A base-2 LSE would be off by a factor of ln 2: far outside this tolerance.
    torch.testing.assert_close(lse.double().cpu(), expected_lse, **TOL)


@needs_gpu
def test_new_tokens_are_saved_to_their_slots_and_padding_slots_are_skipped():
    impl = flashinfer_impl()
    b = batch("mixed")
    md = b.metadata
    cache = b.layer.kv_cache
    before_k = cache.k.clone()
    pad = 3
    k = torch.cat([b.k, torch.randn(pad, *b.k.shape[1:], device=DEVICE, dtype=DTYPE)])
    v = torch.cat([b.v, torch.randn(pad, *b.v.shape[1:], device=DEVICE, dtype=DTYPE)])
    slots = torch.cat([md.slot_mapping, torch.full((pad,), -1, dtype=torch.int64, device=DEVICE)])
    padded_md = dataclasses.replace(md, slot_mapping=slots)
    call = type("Call", (), {"k": k, "v": v})()
    with fullcg.forward_context(padded_md, b.layer, config=config("flashinfer")) as ctx:
        impl.save_kv(call, ctx, cache)
    flat_k = cache.k.view(-1, *cache.k.shape[2:])
    torch.testing.assert_close(flat_k[md.slot_mapping], b.k, atol=0, rtol=0)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[md.slot_mapping] = False
    assert torch.equal(flat_k[untouched], before_k.view(-1, *cache.k.shape[2:])[untouched])


@needs_gpu
@pytest.mark.parametrize("causal", [True, False])
def test_attention_over_given_kv_matches_the_reference(causal):
    flashinfer_impl()
    b = batch("prefill")
    assert_matches_reference(b, use_kv_cache=False, causal=causal)
    starts = b.metadata.query_starts
    out, lse = attend(b, "flashinfer", use_kv_cache=False, causal=causal)
    for r in range(b.metadata.num_requests):
        s, e = starts[r], starts[r + 1]
        o, l = naive_attention(b.q[s:e].cpu(), b.k[s:e].cpu(), b.v[s:e].cpu(), b.layer.scale, 0 if causal else None)
        torch.testing.assert_close(out[s:e].double().cpu(), o, **TOL)
        torch.testing.assert_close(lse[s:e].double().cpu(), l, **TOL)


@needs_gpu
@pytest.mark.parametrize("chunk_tokens", [64, 20])
def test_chunked_prefix_merge_equals_attention_over_the_whole_sequence(chunk_tokens):
    """Suffix (causal over new tokens) merged with every prefix chunk by LSE: exact only
    if each LSE is the natural log, as merge_attn_states assumes."""
    flashinfer_impl()
    b = batch("mixed", prefix_chunk_tokens=chunk_tokens)
    md = b.metadata
    cfg = config("flashinfer")
    ref_cfg = config("reference")
    assert len(md.prefix_chunks) >= 1
    results = {}
    for name, c in (("flashinfer", cfg), ("reference", ref_cfg)):
        with fullcg.forward_context(md, b.layer, config=c):
            out, lse = b.layer(b.q, b.k, b.v, return_lse=True, use_kv_cache=False, causal=True, save_kv_cache=True)
            for chunk in range(len(md.prefix_chunks)):
                ck, cv = b.layer.gather_prefix_chunk(chunk)
                p_out, p_lse = b.layer(b.q, ck, cv, return_lse=True, use_kv_cache=False, causal=False,
                                       prefix_chunk=chunk, save_kv_cache=False)
                merged = torch.empty_like(out)
                merged_lse = torch.empty_like(lse)
                torch.ops.fullcg.merge_attn_states(merged, p_out, p_lse, out, lse, merged_lse)
                out, lse = merged, merged_lse
        results[name] = (out, lse)
    torch.testing.assert_close(results["flashinfer"][0].float(), results["reference"][0].float(), **TOL)
    torch.testing.assert_close(results["flashinfer"][1], results["reference"][1], **TOL)
    expected_out, expected_lse = oracle(dataclasses.replace(b, q=b.q.cpu()))
    torch.testing.assert_close(results["flashinfer"][0].double().cpu(), expected_out, **TOL)
    torch.testing.assert_close(results["flashinfer"][1].double().cpu(), expected_lse, **TOL)


@needs_gpu
@pytest.mark.parametrize("name", ["prefill", "decode", "mixed"])
def test_padding_rows_are_zero_with_minus_infinite_lse(name):
    flashinfer_impl()
    b = batch(name)
    pad = 5
    q = torch.cat([b.q, torch.full((pad, *b.q.shape[1:]), float("nan"), device=DEVICE, dtype=DTYPE)])
    k = torch.cat([b.k, torch.randn(pad, *b.k.shape[1:], device=DEVICE, dtype=DTYPE)])
    v = torch.cat([b.v, torch.randn(pad, *b.v.shape[1:], device=DEVICE, dtype=DTYPE)])
    n = b.metadata.num_tokens
    ref_out, ref_lse = attend(b, "reference")
    out, lse = attend(b, "flashinfer", q=q, k=k, v=v)
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))
    assert torch.isneginf(lse[n:]).all()
    torch.testing.assert_close(out[:n].float(), ref_out.float(), **TOL)
    torch.testing.assert_close(lse[:n], ref_lse, **TOL)


@needs_gpu
@pytest.mark.parametrize(("name", "return_lse"), [("decode", False), ("extend", True)])
def test_a_skip_softmax_factor_is_refused_below_sm100_where_flashinfer_would_ignore_it(name, return_lse):
    """Below SM100 only FMHAv2 honours a factor, and it runs neither decode-only batches
    nor attention over a cached prefix that returns LSE."""
    flashinfer_impl()
    if torch.cuda.get_device_capability()[0] >= 10:
        pytest.skip("SM100+ passes the factor to FlashInfer's trtllm-gen backend")
    b = batch(name)
    cfg = config("flashinfer", prefill_scale_factor=4.0, decode_scale_factor=4.0)
    with fullcg.forward_context(b.metadata, b.layer, config=cfg):
        with pytest.raises(ValueError, match="attention_impl='triton'.*'reference'"):
            b.layer(b.q, b.k, b.v, return_lse=return_lse)


def needs_hopper(fn):
    """An FMHAv2 test: its kernels run on SM90 only."""
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    return pytest.mark.cuda(pytest.mark.skipif(not hopper, reason="FlashInfer's FMHAv2 kernels need an SM90 GPU")(fn))


@pytest.fixture
def fmha_calls(monkeypatch) -> list[str]:
    """The FMHAv2 entry points the step called, in order."""
    calls: list[str] = []
    for name in ("attend_paged", "attend_contiguous"):
        def spy(*args, _real=getattr(fmha_v2, name), _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(fmha_v2, name, spy)
    return calls


@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("name", ["prefill", "extend", "mixed"])
def test_fmha_v2_runs_prefill_and_extend_batches_over_the_cache_on_hopper_and_all_match_the_oracle(
    name, heads, head_dim, fmha_calls
):
    """Batches with decode requests stay on FA2 (FMHAv2 would spend a tile per query head on each)."""
    flashinfer_impl()
    b = batch(name, heads, head_dim)
    with fullcg.forward_context(b.metadata, b.layer, config=config("flashinfer")):
        out = b.layer(b.q, b.k, b.v)
    assert fmha_calls == ([] if name == "mixed" else ["attend_paged"])
    expected_out, _ = oracle(dataclasses.replace(b, q=b.q.cpu()))
    torch.testing.assert_close(out.double().cpu(), expected_out, **TOL)


@needs_hopper
@pytest.mark.parametrize("causal", [True, False])
def test_fmha_v2_attends_over_given_kv_with_the_natural_log_lse_and_dead_padding_rows(causal, fmha_calls):
    flashinfer_impl()
    b = batch("prefill", head_dim=128)
    pad = 5  # padding rows are never read: NaN there must not reach a real row

    def padded(x):
        return torch.cat([x, torch.full((pad, *x.shape[1:]), float("nan"), device=DEVICE, dtype=DTYPE)])

    out, lse = attend(b, "flashinfer", q=padded(b.q), k=padded(b.k), v=padded(b.v), use_kv_cache=False,
                      causal=causal)
    assert fmha_calls == ["attend_contiguous"]
    n = b.metadata.num_tokens
    assert torch.equal(out[n:], torch.zeros_like(out[n:])) and torch.isneginf(lse[n:]).all()
    starts = b.metadata.query_starts
    for r in range(b.metadata.num_requests):
        s, e = starts[r], starts[r + 1]
        o, l = naive_attention(b.q[s:e].cpu(), b.k[s:e].cpu(), b.v[s:e].cpu(), b.layer.scale, 0 if causal else None)
        torch.testing.assert_close(out[s:e].double().cpu(), o, **TOL)
        torch.testing.assert_close(lse[s:e].double().cpu(), l, **TOL)


def _two_level_batch(q_len: int = 64, p_len: int = 960) -> Batch:
    """One request (``p_len`` cached + ``q_len`` new tokens, head dim 128) whose first 128
    keys score 3 above all others (after scaling) and carry v = 0, the others v = 1: dense
    attention gives about 0.26 at the last rows, skipping every tile past the first gives 0."""
    head_dim = 128
    b = make_batch([q_len], [p_len], num_heads=8, num_kv_heads=2, head_dim=head_dim, page_size=16, dtype=DTYPE,
                   seed=5)
    n = q_len + p_len
    u = torch.zeros(head_dim)
    u[0] = 1.0
    pos = torch.arange(n)
    k = (torch.where(pos < 128, 10.0, 7.0)[:, None, None] * u).expand(n, 2, head_dim).to(DTYPE)
    v = (pos >= 128).float()[:, None, None].expand(n, 2, head_dim).to(DTYPE)
    cache, md = b.layer.kv_cache, b.metadata
    pages = md.page_table[0, pos[:p_len] // 16].long()
    cache.k[pages, pos[:p_len] % 16] = k[:p_len]
    cache.v[pages, pos[:p_len] % 16] = v[:p_len]
    q = (math.sqrt(head_dim) * u).expand(q_len, 8, head_dim).to(DTYPE)
    return on_gpu(dataclasses.replace(b, q=q.contiguous(), k=k[p_len:].contiguous(), v=v[p_len:].contiguous(),
                                      full_k=[k], full_v=[v]))


@needs_hopper
def test_fmha_v2_honours_the_prefill_skip_factor_on_hopper_and_reports_its_calls_unmeasured(fmha_calls):
    flashinfer_impl()
    b = _two_level_batch()
    dense, _ = oracle(dataclasses.replace(b, q=b.q.cpu()))
    assert dense.min() > 0.2  # what ignoring the factor would give
    fullcg.reset_skip_softmax_stats()
    # threshold 128 / 1024 = 0.125 > exp(-3): every tile after the first is skipped.
    with fullcg.forward_context(b.metadata, b.layer, config=config("flashinfer", prefill_scale_factor=128.0)):
        out = b.layer(b.q, b.k, b.v)
    assert fmha_calls == ["attend_paged"]
    with fullcg.forward_context(b.metadata, b.layer, config=config("reference", prefill_scale_factor=128.0)):
        ref = b.layer(b.q, b.k, b.v)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=0)
    assert out.float().abs().max() < 0.05
    stats = fullcg.skip_softmax_stats()[b.layer.layer_id]
    assert stats.unmeasured_calls == 1 and not stats.measured


@needs_hopper
def test_a_prefill_without_a_cached_prefix_runs_fmha_v2_over_its_own_rows_with_the_factor_and_lse(fmha_calls):
    """No request has a cached prefix and the call saves its k/v: the cache holds exactly
    those keys, so FMHAv2 attends over the rows (faster with a factor than over pages, and
    with softmax statistics); the factor is honoured and the LSE is that of the kept tiles."""
    flashinfer_impl()
    b = _two_level_batch(q_len=1024, p_len=0)
    dense, _ = oracle(dataclasses.replace(b, q=b.q.cpu()))
    assert dense[-64:].min() > 0.2  # what ignoring the factor would give
    fullcg.reset_skip_softmax_stats()
    results = {}
    for impl in ("flashinfer", "reference"):
        with fullcg.forward_context(b.metadata, b.layer, config=config(impl, prefill_scale_factor=128.0)):
            results[impl] = b.layer(b.q, b.k, b.v, return_lse=True)
    assert fmha_calls == ["attend_contiguous"]
    (out, lse), (ref, ref_lse) = results["flashinfer"], results["reference"]
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=0)
    assert out.float().abs().max() < 0.05
    torch.testing.assert_close(lse, ref_lse, **TOL)
    assert fullcg.skip_softmax_stats()[b.layer.layer_id].unmeasured_calls == 1
    # The saved k/v are in the cache as usual: a later extend step reads them.
    pages = b.metadata.page_table[0, :8].long()
    assert torch.equal(b.layer.kv_cache.k[pages, 0], b.k[0:128:16])


@needs_hopper
def test_a_prefill_without_a_cached_prefix_and_no_factor_or_lse_stays_on_the_paged_kernel(fmha_calls):
    """Dense and without LSE the paged kernel is as fast and needs no copy of k/v."""
    flashinfer_impl()
    b = batch("prefill", head_dim=128)
    with fullcg.forward_context(b.metadata, b.layer, config=config("flashinfer")):
        b.layer(b.q, b.k, b.v)
        b.layer(b.q, b.k, b.v, return_lse=True)
    assert fmha_calls == ["attend_paged", "attend_contiguous"]


@needs_hopper
def test_a_factor_fmha_v2_would_misapply_to_a_short_request_is_refused_on_hopper():
    flashinfer_impl()
    b = on_gpu(make_batch([150], [0], num_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=DTYPE))
    with fullcg.forward_context(b.metadata, b.layer, config=config("flashinfer", prefill_scale_factor=500.0)):
        with pytest.raises(ValueError, match="request 0 has 150 keys"):
            b.layer(b.q, b.k, b.v)


@needs_hopper
def test_fmha_v2_can_be_turned_off(monkeypatch, fmha_calls):
    impl = flashinfer_impl()
    monkeypatch.setattr(impl, "use_fmha_v2", False)
    b = batch("prefill", head_dim=128)
    with fullcg.forward_context(b.metadata, b.layer, config=config("flashinfer")):
        out = b.layer(b.q, b.k, b.v)
    assert fmha_calls == []
    expected_out, _ = oracle(dataclasses.replace(b, q=b.q.cpu()))
    torch.testing.assert_close(out.double().cpu(), expected_out, **TOL)


@needs_gpu
def test_a_factor_for_modes_absent_from_the_batch_runs_dense():
    flashinfer_impl()
    b = batch("prefill")
    ref_out, _ = attend(b, "reference")
    with fullcg.forward_context(b.metadata, b.layer, config=config("flashinfer", decode_scale_factor=4.0)):
        out = b.layer(b.q, b.k, b.v)
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL)


def _padded(b: Batch, size: int) -> tuple[Batch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's q/k/v padded to ``size`` rows and its slot mapping padded with -1."""
    n = b.metadata.num_tokens
    pad = size - n

    def grow(x):
        return torch.cat([x, torch.zeros(pad, *x.shape[1:], device=DEVICE, dtype=x.dtype)])

    slots = torch.cat([b.metadata.slot_mapping, torch.full((pad,), -1, dtype=torch.int64, device=DEVICE)])
    return dataclasses.replace(b, metadata=dataclasses.replace(b.metadata, slot_mapping=slots)), grow(b.q), grow(b.k), grow(b.v)


def _batch_with_pages(q_lens: list[int], p_lens: list[int], num_pages: int, seed: int) -> Batch:
    """A GPU batch whose cache has exactly ``num_pages`` pages (so two batches' caches fit one another)."""
    used = sum(-(-(q + p) // 16) for q, p in zip(q_lens, p_lens))
    return on_gpu(make_batch(q_lens, p_lens, num_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=DTYPE,
                             seed=seed, spare_pages=num_pages - used))


@needs_gpu
@pytest.mark.parametrize("kind", ["decode", "extend"])
def test_captured_attention_replays_a_different_batch_of_the_same_padded_size(kind):
    """Warm up eagerly, plan outside capture, capture once; then plan another batch of the
    same padded size and replay: the output matches the oracle for the new batch.

    As a runner does, the metadata tensors the graph reads (slot mapping, real token
    count) live in static buffers that are refilled before the replay.
    """
    impl = flashinfer_impl()
    assert impl.capture_safe
    size = 8
    if kind == "decode":
        first, second = ([1] * 5, [3, 40, 17, 9, 22]), ([1] * 7, [30, 2, 5, 64, 11, 8, 19])
    else:
        first, second = ([3, 2], [10, 30]), ([2, 1, 4], [5, 20, 33])  # the second is mixed
    cfg = FullCGConfig(attention_impl="flashinfer", capture_sizes=(size,))
    b1 = _batch_with_pages(*first, num_pages=48, seed=3)
    b2 = _batch_with_pages(*second, num_pages=48, seed=4)
    layer, cache = b1.layer, b1.layer.kv_cache
    p1, q1, k1, v1 = _padded(b1, size)
    p2, q2, k2, v2 = _padded(b2, size)
    static_q, static_k, static_v = q1.clone(), k1.clone(), v1.clone()
    static_slots = p1.metadata.slot_mapping.clone()
    static_count = p1.metadata.num_tokens_tensor.clone()
    md1 = dataclasses.replace(p1.metadata, slot_mapping=static_slots, num_tokens_tensor=static_count)

    with fullcg.forward_context(md1, layer, config=cfg) as ctx:
        layer(static_q, static_k, static_v, return_lse=True)  # warm-up: the implementation learns the shape
        impl.plan(ctx)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out, static_lse = layer(static_q, static_k, static_v, return_lse=True)

    # The second batch: its prefixes into the captured cache, its inputs into the static buffers.
    cache.k.copy_(b2.layer.kv_cache.k)
    cache.v.copy_(b2.layer.kv_cache.v)
    for dst, src in ((static_q, q2), (static_k, k2), (static_v, v2)):
        dst.copy_(src)
    static_slots.copy_(p2.metadata.slot_mapping)
    static_count.copy_(p2.metadata.num_tokens_tensor)
    md2 = dataclasses.replace(p2.metadata, slot_mapping=static_slots, num_tokens_tensor=static_count)
    with fullcg.forward_context(md2, layer, config=cfg) as ctx:
        impl.plan(ctx)
        graph.replay()
    torch.cuda.synchronize()

    n = md2.num_tokens
    expected_out, expected_lse = oracle(dataclasses.replace(b2, q=b2.q.cpu()))
    torch.testing.assert_close(static_out[:n].double().cpu(), expected_out, **TOL)
    torch.testing.assert_close(static_lse[:n].double().cpu(), expected_lse, **TOL)
    assert torch.equal(static_out[n:], torch.zeros_like(static_out[n:]))
    assert torch.isneginf(static_lse[n:]).all()
    # The replay also saved the second batch's new k/v into its slots.
    flat_k = cache.k.view(-1, *cache.k.shape[2:])
    torch.testing.assert_close(flat_k[p2.metadata.slot_mapping[:n]], b2.k, atol=0, rtol=0)


@needs_gpu
def test_capturing_an_unplanned_batch_fails_with_the_fix():
    flashinfer_impl()  # skips without FlashInfer
    b = batch("decode", seed=11)
    cfg = FullCGConfig(attention_impl="flashinfer", capture_sizes=(8,))
    p, q, k, v = _padded(b, 8)
    with fullcg.forward_context(p.metadata, b.layer, config=cfg):
        b.layer(q, k, v)  # eager: plans this metadata object
    fresh = dataclasses.replace(p.metadata)  # same batch, new object: not planned
    with fullcg.forward_context(fresh, b.layer, config=cfg):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="plan"):
            with torch.cuda.graph(graph):
                b.layer(q, k, v)


@needs_hopper
def test_auto_runs_skip_softmax_prefill_on_fmha_v2_and_what_flashinfer_would_refuse_on_triton(fmha_calls):
    """Hopper, both factors set (and different): a prefill batch runs on FMHAv2, a
    decode-only batch (no skip-softmax decode in FlashInfer on SM90) and a mixed one (one
    factor per FlashInfer call) on the Triton kernels; all agree with the reference."""
    pytest.importorskip("triton")
    flashinfer_impl()
    assert resolve_implementation("auto", DEVICE, 128, 128).name == "auto"
    factors = dict(prefill_scale_factor=8.0, decode_scale_factor=4.0)
    for name in ("prefill", "decode", "mixed"):
        b = batch(name, head_dim=128)
        outs = []
        for impl in ("auto", "reference"):
            with fullcg.forward_context(b.metadata, b.layer, config=config(impl, **factors)):
                outs.append(b.layer(b.q, b.k, b.v))
        torch.testing.assert_close(outs[0].float(), outs[1].float(), **TOL)
    # The prefill batch has no cached prefix: FMHAv2 over its own rows (see above).
    assert fmha_calls == ["attend_contiguous"]


@needs_gpu
@pytest.mark.parametrize("name", list(BATCHES))
def test_serves_says_exactly_which_calls_forward_computes_rather_than_refuses(name, monkeypatch):
    """``auto`` trusts ``serves``: over batch kinds, factors, LSE and cache use, a call it
    serves runs, and a call it does not serve is refused."""
    impl = flashinfer_impl()
    real_forward = impl.forward
    verdicts: list[tuple[bool, bool]] = []  # (served, ran)

    def forward(call, ctx, cache):
        served = impl.serves(call, ctx, cache)
        try:
            result = real_forward(call, ctx, cache)
        except (ValueError, RuntimeError):
            verdicts.append((served, False))
            raise
        verdicts.append((served, True))
        return result

    monkeypatch.setattr(impl, "forward", forward)
    b = batch(name, head_dim=128)
    for factors in ({}, {"prefill_scale_factor": 8.0}, {"decode_scale_factor": 4.0},
                    {"prefill_scale_factor": 8.0, "decode_scale_factor": 8.0}):
        for kwargs in ({}, {"return_lse": True}, {"use_kv_cache": False}):
            with fullcg.forward_context(b.metadata, b.layer, config=config("flashinfer", **factors)):
                try:
                    b.layer(b.q, b.k, b.v, **kwargs)
                except (ValueError, RuntimeError):
                    pass
    assert len(verdicts) == 12
    assert all(served == ran for served, ran in verdicts), verdicts


@needs_hopper
@pytest.mark.parametrize(("variant", "padded_size", "uses_fmha_v2"), [
    ("full", 32, False),  # the warm-up of a capture: FA2, as the capture
    ("full", None, True),  # a full graph run uncaptured
    ("piecewise", 32, True),  # attention between captured pieces is never captured
])
def test_fmha_v2_stays_out_of_full_graphs_at_capture_sizes(variant, padded_size, uses_fmha_v2, fmha_calls):
    from fullcg.context import derived_context

    flashinfer_impl()
    b = batch("prefill", head_dim=128)
    cfg = config("flashinfer")
    with fullcg.forward_context(b.metadata, b.layer, config=cfg) as ctx:
        with derived_context(ctx, config=cfg, variant=variant, padded_size=padded_size):
            out = b.layer(b.q, b.k, b.v)
    assert fmha_calls == (["attend_paged"] if uses_fmha_v2 else [])
    expected_out, _ = oracle(dataclasses.replace(b, q=b.q.cpu()))
    torch.testing.assert_close(out.double().cpu(), expected_out, **TOL)


@needs_gpu
def test_a_full_graph_at_a_capture_size_counts_the_decode_factor_even_when_captured_on_a_prefill_batch(fmha_calls):
    """Such a graph also replays mixed batches, whose decode rows need the decode factor:
    FlashInfer, which would bake them dense, refuses; ``auto`` runs the call on Triton."""
    from fullcg.context import derived_context

    pytest.importorskip("triton")
    flashinfer_impl()
    b = batch("prefill", head_dim=128)
    expected_out, _ = oracle(dataclasses.replace(b, q=b.q.cpu()))
    for impl in ("flashinfer", "auto"):
        cfg = config(impl, decode_scale_factor=4.0)
        with fullcg.forward_context(b.metadata, b.layer, config=cfg) as ctx:
            with derived_context(ctx, config=cfg, variant="full", padded_size=32):
                if impl == "flashinfer":
                    with pytest.raises(ValueError, match="attention_impl='triton'"):
                        b.layer(b.q, b.k, b.v)
                else:
                    out = b.layer(b.q, b.k, b.v)
                    torch.testing.assert_close(out.double().cpu(), expected_out, **TOL)
    assert fmha_calls == []


# ---------------------------------------------------------------- sliding windows and soft-caps

MASKS = {
    "window": dict(sliding_window=16),
    "softcap": dict(logit_softcap=2.0),
    "window_and_softcap": dict(sliding_window=9, logit_softcap=1.5),
}


def naive_options(mask: dict) -> dict:
    """``mask`` (layer attributes) as the oracle's options."""
    return {"window": mask.get("sliding_window"), "softcap": mask.get("logit_softcap")}


def assert_mask_matters(b: Batch, mask: dict) -> None:
    """The window or soft-cap changes this batch's result: a kernel that ignored it would fail."""
    with_mask, _ = oracle(dataclasses.replace(b, q=b.q.cpu()), **naive_options(mask))
    without, _ = oracle(dataclasses.replace(b, q=b.q.cpu()))
    assert (with_mask - without).abs().max() > 0.1


@needs_gpu
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("name", list(BATCHES))
def test_windows_and_softcaps_over_the_cache_match_the_reference_and_oracle_on_fa2(name, mask, fmha_calls):
    """Prefill, extend, decode and mixed batches, with the natural-log LSE; FA2 even where
    FMHAv2 would run the call unmasked (bf16 prefill and extend on Hopper)."""
    flashinfer_impl()
    b = batch(name, **MASKS[mask])
    assert_mask_matters(b, MASKS[mask])
    out, lse = assert_matches_reference(b)
    expected_out, expected_lse = oracle(dataclasses.replace(b, q=b.q.cpu()), **naive_options(MASKS[mask]))
    torch.testing.assert_close(out.double().cpu(), expected_out, **TOL)
    torch.testing.assert_close(lse.double().cpu(), expected_lse, **TOL)
    assert fmha_calls == []


@needs_gpu
@pytest.mark.parametrize("mask", list(MASKS))
def test_windows_and_softcaps_over_given_kv_match_the_oracle_with_dead_padding_rows(mask):
    """Causal attention over given k/v: the window counts back from each request's own rows."""
    flashinfer_impl()
    b = batch("prefill", **MASKS[mask])
    pad = 3
    q, k, v = (torch.cat([x, torch.zeros(pad, *x.shape[1:], device=DEVICE, dtype=DTYPE)]) for x in (b.q, b.k, b.v))
    out, lse = attend(b, "flashinfer", q=q, k=k, v=v, use_kv_cache=False, save_kv_cache=False)
    n = b.metadata.num_tokens
    assert torch.equal(out[n:], torch.zeros_like(out[n:])) and torch.isneginf(lse[n:]).all()
    starts = b.metadata.query_starts
    for r in range(b.metadata.num_requests):
        s, e = starts[r], starts[r + 1]
        o, l = naive_attention(b.q[s:e].cpu(), b.k[s:e].cpu(), b.v[s:e].cpu(), b.layer.scale, 0,
                               **naive_options(MASKS[mask]))
        torch.testing.assert_close(out[s:e].double().cpu(), o, **TOL)
        torch.testing.assert_close(lse[s:e].double().cpu(), l, **TOL)


def _layers(b: Batch, masks: list[dict]) -> torch.nn.ModuleList:
    """One layer per mask (layer ids 0, 1, ...), each with its own copy of ``b``'s cache."""
    layers = torch.nn.ModuleList()
    for i, mask in enumerate(masks):
        layer = fullcg.Attention(b.layer.num_heads, b.layer.head_dim, b.layer.num_kv_heads, layer_id=i, **mask)
        layer.kv_cache = copy.deepcopy(b.layer.kv_cache)
        layers.append(layer)
    return layers


#: Gemma-like: sliding and full layers alternate; two windows, a soft-capped layer.
STEP_MASKS = [dict(sliding_window=16), {}, dict(sliding_window=16), dict(sliding_window=5, logit_softcap=3.0), {}]


@needs_gpu
@pytest.mark.parametrize("name", ["extend", "decode", "mixed"])
def test_layers_with_different_windows_in_one_step_each_attend_with_their_own(name):
    """Each layer's plan carries its window: the full layer after a sliding one, and the
    sliding one after the full one, are planned apart and all match the oracle."""
    flashinfer_impl()
    b = batch(name)
    layers = _layers(b, STEP_MASKS)
    with fullcg.forward_context(b.metadata, layers, config=config("flashinfer")):
        results = [layer(b.q, b.k, b.v, return_lse=True) for layer in layers]
    for mask, (out, lse) in zip(STEP_MASKS, results):
        expected_out, expected_lse = oracle(dataclasses.replace(b, q=b.q.cpu()), **naive_options(mask))
        torch.testing.assert_close(out.double().cpu(), expected_out, **TOL)
        torch.testing.assert_close(lse.double().cpu(), expected_lse, **TOL)


@needs_gpu
@pytest.mark.parametrize("kind", ["decode", "extend"])
def test_captured_layers_with_different_windows_replay_a_different_batch_of_the_same_padded_size(kind):
    """A sliding (and soft-capped) layer and a full one in one captured graph, replayed for
    another batch after plan(ctx): each matches the oracle with its own window."""
    impl = flashinfer_impl()
    size = 8
    if kind == "decode":
        first, second = ([1] * 5, [3, 40, 17, 9, 22]), ([1] * 7, [30, 2, 5, 64, 11, 8, 19])
    else:
        first, second = ([3, 2], [10, 30]), ([2, 1, 4], [5, 20, 33])  # the second is mixed
    masks = [dict(sliding_window=12, logit_softcap=3.0), {}]
    cfg = FullCGConfig(attention_impl="flashinfer", capture_sizes=(size,))
    b1 = _batch_with_pages(*first, num_pages=48, seed=3)
    b2 = _batch_with_pages(*second, num_pages=48, seed=4)
    layers = _layers(b1, masks)
    p1, q1, k1, v1 = _padded(b1, size)
    p2, q2, k2, v2 = _padded(b2, size)
    static_q, static_k, static_v = q1.clone(), k1.clone(), v1.clone()
    static_slots = p1.metadata.slot_mapping.clone()
    static_count = p1.metadata.num_tokens_tensor.clone()
    md1 = dataclasses.replace(p1.metadata, slot_mapping=static_slots, num_tokens_tensor=static_count)

    with fullcg.forward_context(md1, layers, config=cfg) as ctx:
        for layer in layers:  # warm-up: the implementation learns both shapes
            layer(static_q, static_k, static_v, return_lse=True)
        impl.plan(ctx)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = [layer(static_q, static_k, static_v, return_lse=True) for layer in layers]

    for layer in layers:
        layer.kv_cache.k.copy_(b2.layer.kv_cache.k)
        layer.kv_cache.v.copy_(b2.layer.kv_cache.v)
    for dst, src in ((static_q, q2), (static_k, k2), (static_v, v2)):
        dst.copy_(src)
    static_slots.copy_(p2.metadata.slot_mapping)
    static_count.copy_(p2.metadata.num_tokens_tensor)
    md2 = dataclasses.replace(p2.metadata, slot_mapping=static_slots, num_tokens_tensor=static_count)
    with fullcg.forward_context(md2, layers, config=cfg) as ctx:
        impl.plan(ctx)
        graph.replay()
    torch.cuda.synchronize()

    n = md2.num_tokens
    for mask, (out, lse) in zip(masks, static):
        expected_out, expected_lse = oracle(dataclasses.replace(b2, q=b2.q.cpu()), **naive_options(mask))
        torch.testing.assert_close(out[:n].double().cpu(), expected_out, **TOL)
        torch.testing.assert_close(lse[:n].double().cpu(), expected_lse, **TOL)
        assert torch.equal(out[n:], torch.zeros_like(out[n:])) and torch.isneginf(lse[n:]).all()


@needs_gpu
def test_a_softcap_over_prefix_chunks_merges_to_attention_over_the_whole_sequence():
    flashinfer_impl()
    b = batch("mixed", prefix_chunk_tokens=20, logit_softcap=2.0)
    assert len(b.metadata.prefix_chunks) > 1
    with fullcg.forward_context(b.metadata, b.layer, config=config("flashinfer")):
        out, lse = b.layer(b.q, b.k, b.v, return_lse=True, use_kv_cache=False, save_kv_cache=True)
        b.layer.merge_prefix_chunks(b.q, out, lse)
    expected_out, expected_lse = oracle(dataclasses.replace(b, q=b.q.cpu()), softcap=2.0)
    torch.testing.assert_close(out.double().cpu(), expected_out, **TOL)
    torch.testing.assert_close(lse.double().cpu(), expected_lse, **TOL)


@needs_gpu
def test_a_window_over_a_prefix_chunk_is_refused_naming_the_alternative():
    impl = flashinfer_impl()
    b = batch("mixed", prefix_chunk_tokens=20, sliding_window=16)
    with fullcg.forward_context(b.metadata, b.layer, config=config("flashinfer")) as ctx:
        ck, cv = b.layer.gather_prefix_chunk(0)
        with pytest.raises(ValueError, match="prefix chunk.*attention_impl='triton' or 'auto'"):
            b.layer(b.q, ck, cv, return_lse=True, use_kv_cache=False, causal=False, prefix_chunk=0,
                    save_kv_cache=False)
        call = AttentionCall(op="attention_with_lse", q=b.q, k=ck, v=cv, out=torch.empty_like(b.q), layer_id=0,
                             key_value_num_tokens=None, prefill_scale_factor=None, decode_scale_factor=None,
                             scale=b.layer.scale, use_kv_cache=False, causal=False, prefix_chunk=0,
                             save_kv_cache=False, return_lse=True, sliding_window=16)
        assert not impl.serves(call, ctx, None)


@needs_gpu
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("name", list(BATCHES))
def test_serves_says_exactly_which_windowed_and_softcapped_calls_forward_computes(name, mask, monkeypatch):
    """Over factors, LSE and cache use: a skip-softmax factor the batch uses is refused with
    a window or soft-cap (FA2 would ignore it); everything else is computed."""
    impl = flashinfer_impl()
    real_forward = impl.forward
    verdicts: list[tuple[bool, bool, dict, dict]] = []  # (served, ran, factors, kwargs)

    def forward(call, ctx, cache):
        served = impl.serves(call, ctx, cache)
        try:
            result = real_forward(call, ctx, cache)
        except (ValueError, RuntimeError):
            verdicts.append((served, False, factors, kwargs))
            raise
        verdicts.append((served, True, factors, kwargs))
        return result

    monkeypatch.setattr(impl, "forward", forward)
    b = batch(name, **MASKS[mask])
    for factors in ({}, {"prefill_scale_factor": 8.0}, {"decode_scale_factor": 4.0}):
        for kwargs in ({}, {"return_lse": True}, {"use_kv_cache": False}):
            with fullcg.forward_context(b.metadata, b.layer, config=config("flashinfer", **factors)):
                try:
                    b.layer(b.q, b.k, b.v, **kwargs)
                except (ValueError, RuntimeError):
                    pass
    assert len(verdicts) == 9
    assert all(served == ran for served, ran, _, _ in verdicts), verdicts
    md = b.metadata
    for served, _, factors, kwargs in verdicts:
        used = (not md.is_decode_only and "prefill_scale_factor" in factors) or (
            md.has_decode and "decode_scale_factor" in factors)
        assert served == (not used), (factors, kwargs)
