"""One decoder layer's element-wise work run eagerly: transformers' modules against fullcg's fused ops.

    python benchmarks/fused_ops.py [--tokens 1 64 2048] [--out results/fused_ops_h200.json]

For a Llama-3-8B-shaped layer (hidden 4096, MLP 14336, 32/8 heads of 128, bf16) and each
token count, it times, as a model captured without a compiler runs them:

- ``rms_norm``: transformers' ``LlamaRMSNorm`` forward against ``fullcg::rms_norm``;
- ``mlp``: ``LlamaMLP`` (gate, up, SiLU, multiply, down) against the prepared module
  (gate and up as one matmul, ``fullcg::silu_mul``, down);
- ``qkv``: the three projections as three matmuls against one shared matmul;
- ``rotary``: transformers' ``apply_rotary_pos_emb`` of q and k against ``fullcg::rotate_half``.

Each figure is GPU microseconds per call, the median of ``--repeats`` replays of a CUDA
graph of back-to-back calls (so host launch cost is not counted), both sides in one
process. The JSON holds a row per (part, tokens) with ``hf_us``, ``fused_us`` and their
ratio.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch
from decode_sweep import time_us  # CUDA-graph bursts, median GPU microseconds per call

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 2048])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fused_ops.py times CUDA kernels: it needs a GPU")
    import transformers

    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from fullcg.integrations.eager_kernels import use_fused_ops
    from fullcg.integrations.fused_linear import fuse_sibling_projections
    from fullcg.ops import fused as fused_ops

    dev, dtype = torch.device("cuda"), torch.bfloat16
    config = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_hidden_layers=1)
    with torch.device(dev):
        layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer(config, 0).to(dtype).eval()
    fused = copy.deepcopy(layer)
    fuse_sibling_projections(fused)
    use_fused_ops(fused)
    rows = []
    name = torch.cuda.get_device_name()
    with torch.inference_mode():
        for tokens in args.tokens:
            x = torch.randn(1, tokens, HIDDEN, device=dev, dtype=dtype)
            attn, fattn = layer.self_attn, fused.self_attn
            q = torch.randn(tokens, HEADS, HEAD_DIM, device=dev, dtype=dtype)
            k = torch.randn(tokens, KV_HEADS, HEAD_DIM, device=dev, dtype=dtype)
            angles = torch.randn(tokens, HEAD_DIM // 2, device=dev)
            cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
            hf_q, hf_k = q.transpose(0, 1)[None], k.transpose(0, 1)[None]  # transformers' [1, heads, tokens, dim]
            parts = {
                "rms_norm": (lambda: layer.input_layernorm(x), lambda: fused.input_layernorm(x)),
                "mlp": (lambda: layer.mlp(x), lambda: fused.mlp(x)),
                "qkv": (lambda: (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)),
                        lambda: (fattn.q_proj(x), fattn.k_proj(x), fattn.v_proj(x))),
                "rotary": (lambda: apply_rotary_pos_emb(hf_q, hf_k, cos[None], sin[None]),
                           lambda: fused_ops.rotate_half(q, k, cos, sin)),
            }
            for part, (hf, ours) in parts.items():
                hf_us = time_us(hf, repeats=args.repeats)
                fused_us = time_us(ours, repeats=args.repeats)
                rows.append({"part": part, "tokens": tokens, "hf_us": round(hf_us, 2), "fused_us": round(fused_us, 2),
                             "fused_over_hf": round(fused_us / hf_us, 3)})
                print(f"{part:9s} tokens {tokens:5d}: transformers {hf_us:8.2f} us, fused {fused_us:8.2f} us "
                      f"({fused_us / hf_us:.2f}x)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": name, "torch": torch.__version__, "hidden": HIDDEN, "intermediate": INTERMEDIATE,
                       "dtype": "bfloat16", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
