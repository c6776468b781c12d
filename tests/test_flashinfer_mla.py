"""The ``flashinfer`` implementation runs multi-head latent attention on FlashInfer's MLA
kernel, and DeepSeek's decompressed head dims (192/128) on its ragged prefill.

GPU tests run the same steps through ``attention_impl="reference"`` and ``"flashinfer"`` at
DeepSeek's dims (bf16) and compare outputs, LSE and the latent cache; they are skipped
without a GPU or FlashInfer. The CPU tests check what fullcg hands FlashInfer (index arrays,
plans, CUDA-graph buffers, recorded by stand-in wrappers), the schedule bound against a port
of FlashInfer's planner, the refusals, and the latent save.
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
from fullcg.mla import allocate_latent_cache
from fullcg.ops import torch_ops
from fullcg.ops.call import AttentionCall
from fullcg.ops.impl import resolve_implementation

flashinfer_mla = pytest.importorskip(
    "fullcg.ops.impl.flashinfer_mla", reason="triton is not installed (the latent save is a Triton kernel)")

H, RANK, NOPE, ROPE, VDIM = 16, 512, 128, 64, 128
SCALE = 1.0 / math.sqrt(NOPE + ROPE)
SMS = 132  # an H100/H200's


# ---------------------------------------------------------------- CPU: what fullcg hands FlashInfer


def _port_of_mla_plan_work_items(q_lens: list[int], kv_lens: list[int], heads: int, sms: int) -> int:
    """The work items ``MLAPlan`` (FlashInfer's ``scheduler.cuh``) makes for a causal batch:
    its loops, without the cost heap."""
    cluster = 2 if sum(q * heads for q in q_lens) // len(q_lens) > 64 else 1
    clusters, tile = sms // cluster, cluster * 64

    def causal_end(q: int, kv: int, t: int, tiles: int) -> int:
        if t + 1 == tiles:
            return kv
        return max(min(kv - q + -(-((t + 1) * tile) // heads), kv), 0)

    ends = [[causal_end(q, kv, t, -(-q * heads // tile)) for t in range(-(-q * heads // tile))]
            for q, kv in zip(q_lens, kv_lens)]
    total = sum(sum(e) for e in ends)
    x = max(-(-total // clusters), 1)
    limit = 32 if x <= 8 else 64 if x <= 16 else 128 if x <= 32 else 192 if x <= 64 else -(-x // 256) * 256
    return sum(1 if e == 0 else -(-e // limit) for request in ends for e in request)


@pytest.mark.parametrize("heads", [16, 128])
def test_the_schedule_bound_covers_what_flashinfers_planner_makes(heads):
    g = torch.Generator().manual_seed(heads)
    for _ in range(200):
        r = int(torch.randint(1, 40, (1,), generator=g))
        q_lens = torch.randint(1, 300, (r,), generator=g).tolist()
        if r > 1 and bool(torch.rand(1, generator=g) < 0.5):
            q_lens = [1] * r  # decode batches
        kv_lens = [q + int(torch.randint(0, 5000, (1,), generator=g)) for q in q_lens]
        made = _port_of_mla_plan_work_items(q_lens, kv_lens, heads, SMS)
        bound = flashinfer_mla.schedule_bound(q_lens, heads, SMS)
        assert made <= bound, (q_lens, kv_lens)
        assert bound <= made + SMS, "the bound is one tile per request tile plus one per cluster"


@pytest.mark.parametrize("heads", [16, 128])
def test_a_cuda_graph_plan_is_judged_by_its_worst_case_at_its_padded_size(heads):
    """One-row requests make the most tiles at a given row count: every batch replayed at
    that size (as many requests as rows, padding included) fits if they do."""
    for size in (8, 64, 512):
        worst = flashinfer_mla.padded_schedule_bound(size, heads, SMS)
        assert worst == flashinfer_mla.schedule_bound([1] * size, heads, SMS)
        for q_lens in ([size] + [0] * (size - 1), [size // 2, size // 2] + [0] * (size - 2),
                       [1] * (size // 2) + [size // 2] + [0] * (size // 2 - 1)):
            assert flashinfer_mla.schedule_bound(q_lens, heads, SMS) <= worst


def _latent_cache(num_pages: int, page_size: int, *, rank: int = RANK, dtype=torch.bfloat16, device="cpu"):
    cache = allocate_latent_cache(num_pages, page_size, rank, ROPE, dtype=dtype, device=device)
    cache.k.normal_(generator=torch.Generator(device=device).manual_seed(num_pages))
    return cache


def _table(pages_per_request: list[int], num_pages: int, seed: int = 0) -> torch.Tensor:
    """A page table whose requests own scattered pages."""
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    table = torch.zeros(len(pages_per_request), max(pages_per_request) + 1, dtype=torch.int32)
    used = 0
    for r, n in enumerate(pages_per_request):
        table[r, :n] = perm[used: used + n]
        used += n
    return table


def _metadata(q_lens, p_lens, page_size, num_pages, seed=0, device="cpu", prefix_chunk_tokens=4096):
    pages = [-(-(q + p) // page_size) for q, p in zip(q_lens, p_lens)]
    return fullcg.AttentionMetadata.build(q_lens, p_lens, _table(pages, num_pages, seed), page_size, device=device,
                                          prefix_chunk_tokens=prefix_chunk_tokens)


def _call(q: torch.Tensor, *, v_dim: int = RANK, window=None, softcap=None, factor=None) -> AttentionCall:
    t = q.shape[0]
    zeros = q.new_zeros(1, 1, 1)  # expanded: a call may be shaped beyond what memory holds
    k = zeros.expand(t, 1, q.shape[2])
    return AttentionCall(
        op="attention_with_lse", q=q, k=k, v=k[..., :v_dim], out=zeros.expand(t, q.shape[1], v_dim), layer_id=0,
        key_value_num_tokens=None, prefill_scale_factor=factor, decode_scale_factor=factor, scale=SCALE,
        use_kv_cache=True, causal=True, prefix_chunk=None, save_kv_cache=True, return_lse=True,
        sliding_window=window, logit_softcap=softcap,
    )


def test_refusals_name_the_fix_and_a_dense_deepseek_call_passes():
    cache = _latent_cache(8, 16)
    q = torch.zeros(5, H, RANK + ROPE, dtype=torch.bfloat16)
    ok = dict(device_capability=(9, 0), uses_factor=False, work_items=200)

    def refused(call, c=cache, **changes):
        return flashinfer_mla.refusal(call, c, "here", **{**ok, **changes})

    assert refused(_call(q)) is None
    assert isinstance(refused(_call(q.float()), _latent_cache(8, 16, dtype=torch.float32)), TypeError)
    assert "allocate the cache in q's dtype" in str(refused(_call(q.half())))
    small = _latent_cache(8, 16, rank=256)
    assert "kv_lora_rank 256" in str(refused(_call(q[..., :256 + ROPE], v_dim=256), small))
    cases = {
        "no sliding window": refused(_call(q, window=8)),
        "no sliding window or logit soft-capping": refused(_call(q, softcap=30.0)),
        "no skip-softmax": refused(_call(q), uses_factor=True),
        "SM80 or newer": refused(_call(q), device_capability=(7, 5)),
        "work items": refused(_call(q), work_items=flashinfer_mla.MAX_WORK_ITEMS + 1),
        # Shape only: the 32-bit row offsets of the kernel overflow.
        "32-bit row offsets": refused(_call(torch.zeros(1, dtype=torch.bfloat16).expand(2**16, 128, RANK + ROPE))),
    }
    for words, error in cases.items():
        assert error is not None and words in str(error), (words, error)
        fix = "attention_impl='reference'" if words == "no skip-softmax" else "attention_impl='triton' or 'reference'"
        assert fix in str(error), error


def test_kv_lens_come_from_the_paged_layout():
    pages = torch.tensor([0, 3, 4, 10], dtype=torch.int32)  # 3, 1 and 6 pages
    last = torch.tensor([16, 5, 1], dtype=torch.int32)
    assert flashinfer_mla.kv_lens(pages, last, 16).tolist() == [48, 5, 81]


@pytest.mark.parametrize("v_leads_k", [False, True])
def test_the_latent_save_leaves_what_saving_k_then_v_into_vs_view_leaves(v_leads_k):
    torch.manual_seed(0)
    n, pad = 5, 3
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the Triton save: a GPU or the interpreter
    k = torch.randn(n + pad, 1, RANK + ROPE, device=dev)
    v = k[..., :RANK] if v_leads_k else torch.randn(n + pad, 1, RANK, device=dev)
    slots = torch.tensor([17, 3, 40, 8, 9] + [-1] * pad, device=dev)
    ctx = types.SimpleNamespace(metadata=types.SimpleNamespace(slot_mapping=slots))
    call = types.SimpleNamespace(k=k, v=v)
    got = _latent_cache(4, 16, dtype=torch.float32, device=dev)
    want = _latent_cache(4, 16, dtype=torch.float32, device=dev)
    flashinfer_mla.save_latent(call, ctx, got)
    torch_ops.save_kv(want, k[:n], v[:n], slots[:n])
    assert torch.equal(got.k, want.k)


class _RecordingMLAWrapper:
    """Stands in for ``BatchMLAPagedAttentionWrapper`` on the CPU: records its plans and, as
    FlashInfer's planner, derives its launch from the average packed query rows."""

    def __init__(self, float_workspace, use_cuda_graph=False, qo_indptr=None, kv_indptr=None, kv_indices=None,
                 kv_len_arr=None, backend="auto") -> None:
        self._int_workspace_buffer = torch.zeros(8, dtype=torch.uint8)
        self.backend = backend
        self.use_cuda_graph = use_cuda_graph
        self.buffers = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr)
        self.plans: list[dict] = []

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, **kwargs) -> None:
        self.plans.append(dict(qo_indptr=qo_indptr.tolist(), kv_indptr=kv_indptr.tolist(),
                               kv_indices=kv_indices.tolist(), kv_len_arr=kv_len_arr.tolist(), **kwargs))
        q = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
        cluster = 2 if sum(q) * kwargs["num_heads"] // len(q) > 64 else 1
        self._plan_info = (cluster, SMS // cluster, 0, 1024)


class _Unused:
    def __init__(self, *args, **kwargs) -> None:
        raise AssertionError("only the MLA wrapper plans latent-cache calls")


@pytest.fixture
def stand_in(monkeypatch) -> types.ModuleType:
    """``fullcg.ops.impl.flashinfer`` loaded afresh over a stand-in ``flashinfer`` whose MLA
    wrapper records its plans (on a CPU: no SM count to ask; registrations go nowhere)."""
    module = types.ModuleType("flashinfer")
    module.BatchMLAPagedAttentionWrapper = _RecordingMLAWrapper
    for name in ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
                 "BatchPrefillWithRaggedKVCacheWrapper"):
        setattr(module, name, _Unused)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(fullcg.ops.impl, "_registry", {})
    monkeypatch.setattr(flashinfer_mla, "num_sms", lambda index: SMS)
    name = "fullcg.ops.impl._flashinfer_mla_over_a_stand_in"
    spec = importlib.util.spec_from_file_location(name, fullcg.ops.impl.__path__[0] + "/flashinfer.py")
    loaded = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, loaded)
    spec.loader.exec_module(loaded)
    return loaded


def _impl(stand_in):
    impl = stand_in.FlashInferAttention()
    impl.mla_backend = "fa2"  # no GPU to ask
    return impl


def _plan(impl, md, cache, rows: int, config: FullCGConfig, heads: int = H):
    call = _call(torch.zeros(rows, heads, RANK + ROPE, dtype=torch.bfloat16))
    with torch.inference_mode(), fullcg.forward_context(md, {0: cache}, config=config) as ctx:
        shape, kind = impl._shape_and_kind(call, cache)
        assert kind == ("mla",)
        return impl._planned(call, ctx, shape, kind, cache, None)


def test_an_mla_call_plans_the_mla_wrapper_over_each_requests_prefix_and_new_tokens(stand_in):
    impl = _impl(stand_in)
    assert impl.takes_v_in_k and impl.capture_safe
    cache = _latent_cache(40, 16)
    q_lens, p_lens = [5, 1, 1, 9], [12, 30, 0, 100]
    md = _metadata(q_lens, p_lens, 16, 40)
    plan = _plan(impl, md, cache, md.num_tokens, FullCGConfig(capture_sizes=(64,)))  # 16 rows: no capture size
    wrapper = plan.wrapper
    assert isinstance(wrapper, _RecordingMLAWrapper) and not wrapper.use_cuda_graph and plan.slots is None
    (planned,) = wrapper.plans
    kv = [q + p for q, p in zip(q_lens, p_lens)]
    pages = [-(-n // 16) for n in kv]
    assert planned["qo_indptr"] == [0, 5, 6, 7, 16]
    assert planned["kv_len_arr"] == kv
    assert planned["kv_indptr"] == [0, *torch.tensor(pages).cumsum(0).tolist()]
    assert planned["kv_indices"] == sum((md.page_table[r, :n].tolist() for r, n in enumerate(pages)), [])
    assert planned == {**planned, "num_heads": H, "head_dim_ckv": RANK, "head_dim_kpe": ROPE, "page_size": 16,
                       "causal": True, "sm_scale": SCALE, "q_data_type": torch.bfloat16,
                       "kv_data_type": torch.bfloat16}


@pytest.mark.parametrize("heads", [16, 128])
def test_cuda_graph_plans_keep_the_capture_launch_for_every_batch_at_their_padded_size(stand_in, heads):
    """One request per row (padding included): the average packed rows per request is the
    head count for every batch, so FlashInfer's grid never changes between replays."""
    impl = _impl(stand_in)
    size = 16
    cache = _latent_cache(64, 16)
    config = FullCGConfig(capture_sizes=(size,))
    batches = [([1] * 5, [3, 40, 17, 9, 22]), ([3, 2], [10, 30]), ([2, 1, 4], [5, 20, 33]), ([16], [0]),
               ([1] * 16, [7] * 16)]
    wrappers = set()
    for i, (q_lens, p_lens) in enumerate(batches):
        md = _metadata(q_lens, p_lens, 16, 64, seed=i)
        plan = _plan(impl, md, cache, size, config, heads)
        wrapper = plan.wrapper
        wrappers.add(id(wrapper))
        planned = wrapper.plans[-1]
        assert plan.slots == size and wrapper.use_cuda_graph
        assert planned["qo_indptr"][-1] == size and len(planned["qo_indptr"]) == size + 1
        # Real requests first, then the padding's: every row is some request's, none sees no key.
        rows = torch.tensor(planned["qo_indptr"]).diff().tolist()
        assert rows[: len(q_lens)] == q_lens
        assert all(kv >= q for q, kv in zip(rows, planned["kv_len_arr"]))
        assert len(planned["kv_indices"]) <= wrapper.buffers["kv_indices"].numel()
    assert len(wrappers) == 1, "one fixed wrapper per padded size"
    (launch,) = set(impl._mla_launches.values())
    assert launch[0] == (2 if heads > 64 else 1)

    # Were FlashInfer's launch to change after all, planning refuses instead of replaying wrong.
    wrapper = next(w for w in impl._wrappers.values() if id(w) in wrappers)
    real_plan = wrapper.plan

    def plan_on_another_grid(*args, **kwargs):
        real_plan(*args, **kwargs)
        wrapper._plan_info = (3, 44, 0, 1024)

    wrapper.plan = plan_on_another_grid
    with pytest.raises(RuntimeError, match="changed its launch.*graph_mode='piecewise'"):
        _plan(impl, _metadata([1], [5], 16, 64), cache, size, config, heads)


def test_mla_wrappers_of_one_shape_share_their_int_workspace_and_plan_ctx_replans_them(stand_in):
    impl = _impl(stand_in)
    cache = _latent_cache(64, 16)
    config = FullCGConfig(capture_sizes=(8, 16))
    small = _plan(impl, _metadata([1] * 4, [5, 6, 7, 8], 16, 64), cache, 8, config).wrapper
    large = _plan(impl, _metadata([9, 1], [0, 3], 16, 64), cache, 16, config).wrapper
    assert small is not large and small._int_workspace_buffer is large._int_workspace_buffer
    md = _metadata([2, 1, 1], [30, 4, 60], 16, 64, seed=5)
    with torch.inference_mode(), fullcg.forward_context(md, {0: cache}, config=config) as ctx:
        impl.plan(ctx)  # what the runner does before replaying a graph of this batch's padded size
    # Padded to 8 rows and requests: the three real ones, one owning the 4 padding rows, 4 empty.
    assert small.plans[-1]["qo_indptr"] == [0, 2, 3, 4, 8, 8, 8, 8, 8]
    assert small.plans[-1]["kv_len_arr"] == [32, 5, 61, 4, 1, 1, 1, 1]


def test_head_dims_flashinfer_takes_for_which_calls(stand_in):
    impl = _impl(stand_in)
    refusal = stand_in.FlashInferAttention._dims_refusal
    assert impl.supports(128, 128) and impl.supports(192, 128) and impl.supports(576, 512)
    assert not impl.supports(96, 96) and not impl.supports(192, 192) and not impl.supports(576, 576)
    q = torch.zeros(4, H, 192)
    ragged = AttentionCall(op="attention", q=q, k=q, v=q[..., :128], out=q[..., :128].clone(), layer_id=0,
                           key_value_num_tokens=None, prefill_scale_factor=None, decode_scale_factor=None,
                           scale=SCALE, use_kv_cache=False, causal=True, prefix_chunk=None, save_kv_cache=False,
                           return_lse=False)
    assert refusal(ragged, None, "here") is None
    paged = fullcg.KVCache.allocate(4, 16, H, 192, v_head_dim=128)
    assert "over given k/v only" in str(refusal(ragged, paged, "here"))
    not_latent = _call(torch.zeros(4, H, RANK + ROPE))
    assert "only over a latent cache" in str(refusal(not_latent, None, "here"))


# ---------------------------------------------------------------- GPU: against the reference


def needs_gpu(fn):
    """A GPU test: selected by ``-m cuda``, skipped with a reason without a GPU."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer kernels need a CUDA GPU")
    return pytest.mark.cuda(skip(fn))


DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16
TOL = dict(atol=2e-2, rtol=2e-2)


def flashinfer_impl():
    pytest.importorskip("flashinfer", reason="flashinfer is not installed: `pip install fullcg[flashinfer]`")
    return resolve_implementation("flashinfer", DEVICE)


def config(impl: str, **options) -> FullCGConfig:
    skip = {k: options.pop(k) for k in ("prefill_scale_factor", "decode_scale_factor") if k in options}
    return FullCGConfig(attention_impl=impl, skip_softmax=SkipSoftmaxConfig(**skip), **options)


def kv_b_weight(seed: int = 1) -> torch.Tensor:
    """kv_b_proj.weight: W_UK scaled so that scores spread about 1 (after the softmax scale),
    W_UV not, so that outputs are large enough for bf16 tolerances to mean something."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(H, NOPE + VDIM, RANK, generator=g)
    w[:, :NOPE] /= math.sqrt(RANK)
    return w.reshape(H * (NOPE + VDIM), RANK).to(DEVICE, DTYPE)


def step_inputs(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q_nope": (n, H, NOPE), "q_pe": (n, H, ROPE), "latent": (n, RANK), "k_pe": (n, ROPE)}
    return {name: torch.randn(*shape, generator=g).to(DEVICE, DTYPE) for name, shape in shapes.items()}


def mla_layer(cache: fullcg.KVCache, layer_id: int = 0) -> fullcg.MLAAttention:
    """An MLA layer over a copy of ``cache`` (same pages, own memory)."""
    mla = fullcg.MLAAttention(H, RANK, NOPE, ROPE, VDIM, layer_id=layer_id)
    k = cache.k.clone()
    mla.attn.kv_cache = fullcg.KVCache(k, k[..., :RANK])
    return mla


def attend(mla, md, inputs, kv_b, impl: str, **options):
    with fullcg.forward_context(md, mla, config=config(impl, **options)):
        return mla(**inputs, kv_b_weight=kv_b, return_lse=True)


def assert_close(out, lse, ref_out, ref_lse):
    torch.testing.assert_close(out.float(), ref_out.float(), atol=TOL["atol"] * ref_out.float().abs().max().item(),
                               rtol=TOL["rtol"])
    torch.testing.assert_close(lse, ref_lse, **TOL)


#: (query_lens, prefix_lens) of one-step batches over random prefixes.
BATCHES = {
    "decode": ([1, 1, 1], [70, 5, 33]),
    "extend": ([7, 12], [40, 23]),
    "mixed": ([13, 1, 6, 1], [0, 50, 37, 16]),
    "prefill": ([21, 9], [0, 0]),
    "long_decode": ([1, 1], [3000, 700]),  # split over clusters: FlashInfer merges partial results
}


@needs_gpu
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("name", list(BATCHES))
def test_mla_over_a_latent_cache_matches_the_reference_with_lse_and_saves_the_same_latents(name, page_size):
    flashinfer_impl()
    q_lens, p_lens = BATCHES[name]
    num_pages = sum(-(-(q + p) // page_size) for q, p in zip(q_lens, p_lens)) + 3
    cache = _latent_cache(num_pages, page_size, device=DEVICE)
    md = _metadata(q_lens, p_lens, page_size, num_pages, seed=page_size, device=DEVICE)
    inputs, kv_b = step_inputs(md.num_tokens, seed=len(name)), kv_b_weight()
    ref, fi = mla_layer(cache), mla_layer(cache)
    ref_out, ref_lse = attend(ref, md, inputs, kv_b, "reference")
    out, lse = attend(fi, md, inputs, kv_b, "flashinfer")
    assert_close(out, lse, ref_out, ref_lse)
    assert torch.equal(fi.kv_cache.k, ref.kv_cache.k), "new latents and rope keys are saved as the reference saves them"


#: A request stream: (query_lens, prefix_lens, requests) per step; every batch kind appears.
STEPS = [([30, 17], [0, 0], [0, 1]), ([9, 1], [30, 17], [0, 1]), ([1, 1, 5], [39, 18, 0], [0, 1, 2]),
         ([1, 1, 1], [40, 19, 5], [0, 1, 2]), ([1, 1, 1], [41, 20, 6], [0, 1, 2]), ([1], [42], [0])]
LENGTHS = {0: 43, 1: 21, 2: 7}


def stream(page_size: int, seed: int = 0):
    """The latent cache, per-request inputs and each step's (metadata, inputs) of :data:`STEPS`."""
    pages = {r: -(-n // page_size) for r, n in LENGTHS.items()}
    num_pages = sum(pages.values()) + 2
    table = _table(list(pages.values()), num_pages, seed)
    cache = allocate_latent_cache(num_pages, page_size, RANK, ROPE, dtype=DTYPE, device=DEVICE)
    per_request = {r: step_inputs(n, seed=100 * seed + r) for r, n in LENGTHS.items()}
    steps = []
    for q_lens, p_lens, reqs in STEPS:
        md = fullcg.AttentionMetadata.build(q_lens, p_lens, table[reqs], page_size, device=DEVICE)
        parts = {name: torch.cat([per_request[r][name][p: p + q] for r, q, p in zip(reqs, q_lens, p_lens)])
                 for name in per_request[0]}
        steps.append((md, parts))
    return cache, steps


@needs_gpu
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_a_request_stream_through_prefill_extend_mixed_and_decode_steps_matches_the_reference(page_size):
    flashinfer_impl()
    cache, steps = stream(page_size)
    kv_b = kv_b_weight()
    ref, fi = mla_layer(cache), mla_layer(cache)
    for md, parts in steps:
        ref_out, ref_lse = attend(ref, md, parts, kv_b, "reference")
        out, lse = attend(fi, md, parts, kv_b, "flashinfer")
        assert_close(out, lse, ref_out, ref_lse)
    assert torch.equal(fi.kv_cache.k, ref.kv_cache.k)


@needs_gpu
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_both_mla_backends_match_the_reference(backend, monkeypatch):
    impl = flashinfer_impl()
    if backend == "fa3" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FlashInfer's FA3 MLA kernel runs on Hopper only")
    monkeypatch.setattr(impl, "mla_backend", backend)
    for name in ("decode", "mixed", "long_decode"):
        q_lens, p_lens = BATCHES[name]
        num_pages = sum(-(-(q + p) // 16) for q, p in zip(q_lens, p_lens)) + 3
        cache = _latent_cache(num_pages, 16, device=DEVICE)
        md = _metadata(q_lens, p_lens, 16, num_pages, device=DEVICE)
        inputs, kv_b = step_inputs(md.num_tokens, seed=3), kv_b_weight()
        ref_out, ref_lse = attend(mla_layer(cache), md, inputs, kv_b, "reference")
        out, lse = attend(mla_layer(cache), md, inputs, kv_b, "flashinfer")
        assert_close(out, lse, ref_out, ref_lse)


@needs_gpu
@pytest.mark.parametrize("name", ["decode", "mixed"])
def test_padding_rows_are_zero_with_minus_infinite_lse(name):
    flashinfer_impl()
    q_lens, p_lens = BATCHES[name]
    num_pages = sum(-(-(q + p) // 16) for q, p in zip(q_lens, p_lens)) + 3
    cache = _latent_cache(num_pages, 16, device=DEVICE)
    md = _metadata(q_lens, p_lens, 16, num_pages, device=DEVICE)
    n, pad = md.num_tokens, 5
    inputs, kv_b = step_inputs(n, seed=7), kv_b_weight()
    padded = {k: torch.cat([v, torch.full((pad, *v.shape[1:]), float("nan"), device=DEVICE, dtype=DTYPE)])
              for k, v in inputs.items()}
    ref_out, ref_lse = attend(mla_layer(cache), md, inputs, kv_b, "reference")
    out, lse = attend(mla_layer(cache), md, padded, kv_b, "flashinfer")
    assert torch.equal(out[n:], torch.zeros_like(out[n:])) and torch.isneginf(lse[n:]).all()
    assert_close(out[:n], lse[:n], ref_out, ref_lse)


@needs_gpu
@pytest.mark.parametrize("kind", ["decode", "extend"])
def test_captured_mla_replays_a_different_batch_of_the_same_padded_size(kind):
    """Warm up, plan, capture once; plan another batch of the padded size (for ``extend``, a
    mixed one) and replay: as the reference for the new batch, padding rows dead."""
    impl = flashinfer_impl()
    size, page_size, num_pages = 8, 16, 48
    if kind == "decode":
        first, second = ([1] * 5, [3, 40, 17, 9, 22]), ([1] * 7, [30, 2, 5, 64, 11, 8, 19])
    else:
        first, second = ([3, 2], [10, 30]), ([2, 1, 4], [5, 20, 33])
    cfg = FullCGConfig(attention_impl="flashinfer", capture_sizes=(size,))
    cache = _latent_cache(num_pages, page_size, device=DEVICE)
    mds = [_metadata(*batch, page_size, num_pages, seed=i, device=DEVICE) for i, batch in enumerate((first, second))]
    layer = mla_layer(cache).attn  # the latent attention itself: q [T, H, 576], k [T, 1, 576], v [T, 1, 512]
    g = torch.Generator().manual_seed(0)

    def rows(md):
        n = md.num_tokens
        q = torch.randn(size, H, RANK + ROPE, generator=g).to(DEVICE, DTYPE)
        kv = torch.randn(size, 1, RANK + ROPE, generator=g).to(DEVICE, DTYPE)
        q[n:], kv[n:] = 0, 0
        slots = torch.cat([md.slot_mapping, torch.full((size - n,), -1, dtype=md.slot_mapping.dtype, device=DEVICE)])
        return q, kv, slots

    q1, kv1, slots1 = rows(mds[0])
    q2, kv2, slots2 = rows(mds[1])
    static_q, static_kv, static_slots = q1.clone(), kv1.clone(), slots1.clone()
    static_count = mds[0].num_tokens_tensor.clone()
    md1 = dataclasses.replace(mds[0], slot_mapping=static_slots, num_tokens_tensor=static_count)
    with fullcg.forward_context(md1, layer, config=cfg) as ctx:
        layer(static_q, static_kv, static_kv[..., :RANK], return_lse=True)  # warm-up: learns the shape
        impl.plan(ctx)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out, static_lse = layer(static_q, static_kv, static_kv[..., :RANK], return_lse=True)

    layer.kv_cache.k.copy_(cache.k)  # the second batch's prefixes, as before the warm-up wrote into them
    reference = mla_layer(cache).attn
    for dst, src in ((static_q, q2), (static_kv, kv2), (static_slots, slots2)):
        dst.copy_(src)
    static_count.copy_(mds[1].num_tokens_tensor)
    md2 = dataclasses.replace(mds[1], slot_mapping=static_slots, num_tokens_tensor=static_count)
    with fullcg.forward_context(md2, layer, config=cfg) as ctx:
        impl.plan(ctx)
        graph.replay()
    torch.cuda.synchronize()
    n = mds[1].num_tokens
    with fullcg.forward_context(mds[1], reference, config=config("reference")):
        ref_out, ref_lse = reference(q2[:n], kv2[:n], kv2[:n, :, :RANK].contiguous(), return_lse=True)
    assert_close(static_out[:n], static_lse[:n], ref_out, ref_lse)
    assert torch.equal(static_out[n:], torch.zeros_like(static_out[n:])) and torch.isneginf(static_lse[n:]).all()
    assert torch.equal(layer.kv_cache.k, reference.kv_cache.k), "the replay saved the second batch's latents"


class _MLAStep(torch.nn.Module):
    def __init__(self, cache: fullcg.KVCache, kv_b: torch.Tensor) -> None:
        super().__init__()
        self.mla = mla_layer(cache)
        self.kv_b = torch.nn.Parameter(kv_b, requires_grad=False)

    def forward(self, q_nope, q_pe, latent, k_pe):
        return self.mla(q_nope, q_pe, latent, k_pe, self.kv_b, return_lse=True)


@needs_gpu
def test_compiled_full_graphs_replay_every_step_of_a_request_stream_as_the_reference():
    flashinfer_impl()
    torch._dynamo.reset()
    fullcg.reset_graph_mode_counts()
    cache, steps = stream(16, seed=1)
    kv_b = kv_b_weight()
    model, ref = _MLAStep(cache, kv_b), _MLAStep(cache, kv_b)
    cfg = config("flashinfer", graph_mode="full", compiler="eager", capture_sizes=(1, 2, 4, 8, 16, 32, 64))
    run = fullcg.compile(model, cfg)
    with torch.inference_mode():
        for md, parts in steps:
            with fullcg.forward_context(md, model, config=cfg):
                out, lse = run(*parts.values())
            with fullcg.forward_context(md, ref, config=config("reference")):
                ref_out, ref_lse = ref(*parts.values())
            assert_close(out, lse, ref_out, ref_lse)
    counts = fullcg.graph_mode_counts()
    assert counts.get("full:captured", 0) == len(steps), counts
    assert torch.equal(model.mla.kv_cache.k, ref.mla.kv_cache.k)


@needs_gpu
def test_refused_mla_calls_raise_errors_naming_the_fix_and_serves_says_so(monkeypatch):
    impl = flashinfer_impl()
    real_forward = impl.forward
    verdicts: list[tuple[bool, bool]] = []  # (served, ran)

    def forward(call, ctx, cache):
        served = impl.serves(call, ctx, cache if call.use_kv_cache else None)
        try:
            result = real_forward(call, ctx, cache)
        except (ValueError, TypeError, RuntimeError):
            verdicts.append((served, False))
            raise
        verdicts.append((served, True))
        return result

    monkeypatch.setattr(impl, "forward", forward)
    q_lens, p_lens = BATCHES["mixed"]
    cache = _latent_cache(40, 16, device=DEVICE)
    md = _metadata(q_lens, p_lens, 16, 40, device=DEVICE)
    inputs, kv_b = step_inputs(md.num_tokens, seed=1), kv_b_weight()
    attend(mla_layer(cache), md, inputs, kv_b, "flashinfer")  # dense DeepSeek MLA: served
    with pytest.raises(ValueError, match="no skip-softmax.*attention_impl='reference'"):
        attend(mla_layer(cache), md, inputs, kv_b, "flashinfer", prefill_scale_factor=4.0)

    # A latent attention with a window, and one at another kv_lora_rank.
    windowed = fullcg.Attention(H, RANK + ROPE, 1, layer_id=0, v_head_dim=RANK, sliding_window=8)
    k = cache.k.clone()
    windowed.kv_cache = fullcg.KVCache(k, k[..., :RANK])
    q = torch.randn(md.num_tokens, H, RANK + ROPE, device=DEVICE, dtype=DTYPE)
    kv = torch.randn(md.num_tokens, 1, RANK + ROPE, device=DEVICE, dtype=DTYPE)
    with fullcg.forward_context(md, windowed, config=config("flashinfer")):
        with pytest.raises(ValueError, match="no sliding window.*attention_impl='triton' or 'reference'"):
            windowed(q, kv, kv[..., :RANK].contiguous())
    small = fullcg.MLAAttention(H, 256, NOPE, ROPE, VDIM, layer_id=0)
    small.allocate_kv_cache(40, 16, dtype=DTYPE, device=DEVICE)
    small_kv_b = torch.randn(H * (NOPE + VDIM), 256, device=DEVICE, dtype=DTYPE)
    small_inputs = {**inputs, "latent": inputs["latent"][:, :256]}
    with fullcg.forward_context(md, small, config=config("flashinfer")):
        with pytest.raises(ValueError, match="kv_lora_rank 512.*got kv_lora_rank 256"):
            small(**small_inputs, kv_b_weight=small_kv_b)
    assert verdicts == [(True, True), (False, False), (False, False), (False, False)], verdicts


@needs_gpu
def test_auto_runs_dense_mla_on_flashinfer_and_refuses_skip_softmax_over_a_latent_cache():
    flashinfer_impl()
    auto = resolve_implementation("auto", DEVICE, RANK + ROPE, RANK)
    if not auto.takes_v_in_k:
        pytest.skip(f"attention_impl='auto' ({type(auto).__name__}) does not attend over latent caches yet")
    q_lens, p_lens = BATCHES["mixed"]
    cache = _latent_cache(40, 16, device=DEVICE)
    md = _metadata(q_lens, p_lens, 16, 40, device=DEVICE)
    inputs, kv_b = step_inputs(md.num_tokens, seed=2), kv_b_weight()
    ref_out, ref_lse = attend(mla_layer(cache), md, inputs, kv_b, "reference")
    out, lse = attend(mla_layer(cache), md, inputs, kv_b, "auto")
    assert_close(out, lse, ref_out, ref_lse)
    # Skip-softmax over a latent cache: FlashInfer refuses it, so auto asks Triton, whose MLA
    # kernel refuses it too (naming the fix) rather than attending densely.
    with pytest.raises(ValueError, match="skip-softmax over a latent cache"):
        attend(mla_layer(cache), md, inputs, kv_b, "auto", prefill_scale_factor=4.0, decode_scale_factor=4.0)


# ---------------------------------------------------------------- GPU: DeepSeek's decompressed head dims


def _decompressed_layer(seed: int, q_lens, p_lens, prefix_chunk_tokens: int = 4096):
    """A 192/128 layer (H heads) whose paged cache holds random prefixes, with a step's
    metadata and new q/k/v."""
    num_pages = sum(-(-(q + p) // 16) for q, p in zip(q_lens, p_lens)) + 3
    layer = fullcg.Attention(H, NOPE + ROPE, H, layer_id=0, v_head_dim=VDIM, scale=SCALE)
    cache = layer.allocate_kv_cache(num_pages, 16, dtype=DTYPE, device=DEVICE)
    g = torch.Generator().manual_seed(seed)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    pages = [-(-(q + p) // 16) for q, p in zip(q_lens, p_lens)]
    md = fullcg.AttentionMetadata.build(q_lens, p_lens, _table(pages, num_pages, seed), 16, device=DEVICE,
                                        prefix_chunk_tokens=prefix_chunk_tokens)
    n = md.num_tokens
    q, k = (torch.randn(n, H, NOPE + ROPE, generator=g).to(DEVICE, DTYPE) for _ in range(2))
    v = torch.randn(n, H, VDIM, generator=g).to(DEVICE, DTYPE)
    return layer, md, q, k, v


@needs_gpu
@pytest.mark.parametrize("causal", [True, False])
def test_decompressed_deepseek_dims_over_given_kv_match_the_reference(causal):
    flashinfer_impl()
    layer, md, q, k, v = _decompressed_layer(3, [21, 9, 4], [0, 0, 0])
    results = {}
    for impl in ("reference", "flashinfer"):
        with fullcg.forward_context(md, layer, config=config(impl)):
            results[impl] = layer(q, k, v, return_lse=True, use_kv_cache=False, causal=causal, save_kv_cache=False)
    assert_close(*results["flashinfer"], *results["reference"])


@needs_gpu
@pytest.mark.parametrize("chunk_tokens", [64, 20])
def test_decompressed_chunked_prefix_attention_matches_the_reference(chunk_tokens):
    """MLA's chunked-prefix path at 192/128: new tokens causal over themselves, then every
    prefix chunk (non-causal, over given k/v) merged in by LSE."""
    flashinfer_impl()
    layer, md, q, k, v = _decompressed_layer(4, [13, 1, 6], [0, 50, 37], prefix_chunk_tokens=chunk_tokens)
    assert len(md.prefix_chunks) >= 1
    results = {}
    for impl in ("reference", "flashinfer"):
        own = copy.deepcopy(layer)
        with fullcg.forward_context(md, own, config=config(impl)):
            out, lse = own(q, k, v, return_lse=True, use_kv_cache=False, causal=True, save_kv_cache=True)
            own.merge_prefix_chunks(q, out, lse)
        results[impl] = (out, lse)
    assert_close(*results["flashinfer"], *results["reference"])


@needs_gpu
@pytest.mark.parametrize(("q_lens", "p_lens"), [([7, 12], [40, 23]), ([21, 9], [0, 37])])
def test_mla_in_mha_form_attends_at_the_decompressed_dims_on_flashinfer_as_the_reference(q_lens, p_lens, monkeypatch):
    """Prompt-heavy steps of MLA run in MHA form: new tokens causal at 192/128, then each
    prefix chunk (32 tokens here, so several) up-projected and merged in."""
    impl = flashinfer_impl()
    if "mla_mha_min_heads" not in {f.name for f in dataclasses.fields(FullCGConfig)}:
        pytest.skip("this fullcg has no FullCGConfig.mla_mha_min_heads to run a few-head layer in MHA form")
    dims = []
    real_forward = impl.forward

    def forward(call, ctx, cache):
        dims.append((call.q.shape[2], call.v.shape[2]))
        return real_forward(call, ctx, cache)

    monkeypatch.setattr(impl, "forward", forward)
    num_pages = sum(-(-(q + p) // 16) for q, p in zip(q_lens, p_lens)) + 3
    cache = _latent_cache(num_pages, 16, device=DEVICE)
    md = _metadata(q_lens, p_lens, 16, num_pages, device=DEVICE, prefix_chunk_tokens=32)
    inputs, kv_b = step_inputs(md.num_tokens, seed=9), kv_b_weight()
    ref, fi = mla_layer(cache), mla_layer(cache)
    ref_out, ref_lse = attend(ref, md, inputs, kv_b, "reference", mla_mha_min_tokens=4, mla_mha_min_heads=1)
    out, lse = attend(fi, md, inputs, kv_b, "flashinfer", mla_mha_min_tokens=4, mla_mha_min_heads=1)
    assert dims and set(dims) == {(NOPE + ROPE, VDIM)}, dims
    assert_close(out, lse, ref_out, ref_lse)
    assert torch.equal(fi.kv_cache.k, ref.kv_cache.k)


@needs_gpu
def test_decompressed_deepseek_dims_over_the_paged_cache_are_refused_naming_the_fix():
    impl = flashinfer_impl()
    layer, md, q, k, v = _decompressed_layer(5, [3, 1], [10, 20])
    with fullcg.forward_context(md, layer, config=config("flashinfer")) as ctx:
        with pytest.raises(ValueError, match="192/128.*over given k/v only.*attention_impl='triton' or 'reference'"):
            layer(q, k, v)
        call = dataclasses.replace(_call(q, v_dim=VDIM), k=k, v=v, out=torch.empty_like(v))
        assert not impl.serves(call, ctx, layer.kv_cache)
