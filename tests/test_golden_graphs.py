"""Golden graphs: how the split pass cuts a two-layer model (expecttest; EXPECTTEST_ACCEPT=1 rewrites)."""

from __future__ import annotations

import re

import pytest
import torch

import fullcg
from fullcg.models.generate import Scheduler
from fullcg.models.llama import LlamaConfig, LlamaModel
from fullcg.ops.attention import ATTENTION_OPS, ATTRIBUTE_NAMES

# The attributes of merge_prefix_chunks after q, out, lse, in schema order.
MERGE_PREFIX_ATTRIBUTES = tuple(a.name for a in torch.ops.fullcg.merge_prefix_chunks.default._schema.arguments[3:])
from fullcg.passes import AttributesPass, PassManager, SplitPointsPass, split_graph
from fullcg.passes.attributes import node_attribute

expecttest = pytest.importorskip("expecttest", reason="golden graphs compare with expecttest: pip install -e '.[test]'")


def _dynamo_graph(chunked_prefix: bool) -> torch.fx.GraphModule:
    torch._dynamo.reset()
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = LlamaModel(LlamaConfig.tiny(chunked_prefix=chunked_prefix))
    model.allocate_kv_cache(8, 4)
    sched = Scheduler([[1, 2, 3, 4, 5]], 1, num_pages=8, page_size=4, prefill_chunk=3)
    sched.commit(sched.next_step(), torch.zeros(3, 256))  # the prompt's first 3 tokens are now cached
    step = sched.next_step()  # extend: 2 new tokens on a prefix of 3, one prefix chunk
    with fullcg.forward_context(step.metadata, model), torch.inference_mode():
        torch.compile(model, backend=keep)(step.input_ids, step.positions)
    return graphs[0]


def _value(value: object) -> str:
    # A graph input (a layer's key) by its name: the module path it was read from.
    return f"%{value.name}" if isinstance(value, torch.fx.Node) else str(value)


def _describe(gm: torch.fx.GraphModule) -> str:
    """Pieces in call order, what each holds, and every fullcg node with its attributes."""
    PassManager([AttributesPass(fullcg.SkipSoftmaxConfig(64.0, 4.0)), SplitPointsPass()])(gm.graph)
    split = split_graph(gm)
    lines = []
    for piece in split.pieces:
        fullcg_nodes = [
            n for n in piece.graph_module.graph.nodes if n.op == "call_function" and str(n.target).startswith("fullcg.")
        ]
        kind = "breakable" if piece.breakable else "compiled"
        lines.append(f"{piece.name} [{kind}]")
        for n in fullcg_nodes:
            if n.target in ATTENTION_OPS.values():
                attrs = ", ".join(f"{k}={_value(v)}" for k, v in zip(ATTRIBUTE_NAMES, n.args[4:]))
            elif n.target is torch.ops.fullcg.merge_prefix_chunks.default:
                attrs = ", ".join(f"{k}={_value(node_attribute(n, k))}" for k in MERGE_PREFIX_ATTRIBUTES)
            else:
                attrs = ", ".join("%" if isinstance(a, torch.fx.Node) else str(a) for a in n.args)
            lines.append(f"  {n.target}({attrs})")
    # Symbol names and cache uids depend on what ran before in the process, not on the split.
    return re.sub(r"kv_cache_id=\d+", "kv_cache_id=#", re.sub(r"\bs\d+\b", "s", "\n".join(lines)))


class TestGoldenSplit(expecttest.TestCase):
    def test_two_layer_model_splits_at_each_attention(self):
        self.assertExpectedInline(_describe(_dynamo_graph(chunked_prefix=False)), """\
submod_0 [compiled]
submod_1 [breakable]
  fullcg.breakable_attention.default(layer_id=-1, key_value_num_tokens=None, skip_softmax_prefill_scale_factor=64.0, skip_softmax_decode_scale_factor=4.0, scale=0.25, use_kv_cache=True, causal=True, prefix_chunk=None, save_kv_cache=True, sliding_window=None, logit_softcap=None, kv_cache_id=#, layer=%l_self_modules_layers_modules_0_modules_self_attn_modules_attn_layer_key)
submod_2 [compiled]
submod_3 [breakable]
  fullcg.breakable_attention.default(layer_id=-1, key_value_num_tokens=None, skip_softmax_prefill_scale_factor=64.0, skip_softmax_decode_scale_factor=4.0, scale=0.25, use_kv_cache=True, causal=True, prefix_chunk=None, save_kv_cache=True, sliding_window=None, logit_softcap=None, kv_cache_id=#, layer=%l_self_modules_layers_modules_1_modules_self_attn_modules_attn_layer_key)
submod_4 [compiled]""")

    def test_chunked_prefix_model_splits_at_the_suffix_attention_and_at_the_prefix_chunk_merge(self):
        # One merge_prefix_chunks node per layer, whatever the step's chunk count: one graph for all counts.
        self.assertExpectedInline(_describe(_dynamo_graph(chunked_prefix=True)), """\
submod_0 [compiled]
submod_1 [breakable]
  fullcg.breakable_attention_with_lse.default(layer_id=-1, key_value_num_tokens=None, skip_softmax_prefill_scale_factor=64.0, skip_softmax_decode_scale_factor=4.0, scale=0.25, use_kv_cache=False, causal=True, prefix_chunk=None, save_kv_cache=True, sliding_window=None, logit_softcap=None, kv_cache_id=#, layer=%l_self_modules_layers_modules_0_modules_self_attn_modules_attn_layer_key)
submod_3 [breakable]
  fullcg.merge_prefix_chunks.default(layer_id=-1, skip_softmax_prefill_scale_factor=64.0, skip_softmax_decode_scale_factor=4.0, scale=0.25, kv_cache_id=#, sliding_window=None, logit_softcap=None, layer=%l_self_modules_layers_modules_0_modules_self_attn_modules_attn_layer_key)
submod_4 [compiled]
submod_5 [breakable]
  fullcg.breakable_attention_with_lse.default(layer_id=-1, key_value_num_tokens=None, skip_softmax_prefill_scale_factor=64.0, skip_softmax_decode_scale_factor=4.0, scale=0.25, use_kv_cache=False, causal=True, prefix_chunk=None, save_kv_cache=True, sliding_window=None, logit_softcap=None, kv_cache_id=#, layer=%l_self_modules_layers_modules_1_modules_self_attn_modules_attn_layer_key)
submod_7 [breakable]
  fullcg.merge_prefix_chunks.default(layer_id=-1, skip_softmax_prefill_scale_factor=64.0, skip_softmax_decode_scale_factor=4.0, scale=0.25, kv_cache_id=#, sliding_window=None, logit_softcap=None, layer=%l_self_modules_layers_modules_1_modules_self_attn_modules_attn_layer_key)
submod_8 [compiled]""")
