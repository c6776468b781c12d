"""The Triton MLA kernel (fullcg/ops/kernels/mla.py): attention over a latent cache equals
the reference for every batch kind, run split or whole, with LSE, padding rows and the
new rows' save; the ``triton`` implementation routes latent caches to it.

Small sizes run on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set before
triton is imported); the ``cuda`` tests add DeepSeek-V3's sizes (latent 512, rope 64),
half precision and CUDA graph capture.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`

pytest.importorskip("triton", reason="triton is not installed; `pip install triton` runs these tests on the CPU")

import fullcg  # noqa: E402
import fullcg.ops.impl.triton as triton_impl  # noqa: E402  (registers the "triton" implementation)
from fullcg import runner  # noqa: E402
from fullcg.config import FullCGConfig, SkipSoftmaxConfig  # noqa: E402
from fullcg.metadata import AttentionMetadata  # noqa: E402
from fullcg.ops.call import AttentionCall  # noqa: E402
from fullcg.ops.impl import resolve_implementation  # noqa: E402
from fullcg.mla import allocate_latent_cache  # noqa: E402
from fullcg.ops import device_facts  # noqa: E402
from fullcg.ops.kernels import mla as mla_kernels  # noqa: E402

# Triton 3.6's interpreter converts 1-element arrays to loop bounds (deprecated by NumPy).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")

RANK, ROPE = 32, 16
BATCHES = {
    "decode": ([1, 1, 1], [70, 5, 33]),
    "extend": ([7, 12], [40, 23]),
    "prefill": ([21, 9], [0, 0]),
    "mixed": ([13, 1, 6, 1], [0, 50, 37, 16]),
}


@dataclasses.dataclass
class LatentBatch:
    """One step over a latent cache: metadata, a layer owning the cache, the new q/k/v and
    each request's whole (prefix + new) rows for the oracle."""

    metadata: AttentionMetadata
    layer: fullcg.Attention
    q: torch.Tensor  # [T, H, rank + rope]
    k: torch.Tensor  # [T, 1, rank + rope]
    v: torch.Tensor  # [T, 1, rank]: k's leading values, as MLAAttention passes them
    rows: list[torch.Tensor]  # per request [prefix + new, rank + rope]

    @property
    def cache(self) -> fullcg.KVCache:
        return self.layer.kv_cache


def latent_batch(query_lens, prefix_lens, *, heads=4, rank=RANK, rope=ROPE, page_size=4, dtype=torch.float32,
                 seed=0, spare_pages=3, device=DEVICE) -> LatentBatch:
    """A batch whose prefixes are in a latent cache (garbage everywhere else) under a shuffled page table."""
    g = torch.Generator().manual_seed(seed)
    pages_needed = [math.ceil((q + p) / page_size) for q, p in zip(query_lens, prefix_lens)]
    num_pages = sum(pages_needed) + spare_pages
    perm = torch.randperm(num_pages, generator=g)
    table = torch.zeros(len(query_lens), max(pages_needed) + 1, dtype=torch.int32)
    used = 0
    for r, n in enumerate(pages_needed):
        table[r, :n] = perm[used: used + n]
        used += n
    layer = fullcg.Attention(heads, rank + rope, 1, layer_id=0, v_head_dim=rank, scale=1 / math.sqrt(48))
    cache = allocate_latent_cache(num_pages, page_size, rank, rope, dtype=dtype)
    cache.k.normal_(generator=g)
    rows, new = [], []
    for r, (ql, pl) in enumerate(zip(query_lens, prefix_lens)):
        x = torch.randn(pl + ql, rank + rope, generator=g).to(dtype)
        for pos in range(pl):
            cache.k[int(table[r, pos // page_size]), pos % page_size, 0] = x[pos]
        rows.append(x)
        new.append(x[pl:])
    q = torch.randn(sum(query_lens), heads, rank + rope, generator=g).to(dtype)
    k = torch.cat(new)[:, None, :]
    if device.type != "cpu":
        on_device = allocate_latent_cache(num_pages, page_size, rank, rope, dtype=dtype, device=device)
        on_device.k.copy_(cache.k)
        cache = on_device
    layer.kv_cache = cache
    md = AttentionMetadata.build(query_lens, prefix_lens, table, page_size, device=device)
    return LatentBatch(md, layer, q.to(device), k.to(device), k.to(device)[..., :rank], rows)


def oracle(b: LatentBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention of every new token over its request's rows [0, prefix + j] (on the CPU)."""
    rank = b.v.shape[-1]
    outs, lses = [], []
    starts = b.metadata.query_starts
    for r, pl in enumerate(b.metadata.prefix_lens):
        q = b.q[starts[r]: starts[r + 1]].cpu().double()
        x = b.rows[r].double()
        s = torch.einsum("nhd,ld->nhl", q, x) * b.layer.scale
        visible = torch.arange(x.shape[0])[None, :] <= (pl + torch.arange(q.shape[0]))[:, None]
        s = s.masked_fill(~visible[:, None, :], float("-inf"))
        outs.append(torch.einsum("nhl,lr->nhr", s.softmax(-1), x[:, :rank]))
        lses.append(torch.logsumexp(s, -1))
    return torch.cat(outs), torch.cat(lses)


def run(b: LatentBatch, impl: str, skip: SkipSoftmaxConfig | None = None, **kwargs):
    """``(out, lse)`` of one attention call over the latent cache (writing the new rows again is idempotent)."""
    cfg = FullCGConfig(attention_impl=impl, skip_softmax=skip or SkipSoftmaxConfig())
    with torch.no_grad(), fullcg.forward_context(b.metadata, b.layer, config=cfg):
        return b.layer(b.q, b.k, b.v, return_lse=True, **kwargs)


@pytest.fixture
def planned(monkeypatch):
    """The MLA launches the ``triton`` implementation plans, recorded."""
    launches = []
    real = triton_impl.plan_mla

    def record(*args, **kwargs):
        launches.append(real(*args, **kwargs))
        return launches[-1]

    monkeypatch.setattr(triton_impl, "plan_mla", record)
    return launches


def many_runs(monkeypatch, sms: int = 64) -> None:
    """Make the kernel split every token's keys into several runs (as on a GPU of ``sms`` SMs)."""
    monkeypatch.setattr(device_facts, "sm_count", lambda device: sms)


def runs_per_token(monkeypatch, runs: str) -> None:
    """``many-runs``: split every token's keys (:func:`many_runs`); ``one-run``: never split."""
    many_runs(monkeypatch, 64 if runs == "many-runs" else 0)


def rows_of(cache: fullcg.KVCache, slots: torch.Tensor) -> torch.Tensor:
    return cache.k.view(-1, cache.k.shape[-1])[slots.long()]


# ---- the kernel against the reference ---------------------------------------------------


@pytest.mark.parametrize("runs", ["one-run", "many-runs"])
@pytest.mark.parametrize("name", list(BATCHES))
def test_every_batch_kind_matches_the_reference_and_the_oracle(name, runs, monkeypatch, planned):
    runs_per_token(monkeypatch, runs)
    b = latent_batch(*BATCHES[name], seed=len(name))
    ref_out, ref_lse = run(b, "reference")
    out, lse = run(b, "triton")
    (launch,) = planned
    assert (launch.num_splits > 1) == (runs == "many-runs")
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)
    expected_out, expected_lse = oracle(b)
    torch.testing.assert_close(out.double().cpu(), expected_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double().cpu(), expected_lse, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("heads,page_size", [(32, 4), (4, 16), (20, 8)], ids=["2-head-blocks", "tile-in-one-page",
                                                                                "padded-head-block"])
def test_head_blocks_and_page_sizes_match_the_reference(heads, page_size, monkeypatch):
    # 16-head blocks on the CPU: 32 heads are two blocks reading the same keys, 20 a full
    # block and a padded one; a 16-key tile lies in one 16-key page or spans 4 or 2 pages.
    many_runs(monkeypatch)
    b = latent_batch(*BATCHES["mixed"], heads=heads, page_size=page_size, seed=heads)
    ref_out, ref_lse = run(b, "reference")
    out, lse = run(b, "triton")
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


def test_a_latent_and_rope_of_other_sizes_match_the_reference(monkeypatch):
    many_runs(monkeypatch)
    b = latent_batch([3, 1], [30, 44], rank=64, rope=32, heads=8, seed=5)
    ref_out, ref_lse = run(b, "reference")
    out, lse = run(b, "triton")
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "dtype",
    [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        DEVICE.type == "cpu", reason="Triton's CPU interpreter has no bfloat16 arithmetic (NumPy lacks it)"))],
    ids=["fp16", "bf16"],
)
def test_half_precision_matches_the_reference(dtype, monkeypatch):
    many_runs(monkeypatch)
    b = latent_batch(*BATCHES["mixed"], dtype=dtype, seed=9)
    ref_out, ref_lse = run(b, "reference")
    out, lse = run(b, "triton")
    torch.testing.assert_close(out.float(), ref_out.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


def test_explicit_split_counts_and_tiles_give_the_same_result():
    # Dense results depend on the split only through rounding: any launch shape is free to tune.
    b = latent_batch(*BATCHES["mixed"], heads=8, seed=3)
    ref_out, ref_lse = run(b, "reference")
    md = b.metadata
    for num_splits, block_n in ((1, 16), (5, 16), (64, 32)):
        out = torch.full((b.q.shape[0], 8, RANK), float("nan"), device=DEVICE)
        lse = torch.empty(b.q.shape[:2], device=DEVICE)
        mla_kernels.mla_attention(b.q, b.cache.k, out, lse, query_start_loc=md.query_start_loc,
                                  page_table=md.page_table, seq_lens=md.seq_lens, scale=b.layer.scale,
                                  num_splits=num_splits, block_n=block_n, workspace={})
        torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("shared_memory, block_n", [(232448, 64), (167936, 32), (0, 32)],
                         ids=["hopper", "less-shared-memory", "unknown"])
def test_default_tiles_are_64_keys_where_two_stages_of_them_fit_in_shared_memory(shared_memory, block_n, monkeypatch):
    monkeypatch.setattr(device_facts, "shared_memory_per_block", lambda device: shared_memory)
    cuda = torch.device("cuda", 0)
    assert mla_kernels.default_tuning(128, torch.bfloat16, cuda) == mla_kernels.MLATuning(64, block_n, 8, 2)
    assert mla_kernels.default_tuning(16, torch.bfloat16, cuda) == mla_kernels.MLATuning(16, block_n, 4, 2)
    # fp32 and the CPU keep their small tiles whatever the device holds.
    assert mla_kernels.default_tuning(128, torch.float32, cuda) == mla_kernels.MLATuning(16, 16, 4, 1)
    assert mla_kernels.default_tuning(128, torch.bfloat16, torch.device("cpu")) == mla_kernels.MLATuning(16, 16, 4, 1)


def test_runs_merged_in_the_kernel_leave_the_arrival_counts_at_zero():
    # The last run of a token merges and resets its count: one workspace serves every layer
    # of a step and every replay of a graph.
    b = latent_batch(*BATCHES["decode"], heads=32, seed=4)
    ref_out, ref_lse = run(b, "reference")
    md, workspace = b.metadata, {}
    out, lse = torch.empty(b.q.shape[0], 32, RANK, device=DEVICE), torch.empty(b.q.shape[:2], device=DEVICE)
    for _ in range(2):
        out.fill_(float("nan"))
        mla_kernels.mla_attention(b.q, b.cache.k, out, lse, query_start_loc=md.query_start_loc,
                                  page_table=md.page_table, seq_lens=md.seq_lens, scale=b.layer.scale,
                                  num_splits=4, workspace=workspace)
        torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)
        (parts,) = workspace.values()
        assert parts[2].shape == (b.q.shape[0], 2), "one count per (token, head block)"
        assert not parts[2].any(), "every arrival count is reset by the program that merged"


# ---- padding rows -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["decode", "mixed"])
def test_padded_static_metadata_gives_the_real_rows_and_zero_padding(name, monkeypatch):
    # What a full CUDA graph replays: the batch padded with stand-in and empty requests.
    many_runs(monkeypatch)
    b = latent_batch(*BATCHES[name], seed=2)
    n, size = b.metadata.num_tokens, b.metadata.num_tokens + 3
    static = runner.StaticMetadata(size, runner.StaticTables(size, b.metadata.page_table.shape[1] + 2, DEVICE),
                                   DEVICE)
    padded_md = static.fill(b.metadata)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, torch.full((size - n, *t.shape[1:]), float("nan"), dtype=t.dtype, device=DEVICE)])

    ref_out, ref_lse = run(b, "reference")
    k = pad(b.k)
    padded = dataclasses.replace(b, metadata=padded_md, q=pad(b.q), k=k, v=k[..., :RANK])
    out, lse = run(padded, "triton")
    torch.testing.assert_close(out[:n], ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse[:n], ref_lse, atol=2e-5, rtol=2e-5)
    assert torch.equal(out[n:], torch.zeros_like(out[n:])) and torch.isneginf(lse[n:]).all()


def test_rows_past_the_token_count_or_owned_by_no_request_are_zero_with_lse_minus_inf():
    b = latent_batch(*BATCHES["mixed"], seed=6)
    md = b.metadata
    n = md.num_tokens
    ref_out, ref_lse = run(b, "reference")
    q = torch.cat([b.q, torch.full((5, *b.q.shape[1:]), float("nan"), device=DEVICE)])
    for num_tokens in (n, n + 3):  # rows n.. are past the count, or (n + 3) past the last request's
        out = torch.full((n + 5, b.q.shape[1], RANK), float("nan"), device=DEVICE)
        lse = torch.full((n + 5, b.q.shape[1]), float("nan"), device=DEVICE)
        mla_kernels.mla_attention(q, b.cache.k, out, lse, query_start_loc=md.query_start_loc,
                                  page_table=md.page_table, seq_lens=md.seq_lens, scale=b.layer.scale,
                                  num_tokens=torch.tensor([num_tokens], dtype=torch.int32, device=DEVICE),
                                  num_splits=3, workspace={})
        torch.testing.assert_close(out[:n], ref_out, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse[:n], ref_lse, atol=2e-5, rtol=2e-5)
        assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padding rows must be zero"
        assert torch.isneginf(lse[n:]).all(), "padding rows' LSE must be -inf"


# ---- saving the new rows ----------------------------------------------------------------


@pytest.mark.parametrize("runs", ["one-run", "many-runs"])
def test_decode_only_steps_write_the_new_rows_inside_the_mla_kernel(runs, monkeypatch, planned):
    # The last run of each token puts the token's row into the cache before reading it; no
    # save launch runs. Poisoned slots prove the write.
    runs_per_token(monkeypatch, runs)
    b = latent_batch(*BATCHES["decode"], heads=20, seed=8)
    slots = b.metadata.slot_mapping
    b.cache.k.view(-1, RANK + ROPE)[slots.long()] = float("nan")
    saves = []
    monkeypatch.setattr(triton_impl, "plan_latent_save", lambda *a: saves.append(a))
    out, lse = run(b, "triton")
    assert not saves, "decode-only steps need no save launch"
    (launch,) = planned
    assert launch.save and (launch.num_splits > 1) == (runs == "many-runs")
    assert torch.equal(rows_of(b.cache, slots), b.k[:, 0])
    expected_out, expected_lse = oracle(b)
    torch.testing.assert_close(out.double().cpu(), expected_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double().cpu(), expected_lse, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["extend", "prefill", "mixed"])
def test_other_steps_save_the_new_rows_before_attending(name, monkeypatch):
    many_runs(monkeypatch)
    b = latent_batch(*BATCHES[name], seed=11)
    slots = b.metadata.slot_mapping
    b.cache.k.view(-1, RANK + ROPE)[slots.long()] = float("nan")
    out, lse = run(b, "triton")
    assert torch.equal(rows_of(b.cache, slots), b.k[:, 0])
    expected_out, expected_lse = oracle(b)
    torch.testing.assert_close(out.double().cpu(), expected_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double().cpu(), expected_lse, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fused", [False, True], ids=["save-launch", "in-the-mla-kernel"])
def test_the_save_skips_negative_slots_and_takes_the_latent_from_v(fused):
    b = latent_batch(*BATCHES["decode"], seed=12)
    md, cache = b.metadata, b.cache
    slots = md.slot_mapping.clone()
    slots[1] = -1  # a padding token: writes nothing
    v = b.v + 1.0  # the latent from v, as the reference (k, then v over k's leading values)
    before = cache.k.clone()
    if fused:
        out, lse = torch.empty(b.q.shape[0], b.q.shape[1], RANK, device=DEVICE), torch.empty(b.q.shape[:2],
                                                                                             device=DEVICE)
        mla_kernels.mla_attention(b.q, cache.k, out, lse, query_start_loc=md.query_start_loc,
                                  page_table=md.page_table, seq_lens=md.seq_lens, scale=b.layer.scale,
                                  slot_mapping=slots, new_kv=(b.k, v), num_splits=2, workspace={})
    else:
        mla_kernels.save_latent(b.k, v, slots, cache.k)
    flat, flat_before = cache.k.view(-1, RANK + ROPE), before.view(-1, RANK + ROPE)
    written = slots[slots >= 0].long()
    expected = torch.cat([v[:, 0], b.k[:, 0, RANK:]], dim=-1)[slots >= 0]
    assert torch.equal(flat[written], expected)
    untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert torch.equal(flat[untouched], flat_before[untouched]), "no other slot is written"


# ---- what the Triton MLA path refuses ----------------------------------------------------


def test_skip_softmax_factors_are_refused_over_a_latent_cache_and_nothing_is_written():
    b = latent_batch(*BATCHES["mixed"], seed=13)
    before = b.cache.k.clone()
    impl = resolve_implementation("triton", DEVICE)
    for skip in (SkipSoftmaxConfig(decode_scale_factor=1.0), SkipSoftmaxConfig(prefill_scale_factor=1.0)):
        cfg = FullCGConfig(attention_impl="triton", skip_softmax=skip)
        with torch.no_grad(), fullcg.forward_context(b.metadata, b.layer, config=cfg) as ctx:
            call = AttentionCall(
                op="attention", q=b.q, k=b.k, v=b.v, out=torch.empty(b.q.shape[0], b.q.shape[1], RANK, device=DEVICE),
                layer_id=0, key_value_num_tokens=None, prefill_scale_factor=skip.prefill_scale_factor,
                decode_scale_factor=skip.decode_scale_factor, scale=b.layer.scale, use_kv_cache=True, causal=True,
                prefix_chunk=None, save_kv_cache=True, return_lse=False)
            assert not impl.serves(call, ctx, b.cache)
            assert impl.serves(dataclasses.replace(call, prefill_scale_factor=None, decode_scale_factor=None), ctx,
                               b.cache)
            with pytest.raises(ValueError, match="skip-softmax over a latent cache.*factors None.*'reference'"):
                b.layer(b.q, b.k, b.v)
    assert torch.equal(b.cache.k, before)


def test_latent_head_dims_over_given_kv_are_refused_before_anything_is_written():
    # DeepSeek's latent dims (576/512) are past what the ordinary kernels take (256); smaller
    # ones run there like any head dim.
    b = latent_batch(*BATCHES["prefill"], rank=512, rope=64, seed=14)
    before = b.cache.k.clone()
    with pytest.raises(ValueError, match="served only over a latent cache.*attention_impl='reference'"):
        run(b, "triton", use_kv_cache=False, save_kv_cache=True)
    assert torch.equal(b.cache.k, before)


def test_attention_over_given_kv_saved_into_a_latent_cache_writes_each_row_once():
    # Power-of-two dims (latent 32, rope 32) over given k/v run the ordinary kernels; the save
    # into the latent cache must still write the latent from v and the rope key from k.
    b = latent_batch(*BATCHES["mixed"], rank=32, rope=32, seed=15)
    slots = b.metadata.slot_mapping
    b.cache.k.view(-1, 64)[slots.long()] = float("nan")
    out, lse = run(b, "triton", use_kv_cache=False, save_kv_cache=True)
    assert torch.equal(rows_of(b.cache, slots), b.k[:, 0])
    ref_out, ref_lse = run(b, "reference", use_kv_cache=False, save_kv_cache=True)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("use_kv_cache", [True, False], ids=["over-the-cache", "over-given-kv"])
@pytest.mark.parametrize("name", ["decode", "mixed"])
def test_step_plans_save_and_attend_as_the_first_call_did(name, use_kv_cache, monkeypatch):
    # Compiled steps run later calls of a shape through the plan the first call left (the
    # save included): over the latent cache the MLA kernel, over given k/v the ordinary ones.
    import importlib

    from fullcg.context import derived_context

    many_runs(monkeypatch)
    ops = importlib.import_module("fullcg.ops.attention")
    kernel = ops.EAGER_KERNELS[ops.breakable_attention_with_lse]
    b = latent_batch(*BATCHES[name], rank=32, rope=32, seed=16)
    slots = b.metadata.slot_mapping.long()
    ref_out, ref_lse = run(b, "reference", use_kv_cache=use_kv_cache, save_kv_cache=True)
    cfg = FullCGConfig(attention_impl="triton")
    with torch.no_grad(), fullcg.forward_context(b.metadata, b.layer, config=cfg) as user, \
            derived_context(user, config=cfg, variant="piecewise", padded_size=None) as ctx:
        forwards = []
        real_forward = triton_impl.TritonAttention.forward
        monkeypatch.setattr(triton_impl.TritonAttention, "forward", lambda *a: forwards.append(1) or real_forward(*a))
        for _ in range(3):
            b.cache.k.view(-1, 64)[slots] = float("nan")
            out = torch.empty(b.q.shape[0], b.q.shape[1], 32, device=DEVICE)
            lse = kernel(b.q, b.k, b.v, out, 0, None, None, None, b.layer.scale, use_kv_cache, True, None, True,
                         None, None, b.cache.uid)
            assert torch.equal(rows_of(b.cache, slots), b.k[:, 0])
            torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)
        assert len(ctx.step.plans) == 1 and len(forwards) == 1, "the first call plans, the others run its plan"


def test_supports_takes_head_dims_up_to_256_and_latent_plus_rope_dims():
    impl = resolve_implementation("triton", DEVICE)
    assert impl.takes_v_in_k and impl.capture_safe
    assert impl.supports(576, 512) and impl.supports(48, 32) and impl.supports(128, 128) and impl.supports(96, 64)
    assert not impl.supports(576, 576) and not impl.supports(520, 512) and not impl.supports(512, 576)
    assert impl.supports(80, 80) and impl.supports(192, 128)  # padded tiles in the MHA kernels
    assert not impl.supports(264, 264) and not impl.supports(72 + 1, 64)


# ---- through fullcg.MLAAttention ---------------------------------------------------------

H, NOPE, VDIM, PAGE = 4, 16, 16, 4
STEPS = [([4, 5], [0, 0]), ([3], [4]), ([1, 1], [7, 5]), ([1], [8])]  # two prompts (one chunked), decodes
REQUESTS_OF_STEP = [[0, 1], [0], [0, 1], [0]]


def _mla_inputs(seed: int, device=DEVICE, dtype=torch.float32, rank=RANK, rope=ROPE, heads=H):
    g = torch.Generator().manual_seed(seed)
    lengths = {0: 9, 1: 6}
    inputs = {r: {"q_nope": torch.randn(n, heads, NOPE, generator=g), "q_pe": torch.randn(n, heads, rope, generator=g),
                  "latent": torch.randn(n, rank, generator=g), "k_pe": torch.randn(n, rope, generator=g)}
              for r, n in lengths.items()}
    kv_b = torch.randn(heads * (NOPE + VDIM), rank, generator=g) / math.sqrt(rank)
    cast = {r: {k: t.to(device, dtype) for k, t in x.items()} for r, x in inputs.items()}
    return cast, kv_b.to(device, dtype)


def _mla_step(inputs, step, device=DEVICE):
    (q_lens, p_lens), reqs = STEPS[step], REQUESTS_OF_STEP[step]
    parts = {name: torch.cat([inputs[r][name][p: p + q] for r, q, p in zip(reqs, q_lens, p_lens)])
             for name in ("q_nope", "q_pe", "latent", "k_pe")}
    table = torch.stack([torch.arange(r * 4, r * 4 + 4, dtype=torch.int32) for r in reqs])
    return parts, AttentionMetadata.build(q_lens, p_lens, table, PAGE, device=device)


class _MLAModel(torch.nn.Module):
    """Two MLA layers (the second attends the first's output), so later layers run the plan of the first."""

    def __init__(self, kv_b: torch.Tensor, heads: int = H, rank: int = RANK, rope: int = ROPE) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            fullcg.MLAAttention(heads, rank, NOPE, rope, VDIM, layer_id=i) for i in range(2))
        self.kv_b = torch.nn.Parameter(kv_b, requires_grad=False)

    def forward(self, q_nope, q_pe, latent, k_pe):
        out = self.layers[0](q_nope, q_pe, latent, k_pe, self.kv_b)
        return self.layers[1](q_nope + out, q_pe, latent, k_pe, self.kv_b)


def _run_steps(model, run, inputs, impl):
    outs = []
    cfg = FullCGConfig(attention_impl=impl)
    with torch.inference_mode():
        for step in range(len(STEPS)):
            parts, md = _mla_step(inputs, step, device=inputs[0]["latent"].device)
            with fullcg.forward_context(md, model, config=cfg):
                outs.append(run(parts["q_nope"], parts["q_pe"], parts["latent"], parts["k_pe"]))
    return outs


def _mla_model(kv_b, device=DEVICE, dtype=torch.float32, **dims):
    model = _MLAModel(kv_b, **dims)
    for layer in model.layers:
        layer.allocate_kv_cache(8, PAGE, dtype=dtype, device=device)
    return model


def test_mla_attention_with_triton_equals_the_reference_eagerly(monkeypatch):
    many_runs(monkeypatch)
    inputs, kv_b = _mla_inputs(seed=0)
    expected = _run_steps(ref := _mla_model(kv_b), ref, inputs, "reference")
    got = _run_steps(model := _mla_model(kv_b), model, inputs, "triton")
    for e, o in zip(expected, got):
        torch.testing.assert_close(o, e, atol=1e-5, rtol=1e-5)
    for a, b in zip(ref.layers, model.layers):
        torch.testing.assert_close(a.kv_cache.k, b.kv_cache.k, atol=0, rtol=0)


@pytest.mark.parametrize("graph_mode", ["piecewise", "full"])
def test_compiled_mla_with_triton_equals_the_reference(graph_mode, monkeypatch):
    # Compiled steps plan each call shape once (step_plan) and run the plan for the other layer.
    torch._dynamo.reset()
    many_runs(monkeypatch)
    inputs, kv_b = _mla_inputs(seed=1)
    expected = _run_steps(ref := _mla_model(kv_b), ref, inputs, "reference")
    model = _mla_model(kv_b)
    compiled = fullcg.compile(model, compiler="eager", graph_mode=graph_mode, attention_impl="triton")
    forwards = []
    real_forward = triton_impl.TritonAttention.forward
    monkeypatch.setattr(triton_impl.TritonAttention, "forward", lambda *a: forwards.append(1) or real_forward(*a))
    got = _run_steps(model, compiled, inputs, "triton")
    for e, o in zip(expected, got):
        torch.testing.assert_close(o, e, atol=1e-5, rtol=1e-5)
    if DEVICE.type == "cpu" or graph_mode == "piecewise":
        # (On a GPU a full graph calls forward while capturing each size, and never on replay.)
        assert len(forwards) < 2 * len(STEPS), "the second layer of a compiled step runs the first one's plan"


# ---- real sizes on a GPU -----------------------------------------------------------------

V3 = dict(rank=512, rope=64)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", [16, 128])
def test_deepseek_v3_sizes_match_the_reference_on_gpu(heads, dtype):
    b = latent_batch([1, 1, 300, 1, 40, 1], [4000, 70, 0, 9000, 1500, 1], heads=heads, page_size=64, dtype=dtype,
                     seed=heads, spare_pages=0, **V3)
    ref_out, ref_lse = run(b, "reference")
    out, lse = run(b, "triton")
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)
    expected_out, expected_lse = oracle(b)
    torch.testing.assert_close(out.double().cpu(), expected_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double().cpu(), expected_lse, atol=2e-3, rtol=2e-3)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("heads", [16, 128])
def test_runs_merged_in_one_launch_give_the_same_bits_every_time_on_gpu(heads):
    # Hundreds of programs race to be the last run of their token: a missing barrier or
    # fence would show as results that change between launches on the same inputs.
    torch.manual_seed(0)
    lens = torch.randint(1, 9000, (24,)).tolist()
    b = latent_batch([1] * len(lens), lens, heads=heads, page_size=64, dtype=torch.bfloat16, seed=3, spare_pages=0,
                     **V3)
    md = b.metadata
    # Each token's own row is saved by the launch (the batch's cache holds the prefixes only).
    options = dict(query_start_loc=md.query_start_loc, page_table=md.page_table, seq_lens=md.seq_lens,
                   scale=b.layer.scale, num_splits=16, workspace={}, slot_mapping=md.slot_mapping,
                   new_kv=(b.k, b.v))
    first_out = torch.empty(b.q.shape[0], heads, 512, dtype=b.q.dtype, device=DEVICE)
    first_lse = torch.empty(b.q.shape[:2], device=DEVICE)
    mla_kernels.mla_attention(b.q, b.cache.k, first_out, first_lse, **options)
    expected_out, expected_lse = oracle(b)
    torch.testing.assert_close(first_out.double().cpu(), expected_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(first_lse.double().cpu(), expected_lse, atol=2e-3, rtol=2e-3)
    out, lse = torch.empty_like(first_out), torch.empty_like(first_lse)
    for _ in range(30):
        out.fill_(float("nan"))
        mla_kernels.mla_attention(b.q, b.cache.k, out, lse, **options)
        assert torch.equal(out, first_out) and torch.equal(lse, first_lse)


@pytest.mark.cuda
@needs_cuda
def test_decode_with_the_fused_save_replays_under_cuda_graph_capture():
    b = latent_batch([1] * 8, [4000, 100, 2500, 700, 64, 1, 3333, 1024], heads=128, page_size=64,
                     dtype=torch.bfloat16, seed=5, spare_pages=0, **V3)
    ref_out, _ = run(b, "reference")  # also writes the new rows
    slots = b.metadata.slot_mapping.long()
    cfg = FullCGConfig(attention_impl="triton")
    with fullcg.forward_context(b.metadata, b.layer, config=cfg):
        b.layer(b.q, b.k, b.v)  # warm-up: compiles the kernel
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = b.layer(b.q, b.k, b.v)
        out.zero_()
        b.cache.k.view(-1, 576)[slots] = float("nan")  # the replay writes them again
        graph.replay()
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(rows_of(b.cache, slots), b.k[:, 0])
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("graph_mode", ["piecewise", "full"])
def test_compiled_mla_at_deepseek_sizes_equals_the_reference_on_gpu(graph_mode):
    # Full graphs capture the MLA kernel with stand-in batches and replay it for real ones.
    torch._dynamo.reset()
    dims = dict(heads=16, rank=512, rope=64)
    inputs, kv_b = _mla_inputs(seed=2, dtype=torch.bfloat16, **dims)
    expected = _run_steps(ref := _mla_model(kv_b, dtype=torch.bfloat16, **dims), ref, inputs, "reference")
    model = _mla_model(kv_b, dtype=torch.bfloat16, **dims)
    compiled = fullcg.compile(model, compiler="inductor", graph_mode=graph_mode, attention_impl="triton")
    got = _run_steps(model, compiled, inputs, "triton")
    for e, o in zip(expected, got):
        torch.testing.assert_close(o.float(), e.float(), atol=5e-2, rtol=5e-2)
