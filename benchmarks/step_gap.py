"""Where a captured decode step's time goes beyond its graph's replay.

    python benchmarks/step_gap.py [--model llama3_8b] [--batch 1] [--context 1024] \
        [--modes full:inductor auto:inductor full:none] [--trace-dir traces] [--out step_gap.json]

``decode.py`` times a full decode step (context entry, dispatch, runner, replay) and the
replay of its captured graph alone; on an H100 the two differ by 0.38 ms at batch 1 (6.70
against 6.32 ms), on an H200 by 0.40 ms under ``graph_mode="full"`` and 0.14 ms under
``auto``, though both replay the same graph. This script takes that difference apart, one
process, the same model, for each ``--modes`` entry (``graph_mode:compiler``):

- ``step_ms``: CUDA events around the whole step, the GPU idle before it (as ``decode.py``);
- ``replay_ms``: the captured graph's replay alone (null without a compiler: the eager
  capture keeps no graph this script can reach);
- ``host_us``: wall time of the step's Python call from an idle GPU, synchronised before,
  not after (the host's own work: context entry to the replay's launch returning);
- ``host_busy_us``: the same with the GPU busy ahead of it, so no launch can wait on it;
- ``step_after_busy_ms``: CUDA events around the step queued behind a sleep kernel (about 1 ms),
  so the host's work is done before the GPU reaches it: the step's GPU time as issued.

``step_ms - step_after_busy_ms`` is the host's share the GPU waits for; ``step_after_busy_ms
- replay_ms`` what the step issues besides the replay (the metadata copies). With
``--trace-dir`` each mode also writes a torch profiler trace (CPU and CUDA) of a few steps
and a table of host functions by self time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

import fullcg
from decode import PAGE, captured_full_graph, decode_metadata, time_ms
from fullcg.models.llama import LlamaConfig, LlamaModel


def host_us(run, repeats: int, busy: torch.Tensor | None = None) -> float:
    """Median microseconds until ``run()`` returns (the GPU idle before it, or busy with ``busy``)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        if busy is not None:
            busy.add_(1)  # about 0.3 ms of GPU work (512 MiB read and written) queued ahead of the step
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3_8b", choices=["tiny", "mid", "llama3_8b"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--modes", nargs="+", default=["full:inductor", "auto:inductor", "full:none"],
                    help="graph_mode:compiler pairs, each compiled and timed in turn")
    ap.add_argument("--impl", default="triton")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--trace-dir", type=Path, default=None, help="write a profiler trace and host table per mode")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("step_gap.py times CUDA graph replays: it needs an NVIDIA GPU")

    dev = torch.device("cuda")
    cfg = LlamaConfig.preset(args.model)
    with torch.device(dev):
        model = LlamaModel(cfg, seed=None, dtype=torch.bfloat16, device=dev).eval()
    model.allocate_kv_cache(args.batch * math.ceil((args.context + 1) / PAGE) + 8, PAGE)
    results: dict = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "args": vars(args) | {
        "trace_dir": str(args.trace_dir) if args.trace_dir else None, "out": str(args.out) if args.out else None},
        "modes": {}}
    sizes = tuple(sorted({1, 2, 4, 8, args.batch}))
    busy = torch.empty(1 << 29, dtype=torch.uint8, device=dev)
    for entry in args.modes:
        graph_mode, _, compiler = entry.partition(":")
        torch._dynamo.reset()
        fullcg.reset_graph_mode_counts()
        config = fullcg.FullCGConfig(attention_impl=args.impl, capture_sizes=sizes, graph_mode=graph_mode,
                                     compiler=compiler or "inductor")
        compiled = fullcg.compile(model, config)
        md = decode_metadata(args.batch, args.context, dev)
        ids = torch.randint(0, cfg.vocab_size, (args.batch,), device=dev)
        pos = torch.full((args.batch,), args.context, dtype=torch.long, device=dev)
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(pos, 0)

        def run(md=md, ids=ids, pos=pos, compiled=compiled, config=config):
            with fullcg.forward_context(md, model, config=config):
                return compiled(ids, pos)

        with torch.inference_mode():
            for _ in range(5):
                run()
            torch.cuda.synchronize()
            row: dict = {"step_ms": time_ms(run, args.repeats)}
            backend = getattr(compiled, "backend", None)
            replay = captured_full_graph(backend, args.batch) if backend is not None else None
            row["replay_ms"] = time_ms(replay, args.repeats) if replay is not None else None
            row["host_us"] = host_us(run, args.repeats)
            row["host_busy_us"] = host_us(run, args.repeats, busy)
            # The step queued behind a sleep of about 1 ms (longer than the host's work): its GPU time as issued.
            row["step_after_busy_ms"] = time_ms(run, args.repeats, before=lambda: torch.cuda._sleep(2_000_000))
            row["graph_mode_counts"] = dict(fullcg.graph_mode_counts())
            if args.trace_dir is not None:
                from torch.profiler import ProfilerActivity, profile, record_function

                args.trace_dir.mkdir(parents=True, exist_ok=True)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(6):
                        with record_function("step"):
                            run()
                        torch.cuda.synchronize()
                name = entry.replace(":", "_")
                prof.export_chrome_trace(str(args.trace_dir / f"trace_{name}.json"))
                (args.trace_dir / f"host_{name}.txt").write_text(
                    prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
        results["modes"][entry] = row
        print(f"{entry}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                       for k, v in row.items() if k != "graph_mode_counts"), flush=True)
        if args.out is not None:
            args.out.write_text(json.dumps(results, indent=1))
        del compiled


if __name__ == "__main__":
    main()
