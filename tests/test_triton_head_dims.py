"""The Triton kernels take head dims that are not powers of two (80, 96, DeepSeek's 192/128).

``tl.arange`` needs a power of two, so the kernels pad a head's register tile to the next
one and mask its columns. These tests call the kernels' public functions directly (the
``triton`` implementation's own head-dim check is separate) at q/k and v dims that need
padding, and at a power-of-two control, against the reference implementation's functions.

Every q, k, v and cache tensor is a view into a wider buffer whose columns past the head
hold NaN, and every output a view whose columns past the head hold a sentinel: a kernel
that read a column past its head would put NaN into the scores, and one that wrote past it
would overwrite the sentinel.

Small sizes run on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set here
before triton is imported), as in ``test_triton_kernels.py``.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`

pytest.importorskip("triton", reason="triton is not installed; `pip install triton` runs these tests on the CPU")

from fullcg.metadata import AttentionMetadata  # noqa: E402
from fullcg.ops.impl.reference import attend_dense, attend_tiled  # noqa: E402
from fullcg.ops.kernels import decode_attention, prefill_attention  # noqa: E402
from fullcg.ops.kernels.decode import _dense_tile_kv  # noqa: E402
from fullcg.ops.kernels.save_kv import save_kv_to_cache  # noqa: E402
from fullcg.ops.kernels.tile import padded  # noqa: E402

from batches import make_batch  # noqa: E402

# Triton 3.6's interpreter converts 1-element arrays to loop bounds (deprecated by NumPy).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TILE_KV, TILE_Q = 16, 4
NUM_HEADS, NUM_KV_HEADS = 4, 2
#: (q/k head dim, v head dim): padded heads (64, 128, 128/64 and 256/128 wide tiles) and
#: a power-of-two control.
DIMS = [(48, 48), (80, 80), (96, 64), (192, 128), (64, 64)]
DIM_IDS = [f"{d}-{dv}" for d, dv in DIMS]
#: Columns of NaN (inputs) or sentinel (outputs) after each head.
GAP = 16
SENTINEL = 777.0
# Structured (peaky) inputs, as test_triton_kernels.py uses them: some tiles skip, some do not.
PEAKY = dict(key_bias=2.0, sink=4.0)
# Peaky scores reach ~70 (LSE), where a float32 ulp is 8e-6: sums over up to 192 columns in
# another order than the reference's differ by a few. A column read or written wrongly
# shows as NaN or an error of order one.
ATOL = RTOL = 1e-4


def gapped(x: torch.Tensor, fill: float = float("nan")) -> torch.Tensor:
    """``x`` as a view into a buffer whose last dim is ``GAP`` wider, the extra columns ``fill``."""
    buf = torch.full((*x.shape[:-1], x.shape[-1] + GAP), fill, dtype=x.dtype, device=x.device)
    buf[..., : x.shape[-1]] = x
    return buf[..., : x.shape[-1]]


def gapped_empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An output view: NaN in the head's columns (every one must be written), SENTINEL past them."""
    return gapped(torch.full(shape, float("nan"), dtype=dtype, device=DEVICE), SENTINEL)


def gap_of(x: torch.Tensor) -> torch.Tensor:
    """The columns past the head in ``x``'s buffer (``x`` made by :func:`gapped`)."""
    full = x.as_strided((*x.shape[:-1], x.shape[-1] + GAP), (*x.stride()[:-1], 1))
    return full[..., x.shape[-1]:]


@dataclasses.dataclass
class Case:
    """One batch at head dims ``(d, dv)``: metadata, new q/k/v, a paged cache holding every
    request's prefix and new tokens, and each request's full k/v for the reference."""

    md: AttentionMetadata
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    full_k: list[torch.Tensor]
    full_v: list[torch.Tensor]
    scale: float

    @property
    def max_kv_len(self) -> int:
        return self.md.page_table.shape[1] * self.md.page_size


def make_case(q_lens: list[int], p_lens: list[int], d: int, dv: int, *, peaky: bool = False,
              sink: float | None = None, seed: int = 0) -> Case:
    """A batch of 4 query heads over 2 KV heads, pages of 4 tokens, float32 (the interpreter's).

    ``sink``: key 0 of every request becomes that many times its mean query (per KV head), an
    attention sink, so that the tiles after it fall below the skip threshold.
    """
    b = make_batch(q_lens, p_lens, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=d, page_size=4,
                   seed=seed, **(PEAKY if peaky else {}))
    md = b.metadata
    starts = md.query_starts
    if sink is not None:
        for r, k_r in enumerate(b.full_k):
            q_mean = b.q[starts[r]: starts[r + 1]].mean(0).view(NUM_KV_HEADS, -1, d).mean(1)
            k_r[0] = sink * q_mean
    k_new = torch.cat([k_r[p:] for k_r, p in zip(b.full_k, p_lens)])
    g = torch.Generator().manual_seed(seed + 1000)
    full_v = [torch.randn(k.shape[0], NUM_KV_HEADS, dv, generator=g) for k in b.full_k]
    k_cache = b.layer.kv_cache.k.clone()  # garbage (random) wherever no request's key lives
    v_cache = torch.randn(*k_cache.shape[:3], dv, generator=g)
    for r, (k_r, v_r) in enumerate(zip(b.full_k, full_v)):
        pos = torch.arange(k_r.shape[0])
        pages = md.page_table[r].long()[pos // md.page_size]
        k_cache[pages, pos % md.page_size] = k_r
        v_cache[pages, pos % md.page_size] = v_r
    v_new = torch.cat([v_r[p:] for v_r, p in zip(full_v, p_lens)])
    return Case(
        md if DEVICE.type == "cpu" else AttentionMetadata.build(q_lens, p_lens, md.page_table, md.page_size,
                                                                device=DEVICE),
        gapped(b.q.to(DEVICE)), gapped(k_new.to(DEVICE)), gapped(v_new.to(DEVICE)),
        gapped(k_cache.to(DEVICE)), gapped(v_cache.to(DEVICE)), b.full_k, full_v, b.layer.scale,
    )


def reference(case: Case, *, source: str, factor: float | None = None, split_tiles: int | None = None,
              window: int | None = None, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(out, lse, visited, skipped)`` of the reference over every request: over the cache
    (causal after each prefix) or over the new tokens' own k/v (``ragged-causal``/``ragged-full``)."""
    outs, lses, visited, skipped = [], [], 0, 0
    starts = case.md.query_starts
    for r, p in enumerate(case.md.prefix_lens):
        q = case.q[starts[r]: starts[r + 1]].cpu().contiguous()
        if source == "cache":
            k, v, offset = case.full_k[r], case.full_v[r], p
        else:
            k, v = case.full_k[r][p:], case.full_v[r][p:]
            offset = 0 if source == "ragged-causal" else None
        if factor is None:
            o, lse = attend_dense(q, k, v, case.scale, offset, window, softcap)
        else:
            o, lse, vis, sk = attend_tiled(q, k, v, case.scale, offset, factor, TILE_KV, TILE_Q, split_tiles, window,
                                           softcap)
            visited, skipped = visited + vis, skipped + sk
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses), visited, skipped


def assert_close(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor) -> None:
    torch.testing.assert_close(out.cpu(), ref_out, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=ATOL, rtol=RTOL)
    assert (gap_of(out) == SENTINEL).all(), "a kernel wrote past the head's columns"


def run_prefill(case: Case, *, source: str, factor: float | None = None, window: int | None = None,
                softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, lse, counters)`` of the prefill kernel on every (non-decode) request of ``case``."""
    md = case.md
    out = gapped_empty((case.q.shape[0], NUM_HEADS, case.v.shape[2]))
    lse = torch.full(case.q.shape[:2], float("nan"), device=DEVICE)
    counters = torch.zeros(2, 2, dtype=torch.int64, device=DEVICE)
    if source == "cache":
        k, v = case.k_cache, case.v_cache
        src = dict(page_table=md.page_table, seq_lens=md.seq_lens, prefix_lens=md.prefix_lens_tensor)
    else:
        k, v = case.k, case.v
        src = dict(kv_start_loc=md.query_start_loc)
    prefill_attention(
        case.q, k, v, out, lse, counters, query_start_loc=md.query_start_loc, is_decode=md.is_decode,
        scale=case.scale, causal=source != "ragged-full", factor=factor, tile_q=TILE_Q, tile_kv=TILE_KV,
        window=window, softcap=softcap, **src,
    )
    return out, lse, counters


@pytest.mark.parametrize("factor", [None, 4.0], ids=["dense", "skip"])
@pytest.mark.parametrize("source", ["cache", "ragged-causal", "ragged-full"])
@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
def test_prefill_matches_the_reference(dims, source, factor):
    # A fresh prefill and an extend over a cached prefix of 37 keys (over the cache).
    skip = factor is not None
    case = make_case([13, 6], [0, 37], *dims, peaky=skip, sink=4.0 if skip else None, seed=sum(dims))
    ref_out, ref_lse, visited, skipped = reference(case, source=source, factor=factor)
    out, lse, counters = run_prefill(case, source=source, factor=factor)
    assert_close(out, lse, ref_out, ref_lse)
    assert counters[0].tolist() == [visited, skipped], "tiles visited/skipped differ from the reference"
    if skip and source == "cache":
        assert 0 < skipped < visited, "the batch should exercise both skip decisions"


@pytest.mark.parametrize("dims", DIMS[:-1], ids=DIM_IDS[:-1])
def test_prefill_with_window_and_softcap_matches_the_reference(dims):
    case = make_case([13, 6], [0, 37], *dims, peaky=True, sink=4.0, seed=3)
    ref_out, ref_lse, visited, skipped = reference(case, source="cache", factor=4.0, window=10, softcap=5.0)
    out, lse, counters = run_prefill(case, source="cache", factor=4.0, window=10, softcap=5.0)
    assert_close(out, lse, ref_out, ref_lse)
    assert counters[0].tolist() == [visited, skipped]


def run_decode(case: Case, *, factor: float | None = None, split_tiles: int | None = None,
               num_splits: int | None = None, num_tokens: int | None = None, extra_rows: int = 0,
               save: bool = False, window: int | None = None,
               softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, lse, counters)`` of the decode kernel over the cache, with ``extra_rows`` rows
    past every request's (owned by none) and ``num_tokens`` real tokens (default: all)."""
    md = case.md
    rows = case.q.shape[0] + extra_rows
    q = gapped(torch.cat([case.q, torch.full((extra_rows, *case.q.shape[1:]), float("nan"), device=DEVICE)]))
    out = gapped_empty((rows, NUM_HEADS, case.v.shape[2]))
    lse = torch.full((rows, NUM_HEADS), float("nan"), device=DEVICE)
    counters = torch.zeros(2, 2, dtype=torch.int64, device=DEVICE)
    n = torch.tensor([md.num_tokens if num_tokens is None else num_tokens], dtype=torch.int32, device=DEVICE)
    decode_attention(
        q, case.k_cache, case.v_cache, out, lse, counters if factor is not None else None,
        query_start_loc=md.query_start_loc, is_decode=md.is_decode, scale=case.scale, factor=factor,
        tile_kv=TILE_KV, split_tiles=split_tiles, max_kv_len=case.max_kv_len, page_table=md.page_table,
        seq_lens=md.seq_lens, num_tokens=n, num_splits=num_splits, window=window, softcap=softcap,
        slot_mapping=md.slot_mapping if save else None, new_kv=(case.k, case.v) if save else None,
    )
    return out, lse, counters


DECODE = ([1, 1, 1], [70, 5, 33])  # 5, 1 and 3 tiles of keys


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-run", "three-runs"])
@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
def test_dense_decode_matches_the_reference(dims, num_splits):
    case = make_case(*DECODE, *dims, seed=sum(dims))
    ref_out, ref_lse, _, _ = reference(case, source="cache")
    out, lse, _ = run_decode(case, num_splits=num_splits)
    assert_close(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("split_tiles", [None, 2], ids=["one-run", "runs-of-2"])
@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
def test_skip_softmax_decode_matches_the_reference(dims, split_tiles):
    case = make_case(*DECODE, *dims, peaky=True, sink=4.0, seed=sum(dims))
    ref_out, ref_lse, visited, skipped = reference(case, source="cache", factor=4.0, split_tiles=split_tiles)
    out, lse, counters = run_decode(case, factor=4.0, split_tiles=split_tiles)
    assert_close(out, lse, ref_out, ref_lse)
    assert counters[1].tolist() == [visited, skipped], "tiles visited/skipped differ from the reference"
    assert 0 < skipped < visited, "the batch should exercise both skip decisions"


@pytest.mark.parametrize("dims", DIMS[:-1], ids=DIM_IDS[:-1])
def test_decode_with_window_and_softcap_matches_the_reference(dims):
    case = make_case(*DECODE, *dims, peaky=True, sink=4.0, seed=5)
    ref_out, ref_lse, visited, skipped = reference(case, source="cache", factor=4.0, split_tiles=2, window=40,
                                                   softcap=5.0)
    out, lse, counters = run_decode(case, factor=4.0, split_tiles=2, window=40, softcap=5.0)
    assert_close(out, lse, ref_out, ref_lse)
    assert counters[1].tolist() == [visited, skipped]


@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
def test_decode_padding_rows_are_zero_with_lse_minus_inf(dims):
    # CUDA-graph padding: the third request is a stand-in past the real count (2), and two
    # rows past every request's are owned by none; the split runs still merge the real ones.
    case = make_case(*DECODE, *dims, seed=sum(dims))
    ref_out, ref_lse, _, _ = reference(case, source="cache")
    out, lse, _ = run_decode(case, num_splits=2, num_tokens=2, extra_rows=2)
    assert_close(out[:2], lse[:2], ref_out[:2], ref_lse[:2])
    assert torch.equal(out[2:], torch.zeros_like(out[2:])) and torch.isneginf(lse[2:]).all()
    assert (gap_of(out) == SENTINEL).all()


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-run", "three-runs"])
@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
def test_decode_writes_the_new_kv_into_the_cache_first(dims, num_splits):
    # The fused save: poisoned slots prove the kernel wrote each request's new token before
    # reading it, and the gaps (still NaN) that it wrote no column past the head.
    case = make_case(*DECODE, *dims, seed=sum(dims))
    ref_out, ref_lse, _, _ = reference(case, source="cache")
    slots = case.md.slot_mapping.long()
    expected_k, expected_v = case.k_cache.clone(), case.v_cache.clone()
    for cache in (case.k_cache, case.v_cache):
        cache.view(-1, *cache.shape[2:])[slots] = float("nan")
    out, lse, _ = run_decode(case, num_splits=num_splits, save=True)
    assert_close(out, lse, ref_out, ref_lse)
    for cache, expected in ((case.k_cache, expected_k), (case.v_cache, expected_v)):
        assert torch.equal(cache, expected)
        assert gap_of(cache).isnan().all(), "the save wrote past the head's columns"


@pytest.mark.parametrize("dims", DIMS, ids=DIM_IDS)
def test_save_kernel_writes_every_real_slot_and_skips_padding(dims):
    d, dv = dims
    g = torch.Generator().manual_seed(d)
    k_cache = torch.randn(6, 4, NUM_KV_HEADS, d, generator=g).to(DEVICE)
    v_cache = torch.randn(6, 4, NUM_KV_HEADS, dv, generator=g).to(DEVICE)
    k = torch.randn(5, NUM_KV_HEADS, d, generator=g).to(DEVICE)
    v = torch.randn(5, NUM_KV_HEADS, dv, generator=g).to(DEVICE)
    slots = torch.tensor([3, -1, 17, 22, -1], dtype=torch.int64, device=DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    real = slots >= 0
    expected_k.view(-1, NUM_KV_HEADS, d)[slots[real]] = k[real]
    expected_v.view(-1, NUM_KV_HEADS, dv)[slots[real]] = v[real]
    save_kv_to_cache(k, v, slots, k_cache, v_cache)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_padded_heads_count_as_their_register_tiles():
    # Dense decode's KV tile follows the padded tile, not the head (a stand-in q on a GPU).
    assert [padded(d) for d in (16, 48, 64, 80, 96, 128, 192, 256)] == [16, 64, 64, 128, 128, 128, 256, 256]

    class _QOnGpu:
        device = torch.device("cuda")

    k = torch.empty(0, device="meta", dtype=torch.bfloat16)
    assert _dense_tile_kv(_QOnGpu(), k, 96, 96, 16) == 128, "a head of 96 fits as its 128-wide tile"
    assert _dense_tile_kv(_QOnGpu(), k, 192, 128, 16) == 16, "a head of 192 is a 256-wide tile: too wide"
    assert _dense_tile_kv(_QOnGpu(), k, 128, 128, 16) == 128
