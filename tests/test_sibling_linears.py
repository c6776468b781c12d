"""Sibling projections as one weight, and the pass that turns them into one matmul."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx
from torch import nn

import fullcg
from fullcg.integrations.fused_linear import SliceLinear, fuse_sibling_projections
from fullcg.passes.sibling_linears import FuseSiblingLinearsPass


def _linears(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch._C._nn.linear]


class _Siblings(nn.Module):
    """q/k/v and gate/up as slices of one weight each, plus a linear the pass must leave alone."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(8, 14, bias=bias)
        self.q, self.k, self.v = SliceLinear(self.qkv, 0, 8), SliceLinear(self.qkv, 8, 11), SliceLinear(self.qkv, 11, 14)
        self.other = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        return q.sum(-1) + (k * v).sum(-1) + self.other(x).sum(-1)


@pytest.mark.parametrize("bias", [False, True])
def test_pass_merges_adjacent_row_slices_of_one_weight_into_one_linear_with_the_same_values(bias):
    model = _Siblings(bias)
    gm = torch.fx.symbolic_trace(model)
    assert len(_linears(gm)) == 3  # (`other` stays a module call under symbolic tracing)
    x = torch.randn(5, 8)
    expected = gm(x)
    FuseSiblingLinearsPass()(gm.graph)
    gm.recompile()
    assert len(_linears(gm)) == 1
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["other"]
    torch.testing.assert_close(gm(x), expected)


class _Viewed(nn.Module):
    """q/k/v outputs read through views of several shapes, as attention code reads them."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(8, 16, bias=False)
        self.q, self.k, self.v = SliceLinear(self.w, 0, 8), SliceLinear(self.w, 8, 12), SliceLinear(self.w, 12, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        q = self.q(x).view(b, -1, 4, 2)  # heads, a -1 among the leading sizes
        k = self.k(x).view(b, -1, 2)  # tokens and heads merged
        v = self.v(x).view(b, 2 * t, -1, 2)  # tokens split another way
        return torch.cat([q.flatten(), k.flatten(), v.flatten(), self.q(x).view(b, -1).flatten()])


@pytest.mark.parametrize("tokens", [1, 5])
def test_each_projection_gets_its_columns_back_contiguous_so_any_view_of_it_still_works(tokens):
    gm = torch.fx.symbolic_trace(_Viewed())
    x = torch.randn(2, tokens, 8)
    expected = gm(x)
    FuseSiblingLinearsPass()(gm.graph)
    gm.recompile()
    assert len(_linears(gm)) == 2  # q/k/v as one; the second q call has no siblings left to join
    clones = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "clone"]
    assert len(clones) == 3 and all(n.kwargs == {"memory_format": torch.contiguous_format} for n in clones)
    got = gm(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected)


def test_pass_leaves_siblings_alone_when_something_between_them_writes():
    class Written(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Linear(8, 12, bias=False)
            self.q, self.k, self.v = SliceLinear(self.w, 0, 4), SliceLinear(self.w, 4, 8), SliceLinear(self.w, 8, 12)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.q(x)
            x.mul_(2)  # the k and v projections read the doubled x
            return torch.cat([q, self.k(x), self.v(x)], -1)

    gm = torch.fx.symbolic_trace(Written())
    x = torch.randn(2, 8)
    expected = gm(x.clone())
    FuseSiblingLinearsPass()(gm.graph)
    gm.recompile()
    assert len(_linears(gm)) == 3  # a write between two of them: the group stays as it was
    torch.testing.assert_close(gm(x.clone()), expected)


def test_pass_leaves_slices_that_skip_rows_or_read_other_inputs_alone():
    class Gaps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Linear(4, 12, bias=False)
            self.a, self.b = SliceLinear(self.w, 0, 4), SliceLinear(self.w, 8, 12)  # rows 4..8 skipped
            self.c = SliceLinear(self.w, 4, 8)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.a(x) + self.b(x) + self.c(y)  # c is adjacent to both, but reads y

    gm = torch.fx.symbolic_trace(Gaps())
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    expected = gm(x, y)
    FuseSiblingLinearsPass()(gm.graph)
    gm.recompile()
    assert len(_linears(gm)) == 3
    torch.testing.assert_close(gm(x, y), expected)


def test_pass_uuid_is_stable():
    assert FuseSiblingLinearsPass().uuid() == FuseSiblingLinearsPass().uuid()


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_fusing_projections_keeps_parameter_count_and_forward_values():
    model = _tiny_llama()
    ref = copy.deepcopy(model)
    params = sum(p.numel() for p in model.parameters())
    assert fuse_sibling_projections(model) == 4  # two layers x (q/k/v, gate/up)
    assert sum(p.numel() for p in model.parameters()) == params
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn.q_proj, SliceLinear) and attn.k_proj.out_features == 16
    assert attn.v_proj.weight.data_ptr() == attn.qkv_proj.weight[48:].data_ptr()  # a view, not a copy
    assert isinstance(mlp.gate_proj, SliceLinear) and mlp.gate_up_proj.out_features == 128
    assert [n for n, _ in model.model.layers[0].self_attn.named_parameters()] == ["o_proj.weight", "qkv_proj.weight"]
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits)
    assert fuse_sibling_projections(model) == 0  # a second call finds nothing left to fuse


def test_the_state_dict_keeps_the_models_own_keys_both_ways(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _tiny_llama()
    original = copy.deepcopy(model)
    fuse_sibling_projections(model)
    saved = model.state_dict()
    assert saved.keys() == original.state_dict().keys()  # q_proj.weight ..., no fused key
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    # A prepared model's checkpoint loads into the model as transformers builds it ...
    fresh = transformers.LlamaForCausalLM(original.config).eval()
    fresh.load_state_dict(saved)
    # ... and a checkpoint of that model loads into the prepared one (strict).
    other = copy.deepcopy(model)
    torch.nn.init.zeros_(other.model.layers[0].self_attn.qkv_proj.weight)
    other.load_state_dict(original.state_dict())
    model.save_pretrained(tmp_path)  # safetensors, through transformers
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        want = original(ids).logits
        for m in (fresh, other, reloaded):
            torch.testing.assert_close(m(ids).logits, want)


def test_fusing_projections_skips_linears_with_hooks_or_mixed_trainability():
    model = _tiny_llama()
    attn0, mlp1 = model.model.layers[0].self_attn, model.model.layers[1].mlp
    attn0.q_proj.register_forward_hook(lambda *args: None)  # an adapter or a probe: it must keep firing
    mlp1.up_proj.weight.requires_grad_(False)  # a frozen half: fusing would make it trainable
    assert fuse_sibling_projections(model) == 2  # layer 0's MLP, layer 1's attention
    assert type(attn0.q_proj) is nn.Linear and type(mlp1.up_proj) is nn.Linear


def test_fusing_projections_skips_shared_weights_and_linear_subclasses():
    class MyLinear(nn.Linear):
        pass

    model = _tiny_llama()
    attn0, attn1 = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    attn0.k_proj.weight = attn1.k_proj.weight  # tied across layers: layout kept
    mlp = model.model.layers[0].mlp
    sub = MyLinear(mlp.up_proj.in_features, mlp.up_proj.out_features, bias=False)
    mlp.up_proj = sub
    assert fuse_sibling_projections(model) == 1  # only layer 1's gate/up
    assert type(attn0.k_proj) is nn.Linear and mlp.up_proj is sub
    assert isinstance(model.model.layers[1].mlp.gate_proj, SliceLinear)


def test_prepare_fuses_projections_and_compiled_steps_run_one_linear_per_group(monkeypatch):
    from fullcg.integrations import transformers as fhf

    model = _tiny_llama()
    ref = copy.deepcopy(model)
    fused_runs = []
    original = FuseSiblingLinearsPass._fuse
    monkeypatch.setattr(FuseSiblingLinearsPass, "_fuse", staticmethod(
        lambda graph, x, run, position: fused_runs.append(len(run)) or original(graph, x, run, position)))
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    config = fullcg.FullCGConfig(compiler="eager")
    fhf.prepare(ref, num_pages=16, page_size=16, fuse_projections=False)
    expected = fullcg.generate(ref, prompts, 5, progress=False, config=config)
    assert fused_runs == []
    fhf.prepare(model, num_pages=16, page_size=16)
    assert fullcg.generate(model, prompts, 5, progress=False, config=config) == expected
    assert sorted(fused_runs)[:4] == [2, 2, 3, 3]  # per layer: q/k/v as one, gate/up as one
    with pytest.raises(TypeError, match="fuse_projections must be True or False"):
        fhf.prepare(model, num_pages=16, page_size=16, fuse_projections="yes")
