"""torch.library.opcheck: schema, fake implementation and AOT dispatch of every fullcg op."""

from __future__ import annotations

import itertools

import pytest
import torch

import fullcg
from fullcg.ops import ATTENTION_OPS
from batches import make_batch

BATCHES = {
    "prefill": ([6, 3], [0, 0]),
    "extend": ([4, 2], [5, 9]),
    "decode": ([1, 1], [7, 3]),
    "mixed": ([5, 1, 3], [0, 6, 4]),
}
OPS = {str(op).split(".")[1]: op for op in ATTENTION_OPS.values()}


@pytest.mark.parametrize(
    "op_name,batch,skip,padded",
    [
        (op, batch, skip, padded)
        for op, batch, skip, padded in itertools.product(OPS, BATCHES, [False, True], [False, True])
    ],
)
def test_attention_ops_pass_opcheck(op_name, batch, skip, padded):
    q_lens, p_lens = BATCHES[batch]
    b = make_batch(q_lens, p_lens, sink=10.0)
    q, k, v = b.q, b.k, b.v
    kv_tokens = None
    if padded:
        kv_tokens = k.shape[0]
        q, k, v = (torch.cat([t, torch.zeros(2, *t.shape[1:])]) for t in (q, k, v))
    out = torch.empty_like(q)
    factors = (4.0, 2.0) if skip else (None, None)
    config = fullcg.FullCGConfig(skip_softmax=fullcg.SkipSoftmaxConfig(tile_kv=4, tile_q=2))
    with fullcg.forward_context(b.metadata, b.layer, config=config):
        torch.library.opcheck(OPS[op_name], (q, k, v, out, 0, kv_tokens, *factors, None, True, True, None))


def test_given_kv_and_prefix_chunk_attention_pass_opcheck():
    b = make_batch([4, 2], [5, 9], prefix_chunk_tokens=6)
    with fullcg.forward_context(b.metadata, b.layer):
        out = torch.empty_like(b.q)
        torch.library.opcheck(
            torch.ops.fullcg.attention_with_lse.default, (b.q, b.k, b.v, out, 0, None, None, None, None, False, False, None)
        )
        kc, vc = b.layer.gather_prefix_chunk(1)
        torch.library.opcheck(torch.ops.fullcg.gather_prefix_chunk.default, (kc, vc, 0, 1))
        torch.library.opcheck(
            torch.ops.fullcg.breakable_attention_with_lse.default, (b.q, kc, vc, out, 0, None, None, None, None, False, False, 1)
        )


def test_merge_prefix_chunks_passes_opcheck():
    b = make_batch([4, 2], [5, 9], prefix_chunk_tokens=6)
    with fullcg.forward_context(b.metadata, b.layer):
        out, lse = b.layer(b.q, b.k, b.v, return_lse=True, use_kv_cache=False, save_kv_cache=False)
        torch.library.opcheck(torch.ops.fullcg.merge_prefix_chunks.default, (b.q, out, lse, 0, None, None, None, 0))


@pytest.mark.parametrize("op_name", OPS)
def test_attention_ops_naming_their_layer_by_key_pass_opcheck(op_name):
    b = make_batch([4, 2], [5, 9], prefix_chunk_tokens=6)
    key = b.layer.layer_key
    with fullcg.forward_context(b.metadata, b.layer):
        out = torch.empty_like(b.q)
        torch.library.opcheck(OPS[op_name], (b.q, b.k, b.v, out, -1), {"layer": key})


def test_prefix_chunk_ops_naming_their_layer_by_key_pass_opcheck():
    b = make_batch([4, 2], [5, 9], prefix_chunk_tokens=6)
    key = b.layer.layer_key
    with fullcg.forward_context(b.metadata, b.layer):
        kc, vc = b.layer.gather_prefix_chunk(1)
        torch.library.opcheck(torch.ops.fullcg.gather_prefix_chunk.default, (kc, vc, -1, 1), {"layer": key})
        out, lse = b.layer(b.q, b.k, b.v, return_lse=True, use_kv_cache=False, save_kv_cache=False)
        torch.library.opcheck(torch.ops.fullcg.merge_prefix_chunks.default, (b.q, out, lse, -1), {"layer": key})


def test_merge_attn_states_passes_opcheck():
    torch.manual_seed(0)
    a, b = torch.randn(5, 3, 8), torch.randn(5, 3, 8)
    la, lb = torch.randn(5, 3), torch.randn(5, 3)
    la[0, 0] = float("-inf")
    for out_lse in (None, torch.empty(5, 3)):
        torch.library.opcheck(torch.ops.fullcg.merge_attn_states.default, (torch.empty(5, 3, 8), a, la, b, lb, out_lse))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_merge_latent_prefix_chunks_passes_opcheck(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    heads, rank, nope, rope, v_dim = 2, 16, 8, 8, 8
    mla = fullcg.MLAAttention(heads, rank, nope, rope, v_dim, layer_id=0)
    mla.allocate_kv_cache(8, 4, device=device)
    g = torch.Generator().manual_seed(0)
    mla.kv_cache.k.copy_(torch.randn(mla.kv_cache.k.shape, generator=g))
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    md = fullcg.AttentionMetadata.build([3, 2], [5, 6], table, 4, prefix_chunk_tokens=4, device=device)
    q = torch.randn(5, heads, nope + rope, generator=g).to(device)
    out = torch.randn(5, heads, v_dim, generator=g).to(device)
    lse = torch.randn(5, heads, generator=g).to(device)
    latent = torch.randn(5, rank + rope, generator=g).to(device)
    kv_b = torch.randn(heads * (nope + v_dim), rank, generator=g).to(device)
    with torch.inference_mode(), fullcg.forward_context(md, mla, config=fullcg.FullCGConfig(attention_impl="reference")):
        torch.library.opcheck(torch.ops.fullcg.merge_latent_prefix_chunks.default,
                              (q, out, lse, latent, kv_b, 0, None, None, None, mla.kv_cache.uid))
