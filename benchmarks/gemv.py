"""Skinny matmuls of a decode step: fullcg's one-pass GEMV against cuBLAS, per shape and row count.

    python benchmarks/gemv.py [--rows 1 2 4 8] [--out results/gemv.json]

For each projection of the Llama-3-8B layer (qkv, o_proj, gate_up, down, lm_head; bf16)
and each row count it times ``F.linear`` (cuBLAS, with its split-K reduction where it picks
one) and :func:`fullcg.ops.kernels.gemv.gemv` over a grid of launch shapes, and for the MLP
the gated form (``silu(gate) * up`` in the GEMV's epilogue) against ``F.linear`` followed by
fullcg's ``silu_mul`` kernel. Each launch reads a different copy of the weight (copies
cycled over more than twice the L2 cache) so the weight comes from memory, as in a decode
step; launches are replayed from one CUDA graph, so host launch cost is not counted.
Figures are medians over ``--repeats`` replays, microseconds per launch, with the share of
the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from decode import copy_bandwidth  # (this folder's scripts: run from it, or as benchmarks/gemv.py)
from fullcg.ops import fused
from fullcg.ops.kernels.gemv import GemvConfig, gemv
from mla import graph_ms

SHAPES = {  # name: (N, K, gated)
    "qkv": (6144, 4096, False),
    "o_proj": (4096, 4096, False),
    "gate_up": (28672, 4096, False),
    "gate_up_silu": (28672, 4096, True),
    "down": (4096, 14336, False),
    "lm_head": (128256, 4096, False),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--block-n", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--block-k", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out")
    args = p.parse_args()

    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)

    def time_launches(calls: list, repeats: int) -> float:
        """Median microseconds per call over replays of one CUDA graph of all ``calls`` in turn."""
        return graph_ms(lambda i: calls[i % len(calls)](), len(calls), dev, repeats) * 1e3

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth_tbs": bw / 1e12,
               "rows": []}
    print(f"{results['gpu']}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    configs = [GemvConfig(*c) for c in itertools.product(args.block_n, args.block_k, args.warps, args.stages)]
    for name in args.shapes:
        n, k, gated = SHAPES[name]
        nbytes = n * k * 2
        copies = max(2, min(32, -(-3 * l2 // nbytes)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            n_out = n // 2 if gated else n
            out = torch.empty(m, n_out, device="cuda", dtype=torch.bfloat16)

            def lib(w, x=x, gated=gated):
                y = F.linear(x, w)
                return fused.silu_mul(y[:, : y.shape[1] // 2], y[:, y.shape[1] // 2:]) if gated else y

            ref = lib(weights[0]).float()
            base = time_launches([lambda w=w: lib(w) for w in weights], args.repeats)
            row = {"shape": name, "n": n, "k": k, "gated": gated, "rows": m, "mbytes": nbytes / 1e6,
                   "cublas_us": base, "cublas_bw": nbytes / (base * 1e-6) / bw, "gemv": []}
            for cfg in configs:
                if m > 1 and cfg.block_n < 16:
                    continue  # the tensor-core path needs 16 columns
                try:
                    got = gemv(x, weights[0], gated=gated, config=cfg, out=out).float()
                    err = (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
                    us = time_launches([lambda w=w, cfg=cfg: gemv(x, w, gated=gated, config=cfg, out=out)
                                        for w in weights], args.repeats)
                except Exception as e:  # a shape a config cannot compile (shared memory, registers)
                    row["gemv"].append({"config": cfg.__dict__, "error": f"{type(e).__name__}: {e}"[:200]})
                    continue
                row["gemv"].append({"config": cfg.__dict__, "us": us, "bw": nbytes / (us * 1e-6) / bw,
                                    "rel_err": err})
            done = [g for g in row["gemv"] if "us" in g]
            best = min(done, key=lambda g: g["us"]) if done else None
            row["best"] = best
            results["rows"].append(row)
            if best:
                print(f"{name:13s} M={m}: cublas {base:7.2f} us ({row['cublas_bw']:.0%}), gemv best {best['us']:7.2f} us "
                      f"({best['bw']:.0%}) {best['config']} err {best['rel_err']:.1e}  ratio {best['us'] / base:.3f}",
                      flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
