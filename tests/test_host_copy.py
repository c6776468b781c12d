"""One host-to-device copy for many small arrays (fullcg.host_copy): the packed layout
gives back every array with its dtype, shape and values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fullcg.host_copy import pack, unpack, upload

ARRAYS = [
    np.array([3, -1, 2**40], dtype=np.int64),
    np.arange(7, dtype=np.int32).reshape(7),
    np.array([True, False, True]),
    np.arange(6, dtype=np.int32).reshape(2, 3),
    np.array([], dtype=np.int64),
    np.array([1.5, -2.0], dtype=np.float32),
]


def test_packed_arrays_come_back_with_their_dtypes_shapes_and_values():
    host, offsets = pack(ARRAYS)
    assert all(o % 16 == 0 for o in offsets) and host.dtype == torch.uint8
    for a, t in zip(ARRAYS, unpack(host, ARRAYS, offsets)):
        assert t.shape == a.shape and t.numpy().dtype == a.dtype
        assert np.array_equal(t.numpy(), a)


def test_on_the_cpu_upload_shares_the_arrays_memory():
    arrays = [np.arange(4, dtype=np.int64), np.ones(3, dtype=np.int32)]
    tensors = upload(arrays, torch.device("cpu"))
    tensors[0][1] = 40
    assert arrays[0][1] == 40 and tensors[1].dtype == torch.int32


def test_other_dtypes_are_refused():
    with pytest.raises(TypeError, match="int64, int32, bool or float32"):
        pack([np.ones(2, dtype=np.float64)])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_one_asynchronous_copy_gives_every_array():
    dev = torch.device("cuda")
    for a, t in zip(ARRAYS, upload(ARRAYS, dev)):
        assert t.device.type == "cuda" and t.shape == a.shape
        assert np.array_equal(t.cpu().numpy(), a)
