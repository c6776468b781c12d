"""The cached Triton launcher's keys never merge two launches Triton would compile apart."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`

pytest.importorskip("triton", reason="triton is not installed")

from fullcg.ops.kernels import decode as decode_kernels  # noqa: E402
from fullcg.ops.kernels.launch import Launcher, _key, _unspecialised_key, static_key  # noqa: E402


def test_keys_tell_apart_every_int_value_dtype_and_alignment_but_not_float_values():
    t = torch.zeros(8, dtype=torch.float32)
    assert _key(16) != _key(32) and _key(1) != _key(2), "ints are keyed by value (finer than Triton's == 1 / % 16)"
    assert _key(t) != _key(t.to(torch.float16))
    assert _key(t) != _key(t[1:]), "a view 4 bytes in is not 16-byte aligned"
    assert _key(0.5) == _key(2.0), "Triton does not specialise on float values"
    assert _unspecialised_key(3) == _unspecialised_key(70), "do_not_specialize ints: only their width matters"
    assert _unspecialised_key(3) != _unspecialised_key(2**40)
    a = static_key((t, 64, 0.5), (16, True), 4, 2)
    assert a == static_key((t.clone(), 64, 0.25), (16, True), 4, 2)
    assert a != static_key((t, 128, 0.5), (16, True), 4, 2) and a != static_key((t, 64, 0.5), (32, True), 4, 2)


def test_launchers_know_the_constexpr_parameters_of_the_decode_kernels():
    split = decode_kernels._SPLIT
    assert split.constexpr_names == (
        "GROUP", "BLOCK_M", "BLOCK_N", "SPLIT_TILES", "HEAD_D", "HEAD_DV", "PAGED", "PAGE_SIZE", "SKIP", "DOT_F32",
    )
    assert split._key_fns[-1] is _unspecialised_key, "num_splits is marked do_not_specialize"
    assert isinstance(decode_kernels._MERGE, Launcher)
