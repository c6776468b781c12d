"""The device-side k/v save writes every real token to its slot and nothing for padding."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`

pytest.importorskip("triton", reason="triton is not installed; `pip install triton` runs these tests on the CPU")

from fullcg.ops.kernels.save_kv import save_kv_to_cache  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("all_padding", [False, True])
def test_padding_slots_write_nothing_and_real_slots_get_their_token(all_padding):
    torch.manual_seed(0)
    k_cache = torch.full((4, 2, 2, 8), 7.0, device=DEVICE)
    v_cache = torch.full((4, 2, 2, 8), 7.0, device=DEVICE)
    qkv = torch.randn(3, 6, 8, device=DEVICE)
    k, v = qkv[:, 2:4], qkv[:, 4:6]  # non-contiguous views, as a fused projection gives them
    slots = torch.tensor([-1, -1, -1] if all_padding else [5, -1, 0], device=DEVICE)
    save_kv_to_cache(k, v, slots, k_cache, v_cache)
    flat_k, flat_v = k_cache.view(-1, 2, 8), v_cache.view(-1, 2, 8)
    written = {} if all_padding else {5: 0, 0: 2}
    for slot in range(8):
        if slot in written:
            assert torch.equal(flat_k[slot], k[written[slot]]) and torch.equal(flat_v[slot], v[written[slot]])
        else:
            assert (flat_k[slot] == 7.0).all() and (flat_v[slot] == 7.0).all(), f"slot {slot} was written"
