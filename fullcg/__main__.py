"""Command line: ``python -m fullcg demo`` (and ``--help``)."""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import time

import torch

import fullcg
from fullcg.config import COMPILERS, GRAPH_MODES
from fullcg.models.generate import Scheduler
from fullcg.models.llama import LlamaConfig, LlamaModel

PROMPTS = [
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28],  # prefilled over two steps
    [31, 32, 33, 34, 35],
    [41, 42, 43, 44, 45, 46, 47, 48, 49],
]


def demo(args: argparse.Namespace) -> int:
    """Tiny Llama through prefill, chunked prefill (extend), mixed and decode steps, compiled
    with fullcg and checked against eager at every step."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda asked for, but torch sees no CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    given = {"graph_mode": args.graph_mode, "compiler": args.compiler, "attention_impl": args.attention_impl,
             "dump_dir": args.dump_dir}
    config = fullcg.FullCGConfig.from_env(**{k: v for k, v in given.items() if v is not None})  # flags over env
    # On a GPU: bfloat16, and head dim 64 (the smallest FlashInfer has kernels for).
    model_cfg = LlamaConfig.tiny(chunked_prefix=args.chunked_prefix, **({"head_dim": 64} if device.type == "cuda" else {}))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    eager = LlamaModel(model_cfg, seed=0, device=device, dtype=dtype)
    compiled_model = copy.deepcopy(eager)
    for m in (eager, compiled_model):
        m.allocate_kv_cache(num_pages=64, page_size=4)
    compiled = fullcg.compile(compiled_model, config)

    print(f"fullcg demo: tiny Llama ({model_cfg.num_layers} layers, hidden {model_cfg.hidden_size}) on {device}, "
          f"graph_mode={config.graph_mode}, compiler={config.compiler}, attention_impl={config.attention_impl}, "
          f"chunked_prefix={args.chunked_prefix}")
    schedulers = [
        Scheduler(PROMPTS, args.max_new_tokens, num_pages=64, page_size=4, prefill_chunk=10, device=device)
        for _ in range(2)
    ]
    worst = 0.0
    start = time.perf_counter()
    with torch.inference_mode():
        step_no = 0
        while (step := schedulers[0].next_step()) is not None:
            step_c = schedulers[1].next_step()
            with fullcg.forward_context(step.metadata, eager, config=config):
                expected = eager(step.input_ids, step.positions)
            with fullcg.forward_context(step_c.metadata, compiled_model, config=config):
                got = compiled(step_c.input_ids, step_c.positions)
            diff = (expected.float() - got.float()).abs().max().item()
            if device.type == "cuda":  # bfloat16: relative to the logits' scale
                diff /= expected.float().abs().max().item()
            worst = max(worst, diff)
            step_no += 1
            modes = ", ".join(f"{m.value}:{q}" for m, q in zip(step.modes, step.metadata.query_lens))
            print(f"  step {step_no:2d}: {step.metadata.num_tokens:3d} tokens [{modes}]  max |compiled - eager| = {diff:.2e}")
            # Both follow the eager model's tokens, so every step compares the same inputs.
            schedulers[0].commit(step, expected)
            schedulers[1].commit(step_c, expected)
    elapsed = time.perf_counter() - start
    for i, req in enumerate(schedulers[1].requests):
        print(f"  request {i}: prompt of {len(req.prompt)} tokens -> generated {req.generated} (greedy, eager logits)")
    tolerance = 1e-4 if device.type == "cpu" else 5e-2  # relative, in bfloat16, on a GPU
    ok = worst < tolerance
    counts = fullcg.runner.graph_mode_counts()
    kind = "relative" if device.type == "cuda" else "absolute"
    print(f"largest {kind} logit difference over all steps: {worst:.2e} (tolerance {tolerance:g}) -> "
          f"{'OK' if ok else 'MISMATCH'}")
    runners = compiled.runners
    print(f"steps by graph variant: {dict(sorted(counts.items()))}; step runners: {len(runners)}; "
          f"wall time {elapsed:.1f} s (includes compilation)")
    if runners and runners[-1].report:
        print(f"split report of the last of {len(runners)} compiled graph(s):")
        print("\n".join("  " + line for line in runners[-1].report.splitlines() if line))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fullcg", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="run the tiny model compiled with fullcg and check it against eager")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--graph-mode", choices=GRAPH_MODES, help="default: FULLCG_GRAPH_MODE or auto")
    p.add_argument("--compiler", choices=COMPILERS, help="default: FULLCG_COMPILER or inductor")
    p.add_argument("--attention-impl", help="reference, triton, flashinfer or auto (default: FULLCG_ATTENTION_IMPL or auto)")
    p.add_argument("--chunked-prefix", action="store_true", help="attend with the chunked-prefix pattern")
    p.add_argument("--max-new-tokens", type=int, default=5)
    p.add_argument("--dump-dir", default=None, help="write graph dumps and the split report here")
    p.add_argument("-v", "--verbose", action="store_true", help="log what fullcg does")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
