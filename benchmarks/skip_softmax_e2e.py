"""Skip-softmax end to end: how much an 8B-shaped model's logits move at a long context.

    python benchmarks/skip_softmax_e2e.py --out results/skip_softmax_e2e_h200.json   # H200, 32k
    python benchmarks/skip_softmax_e2e.py --smoke                                     # tiny model, CPU

One request: ``--context`` random token ids prefilled densely in chunks of ``--chunk``
tokens (Llama-3-8B shape, bf16, random weights, the ``triton`` implementation; the tiny
model in fp32 with the ``reference`` one under ``--smoke``). Then, against the dense
result of the same step:

- **decode**: the next token's logits with each ``--decode-factors`` value;
- **prefill**: the last chunk run again (an extend over the rest of the context) with each
  ``--prefill-factors`` value, every token's logits compared. The dense chunk is run once
  more after each factor, so the cache holds dense keys and values for the next one.

Per factor: the skipped fraction of tiles (the implementation's counters, all layers), the
largest and the mean relative change of the logits (``|skip - dense|`` over the largest
``|dense|`` of the same token), and how often the top token stays the same. Random weights
give flat attention, which skips little until the factor nears the context length; the
sweep shows where the skipped fraction reaches ``--target-skip``.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

import fullcg
from fullcg.models.llama import LlamaConfig, LlamaModel


def _logit_change(skip: torch.Tensor, dense: torch.Tensor) -> dict[str, float]:
    skip, dense = skip.float(), dense.float()
    rel = (skip - dense).abs() / dense.abs().amax(-1, keepdim=True)
    same_top = (skip.argmax(-1) == dense.argmax(-1)).float().mean()
    return {"max_rel_change": float(rel.max()), "mean_rel_change": float(rel.mean()), "same_top1": float(same_top)}


def _skipped(kind: str) -> float | None:
    stats = fullcg.skip_softmax_stats().values()
    visited = sum(getattr(s, f"{kind}_visited") for s in stats)
    skipped = sum(getattr(s, f"{kind}_skipped") for s in stats)
    if any(s.unmeasured_calls for s in stats):
        return None  # a kernel that counts no tiles ran: the fraction would be wrong
    return skipped / visited if visited else 0.0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks that it runs")
    p.add_argument("--context", type=int, default=32768, help="tokens before the measured steps")
    p.add_argument("--chunk", type=int, default=4096, help="prefill chunk (the prefill measurement's step)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--attention-impl", default=None, help="default: triton on CUDA, reference on the CPU")
    p.add_argument("--prefill-factors", type=float, nargs="*", default=[3.0, 30.0, 300.0, 3000.0, 30000.0])
    p.add_argument("--decode-factors", type=float, nargs="*", default=[100.0, 1000.0, 3000.0, 10000.0, 30000.0])
    p.add_argument("--tile-kv", type=int, default=fullcg.SkipSoftmaxConfig.tile_kv, help="keys per skipped tile")
    p.add_argument("--target-skip", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    if args.smoke:
        device, dtype, cfg = torch.device("cpu"), torch.float32, LlamaConfig.tiny()
        args.context, args.chunk, args.page_size, args.tile_kv = 96, 32, 4, 8
        args.prefill_factors, args.decode_factors = [4.0, 64.0], [16.0, 80.0]
    else:
        device, dtype, cfg = torch.device("cuda"), torch.bfloat16, LlamaConfig.llama3_8b()
    impl = args.attention_impl or ("triton" if device.type == "cuda" else "reference")
    if args.context % args.chunk:
        p.error(f"--context ({args.context}) must be a multiple of --chunk ({args.chunk})")

    t0 = time.perf_counter()
    with torch.device(device):
        model = LlamaModel(cfg, seed=args.seed if args.smoke else None, dtype=dtype, device=device).eval()
    pages = math.ceil((args.context + 1) / args.page_size)
    model.allocate_kv_cache(pages + 1, args.page_size)
    table = torch.arange(pages + 1, dtype=torch.int32, device=device)[None]
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, cfg.vocab_size, (args.context + 1,), generator=g).to(device)

    def step(start: int, length: int, skip: fullcg.SkipSoftmaxConfig | None = None) -> torch.Tensor:
        md = fullcg.AttentionMetadata.build([length], [start], table, args.page_size, device=device)
        config = fullcg.FullCGConfig(attention_impl=impl, skip_softmax=skip or fullcg.SkipSoftmaxConfig())
        with torch.inference_mode(), fullcg.forward_context(md, model, config=config):
            return model(ids[start : start + length], torch.arange(start, start + length, device=device))

    last = args.context - args.chunk
    for start in range(0, last, args.chunk):
        step(start, args.chunk)
    dense_chunk = step(last, args.chunk)
    dense_next = step(args.context, 1)
    prefilled_s = time.perf_counter() - t0

    prefill_rows, decode_rows = [], []
    for factor in args.prefill_factors:
        fullcg.reset_skip_softmax_stats()
        logits = step(last, args.chunk, fullcg.SkipSoftmaxConfig(prefill_scale_factor=factor, tile_kv=args.tile_kv))
        prefill_rows.append({"factor": factor, "skipped_fraction": _skipped("prefill"),
                             **_logit_change(logits, dense_chunk)})
        step(last, args.chunk)  # dense keys and values back in the cache
        print(f"prefill factor {factor:g}: {prefill_rows[-1]}", flush=True)
    for factor in args.decode_factors:
        fullcg.reset_skip_softmax_stats()
        logits = step(args.context, 1, fullcg.SkipSoftmaxConfig(decode_scale_factor=factor, tile_kv=args.tile_kv))
        decode_rows.append({"factor": factor, "skipped_fraction": _skipped("decode"),
                            **_logit_change(logits, dense_next)})
        print(f"decode factor {factor:g}: {decode_rows[-1]}", flush=True)

    def nearest(rows: list[dict]) -> dict | None:
        measured = [r for r in rows if r["skipped_fraction"] is not None]
        return min(measured, key=lambda r: abs(r["skipped_fraction"] - args.target_skip)) if measured else None

    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "model": "tiny" if args.smoke else "llama3_8b", "dtype": str(dtype),
        "attention_impl": impl, "context": args.context, "chunk": args.chunk, "page_size": args.page_size,
        "tile_kv": args.tile_kv,
        "prefill_s": round(prefilled_s, 2), "target_skip": args.target_skip,
        "prefill": prefill_rows, "decode": decode_rows,
        "nearest_to_target": {"prefill": nearest(prefill_rows), "decode": nearest(decode_rows)},
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
