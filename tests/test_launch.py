"""The cached Triton launcher's keys never merge two launches Triton would compile apart."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`

pytest.importorskip("triton", reason="triton is not installed")

from fullcg.ops.kernels import decode as decode_kernels  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fullcg.ops.kernels.launch import Launcher, _key, _unspecialised_key  # noqa: E402


@triton.jit(do_not_specialize=["count"])
def _kernel_of_four(T, n, count, x, X: tl.constexpr):
    pass


def test_keys_tell_apart_every_int_value_dtype_and_alignment_but_not_float_values():
    t = torch.zeros(8, dtype=torch.float32)
    assert _key(16) != _key(32) and _key(1) != _key(2), "ints are keyed by value (finer than Triton's == 1 / % 16)"
    assert _key(t) != _key(t.to(torch.float16))
    assert _key(t) != _key(t[1:]), "a view 4 bytes in is not 16-byte aligned"
    assert _key(0.5) == _key(2.0), "Triton does not specialise on float values"
    assert _unspecialised_key(3) == _unspecialised_key(70), "do_not_specialize ints: only their width matters"
    assert _unspecialised_key(3) != _unspecialised_key(2**40)
    key = Launcher(_kernel_of_four).static_key
    a = key((t, 64, 3, 0.5), (16,), 4, 2)
    assert a == key((t.clone(), 64, 3, 0.25), (16,), 4, 2), "tensors by dtype, floats by type"
    assert a != key((t, 128, 3, 0.5), (16,), 4, 2) and a != key((t, 64, 3, 0.5), (32,), 4, 2)
    assert a == key((t, 64, 70, 0.5), (16,), 4, 2), "a do_not_specialize int (a batch size) keeps the kernel"
    assert a != key((t, 64, 2**40, 0.5), (16,), 4, 2)


def test_launchers_know_the_constexpr_parameters_of_the_decode_kernel():
    decode = decode_kernels._DECODE
    assert decode.constexpr_names == (
        "GROUP", "BLOCK_M", "BLOCK_N", "SPLIT_TILES", "BLOCK_S", "UNROLL", "HEAD_D", "HEAD_DV", "PAGED", "PAGE_SIZE", "SKIP",
        "DOT_F32", "SAVE", "WINDOW", "SOFTCAP",
    )
    names = list(inspect.signature(decode.fn.fn).parameters)
    for count in ("num_splits", "num_requests", "num_rows", "window"):
        assert decode._key_fns[names.index(count)] is _unspecialised_key, f"{count} is marked do_not_specialize"


class _FakeCompiled:
    function, packed_metadata = "fn-handle", "meta"

    def __init__(self) -> None:
        self.runs: list[tuple] = []

    def run(self, *args) -> None:
        self.runs.append(args)


def test_a_planned_launch_calls_the_compiled_kernel_directly_and_recompiles_for_another_alignment(monkeypatch):
    import fullcg.ops.kernels.launch as launch

    launcher = Launcher(decode_kernels._DECODE.fn)
    jit_launches = []

    def fake_jit(grid, args, constexprs, num_warps, num_stages):
        jit_launches.append(args)
        return _FakeCompiled()

    monkeypatch.setattr(launch, "_INTERPRET", False)
    monkeypatch.setattr(launcher, "_launch_jit", fake_jit)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "current_raw_stream", lambda device: 1234)
    buf = torch.zeros(64)
    args = (buf[:8], 3, 0.5)
    key = launcher.static_key(args, (16,), 4, 3)
    launcher.launch_keyed((2, 1, 1), args, (16,), 4, 3, key, stream=77)
    assert len(jit_launches) == 1, "the first launch compiles through Triton"
    launcher.launch_keyed((2, 1, 1), (buf[8:16], 3, 0.5), (16,), 4, 3, key, stream=77)
    compiled = next(iter(next(iter(launcher._by_static_key.values()))[1].values()))
    assert len(jit_launches) == 1 and len(compiled.runs) == 1
    grid_and_handles, rest = compiled.runs[0][:9], compiled.runs[0][9:]
    assert grid_and_handles == (2, 1, 1, 77, "fn-handle", "meta", None, None, None)
    # Tensors go as device addresses: Triton's launcher then skips a driver call per tensor.
    assert rest == (buf[8:16].data_ptr(), 3, 0.5, 16), "runtime args, then constexprs"
    launcher.launch_keyed((2, 1, 1), (buf[1:9], 3, 0.5), (16,), 4, 3, key, stream=77)
    assert len(jit_launches) == 2, "a tensor that is not 16-byte aligned is another specialisation"
    launcher((2, 1, 1), args, (16,), 4, 3)  # the unplanned path keys every argument
    launcher((2, 1, 1), (buf[8:16], 3, 0.25), (16,), 4, 3)
    assert len(jit_launches) == 3
    unplanned = launcher._compiled[next(iter(launcher._compiled))]
    assert unplanned.runs[-1][9:] == (buf[8:16].data_ptr(), 3, 0.25, 16), "the unplanned path passes addresses too"
    unplanned = launcher._compiled[next(iter(launcher._compiled))]
    assert unplanned.runs[0][3] == 1234, "the unplanned path launches on the current device's stream"


def _run_only_launcher(launch_calls: list) -> object:
    """A stand-in compiled kernel whose ``run`` has no scratch memory and a C entry point."""

    class Run:
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = False, False

        def __call__(self, *args) -> None:
            raise AssertionError("a planned launch calls the C entry point, not Triton's wrapper")

        def launch(self, *args) -> None:
            launch_calls.append(args)

    class Compiled:
        function, packed_metadata = "fn-handle", "meta"
        run = Run()

    return Compiled()


def test_a_planned_launch_passes_only_addresses_once_compiled_and_falls_back_for_unaligned_tensors(monkeypatch):
    import fullcg.ops.kernels.launch as launch

    launcher = Launcher(decode_kernels._DECODE.fn)
    jit_launches, c_launches = [], []

    def fake_jit(grid, args, constexprs, num_warps, num_stages):
        jit_launches.append(args)
        return _run_only_launcher(c_launches)

    monkeypatch.setattr(launch, "_INTERPRET", False)
    monkeypatch.setattr(launch, "_hooked", lambda: False)
    monkeypatch.setattr(launcher, "_launch_jit", fake_jit)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    monkeypatch.setattr(launch, "current_raw_stream", lambda device: 77)
    buf, meta = torch.zeros(64), torch.zeros(8, dtype=torch.int32)
    tail = (meta, 5, 0.5)
    device = torch.device("cuda", 0)  # only its index is read: nothing touches a GPU here
    first = launcher.plan((3, 1, 1), (buf, buf), tail, (16,), 4, 2, device)
    first(buf[:8], buf[8:16])
    assert len(jit_launches) == 1 and not c_launches, "the first launch compiles through Triton, with tensors"
    first(buf[16:24], buf[24:32])
    assert c_launches[-1] == (3, 1, 1, 77, "fn-handle", False, False, None, None, "meta", None, None, None,
                              buf[16:24].data_ptr(), buf[24:32].data_ptr(), meta.data_ptr(), 5, 0.5, 16)
    # A plan made later (the next step) finds the compiled kernel at once.
    again = launcher.plan((3, 1, 1), (buf, buf), tail, (16,), 4, 2, device)
    again(buf[:8], buf[8:16])
    assert len(jit_launches) == 1 and len(c_launches) == 2
    again(buf[1:9], buf[8:16])
    assert len(jit_launches) == 2 and len(c_launches) == 2, "an unaligned tensor is another specialisation"


def test_a_new_batch_size_in_a_do_not_specialize_argument_launches_the_compiled_kernel_directly(monkeypatch):
    import fullcg.ops.kernels.launch as launch

    launcher = Launcher(_kernel_of_four)
    jit_launches, c_launches = [], []
    monkeypatch.setattr(launch, "_INTERPRET", False)
    monkeypatch.setattr(launch, "_hooked", lambda: False)
    monkeypatch.setattr(launcher, "_launch_jit", lambda *a: jit_launches.append(a) or _run_only_launcher(c_launches))
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "current_raw_stream", lambda device: 5)
    buf = torch.zeros(16)
    device = torch.device("cuda", 0)
    for count in (3, 70, 1000):  # one step each, planned anew with its own count
        tail = (64, count, 0.5)
        plan = launcher.plan((1, 1, 1), (buf,), tail, (16,), 4, 2, device)
        plan(buf)
    assert len(jit_launches) == 1, "Triton does not specialise on the count: neither does the launcher"
    assert [c[-3] for c in c_launches] == [70, 1000], "later counts go straight to the compiled kernel"
