"""Bad input fails early with a message that says what to fix."""

from __future__ import annotations

import pytest
import torch

import fullcg
from fullcg.metadata import ForwardMode
from batches import make_batch


@pytest.fixture
def batch():
    return make_batch([3, 1], [0, 4])


def _call(b, **changes):
    args = dict(q=b.q, k=b.k, v=b.v)
    args.update(changes)
    with fullcg.forward_context(b.metadata, b.layer):
        return b.layer(args["q"], args["k"], args["v"])


def test_no_forward_context(batch):
    with pytest.raises(RuntimeError, match="no forward context is active"):
        batch.layer(batch.q, batch.k, batch.v)


def test_wrong_dtype(batch):
    with pytest.raises(TypeError, match="must share a dtype"):
        _call(batch, k=batch.k.double())
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        _call(batch, q=batch.q.long(), k=batch.k.long(), v=batch.v.long())


def test_wrong_shape(batch):
    with pytest.raises(ValueError, match=r"q must be \[tokens, 4, 16\]"):
        _call(batch, q=batch.q[:, :3])
    with pytest.raises(ValueError, match=r"k must be \[tokens, 2, 16\]"):
        _call(batch, k=batch.k[:, :, :8])


def test_head_counts_must_divide():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        fullcg.Attention(6, 16, 4, layer_id=0)
    q, k = torch.zeros(2, 6, 16), torch.zeros(2, 4, 16)
    with pytest.raises(ValueError, match=r"query heads \(6\) must be a multiple of key/value heads \(4\)"):
        torch.ops.fullcg.attention(q, k, k, torch.empty(2, 6, 16), 0)


def test_device_mismatch(batch):
    meta_k = batch.k.to("meta")
    with pytest.raises(ValueError, match="move them to one device"):
        torch.ops.fullcg.attention(batch.q, meta_k, meta_k, torch.empty_like(batch.q), 0)


def test_out_of_the_wrong_shape(batch):
    with fullcg.forward_context(batch.metadata, batch.layer):
        with pytest.raises(ValueError, match="out must have shape"):
            torch.ops.fullcg.attention(batch.q, batch.k, batch.v, torch.empty(4, 4, 8), 0)
        with pytest.raises(TypeError, match="out must have q's dtype"):
            torch.ops.fullcg.attention(batch.q, batch.k, batch.v, torch.empty_like(batch.q).half(), 0)


def test_too_few_tokens_for_the_batch(batch):
    with pytest.raises(ValueError, match="q has 2 tokens but the batch has 4"):
        _call(batch, q=batch.q[:2], k=batch.k[:2], v=batch.v[:2])
    with fullcg.forward_context(batch.metadata, batch.layer):
        with pytest.raises(ValueError, match="only 2 are valid"):
            batch.layer(batch.q, batch.k, batch.v, key_value_num_tokens=2)
        with pytest.raises(ValueError, match="key_value_num_tokens must lie in"):
            batch.layer(batch.q, batch.k, batch.v, key_value_num_tokens=99)


def test_invalid_thresholds_on_ops_and_layers(batch):
    with fullcg.forward_context(batch.metadata, batch.layer):
        for bad in (-1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="skip_softmax_prefill_scale_factor must be a finite number >= 0"):
                torch.ops.fullcg.attention(batch.q, batch.k, batch.v, torch.empty_like(batch.q), 0, None, bad)
    with pytest.raises(ValueError, match="skip_softmax_decode_scale_factor"):
        with fullcg.forward_context(batch.metadata, batch.layer):
            torch.ops.fullcg.attention(batch.q, batch.k, batch.v, torch.empty_like(batch.q), 0, None, None, -2.0)


def test_missing_kv_cache(batch):
    with fullcg.forward_context(batch.metadata):  # no model, so no caches
        with pytest.raises(RuntimeError, match="no KV cache for this layer"):
            batch.layer(batch.q, batch.k, batch.v)


def test_cache_attention_cannot_be_non_causal(batch):
    with fullcg.forward_context(batch.metadata, batch.layer):
        with pytest.raises(ValueError, match="use_kv_cache=False"):
            batch.layer(batch.q, batch.k, batch.v, causal=False)


def test_prefix_chunk_out_of_range():
    b = make_batch([2], [5])
    with fullcg.forward_context(b.metadata, b.layer):
        with pytest.raises(ValueError, match="prefix_chunk 3 is out of range; this batch has 1"):
            b.layer(b.q, b.k, b.v, use_kv_cache=False, causal=False, prefix_chunk=3)


def test_unknown_attention_implementation(batch):
    config = fullcg.FullCGConfig(attention_impl="nope")
    with fullcg.forward_context(batch.metadata, batch.layer, config=config):
        with pytest.raises(ValueError, match="unknown attention implementation 'nope'; available: .*reference"):
            batch.layer(batch.q, batch.k, batch.v)


def test_duplicate_layer_ids_in_one_model():
    model = torch.nn.ModuleList([fullcg.Attention(2, 8, layer_id=0), fullcg.Attention(2, 8, layer_id=0)])
    for layer in model:
        layer.allocate_kv_cache(4, 4)
    b = make_batch([1], [2])
    with pytest.raises(ValueError, match="share layer_id 0"):
        with fullcg.forward_context(b.metadata, model):
            pass


def test_a_cache_a_model_drops_is_freed_and_a_new_one_is_seen():
    import gc
    import weakref

    model = torch.nn.ModuleList([fullcg.Attention(2, 8, layer_id=0)])
    old = weakref.ref(model[0].allocate_kv_cache(4, 4))
    b = make_batch([1], [2])
    with fullcg.forward_context(b.metadata, model) as ctx:
        assert ctx.kv_caches[0] is old()
    del ctx
    model[0].kv_cache = None
    gc.collect()
    assert old() is None, "the step's layer -> cache map must not keep a dropped cache alive"
    new = model[0].allocate_kv_cache(4, 4)
    with fullcg.forward_context(b.metadata, model) as ctx:
        assert ctx.kv_caches[0] is new


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(query_lens=[2, 0], prefix_lens=[0, 0]), "at least one new token"),
        (dict(query_lens=[2], prefix_lens=[0, 1]), "one entry per request"),
        (dict(query_lens=[2], prefix_lens=[-1]), "prefix_lens must be >= 0"),
        (dict(query_lens=[2], prefix_lens=[3], forward_modes=[ForwardMode.PREFILL]), "use extend"),
        (dict(query_lens=[2], prefix_lens=[0], forward_modes=[ForwardMode.EXTEND]), "use prefill"),
        (dict(query_lens=[2], prefix_lens=[3], forward_modes=[ForwardMode.DECODE]), "exactly one new token"),
        (dict(query_lens=[40], prefix_lens=[0]), "add pages"),
        (dict(query_lens=[2], prefix_lens=[0], page_size=0), "page_size must be a positive integer"),
    ],
)
def test_invalid_metadata(kwargs, match):
    args = dict(page_table=torch.zeros(len(kwargs["query_lens"]), 4, dtype=torch.int32), page_size=4)
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        fullcg.AttentionMetadata.build(**args)


def test_page_table_pointing_outside_the_cache():
    b = make_batch([2], [3])
    b.metadata.page_table[0, 0] = 10_000
    with fullcg.forward_context(b.metadata, b.layer):
        with pytest.raises(IndexError, match="KV cache has .* pages"):
            b.layer(b.q, b.k, b.v)


def test_merge_shapes_are_checked():
    out = torch.empty(3, 2, 4)
    with pytest.raises(ValueError, match="prefix_lse must be float32"):
        fullcg.merge_attn_states(out, out, torch.zeros(3, 2, dtype=torch.float16), out, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="suffix_out has shape"):
        fullcg.merge_attn_states(out, out, torch.zeros(3, 2), torch.empty(3, 2, 5), torch.zeros(3, 2))
