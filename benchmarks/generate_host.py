"""Where a batch-1 ``fullcg.generate`` step's host time goes, next to the step's GPU time.

    python benchmarks/generate_host.py --compiler inductor [--attention-impl triton] [--new 96]
    python benchmarks/generate_host.py --compiler none [--no-fused-ops]

One Llama-3-8B-shaped ``LlamaForCausalLM`` (random bf16 weights, ``benchmarks/generate.py``'s
model) prepared with fullcg, one 512-token prompt. Prints, after a warm-up run that
compiles and captures:

- milliseconds per output token with ``overlap=True`` and ``overlap=False``, with each
  run's host milliseconds a step and the GPU's idle fraction (:class:`fullcg.GenerateStats`);
- ``step_replay_ms``: one decode step at the run's mean context through the compiled model,
  replayed back to back (``generate.py``'s lower bound of a batch-1 step);
- a cProfile of one overlapped run (host functions by own time, then cumulative), and a
  torch profiler table of a shorter one (host and CUDA time per op: graph launches,
  synchronisations, copies).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

import generate as G  # noqa: E402 - the benchmark's model and step replay

import fullcg  # noqa: E402
from fullcg.integrations import transformers as fhf  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compiler", default="inductor", help="fullcg compiler: inductor, eager or none")
    ap.add_argument("--attention-impl", default="triton")
    ap.add_argument("--new", type=int, default=96, help="tokens generated per timed run")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--no-profile", action="store_true", help="only the timings")
    ap.add_argument("--no-fused-ops", action="store_true",
                    help="prepare without fused_ops: transformers' own norm and activation kernels on eager steps")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("generate_host.py times CUDA graph replays: it needs a GPU")

    dev = torch.device("cuda")
    model = G.build_model(False, dev, torch.bfloat16, 0)
    fhf.prepare(model, num_pages=2048, page_size=G.PAGE_SIZE, fused_ops=not args.no_fused_ops)
    config = fullcg.FullCGConfig.from_env(attention_impl=args.attention_impl, compiler=args.compiler)
    prompts = [list(range(1, args.prompt_len + 1))]

    def run(new: int, overlap: bool = True, stats: bool = False):
        return fullcg.generate(model, prompts, new, stop_token_ids=(), config=config, progress=False,
                               overlap=overlap, return_stats=stats)

    t = time.perf_counter()
    run(8)
    print(f"warmup s {time.perf_counter() - t:.1f}", flush=True)
    for overlap in (True, False):
        torch.cuda.synchronize()
        t = time.perf_counter()
        _, st = run(args.new, overlap, stats=True)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
        print(f"overlap={overlap} ms/token {wall * 1e3 / args.new:.3f} host_ms/step {st.host_ms_per_step:.3f} "
              f"idle {st.gpu_idle_fraction:.3f}", flush=True)
    print("step_replay_ms", G.step_replay_ms(model, config, args.prompt_len + args.new // 2, dev), flush=True)
    if args.no_profile:
        return
    prof = cProfile.Profile()
    prof.enable()
    run(args.new)
    torch.cuda.synchronize()
    prof.disable()
    for order, rows in (("tottime", 30), ("cumulative", 45)):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(order).print_stats(rows)
        print(out.getvalue())
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tprof:
        run(32)
        torch.cuda.synchronize()
    print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))


if __name__ == "__main__":
    main()
