"""AttentionMetadata: immutable after it is made; the prefix-chunk plan made only when something
reads it; build's fast path, the validating constructor and with_device_tensors agree."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import weakref

import pytest
import torch

import fullcg
from fullcg import errors, runner
from fullcg.metadata import _DEVICE_FIELDS, _FIELDS, _HOST_DERIVED, _SLOTS, AttentionMetadata, ForwardMode

_HOST_FIELDS = tuple(name for name in _FIELDS if name not in _DEVICE_FIELDS)
_DERIVED = (*_HOST_DERIVED, "decode_flags", "query_starts")  # the last two made on first read, but for decodes


def _batch() -> fullcg.AttentionMetadata:
    table = torch.arange(12, dtype=torch.int32).view(2, 6)
    return fullcg.AttentionMetadata.build([2, 1], [5, 9], table, 4, prefix_chunk_tokens=4)


def test_the_chunk_count_is_known_without_making_the_chunk_plan():
    md = _batch()
    assert md.num_prefix_chunks == 5  # 2 positions per request per chunk, longest prefix 9
    assert md._prefix_chunks is None
    with fullcg.forward_context(md):
        assert fullcg.context.num_prefix_chunks() == 5
    assert md._prefix_chunks is None, "entering a context must not make the plan"


def test_the_plan_made_on_first_use_packs_each_requests_prefix_in_chunks():
    md = _batch()
    chunks = md.prefix_chunks
    assert md.prefix_chunks is chunks, "made once"
    assert [c.lens for c in chunks] == [(2, 2), (2, 2), (1, 2), (0, 2), (0, 1)]
    assert [c.starts for c in chunks] == [(0, 0), (2, 2), (4, 4), (6, 6), (8, 8)]
    assert [c.offsets for c in chunks][2] == (0, 1, 3)
    assert torch.equal(chunks[2].kv_start_loc, torch.tensor([0, 1, 3], dtype=torch.int32))


def test_a_batch_without_prefixes_has_no_chunks_and_replace_keeps_the_plan():
    table = torch.arange(2, dtype=torch.int32).view(2, 1)
    md = fullcg.AttentionMetadata.build([3, 2], [0, 0], table, 4)
    assert md.num_prefix_chunks == 0 and md.prefix_chunks == ()
    copied = dataclasses.replace(_batch())
    assert copied.num_prefix_chunks == 5 and len(copied.prefix_chunks) == 5
    copied = _batch().replace()
    assert copied.num_prefix_chunks == 5 and len(copied.prefix_chunks) == 5


# --- immutability -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["query_lens", "page_table", "num_tokens", "decode_flags", "prefix_chunks",
                                  "positions", "_max_page", "not_a_field"])
def test_assigning_or_deleting_an_attribute_raises(name):
    md = _batch()
    with pytest.raises(dataclasses.FrozenInstanceError) as e:  # an AttributeError, as for the frozen dataclass
        setattr(md, name, None)
    message = str(e.value)
    assert f"AttentionMetadata.{name}" in message and "metadata is immutable after build" in message
    assert "build a new one with AttentionMetadata.build(...)" in message
    with pytest.raises(dataclasses.FrozenInstanceError, match="immutable after build"):
        delattr(md, name)
    assert not hasattr(md, "__dict__"), "slots only: no attribute can be added"


def test_every_slot_is_set_by_every_constructor():
    md = _batch()
    table = torch.arange(16, dtype=torch.int32).view(2, 8)
    made = {
        "build": md,
        "stand_in": AttentionMetadata.stand_in([1, 1], [3, 3], table, 4),
        "__init__": AttentionMetadata(*(getattr(md, name) for name in _FIELDS)),
        "replace": md.replace(),
        "with_device_tensors": md.with_device_tensors(**{name: getattr(md, name) for name in _DEVICE_FIELDS}),
        "copy": copy.copy(md),
    }
    for how, m in made.items():
        for slot in _SLOTS:
            assert hasattr(m, slot), f"{how} leaves {slot} unset"
        assert weakref.ref(m)() is m, "implementations key per-step plans to the batch by weak reference"


def test_copy_deepcopy_and_pickle_keep_the_batch():
    md = _batch()
    md.prefix_chunks  # made: comes along
    for other in (copy.copy(md), copy.deepcopy(md), pickle.loads(pickle.dumps(md))):
        assert other is not md
        _assert_same(other, md)
        assert [c.offsets for c in other._prefix_chunks] == [c.offsets for c in md.prefix_chunks]
        assert other._max_page == md._max_page
    assert copy.copy(md).page_table is md.page_table and copy.deepcopy(md).page_table is not md.page_table


# --- build's fast path against the validating constructor -------------------------------


def _assert_same(a: AttentionMetadata, b: AttentionMetadata) -> None:
    """Every field and every host-derived value equal; tensors equal in dtype, shape and values."""
    for name in (*_HOST_FIELDS, *_DERIVED):
        assert getattr(a, name) == getattr(b, name), name
        assert type(getattr(a, name)) is type(getattr(b, name)), name
    for name in _DEVICE_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.device == y.device and torch.equal(x, y), name
    assert torch.equal(a.positions, b.positions)
    assert [(c.starts, c.lens, c.offsets) for c in a.prefix_chunks] == \
        [(c.starts, c.lens, c.offsets) for c in b.prefix_chunks]
    assert all(torch.equal(c.kv_start_loc, d.kv_start_loc) for c, d in zip(a.prefix_chunks, b.prefix_chunks))


BATCHES = {
    # query_lens, prefix_lens, table width, page size, prefix_chunk_tokens, forward_modes
    "decode": ([1, 1, 1], [4, 9, 1], 3, 4, 4096, None),
    "one decode": ([1], [30], 8, 4, 4096, None),
    "mixed": ([5, 1, 3, 1], [0, 7, 2, 12], 4, 4, 4096, None),
    "prefix chunks": ([2, 1, 4], [5, 9, 13], 5, 4, 6, None),
    "extend of one token": ([1, 1], [3, 6], 2, 4, 4096, ["extend", "decode"]),
}


@pytest.mark.parametrize("kind", BATCHES)
def test_the_fast_path_of_build_equals_the_validating_constructor(kind):
    q_lens, p_lens, width, page_size, chunk_tokens, modes = BATCHES[kind]
    table = torch.arange(len(q_lens) * width, dtype=torch.int32).view(len(q_lens), width)
    built = AttentionMetadata.build(q_lens, p_lens, table, page_size, modes, prefix_chunk_tokens=chunk_tokens)
    made = AttentionMetadata(*(getattr(built, name) for name in _FIELDS))
    _assert_same(made, built)
    assert made.is_decode_only == (kind in ("decode", "one decode"))
    assert made._max_page is None, "made otherwise than by build: re-verified on first use"
    assert made.verified(table.numel()) is made and made._max_page == built._max_page
    # The host-derived values follow the fields alone, as the constructor derives them:
    assert built.num_tokens == sum(q_lens) and built.query_starts[-1] == sum(q_lens)
    assert built.decode_flags == tuple(m is ForwardMode.DECODE for m in built.forward_modes)
    assert built.has_decode == any(built.decode_flags)
    assert built.num_prefix_chunks == len(built.prefix_chunks)
    assert built.pages_needed == max(-(-(q + p) // page_size) for q, p in zip(q_lens, p_lens))


def test_a_decode_batch_has_its_flags_and_starts_at_once_others_on_first_read():
    table = torch.arange(6, dtype=torch.int32).view(3, 2)
    decode = AttentionMetadata.build([1, 1, 1], [2, 4, 5], table, 4)
    assert decode._decode_flags == (True, True, True) and decode._query_starts == (0, 1, 2, 3)
    mixed = AttentionMetadata.build([2, 1, 3], [0, 4, 5], table, 4)
    assert mixed._decode_flags is None and mixed._query_starts is None
    assert mixed.decode_flags == (False, True, False) and mixed.query_starts == (0, 2, 3, 6)
    assert mixed._decode_flags is mixed.decode_flags, "kept"
    assert mixed.has_decode and not mixed.is_decode_only
    given = AttentionMetadata.build([1, 1], [2, 4], table[:2], 4, ["extend", "decode"])
    assert given.decode_flags == (False, True) and given.has_decode and not given.is_decode_only
    assert given.query_starts == (0, 1, 2)
    prefill = AttentionMetadata.build([2, 3], [0, 0], table[:2], 4)
    assert not prefill.has_decode and prefill.decode_flags == (False, False)


def test_the_validating_constructor_refuses_fields_that_disagree():
    md = _batch()
    fields = {name: getattr(md, name) for name in _FIELDS}
    with pytest.raises(errors.MetadataChangedError, match="^AttentionMetadata fields disagree: slot_mapping has"):
        AttentionMetadata(**{**fields, "query_lens": (5, 1)})
    with pytest.raises(errors.MetadataChangedError, match="prefix_lens must hold integers"):
        AttentionMetadata(**{**fields, "prefix_lens": (5, "9")})
    with pytest.raises(errors.MetadataChangedError, match="request 1 is in decode mode"):
        md.replace(forward_modes=(ForwardMode.EXTEND, ForwardMode.DECODE), query_lens=(1, 2))
    with pytest.raises(errors.MetadataChangedError, match=r"prefix_lens >= 0, got \[2, 1\] and \[5, -1\]"):
        md.replace(prefix_lens=(5, -1))
    with pytest.raises(errors.MetadataChangedError, match="page_size must be a positive integer"):
        md.replace(page_size=0)
    with pytest.raises(errors.MetadataChangedError, match="prefix_chunks has 1 chunks but"):
        md.replace(prefix_chunks=md.prefix_chunks[:1])
    with pytest.raises(errors.MetadataChangedError, match=r"is_decode has shape \(3,\) for 2 requests; metadata is"):
        md.replace(is_decode=torch.ones(3, dtype=torch.bool))


def test_replace_is_checked_like_dataclasses_replace_and_reverified_on_first_use():
    md = _batch()
    moved = md.replace(page_table=md.page_table + 100)
    assert moved.page_table is not md.page_table and moved.query_lens == md.query_lens
    with pytest.raises(errors.PageOutOfRangeError):
        moved.verified(12)
    stale = md.replace(slot_mapping=md.slot_mapping + 1)
    with pytest.raises(errors.MetadataChangedError, match="^AttentionMetadata fields disagree: slot_mapping does not"):
        stale.verified(12)
    swapped_prefixes = AttentionMetadata.build([2, 1], [9, 5], md.page_table, 4, prefix_chunk_tokens=4)
    planned = md.replace(prefix_chunks=swapped_prefixes.prefix_chunks)  # as many chunks, other rows
    with pytest.raises(errors.MetadataChangedError, match="prefix_chunks do not follow"):
        planned.verified(12)
    with pytest.raises(TypeError):
        md.replace(num_tokens=4)  # derived, not a field


# --- with_device_tensors -----------------------------------------------------------------


def _buffers(md: AttentionMetadata, pad: int) -> dict[str, torch.Tensor]:
    """Device tensors for ``md`` padded by ``pad`` requests and tokens, holding values that
    disagree with the batch (so a value derived from them would show)."""
    r, n = md.num_requests, md.num_tokens
    return dict(
        page_table=torch.full((r + pad, md.page_table.shape[1] + 1), 7, dtype=torch.int32),
        slot_mapping=torch.full((n + pad,), -1, dtype=torch.int64),
        query_start_loc=torch.zeros(r + pad + 1, dtype=torch.int32),
        seq_lens=torch.zeros(r + pad, dtype=torch.int32),
        prefix_lens_tensor=torch.zeros(r + pad, dtype=torch.int32),
        is_decode=torch.ones(r + pad, dtype=torch.bool),
        num_tokens_tensor=torch.tensor([99], dtype=torch.int32),
    )


def test_with_device_tensors_keeps_host_fields_and_derived_values_and_swaps_device_tensors():
    md = _batch()
    buffers = _buffers(md, pad=3)
    swapped = md.with_device_tensors(**buffers)
    assert type(swapped) is AttentionMetadata and swapped is not md
    for name in _DEVICE_FIELDS:
        assert getattr(swapped, name) is buffers[name], name
        assert getattr(md, name) is not buffers[name], "the original keeps its own"
    for name in (*_HOST_FIELDS, *_HOST_DERIVED):
        assert getattr(swapped, name) is getattr(md, name), name
    assert swapped._decode_flags is None and swapped._query_starts is None, "not made yet here either"
    assert swapped.decode_flags == md.decode_flags and swapped.query_starts == md.query_starts == (0, 2, 3)
    # Nothing host-side follows the new tensors, which say otherwise:
    assert swapped.num_tokens == 3 and swapped.is_decode_only is False and swapped.decode_flags == (False, True)
    assert swapped.pages_needed == 3 and swapped.num_requests == 2
    assert swapped._max_page == md._max_page, "the verification bound comes along"
    # Not made yet: made on the copy from the host fields (the original still has none).
    assert [c.offsets for c in swapped.prefix_chunks] == [c.offsets for c in md.prefix_chunks]
    assert torch.equal(swapped.positions, torch.tensor([5, 6, 9]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        swapped.page_table = md.page_table


def test_with_device_tensors_carries_what_the_batch_has_made():
    md = _batch()
    chunks, positions, flags, starts = md.prefix_chunks, md.positions, md.decode_flags, md.query_starts
    swapped = md.with_device_tensors(**_buffers(md, pad=0))
    assert swapped.prefix_chunks is chunks and swapped.positions is positions
    assert swapped.decode_flags is flags and swapped.query_starts is starts
    meta = {name: t.to("meta") for name, t in _buffers(md, pad=0).items()}
    elsewhere = md.with_device_tensors(**meta)
    assert elsewhere._prefix_chunks is None and elsewhere._positions is None, "made anew on another device"


def test_with_device_tensors_needs_every_device_tensor_by_name():
    md = _batch()
    buffers = _buffers(md, pad=0)
    with pytest.raises(TypeError):
        md.with_device_tensors(*buffers.values())
    del buffers["is_decode"]
    with pytest.raises(TypeError):
        md.with_device_tensors(**buffers)


def test_static_metadata_fill_gives_the_batch_over_the_static_buffers():
    cpu = torch.device("cpu")
    static = runner.StaticMetadata(8, runner.StaticTables(8, 6, cpu), cpu)
    md = _batch()
    filled = static.fill(md)
    for name, buffer in (("page_table", static.page_table), ("slot_mapping", static.slot_mapping),
                         ("query_start_loc", static.query_start_loc), ("seq_lens", static.seq_lens),
                         ("prefix_lens_tensor", static.prefix_lens), ("is_decode", static.is_decode),
                         ("num_tokens_tensor", static.num_tokens)):
        assert getattr(filled, name) is buffer, name
    for name in (*_HOST_FIELDS, *_DERIVED):
        assert getattr(filled, name) == getattr(md, name), name
    assert filled.query_start_loc.tolist() == [0, 2, 3, 4, 5, 6, 7, 8, 8]


def test_the_host_page_table_is_builds_own_copy_and_survives_device_tensor_swaps():
    # Host planners (FlashInfer) read the table from here: a batch built from a host table
    # keeps it, so a step whose table is on the device never copies it back (that copy would
    # make the host wait for the GPU between steps).
    table = torch.arange(12, dtype=torch.int64).view(2, 6)
    md = fullcg.AttentionMetadata.build([2, 1], [5, 9], table, 4)
    host = md.host_page_table()
    assert host.shape[0] == 2 and host.shape[1] >= md.pages_needed
    assert torch.equal(host, table[:, : host.shape[1]])
    table.fill_(99)  # the caller's table, reused for the next step
    assert torch.equal(md.host_page_table(), torch.arange(12).view(2, 6)[:, : host.shape[1]])
    # A CUDA graph's static buffers hold the batch padded; the host table stays the batch's own.
    swapped = md.with_device_tensors(**{name: getattr(md, name) for name in _DEVICE_FIELDS}
                                     | {"page_table": torch.zeros(8, 16, dtype=torch.int32)})
    assert torch.equal(swapped.host_page_table(), md.host_page_table())
    # Metadata made field by field reads it from page_table on first use.
    made = AttentionMetadata(*(getattr(md, name) for name in _FIELDS))
    assert torch.equal(made.host_page_table(), md.page_table.to(torch.int64))
