"""Fused element-wise ops for eager steps: ``fullcg::rms_norm``, ``fullcg::silu_mul`` and
``fullcg::rotate_half``, the transformers modules that take them (:mod:`fullcg.integrations.eager_kernels`), and sibling
projections sharing one matmul when run eagerly.

The Triton kernels run on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set by
conftest before triton is imported); ``FULLCG_FUSED_TRITON_ON_CPU=1`` makes the ops take them
there, as they do on CUDA.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fullcg
from fullcg.integrations.eager_kernels import RMS_NORM_FORMS, use_fused_ops
from fullcg.integrations.fused_linear import SiblingProduct, fuse_sibling_projections
from fullcg.ops import fused
from fullcg.regions import regions_supported

triton = pytest.importorskip("triton", reason="the fused kernels are Triton kernels: pip install triton")
from fullcg.ops.kernels.fused import rms_norm_rows, rotate_half_rows, silu_mul_rows  # noqa: E402

hf_models = pytest.importorskip("hf_models", reason="needs transformers: pip install -e '.[test]'")
transformers = hf_models.transformers

_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
#: The kernels' tests run on the GPU where there is one, else on the CPU under the interpreter.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def triton_on_cpu(monkeypatch):
    monkeypatch.setenv("FULLCG_FUSED_TRITON_ON_CPU", "1")


class _OpCounter(TorchDispatchMode):
    """Counts the ops a forward dispatches, by packet name (``aten.mm``, ``fullcg.rms_norm``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


# --- the kernels -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", RMS_NORM_FORMS)
@pytest.mark.parametrize("cols", [64, 80])
def test_rms_norm_kernel_equals_the_reference_in_every_form_over_strided_rows(dtype, form, cols):
    g = torch.Generator().manual_seed(cols)
    wide = (3 * torch.randn(5, cols + 16, generator=g)).to(dtype=dtype, device=DEVICE)
    x = wide[:, 8 : 8 + cols]  # rows strided by cols + 16
    weight = torch.randn(cols, generator=g).to(dtype=dtype, device=DEVICE)
    want = fused.reference_rms_norm(x, weight, 1e-6, *form)
    out = torch.empty_like(want)
    rms_norm_rows(x, weight, out, 1e-6, *form)
    torch.testing.assert_close(out, want, rtol=_TOL[dtype], atol=_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [48, 2500])  # 2500: more than one block of columns per row
def test_silu_mul_kernel_equals_silu_times_up_on_halves_of_one_product(dtype, cols):
    g = torch.Generator().manual_seed(cols)
    gate_up = (2 * torch.randn(3, 2 * cols, generator=g)).to(dtype=dtype, device=DEVICE)
    gate, up = gate_up[:, :cols], gate_up[:, cols:]
    out = torch.empty(3, cols, dtype=dtype, device=DEVICE)
    silu_mul_rows(gate, up, out)
    torch.testing.assert_close(out, fused.reference_silu_mul(gate, up), rtol=_TOL[dtype], atol=_TOL[dtype])


def _rotary_inputs(dtype, tokens=3, heads=4, kv_heads=2, dim=16, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    qkv = (2 * torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)).to(dtype=dtype, device=device)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)  # strided views of one product, as attention has them
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    angles = torch.randn(tokens, dim // 2, generator=g)
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype=dtype, device=device) for f in (torch.cos, torch.sin))
    return q, k, cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 80])
def test_rotate_half_kernel_equals_transformers_rotary_embedding_for_q_and_k_in_one_launch(dtype, dim):
    q, k, cos, sin = _rotary_inputs(dtype, dim=dim, device=DEVICE)
    q_out, k_out = torch.empty(q.shape, dtype=dtype, device=DEVICE), torch.empty(k.shape, dtype=dtype, device=DEVICE)
    rotate_half_rows(q, k, cos, sin, q_out, k_out)
    want_q, want_k = fused.reference_rotate_half(q, k, cos, sin)
    # transformers' own function, on its [batch, heads, tokens, dim] layout
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(want_q, hf_q[0].transpose(0, 1)) and torch.equal(want_k, hf_k[0].transpose(0, 1))
    torch.testing.assert_close(q_out, want_q, rtol=_TOL[dtype], atol=_TOL[dtype])
    torch.testing.assert_close(k_out, want_k, rtol=_TOL[dtype], atol=_TOL[dtype])


# --- the ops ---------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("use_triton", [False, True])
def test_fused_ops_pass_opcheck(use_triton, device, monkeypatch):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    if use_triton:
        monkeypatch.setenv("FULLCG_FUSED_TRITON_ON_CPU", "1")
    x = torch.randn(2, 3, 32, device=device)
    torch.library.opcheck(fused.rms_norm, (x, torch.randn(32, device=device), 1e-5, 1.0, False))
    torch.library.opcheck(fused.rms_norm, (x.bfloat16(), torch.randn(32, device=device), 1e-5))  # out: float32
    gate_up = torch.randn(4, 64, device=device)
    torch.library.opcheck(fused.silu_mul, (gate_up[:, :32], gate_up[:, 32:]))
    torch.library.opcheck(fused.rotate_half, _rotary_inputs(torch.float32, device=device))


def test_rms_norm_op_returns_the_promoted_dtype_in_llamas_order_and_the_inputs_in_gemmas(triton_on_cpu):
    x = torch.randn(4, 16).bfloat16()
    assert fused.rms_norm(x, torch.randn(16), 1e-6, 0.0, True).dtype == torch.float32
    assert fused.rms_norm(x, torch.randn(16), 1e-6, 1.0, False).dtype == torch.bfloat16
    assert fused.rms_norm(x, torch.randn(16).bfloat16(), 1e-6).dtype == torch.bfloat16


def test_fused_ops_refuse_mismatched_inputs_naming_the_fix():
    with pytest.raises(ValueError, match=r"needs shape \(16,\)"):
        fused.rms_norm(torch.randn(2, 16), torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="one shape, dtype and device"):
        fused.silu_mul(torch.randn(2, 16), torch.randn(2, 8))
    with pytest.raises(ValueError, match="one shape, dtype and device"):
        fused.silu_mul(torch.randn(2, 16), torch.randn(2, 16).double())
    with pytest.raises(ValueError, match="a last dimension to normalise"):
        fused.rms_norm(torch.tensor(1.0), torch.randn(1), 1e-6)
    assert fused.rms_norm(torch.randn(2, 0), torch.randn(0), 1e-6).shape == (2, 0)
    assert fused.silu_mul(torch.randn(0, 4), torch.randn(0, 4)).shape == (0, 4)
    q, k, cos, sin = _rotary_inputs(torch.float32)
    with pytest.raises(ValueError, match=r"cos and sin must be \[tokens, dim\]"):
        fused.rotate_half(q, k, cos[:, :8], sin)
    with pytest.raises(ValueError, match="one even dim"):
        fused.rotate_half(q, k[..., :8], cos, sin)


def test_eager_step_is_false_while_torch_compile_traces_and_where_autograd_records():
    w = nn.Parameter(torch.randn(4))
    assert not fused.eager_step(torch.randn(4), w)  # grad enabled and w needs it
    with torch.no_grad():
        assert fused.eager_step(torch.randn(4), w)
    with torch.inference_mode():
        assert fused.eager_step(torch.randn(4), w)
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def traced(x):
        seen.append(fused.eager_step(x))
        return x + 1

    with torch.no_grad():
        traced(torch.randn(3))
    assert seen == [False]


# --- transformers modules --------------------------------------------------------------------


def _forms(model):
    return {n: getattr(m, "fullcg_rms_norm_form", None) for n, m in model.named_modules()
            if n.endswith("norm") or n.endswith("layernorm")}


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_llama_style_norms_mlps_and_attention_are_switched_to_the_fused_ops(arch):
    _, model, _ = hf_models.build_pair(arch)  # prepared: fused_ops is on by default
    layers = model.model.layers
    norms = {n: m for n, m in model.named_modules() if hasattr(m, "fullcg_rms_norm_form")}
    assert len(norms) == len(layers) * (4 if arch == "qwen3" else 2) + 1  # Qwen3 adds q_norm and k_norm
    assert set(_forms(model).values()) == {(0.0, True, "variance_epsilon")}
    assert all(getattr(layer.mlp, "fullcg_fused_mlp", False) for layer in layers)
    # Qwen3 normalises q and k before its rotary embedding: not Llama's attention, left as it is
    rotary = [getattr(layer.self_attn, "fullcg_fused_rotary", False) for layer in layers]
    assert rotary == [arch != "qwen3"] * len(layers)
    if arch != "qwen3":  # what its own forward gives the attention function, passed the same way
        assert dict(layers[0].self_attn.fullcg_attention_kwargs)["scaling"] == layers[0].self_attn.scaling
    assert use_fused_ops(model) == 0  # switched once


def test_gemma_norms_take_the_weight_plus_one_float32_form():
    config = transformers.GemmaConfig(**hf_models._COMMON, head_dim=16)
    model = hf_models.randomize(transformers.GemmaForCausalLM(config), 0).eval()
    use_fused_ops(model)
    assert set(_forms(model).values()) == {(1.0, False, "eps")}


class _MeanCenteredRMSNorm(nn.Module):  # a LayerNorm that calls itself an RMSNorm
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = 1e-6

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class _GeluMLP(nn.Module):
    def __init__(self, dim, act=nn.functional.gelu, swap=False):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, 2 * dim), nn.Linear(dim, 2 * dim)
        self.down_proj = nn.Linear(2 * dim, dim)
        self.act, self.swap = act, swap

    def forward(self, x):
        g, u = (self.up_proj(x), self.gate_proj(x)) if self.swap else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(self.act(g) * u)


def test_an_mlp_is_probed_with_random_weights_so_zero_weights_hide_no_other_activation():
    gelu = _GeluMLP(16)
    with torch.no_grad():
        for p in gelu.parameters():
            p.zero_()  # every activation gives the same output now
    assert use_fused_ops(nn.ModuleList([gelu])) == 0


def test_a_norm_given_another_dtype_than_its_weight_runs_its_own_forward():
    model = hf_models.build("llama")
    use_fused_ops(model)
    norm = model.model.norm  # float32 weight
    x = torch.randn(2, 64).bfloat16()
    counter = _OpCounter()
    with torch.no_grad(), counter:
        out = norm(x)
    assert "fullcg.rms_norm" not in counter.counts
    assert torch.equal(out, type(norm).forward(norm, x))


def test_an_adapter_that_needs_grad_keeps_its_gradient_through_a_switched_mlp():
    model = hf_models.build("llama")
    use_fused_ops(model)
    model.requires_grad_(False)
    mlp = model.model.layers[0].mlp

    class Adapted(nn.Module):  # a frozen projection plus a trainable low-rank term, as LoRA adds
        def __init__(self, base):
            super().__init__()
            self.base, self.b = base, nn.Parameter(torch.zeros(base.out_features, 1))
            self.in_features, self.out_features = base.in_features, base.out_features

        def forward(self, x):
            return self.base(x) + x.sum(-1, keepdim=True) * self.b.T

    mlp.gate_proj = Adapted(mlp.gate_proj)
    mlp(torch.randn(3, 64)).sum().backward()
    assert mlp.gate_proj.b.grad is not None and mlp.gate_proj.b.grad.abs().sum() > 0


def test_modules_the_fused_ops_would_compute_otherwise_keep_their_forward():
    norm = _MeanCenteredRMSNorm(16)
    gelu = _GeluMLP(16)
    swapped = _GeluMLP(16, act=nn.functional.silu, swap=True)
    hooked = _GeluMLP(16, act=nn.functional.silu)
    hooked.register_forward_hook(lambda *a: None)
    plain = _GeluMLP(16, act=nn.functional.silu)
    assert use_fused_ops(nn.ModuleList([norm, gelu, swapped, hooked, plain])) == 1
    assert all("forward" not in vars(m) for m in (norm, gelu, swapped, hooked))
    assert "forward" in vars(plain)


def _first_step():
    from fullcg.engine import BatchScheduler

    return BatchScheduler([[3, 17, 29, 41, 53], [7, 19]], 2, num_pages=16, page_size=4).next_step()


def _count_step(step_module, step):
    counter = _OpCounter()
    with torch.inference_mode(), fullcg.forward_context(step.metadata, step_module), counter:
        step_module(step.input_ids, step.positions)
    return counter.counts


def test_a_prepared_models_eager_step_runs_one_kernel_per_norm_activation_rotary_and_projection_group():
    _, model, step_module = hf_models.build_pair("llama")
    layers = model.config.num_hidden_layers
    counts = _count_step(step_module, _first_step())
    assert counts.get("fullcg.rms_norm") == 2 * layers + 1
    assert counts.get("fullcg.silu_mul") == layers
    assert counts.get("fullcg.rotate_half") == layers
    assert "aten.rsqrt" not in counts and "aten.silu" not in counts and "aten.neg" not in counts
    # q/k/v as one matmul, gate/up as one, o_proj, down_proj, and the lm_head
    assert sum(counts.get(f"aten.{mm}", 0) for mm in ("linear", "mm", "addmm")) == 4 * layers + 1


# --- sibling projections run eagerly -----------------------------------------------------------


def _step():
    """A forward context with no caches: siblings share their product only inside a step."""
    return fullcg.forward_context(_first_step().metadata)


def _siblings(bias=False):
    module = nn.Module()
    module.q_proj, module.k_proj, module.v_proj = nn.Linear(8, 8, bias), nn.Linear(8, 4, bias), nn.Linear(8, 4, bias)
    want = copy.deepcopy(module)
    assert fuse_sibling_projections(module, {("q_proj", "k_proj", "v_proj"): "qkv_proj"}) == 1
    return module, want


@pytest.mark.parametrize("bias", [False, True])
def test_eager_siblings_share_one_matmul_and_equal_their_own_linears(bias):
    module, want = _siblings(bias)
    x = torch.randn(3, 8)
    counter = _OpCounter()
    with torch.no_grad(), _step(), counter:
        got = [module.q_proj(x), module.k_proj(x), module.v_proj(x)]
    assert sum(counter.counts.get(f"aten.{mm}", 0) for mm in ("linear", "mm", "addmm")) == 1
    with torch.no_grad():
        for out, ref in zip(got, [want.q_proj(x), want.k_proj(x), want.v_proj(x)]):
            torch.testing.assert_close(out, ref)
            assert out.view(3, 2, -1).shape[-1] == out.shape[-1] // 2  # heads split as attention does


def _matmuls(fn):
    counter = _OpCounter()
    with counter:
        fn()
    return sum(counter.counts.get(f"aten.{mm}", 0) for mm in ("linear", "mm", "addmm"))


def test_a_sibling_computes_afresh_for_another_input_out_of_order_or_after_an_in_place_write():
    module, want = _siblings()
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    with torch.no_grad(), _step():
        module.q_proj(x)
        assert _matmuls(lambda: module.k_proj(y)) == 1  # another tensor
        torch.testing.assert_close(module.k_proj(y), want.k_proj(y))
        module.q_proj(x)
        module.v_proj(x)
        assert _matmuls(lambda: module.k_proj(x)) == 1  # after v: out of order
        module.q_proj(x)
        x.add_(1.0)
        got = []
        assert _matmuls(lambda: got.append(module.k_proj(x))) == 1
        torch.testing.assert_close(got[0], want.k_proj(x))
        module.q_proj(x)
        module.qkv_proj.weight.mul_(2.0)
        want.k_proj.weight.mul_(2.0)
        torch.testing.assert_close(module.k_proj(x), want.k_proj(x))  # the weight written since


def test_the_shared_product_is_dropped_after_the_last_sibling_and_never_pickled():
    module, _ = _siblings()
    x = torch.randn(2, 8)
    with torch.no_grad(), _step():
        module.q_proj(x)
        product = module.q_proj.product
        assert isinstance(product, SiblingProduct) and product._state is not None
        copy_ = pickle.loads(pickle.dumps(module))
        assert copy_.q_proj.product._state is None and copy_.q_proj.product.fused is copy_.qkv_proj
        module.k_proj(x)
        module.v_proj(x)
        assert product._state is None


def test_siblings_share_only_within_one_step():
    module, want = _siblings()
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert _matmuls(lambda: [module.q_proj(x), module.k_proj(x), module.v_proj(x)]) == 3  # no step: each its own
        with _step():
            module.q_proj(x)
        with _step():  # the next step: the same input object, rewritten in place under inference mode, say
            got = []
            assert _matmuls(lambda: got.append(module.k_proj(x))) == 1
        torch.testing.assert_close(got[0], want.k_proj(x))


@pytest.mark.filterwarnings("ignore:fullcg. a step runs with autograd enabled")
def test_siblings_under_autograd_take_their_own_slices():
    module, want = _siblings()
    x = torch.randn(2, 8)
    with _step():
        assert _matmuls(lambda: [module.q_proj(x), module.k_proj(x)]) == 2
    module.k_proj(x).sum().backward()
    assert module.qkv_proj.weight.grad is not None


# --- whole models ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_prepared_model_equals_transformers_every_step_with_the_triton_kernels(arch, triton_on_cpu):
    from test_transformers import TOLERANCE, run_steps

    ref, _, step_module = hf_models.build_pair(arch)
    worst, _ = run_steps(ref, step_module, step_module)
    assert worst < TOLERANCE


def test_fullcgs_own_llama_runs_the_fused_ops_on_eager_steps():
    from fullcg.models.llama import LlamaConfig, LlamaModel

    model = LlamaModel(LlamaConfig.tiny()).eval()
    model.allocate_kv_cache(16, 4)
    counts = _count_step(model, _first_step())
    layers = len(model.layers)
    assert counts.get("fullcg.rms_norm") == 2 * layers + 1
    assert counts.get("fullcg.silu_mul") == layers


# --- built ahead of the first capture --------------------------------------------------------


def test_the_kernel_plan_lists_each_fused_kernel_a_model_launches_once_by_dtype_and_width():
    from fullcg.kernel_build import fused_kernels
    from fullcg.models.llama import LlamaConfig, LlamaModel

    _, model, _ = hf_models.build_pair("llama")
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert {(k.what, k.args) for k in fused_kernels(model)} == {
        ("rms_norm", ("float32", cfg.hidden_size, True)),  # Llama's rounding order
        ("silu_mul", ("float32", cfg.intermediate_size)),
        ("rotate_half", ("float32", head_dim // 2, cfg.num_attention_heads)),
    }
    unswitched = copy.deepcopy(hf_models.build("llama", 0))
    fullcg.integrations.transformers.prepare(unswitched, num_pages=8, page_size=4, fused_ops=False)
    assert fused_kernels(unswitched) == ()
    own = LlamaModel(LlamaConfig.tiny(), dtype=torch.bfloat16)
    assert {(k.what, k.args) for k in fused_kernels(own)} == {
        ("rms_norm", ("bfloat16", own.cfg.hidden_size, False)),
        ("silu_mul", ("bfloat16", own.cfg.intermediate_size)),
    }
    assert fused_kernels(own.double()) == (), "the kernels take float16, bfloat16 and float32 only"


def _specialisation(launch) -> tuple:
    """What Triton compiles a launch for: its kernel, constexprs and options, its tensors'
    dtypes and 16-byte alignment, and which of its integers are 1 or multiples of 16."""
    args = tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
                 else (a == 1, a % 16 == 0) if type(a) is int else type(a) for a in launch.tail)
    return launch.launcher.fn.fn.__name__, launch.constexprs, launch.num_warps, launch.num_stages, args


@pytest.mark.parametrize("fuse_projections", [True, False])
def test_the_builds_stand_in_launches_specialise_as_a_prepared_models_steps_do(fuse_projections, triton_on_cpu,
                                                                                monkeypatch):
    from fullcg import kernel_build
    from fullcg.integrations import transformers as fhf
    from fullcg.ops.kernels.fused import FusedLaunch

    model = copy.deepcopy(hf_models.build("llama", 0))
    step_module = fhf.prepare(model, num_pages=16, page_size=4, fuse_projections=fuse_projections)
    launched: list = []
    run = FusedLaunch.__call__
    monkeypatch.setattr(FusedLaunch, "__call__", lambda self: (launched.append(self), run(self))[1])
    _count_step(step_module, _first_step())  # a prefill of 5 and 2 tokens
    decode = fullcg.AttentionMetadata.build([1], [5], torch.tensor([[0, 1]], dtype=torch.int32), 4)
    with torch.inference_mode(), fullcg.forward_context(decode, step_module):
        step_module(torch.tensor([11]), torch.tensor([5]))  # one token: single rows of each product
    assert {launch.launcher.fn.fn.__name__ for launch in launched} == {
        "_rms_norm_kernel", "_silu_mul_kernel", "_rotate_half_kernel"}
    planned = {_specialisation(kernel_build._fused_launch(k, torch.device("cpu")))
               for k in kernel_build.fused_kernels(model)}
    assert {_specialisation(launch) for launch in launched} == planned


def test_a_deep_copy_keeps_the_switch_and_a_pickled_model_comes_back_with_its_own_forward():
    import io

    model = hf_models.build("llama")
    switched = use_fused_ops(model)
    copied = copy.deepcopy(model)
    assert copied.model.norm.forward.__self__ is copied.model.norm  # bound to the copy, not the original
    assert "fullcg" in copied.model.norm.forward.__func__.__module__
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.model.norm.forward.__func__ is type(loaded.model.norm).forward
    assert use_fused_ops(loaded) == switched
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


@pytest.mark.skipif(not regions_supported(), reason="this torch does not reuse a nested compile region's trace")
def test_switched_layers_are_still_traced_once_for_all_layers():
    from test_transformers import TOLERANCE, run_steps

    torch._dynamo.reset()
    ref = hf_models.build("llama", num_hidden_layers=4)
    model = copy.deepcopy(ref)
    step_module = hf_models.fhf.prepare(model, num_pages=64, page_size=4)
    compiled = fullcg.compile(step_module, graph_mode="piecewise", compiler="eager", compile_cache=False)
    worst, _ = run_steps(ref, step_module, compiled)
    assert worst < TOLERANCE
    assert [r.regions for r in compiled.runners] == [(4, 1)]  # 4 layer calls, 1 traced region


def _olmo(**changes):
    config = transformers.OlmoConfig(**hf_models._COMMON, **changes)
    return hf_models.randomize(transformers.OlmoForCausalLM(config), 0).eval()


def test_a_model_whose_rotary_angles_stay_float32_runs_its_own_attention_forward_in_bfloat16():
    from test_transformers import run_steps

    ref = _olmo().to(torch.bfloat16)  # OLMo's rotary embedding returns float32 cos and sin
    model = copy.deepcopy(ref)
    step_module = hf_models.fhf.prepare(model, num_pages=64, page_size=4)
    assert model.model.layers[0].self_attn.fullcg_fused_rotary  # the probe saw angles in the weights' dtype
    worst, _ = run_steps(ref, step_module, step_module)  # every step falls back to OLMo's own forward
    assert worst < 0.1  # bfloat16 logits against transformers' sdpa


def test_attention_that_clips_q_k_v_by_value_keeps_its_forward():
    model = _olmo(clip_qkv=8.0)
    hf_models.fhf.prepare(model, num_pages=16, page_size=4)
    assert not any(getattr(layer.self_attn, "fullcg_fused_rotary", False) for layer in model.model.layers)


def test_in_training_mode_switched_modules_run_their_own_forward():
    _, model, step_module = hf_models.build_pair("llama")
    model.train()
    step = _first_step()
    counter = _OpCounter()
    with torch.no_grad(), fullcg.forward_context(step.metadata, step_module), counter:
        step_module(step.input_ids, step.positions)
    assert not any(name.startswith("fullcg.") and name != "fullcg.attention" for name in counter.counts)


def test_the_attention_probe_leaves_the_layers_cache_untouched():
    model = hf_models.build("llama")
    hf_models.fhf.prepare(model, num_pages=16, page_size=4, fused_ops=False)
    caches = [layer.self_attn.fullcg_attention.kv_cache for layer in model.model.layers]
    for cache in caches:
        cache.k.fill_(7.0)
        cache.v.fill_(7.0)
    assert use_fused_ops(model) > 0
    assert [layer.self_attn.fullcg_attention.kv_cache for layer in model.model.layers] == caches
    assert all(bool((c.k == 7.0).all()) and bool((c.v == 7.0).all()) for c in caches)
    assert all(layer.self_attn.fullcg_fused_rotary for layer in model.model.layers)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prepared_model_on_the_gpu_runs_the_kernels_and_equals_the_unfused_model_every_step(dtype):
    from fullcg.engine import BatchScheduler
    from test_transformers import PROMPTS

    ref = hf_models.build("llama").to(device="cuda", dtype=dtype)
    fused_model, plain_model = copy.deepcopy(ref), copy.deepcopy(ref)
    fused_step = hf_models.fhf.prepare(fused_model, num_pages=64, page_size=4)
    plain_step = hf_models.fhf.prepare(plain_model, num_pages=64, page_size=4, fused_ops=False)
    sched = BatchScheduler(PROMPTS, 3, num_pages=64, page_size=4, max_num_tokens=8, device=torch.device("cuda"))
    worst, first = 0.0, True
    while (step := sched.next_step()) is not None:
        counter = _OpCounter()
        with torch.inference_mode():
            with fullcg.forward_context(step.metadata, fused_step), counter:
                got = fused_step(step.input_ids, step.positions)
            with fullcg.forward_context(step.metadata, plain_step):
                want = plain_step(step.input_ids, step.positions)
        if first:  # the Triton kernels ran, one launch each per module
            layers = fused_model.config.num_hidden_layers
            assert counter.counts.get("fullcg.rms_norm") == 2 * layers + 1
            assert counter.counts.get("fullcg.rotate_half") == layers == counter.counts.get("fullcg.silu_mul")
            first = False
        worst = max(worst, (got.float() - want.float()).abs().max().item())
        sched.advance(step, [int(want[r].argmax()) if r is not None else None for r in step.sample_rows])
    assert worst < (1e-4 if dtype == torch.float32 else 0.1)
