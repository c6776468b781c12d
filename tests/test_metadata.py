"""AttentionMetadata makes the prefix-chunk plan only when something reads it."""

from __future__ import annotations

import dataclasses

import torch

import fullcg


def _batch() -> fullcg.AttentionMetadata:
    table = torch.arange(12, dtype=torch.int32).view(2, 6)
    return fullcg.AttentionMetadata.build([2, 1], [5, 9], table, 4, prefix_chunk_tokens=4)


def test_the_chunk_count_is_known_without_making_the_chunk_plan():
    md = _batch()
    assert md.num_prefix_chunks == 5  # 2 positions per request per chunk, longest prefix 9
    assert "prefix_chunks" not in md.__dict__
    with fullcg.forward_context(md):
        assert fullcg.context.num_prefix_chunks() == 5
    assert "prefix_chunks" not in md.__dict__, "entering a context must not make the plan"


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
    copy = dataclasses.replace(_batch())
    assert copy.num_prefix_chunks == 5 and len(copy.prefix_chunks) == 5
