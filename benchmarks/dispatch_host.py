"""Host time a step spends reaching its runner: plain ``torch.compile`` vs ``fullcg.compile``.

    python benchmarks/dispatch_host.py [--layers 32] [--device cpu] [--out results.json]

One process, one model (a Llama of ``--layers`` tiny layers), the same decode batch, side
by side. What is timed is the dispatch alone: once a graph is compiled its runner's step
is replaced by one that returns the first step's output, so the three figures differ
only in how the step reaches the runner:

- ``torch_compile``: ``torch.compile(model, backend=fullcg.Backend(config))``: every step
  goes through Dynamo (its guards on every module and parameter, then the parameters
  fetched for the graph);
- ``fullcg_compile``: ``fullcg.compile(model, config)``: after a graph's first step, steps
  go straight to its runner (``fullcg.dispatch``);
- ``runner_only``: the runner called directly with the graph's inputs, the floor.

Each figure is the median wall time of one step (context entry included) over
``--repeats``; ``dispatch_saved_us`` is the first minus the second. On CUDA the step is
synchronised after each call, outside the timed part.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import fullcg
from fullcg.models.llama import LlamaConfig, LlamaModel
from fullcg.runner import observed_runner_calls


def median_us(fn, repeats: int, device: torch.device) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    model = LlamaModel(LlamaConfig.tiny(num_layers=args.layers), device=device).eval()
    model.allocate_kv_cache(64, 16)
    config = fullcg.FullCGConfig(attention_impl="reference", compiler="eager", graph_mode="none")
    b = args.batch
    md = fullcg.AttentionMetadata.build([1] * b, [16] * b, torch.arange(2 * b, dtype=torch.int32).view(b, 2), 16,
                                        device=device)
    ids = torch.zeros(b, dtype=torch.long, device=device)
    pos = torch.full((b,), 16, device=device)

    def step(fn):
        def run():
            with fullcg.forward_context(md, model, config=config):
                return fn(ids, pos)
        return run

    results: dict = {"device": str(device), "torch": torch.__version__, "args": vars(args)}
    with torch.inference_mode():
        torch._dynamo.reset()
        plain = torch.compile(model, backend=fullcg.Backend(config))
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(pos, 0)
        with observed_runner_calls() as calls:
            step(plain)()
        runner, graph_args, out = calls[0]
        runner._step = lambda _args, out=out: out  # the step's own work, taken out of the figure
        results["torch_compile_us"] = median_us(step(plain), args.repeats, device)
        results["runner_only_us"] = median_us(step(lambda *_: runner(*graph_args)), args.repeats, device)
        torch._dynamo.reset()
        ours = fullcg.compile(model, config)
        with observed_runner_calls() as calls:
            step(ours)()
        calls[0][0]._step = lambda _args, out=calls[0][2]: out
        results["fullcg_compile_us"] = median_us(step(ours), args.repeats, device)
    results["dispatch_saved_us"] = results["torch_compile_us"] - results["fullcg_compile_us"]
    print(json.dumps(results, indent=1, default=str))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return results


if __name__ == "__main__":
    main()
