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


def test_pass_views_the_fused_output_as_heads_when_every_projection_is_viewed_as_heads():
    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Linear(8, 16, bias=False)
            self.q, self.k, self.v = SliceLinear(self.w, 0, 8), SliceLinear(self.w, 8, 12), SliceLinear(self.w, 12, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            shape = (x.shape[0], x.shape[1], -1, 4)
            q, k, v = self.q(x).view(shape), self.k(x).view(shape), self.v(x).view(shape)
            return (q[..., :1, :] * k + v).sum(-1)

    gm = torch.fx.symbolic_trace(Heads())
    x = torch.randn(1, 5, 8)
    expected = gm(x)
    FuseSiblingLinearsPass()(gm.graph)
    gm.recompile()
    assert len(_linears(gm)) == 1
    views = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "view"]
    assert len(views) == 1 and views[0].args[0].target is torch._C._nn.linear  # heads first, then sliced and copied
    torch.testing.assert_close(gm(x), expected)


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
    keys = model.state_dict().keys()
    assert "model.layers.0.self_attn.qkv_proj.weight" in keys and "model.layers.0.self_attn.q_proj.weight" not in keys
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits)
    assert fuse_sibling_projections(model) == 0  # a second call finds nothing left to fuse


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
    monkeypatch.setattr(FuseSiblingLinearsPass, "_fuse",
                        lambda self, graph, x, run: (fused_runs.append(len(run)), original(self, graph, x, run)))
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
