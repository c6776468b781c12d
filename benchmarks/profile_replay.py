"""Where a captured full decode graph's GPU time goes: its kernels per replay, 32 layers.

    python benchmarks/profile_replay.py --batch 1 64 --context 1024 [--impl triton] [--top 25]

Builds the Llama-3-8B-shaped model of ``decode.py`` (random bf16 weights), compiles it with
``graph_mode="full"``, captures the decode graph of ``--batch`` requests at ``--context``
and profiles ``--steps`` replays with the torch profiler. Prints each kernel's time per
step (microseconds), its share of the step, and the step's total against the replay's
CUDA-event time, so a regression in one kernel shows as one line.
"""

from __future__ import annotations

import argparse
import collections
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import fullcg
from decode import PAGE, decode_metadata, time_ms
from fullcg.models.llama import LlamaConfig, LlamaModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3_8b", choices=["tiny", "mid", "llama3_8b"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--impl", default="triton")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()

    dev = torch.device("cuda")
    cfg = LlamaConfig.preset(args.model)
    model = LlamaModel(cfg, seed=0, dtype=torch.bfloat16, device=dev).eval()
    pages = max(args.batch) * -(-(args.context + 1) // PAGE) + 8
    model.allocate_kv_cache(pages, PAGE)
    config = fullcg.FullCGConfig(attention_impl=args.impl, graph_mode="full", capture_sizes=tuple(args.batch))
    backend = fullcg.Backend(config)
    compiled = torch.compile(model, backend=backend)
    with torch.inference_mode():
        for batch in args.batch:
            md = decode_metadata(batch, args.context, dev)
            ids = torch.zeros(batch, dtype=torch.long, device=dev)
            pos = torch.full((batch,), args.context, dtype=torch.long, device=dev)
            torch._dynamo.mark_dynamic(ids, 0)
            torch._dynamo.mark_dynamic(pos, 0)
            for _ in range(2):
                with fullcg.forward_context(md, model, config=config):
                    compiled(ids, pos)
            (runner,) = backend.runners
            replay = runner.full_graphs[(batch, True)].graph.replay
            replay_ms = time_ms(replay, 50)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    replay()
                torch.cuda.synchronize()
            per_kernel: dict[str, list[float]] = collections.defaultdict(list)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    per_kernel[e.name].append(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
            total = sum(sum(v) for v in per_kernel.values()) / args.steps
            print(f"\nbatch {batch}, context {args.context}, impl {args.impl}: replay {replay_ms * 1e3:.0f} us "
                  f"(CUDA events, median of 50); kernels sum to {total:.0f} us per step")
            rows = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))
            print(f"{'us/step':>9} {'share':>6} {'calls/step':>10} {'median us':>9}  kernel")
            for name, times in rows[: args.top]:
                step_us = sum(times) / args.steps
                print(f"{step_us:9.1f} {step_us / total:6.1%} {len(times) / args.steps:10.1f} "
                      f"{statistics.median(times):9.2f}  {name[:110]}")


if __name__ == "__main__":
    main()
