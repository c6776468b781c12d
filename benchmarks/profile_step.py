"""Where one decode step's time goes: GPU kernels per step and host time, per graph mode.

    python benchmarks/profile_step.py --layers 4 --batch 1 --context 1024

Compiles the Llama-3-8B-shaped model (``--layers`` of them: the per-layer picture is the
same with fewer layers, and compiles faster) with fullcg in each mode, then reports

- the median step time (CUDA events) and the host time of one call (no sync),
- every GPU kernel of a step with its launches per step and median microseconds,

from ``torch.profiler`` over ``--steps`` steps. Use it to see which kernels a layer runs
inside a full graph, and whether piecewise steps are host-bound.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fullcg
from fullcg.models.llama import LlamaConfig, LlamaModel

from decode import PAGE, decode_metadata, time_ms


def host_us(fn, repeats: int = 20) -> float:
    """Median host microseconds of one call, synchronising between calls (not timed)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def kernel_table(fn, steps: int) -> list[tuple[str, float, float]]:
    """(kernel name, launches per step, total GPU us per step), largest total first."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        gpu_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if gpu_us <= 0:  # host-side runtime calls
            continue
        rows.append((ev.key, ev.count / steps, gpu_us / steps))
    rows.sort(key=lambda r: -r[2])
    return rows


def print_host_profile(fn, top: int, steps: int = 50) -> None:
    """cProfile's functions with the most own time over ``steps`` calls (microseconds per call)."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
        torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # by own time
    print("  host, per step:   own us   cumulative us   calls   function")
    for (file, line, name), (_, calls, own, cum, _) in rows:
        where = f"{os.path.basename(file)}:{line}({name})" if file != "~" else name
        print(f"  {own / steps * 1e6:20.1f} {cum / steps * 1e6:15.1f} {calls / steps:7.1f}   {where[:90]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3_8b", choices=["tiny", "mid", "llama3_8b"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--modes", nargs="+", default=["full", "piecewise"])
    ap.add_argument("--impl", default="triton")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--host-profile", action="store_true", help="also print cProfile's top host functions")
    args = ap.parse_args()

    dev = torch.device("cuda")
    cfg = LlamaConfig.preset(args.model, num_layers=args.layers)
    model = LlamaModel(cfg, seed=0, dtype=torch.bfloat16, device=dev).eval()
    pages = max(args.batch) * (args.context // PAGE + 2) + 8
    model.allocate_kv_cache(pages, PAGE)
    base = fullcg.FullCGConfig(attention_impl=args.impl, capture_sizes=(1, 2, 4, 8, 16, 32, 48, 64))
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, {args.model} x {args.layers} layers, "
          f"context {args.context}", flush=True)
    with torch.inference_mode():
        for mode in ["eager", *args.modes]:
            torch._dynamo.reset()
            config = base.replace(graph_mode=mode if mode != "eager" else "piecewise")
            fn = model if mode == "eager" else torch.compile(model, backend=fullcg.Backend(config))
            for b in args.batch:
                md = decode_metadata(b, args.context, dev)
                ids = torch.randint(0, cfg.vocab_size, (b,), device=dev)
                pos = torch.full((b,), args.context, dtype=torch.long, device=dev)
                torch._dynamo.mark_dynamic(ids, 0)
                torch._dynamo.mark_dynamic(pos, 0)

                def step():
                    with fullcg.forward_context(md, model, config=config):
                        return fn(ids, pos)

                fullcg.reset_graph_mode_counts()
                ms = time_ms(step, 20)
                host = host_us(step)
                print(f"\n== {mode}, batch {b}: step {ms:.3f} ms, host {host:.0f} us per call, "
                      f"{dict(fullcg.graph_mode_counts())}", flush=True)
                for name, per_step, us in kernel_table(step, args.steps)[: args.top]:
                    print(f"  {us:9.1f} us  {per_step:6.1f}x  {name[:110]}")
                if args.host_profile:
                    print_host_profile(step, args.top)


if __name__ == "__main__":
    main()
