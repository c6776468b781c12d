"""Skinny linears: the one-pass GEMV kernel, ``fullcg::skinny_linear`` and the pass that
puts it into compiled graphs.

The kernel runs on the GPU where there is one, else on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, set by conftest before triton is imported); the op takes the kernel
on the CPU only with ``FULLCG_FUSED_TRITON_ON_CPU=1``, as the fused element-wise ops do.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fullcg
from fullcg.models.llama import LlamaConfig, LlamaMLP, LlamaModel
from fullcg.ops import linear as linear_module
from fullcg.ops.linear import MAX_GEMV_ROWS, reference_skinny_linear, skinny_linear
from fullcg.passes.sibling_linears import FuseSiblingLinearsPass
from fullcg.passes.skinny_linear import SkinnyLinearPass

triton = pytest.importorskip("triton", reason="the GEMV is a Triton kernel: pip install triton")
from fullcg.ops.kernels import gemv as gemv_module  # noqa: E402
from fullcg.ops.kernels.gemv import (  # noqa: E402
    GATED_ROWS, NARROW_ROWS, ONE_ROW, GemvConfig, choose, gemv)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
#: Small launch shapes, so the interpreter covers several programs and a ragged tail.
SMALL = GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=2)


def _inputs(rows: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16, device: torch.device = DEVICE):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g).to(dtype=dtype, device=device)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype=dtype, device=device)
    return x, w


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


# --- the kernel -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("k", [64, 80], ids=["k_whole_steps", "k_ragged"])
def test_gemv_equals_the_matmul(dtype, gated, rows, k):
    if DEVICE.type == "cpu" and dtype is torch.bfloat16 and rows > 1:
        pytest.skip("Triton's interpreter computes a bf16 tl.dot wrongly; this case runs on the GPU")
    x, w = _inputs(rows, 40, k, dtype)  # 40 outputs: a ragged last program of 16
    got = gemv(x, w, gated=gated, config=SMALL)
    want = reference_skinny_linear(x.float(), w.float(), gated)
    assert got.shape == want.shape and got.dtype == dtype
    _close(got, want)


def test_gemv_writes_into_a_given_output_with_a_row_stride():
    x, w = _inputs(2, 32, 64, torch.float16)
    out = torch.full((2, 48), 7.0, dtype=x.dtype, device=DEVICE)
    gemv(x, w, config=SMALL, out=out[:, :32])
    _close(out[:, :32], x.float() @ w.float().T)
    assert bool((out[:, 32:] == 7).all()), "columns outside the output view were written"


def test_gemv_refuses_what_it_cannot_compute():
    x, w = _inputs(1, 32, 64)
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\]"):
        gemv(x, w[:, :32])
    with pytest.raises(ValueError, match="1 to 16 rows, got 17"):
        gemv(torch.zeros(17, 64, dtype=x.dtype, device=DEVICE), w)
    with pytest.raises(ValueError, match="even number of weight rows"):
        gemv(x, w[:31], gated=True)
    with pytest.raises(ValueError, match="contiguous along K"):
        gemv(x, w.T.contiguous().T)
    with pytest.raises(ValueError, match=r"out must be \[1, 32\]"):
        gemv(x, w, out=torch.empty(1, 16, dtype=x.dtype, device=DEVICE))
    with pytest.raises(ValueError, match="out must be"):
        gemv(x, w, out=torch.empty(1, 64, dtype=x.dtype, device=DEVICE)[:, ::2])


def test_launch_choice_by_rows_shape_and_gpu_size():
    big = dict(n=28672, k=4096, sms=132)
    assert choose(1, False, **big) is ONE_ROW and choose(1, True, **big) is ONE_ROW
    assert all(choose(r, True, **big) is GATED_ROWS for r in range(2, MAX_GEMV_ROWS + 1))
    assert choose(MAX_GEMV_ROWS + 1, True, **big) is None
    assert choose(2, False, 4096, 14336, 132) is NARROW_ROWS and choose(8, False, 4096, 4096, 132) is NARROW_ROWS
    assert choose(2, False, 6144, 4096, 132) is None, "several rows of a wide plain projection stay with the library GEMM"
    assert choose(9, False, 4096, 14336, 132) is None
    # A tensor-parallel shard's MLP (1792 outputs: 56 programs of 32) cannot fill half of 132 SMs.
    assert choose(2, True, 3584, 4096, 132) is None and choose(1, True, 3584, 4096, 132) is ONE_ROW
    assert choose(2, True, 3584, 4096, 100) is GATED_ROWS


# --- the op -----------------------------------------------------------------------------


@pytest.fixture
def gemv_calls(monkeypatch):
    """The op's GEMV launches (rows, gated), with the kernel taken on the CPU too."""
    monkeypatch.setenv("FULLCG_FUSED_TRITON_ON_CPU", "1")
    # A one-multiprocessor GPU, so the small test shapes fill it at several rows, as large ones fill a real GPU.
    monkeypatch.setattr(linear_module, "sm_count", lambda device: 1)
    calls = []
    real = gemv_module.gemv

    def spy(x, w, *, gated=False, config=ONE_ROW, out=None):
        calls.append((x.shape[0], gated))
        return real(x, w, gated=gated, config=SMALL if DEVICE.type == "cpu" else config, out=out)

    monkeypatch.setattr(gemv_module, "gemv", spy)
    return calls


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_op_takes_the_gemv_for_one_row_and_keeps_the_leading_dims(gemv_calls, gated):
    x, w = _inputs(1, 64, 64)
    x = x.view(1, 1, 64)
    got = skinny_linear(x, w, gated)
    assert gemv_calls == [(1, gated)]
    assert got.shape == (1, 1, 32 if gated else 64)
    _close(got, reference_skinny_linear(x.float(), w.float(), gated))


def test_op_takes_the_gated_and_narrow_gemv_up_to_eight_rows_and_the_gemm_beyond(gemv_calls):
    x, w = _inputs(9, 64, 64, torch.float16)  # (the interpreter's bf16 tl.dot is wrong)
    _close(skinny_linear(x[:8], w, True), reference_skinny_linear(x[:8].float(), w.float(), True))
    _close(skinny_linear(x, w, True), reference_skinny_linear(x.float(), w.float(), True))
    _close(skinny_linear(x[:2], w, False), x[:2].float() @ w.float().T)
    assert gemv_calls == [(8, True), (2, False)], "9 gated rows run the library GEMM"
    wide = torch.cat([w, w])  # 128 outputs of 64 inputs
    _close(skinny_linear(x[:2], wide, False), x[:2].float() @ wide.float().T)
    assert gemv_calls == [(8, True), (2, False)], "2 rows of a wide plain projection run the library GEMM"


def test_op_leaves_fp32_to_the_library_gemm(gemv_calls):
    x, w = _inputs(1, 32, 64, torch.float32)
    torch.testing.assert_close(skinny_linear(x, w), F.linear(x, w))
    assert gemv_calls == []


def test_op_without_the_kernel_is_the_plain_computation():
    x, w = _inputs(1, 32, 64, torch.float32, torch.device("cpu"))
    torch.testing.assert_close(skinny_linear(x, w, True), reference_skinny_linear(x, w, True))


def test_op_errors_name_the_mismatch():
    x, w = _inputs(1, 32, 64, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"x \[..., K\] and weight \[N, K\]"):
        skinny_linear(x, w[:, :16])
    with pytest.raises(ValueError, match="even number of weight rows"):
        skinny_linear(x, w[:31], True)
    with pytest.raises(ValueError, match="move them to one device"):
        skinny_linear(x.to("meta"), w)


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_op_passes_opcheck_and_its_gradients_are_the_matmuls(gated):
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(12, 8, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(skinny_linear, (x, w, gated))
    assert torch.autograd.gradcheck(lambda x, w: skinny_linear(x, w, gated), (x, w))


# --- the pass ---------------------------------------------------------------------------


def _traced(module: nn.Module, *inputs: torch.Tensor, passes=()) -> torch.fx.GraphModule:
    """Dynamo's graph of ``module`` with ``passes`` applied (in inference mode, as steps run)."""
    graphs = []

    def backend(gm, example_inputs):
        for p in passes:
            p(gm.graph)
        gm.recompile()
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    with torch.inference_mode():
        torch.compile(module, backend=backend, fullgraph=True)(*inputs)
    return graphs[0]


def _applying(*passes):
    """A torch.compile backend that applies ``passes`` and runs the graph as traced."""
    def backend(gm, example_inputs):
        for p in passes:
            p(gm.graph)
        gm.recompile()
        return gm
    return backend


def _targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def _skinny(gm: torch.fx.GraphModule) -> list[bool]:
    return [n.args[2] for n in gm.graph.nodes if n.target is skinny_linear]


def test_pass_folds_the_mlps_activation_into_a_gated_linear():
    cfg = LlamaConfig.tiny()
    mlp = LlamaMLP(cfg).to(torch.bfloat16)
    x = torch.randn(3, cfg.hidden_size, dtype=torch.bfloat16)
    gm = _traced(mlp, x, passes=[FuseSiblingLinearsPass(), SkinnyLinearPass(devices=("cpu",))])
    assert _skinny(gm) == [True, False], "the gate_up projection gated, the down projection plain"
    assert not {"chunk", F.silu, operator.mul} & set(_targets(gm))
    with torch.inference_mode():
        _close(gm(*[p for p in mlp.parameters()][:1], x, *[p for p in mlp.parameters()][1:])[0], mlp(x))


class _SeparateGateUp(nn.Module):
    """transformers' MLP form: gate and up as two linears over row slices of one weight."""

    def __init__(self, hidden: int, inter: int, *, extra_silu_user: bool = False) -> None:
        super().__init__()
        self.inter, self.extra = inter, extra_silu_user
        self.gate_up = nn.Parameter(torch.randn(2 * inter, hidden, dtype=torch.bfloat16) / hidden**0.5)
        self.down = nn.Linear(inter, hidden, bias=False, dtype=torch.bfloat16)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        i = self.inter
        act = self.act(F.linear(x, self.gate_up[0:i]))
        out = self.down(act * F.linear(x, self.gate_up[i:2 * i]))
        return out + act.sum() if self.extra else out


def test_pass_folds_sibling_slices_fused_by_the_sibling_pass():
    m = _SeparateGateUp(32, 48)
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    gm = _traced(m, x, passes=[FuseSiblingLinearsPass(), SkinnyLinearPass(devices=("cpu",))])
    assert _skinny(gm) == [True, False]
    assert "clone" not in _targets(gm)
    torch._dynamo.reset()
    with torch.inference_mode():
        got = torch.compile(m, backend=_applying(FuseSiblingLinearsPass(), SkinnyLinearPass(devices=("cpu",))))(x)
        _close(got, m(x))


def test_pass_keeps_the_activation_when_something_else_reads_it():
    m = _SeparateGateUp(32, 48, extra_silu_user=True)
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    gm = _traced(m, x, passes=[FuseSiblingLinearsPass(), SkinnyLinearPass(devices=("cpu",))])
    assert _skinny(gm) == [False, False], "the projection plain, its activation kept for its other reader"
    assert F.silu in _targets(gm)


def test_pass_leaves_biased_fp32_and_other_device_linears_alone():
    biased = nn.Linear(16, 8, dtype=torch.bfloat16)
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    assert _skinny(_traced(biased, x, passes=[SkinnyLinearPass(devices=("cpu",))])) == []
    fp32 = nn.Linear(16, 8, bias=False)
    assert _skinny(_traced(fp32, x.float(), passes=[SkinnyLinearPass(devices=("cpu",))])) == []
    half = nn.Linear(16, 8, bias=False, dtype=torch.bfloat16)
    assert _skinny(_traced(half, x, passes=[SkinnyLinearPass()])) == [], "CUDA weights only, by default"
    assert _skinny(_traced(half, x, passes=[SkinnyLinearPass(devices=("cpu",))])) == [False]


class _Gated(nn.Module):
    """``linear(x, w)`` split in two and gated, with the variations the pass must refuse."""

    def __init__(self, rows: int = 64, *, form: str = "chunk", write_x: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(rows, 32, dtype=torch.bfloat16) / 32**0.5)
        self.form, self.write_x = form, write_x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.w)
        if self.write_x:
            x.mul_(3)  # between the projection and its activation
        h = y.shape[-1] // 2
        if self.form == "chunk":
            g, u = y.chunk(2, dim=-1)
        elif self.form == "chunk_dim0":
            g, u = y.chunk(2, dim=0)
        elif self.form == "swapped":
            u, g = y.chunk(2, dim=-1)
        elif self.form == "partial":
            g, u = y[..., : h - 4], y[..., h: 2 * h - 4]
        else:
            raise AssertionError(self.form)
        return F.silu(g) * u


@pytest.mark.parametrize("form,folded", [("chunk", True), ("chunk_dim0", False), ("swapped", False),
                                         ("partial", False)])
def test_pass_folds_only_the_two_halves_of_the_last_dimension_in_order(form, folded):
    m = _Gated(form=form)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    gm = _traced(m, x, passes=[SkinnyLinearPass(devices=("cpu",))])
    assert (True in _skinny(gm)) == folded, _targets(gm)
    torch._dynamo.reset()
    with torch.inference_mode():
        _close(torch.compile(m, backend=_applying(SkinnyLinearPass(devices=("cpu",))))(x), m(x))


def test_pass_folds_at_the_projection_so_a_later_write_to_its_input_is_not_seen():
    m = _Gated(write_x=True)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = m(x.clone())
        torch._dynamo.reset()
        got = torch.compile(m, backend=_applying(SkinnyLinearPass(devices=("cpu",))))(x.clone())
    _close(got, want)


def test_pass_leaves_an_odd_projection_chunked_in_two_ungated():
    m = _Gated(rows=3)  # chunk(2) gives 2 and 1 columns: a broadcasting product, not two halves
    x = torch.randn(1, 32, dtype=torch.bfloat16)
    gm = _traced(m, x, passes=[SkinnyLinearPass(devices=("cpu",))])
    assert _skinny(gm) == [False]
    torch._dynamo.reset()
    with torch.inference_mode():
        _close(torch.compile(m, backend=_applying(SkinnyLinearPass(devices=("cpu",))))(x), m(x))


def test_pass_leaves_linears_under_autocast_alone():
    lin = nn.Linear(16, 8, bias=False, dtype=torch.bfloat16)

    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return lin(x)

    x = torch.randn(2, 16)  # fp32 activations, bf16 weight: autocast casts x inside linear
    graphs = []
    torch._dynamo.reset()
    with torch.inference_mode():
        got = torch.compile(step, backend=lambda gm, ex: graphs.append(gm) or _applying(
            SkinnyLinearPass(devices=("cpu",)))(gm, ex))(x)
        _close(got, step(x))
    assert _skinny(graphs[0]) == []


def test_backend_runs_the_pass_unless_switched_off():
    from fullcg.backend import _passes

    def kinds(config):
        return [type(p) for p in _passes(config).passes]

    assert SkinnyLinearPass in kinds(fullcg.FullCGConfig())
    assert SkinnyLinearPass not in kinds(fullcg.FullCGConfig(skinny_linears=False))
    assert _passes(fullcg.FullCGConfig()).uuid() != _passes(fullcg.FullCGConfig(skinny_linears=False)).uuid()


def test_pass_uuid_follows_its_devices():
    assert SkinnyLinearPass().uuid() == SkinnyLinearPass(devices=("cuda",)).uuid()
    assert SkinnyLinearPass().uuid() != SkinnyLinearPass(devices=("cpu",)).uuid()


def test_config_switch_is_a_bool():
    assert fullcg.FullCGConfig().skinny_linears is True
    with pytest.raises(TypeError, match="skinny_linears must be True or False"):
        fullcg.FullCGConfig(skinny_linears="yes")


# --- on a GPU: a compiled model --------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the pass rewrites CUDA weights")
@pytest.mark.parametrize("graph_mode", ["full", "piecewise"])
def test_compiled_llama_runs_its_decode_linears_as_gemvs_and_matches_eager(gemv_calls, graph_mode):
    import copy

    from batches import cuda_side_by_side

    torch._dynamo.reset()
    cfg = LlamaConfig.preset("tiny")
    eager = LlamaModel(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    model = copy.deepcopy(eager)
    for m in (eager, model):
        m.allocate_kv_cache(num_pages=128, page_size=16)
    config = fullcg.FullCGConfig(attention_impl="triton", graph_mode=graph_mode, capture_sizes=(1, 2, 4, 8, 16, 32, 64))
    prompts = [list(range(3, 40)), list(range(50, 55))]
    worst, _ = cuda_side_by_side(eager, model, fullcg.compile(model, config), config, prompts)
    assert worst < 3e-2, f"relative difference {worst}"
    assert (1, True) in gemv_calls and (1, False) in gemv_calls, "one-token steps take the gated and plain GEMVs"
    assert (2, True) in gemv_calls and (2, False) in gemv_calls, "two-row steps take the gated and narrow GEMVs"
