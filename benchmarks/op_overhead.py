"""Host time of one breakable attention call: what piecewise steps pay per layer.

    python benchmarks/op_overhead.py                  # CPU: a no-op implementation, and triton's with launches stubbed
    python benchmarks/op_overhead.py --device cuda    # GPU: the triton kernels, 8B layer shape
    python benchmarks/op_overhead.py --device cuda --json out.json
    python benchmarks/op_overhead.py --device cuda --step-layers 4   # + host time of compiled steps

Piecewise steps run attention eagerly between captured pieces, so this host time is paid
per layer per step. On the GPU the call is a decode batch (default batch 1, 1k context) of
a Llama-3-8B layer (32 query heads, 8 KV heads, head dim 128, bf16), inside a derived
context of a compiled piecewise step, made two ways:

- ``host_us_per_call``: as a compiled piecewise step makes it at a split point, the
  breakable op's Python kernel called with the attributes traced into the graph (no
  dispatcher, no module call); the figure the per-layer cost of piecewise steps is;
- ``host_us_per_layer_call``: through ``fullcg.Attention`` and the op dispatcher, as an
  uncompiled model inside such a context would.

Host time is wall time per call over bursts of calls short enough that the GPU never
makes the host wait; the kernels' own time is measured apart with CUDA events. The same
script measures an older fullcg (``PYTHONPATH`` pointing at it) the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import time

import torch

import fullcg
from fullcg.ops.impl import register_implementation


def per_call_us(fn, n: int, repeats: int, sync=None) -> float:
    """Median wall microseconds per call over ``repeats`` bursts of ``n`` calls."""
    for _ in range(50):
        fn()
    if sync:
        sync()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t) / n * 1e6)
        if sync:
            sync()
    return statistics.median(runs)


def _step_context(md, layer, config):
    """The context a compiled piecewise step runs attention in (where this fullcg has one)."""
    ctx_mod = fullcg.context
    if hasattr(ctx_mod, "derived_context") and "variant" in ctx_mod.derived_context.__code__.co_varnames:

        @contextlib.contextmanager
        def both():
            with fullcg.forward_context(md, layer, config=config) as user:
                with ctx_mod.derived_context(user, config=config, variant="piecewise", padded_size=None) as derived:
                    yield derived

        return both()
    return fullcg.forward_context(md, layer, config=config, breakable=True)  # releases before derived contexts


def _split_point_call(layer, q, k, v, out):
    """The call a compiled piecewise step makes at a split point: the breakable op's Python
    kernel, called directly (no dispatcher, no module) with the attributes traced into the
    graph; None where this fullcg has no such table."""
    ops = importlib.import_module("fullcg.ops.attention")  # the package's `attention` is the op itself
    kernel = getattr(ops, "EAGER_KERNELS", {}).get(ops.breakable_attention)
    if kernel is None:
        return None
    uid = layer.kv_cache.uid if hasattr(layer.kv_cache, "uid") else 0
    return lambda: kernel(q, k, v, out, layer.layer_id, None, None, None, layer.scale, True, True, None, True, uid)


def gpu(args: argparse.Namespace) -> dict:
    dev = torch.device("cuda")
    heads, kv_heads, dim, page = 32, 8, 128, 16
    layer = fullcg.Attention(heads, dim, kv_heads, layer_id=0)
    pages = -(-(args.context + 1) // page)
    layer.allocate_kv_cache(args.batch * pages + 4, page, dtype=torch.bfloat16, device=dev)
    layer.kv_cache.k.normal_()
    layer.kv_cache.v.normal_()
    table = torch.arange(args.batch * pages, dtype=torch.int32).view(args.batch, pages)
    md = fullcg.AttentionMetadata.build([1] * args.batch, [args.context] * args.batch, table, page, device=dev)
    q = torch.randn(args.batch, heads, dim, dtype=torch.bfloat16, device=dev)
    k = torch.randn(args.batch, kv_heads, dim, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    config = fullcg.FullCGConfig(attention_impl="triton")
    out = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "batch": args.batch,
           "context": args.context, "shape": f"{heads}q/{kv_heads}kv heads, head dim {dim}, bf16, page {page}"}
    with torch.inference_mode(), _step_context(md, layer, config):
        layer_call = lambda: layer(q, k, v)  # noqa: E731
        split_call = _split_point_call(layer, q, k, v, torch.empty_like(q))
        call = split_call or layer_call
        # What a piecewise step pays per layer (the split-point call), and an eager model's
        # call through the module and the dispatcher.
        out["host_us_per_call"] = per_call_us(call, n=20, repeats=args.repeats, sync=torch.cuda.synchronize)
        out["host_us_per_layer_call"] = per_call_us(layer_call, n=20, repeats=args.repeats, sync=torch.cuda.synchronize)
        call()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(args.repeats):
            start.record()
            for _ in range(20):
                call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 20 * 1e3)
        out["wall_us_per_call_gpu_bound_or_host_bound"] = statistics.median(times)
    if args.step_layers:
        out.update(compiled_steps(args, dev))
    return out


def compiled_steps(args: argparse.Namespace, dev: torch.device) -> dict:
    """Host time of whole compiled decode steps of an 8B-shaped model with few layers, per
    graph mode: what the runner, the piece replays and the eager attention calls cost."""
    from fullcg.models.llama import LlamaConfig, LlamaModel

    cfg = LlamaConfig.llama3_8b(num_layers=args.step_layers)
    model = LlamaModel(cfg, seed=0, dtype=torch.bfloat16, device=dev)
    page = 16
    pages = -(-(args.context + 1) // page)
    model.allocate_kv_cache(args.batch * pages + 4, page)
    table = torch.arange(args.batch * pages, dtype=torch.int32).view(args.batch, pages)
    md = fullcg.AttentionMetadata.build([1] * args.batch, [args.context] * args.batch, table, page, device=dev)
    ids = torch.zeros(args.batch, dtype=torch.long, device=dev)
    pos = torch.full((args.batch,), args.context, dtype=torch.long, device=dev)
    torch._dynamo.mark_dynamic(ids, 0)
    torch._dynamo.mark_dynamic(pos, 0)
    out = {"step_layers": args.step_layers}
    for mode in ("piecewise", "full"):
        torch._dynamo.reset()
        config = fullcg.FullCGConfig(attention_impl="triton", graph_mode=mode, capture_sizes=(args.batch,))
        compiled = torch.compile(model, backend=fullcg.Backend(config))

        def step() -> None:
            with fullcg.forward_context(md, model, config=config):
                compiled(ids, pos)

        with torch.inference_mode():
            host = per_call_us(step, n=10, repeats=args.repeats, sync=torch.cuda.synchronize)
        out[f"{mode}_step_host_us"] = host
        out[f"{mode}_step_host_us_per_layer"] = host / args.step_layers
        del compiled
    return out


class _Noop(fullcg.ops.impl.AttentionImpl if hasattr(fullcg.ops.impl, "AttentionImpl") else object):
    name = "noop"

    def save_kv(self, call, ctx, cache) -> None:
        pass

    def forward(self, call, ctx, cache) -> None:
        return None


def cpu(args: argparse.Namespace) -> dict:
    register_implementation(_Noop())
    layer = fullcg.Attention(32, 128, 8, layer_id=0)
    layer.allocate_kv_cache(64, 16)
    md = fullcg.AttentionMetadata.build([1] * 8, [100] * 8, torch.arange(64, dtype=torch.int32).view(8, 8), 16)
    q, k, v = torch.randn(8, 32, 128), torch.randn(8, 8, 128), torch.randn(8, 8, 128)
    config = fullcg.FullCGConfig(attention_impl="noop")
    with torch.inference_mode(), _step_context(md, layer, config):
        layer_us = per_call_us(lambda: layer(q, k, v), n=2000, repeats=args.repeats)

    def enter_and_leave() -> None:
        with fullcg.forward_context(md, layer, config=config):
            pass

    return {"host_us_per_call_noop_impl": layer_us, "forward_context_enter_exit_us": per_call_us(enter_and_leave, 2000, 5),
            **triton_host_work(args)}


def triton_host_work(args: argparse.Namespace) -> dict:
    """fullcg's own host work per call of the triton implementation, on the CPU: its kernel
    launches replaced by no-ops (``TRITON_INTERPRET=1`` lets it take CPU tensors), so what is
    measured is planning, the step state's lookups, argument assembly and dispatch; the GPU figure less
    this one is what the launches themselves cost. 8B layer shape, decode."""
    if importlib.util.find_spec("triton") is None:
        return {"host_us_per_call_triton_launches_stubbed": None}
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton and the launcher are first imported
    from fullcg.ops.kernels import launch

    launch._INTERPRET = False  # take the planned-launch path ...
    launch.Launcher.launch_keyed = lambda self, *a, **k: None  # ... and launch nothing
    launch.Launcher.__call__ = lambda self, *a, **k: None
    heads, kv_heads, dim, page = 32, 8, 128, 16
    layer = fullcg.Attention(heads, dim, kv_heads, layer_id=0)
    pages = -(-(args.context + 1) // page)
    layer.allocate_kv_cache(args.batch * pages + 4, page, dtype=torch.bfloat16)
    table = torch.arange(args.batch * pages, dtype=torch.int32).view(args.batch, pages)
    md = fullcg.AttentionMetadata.build([1] * args.batch, [args.context] * args.batch, table, page)
    q = torch.randn(args.batch, heads, dim, dtype=torch.bfloat16)
    k = torch.randn(args.batch, kv_heads, dim, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    config = fullcg.FullCGConfig(attention_impl="triton")
    with torch.inference_mode(), _step_context(md, layer, config):
        split_call = _split_point_call(layer, q, k, v, torch.empty_like(q)) or (lambda: layer(q, k, v))
        return {"host_us_per_call_triton_launches_stubbed": per_call_us(split_call, n=200, repeats=args.repeats),
                "host_us_per_layer_call_triton_launches_stubbed": per_call_us(lambda: layer(q, k, v), n=200,
                                                                              repeats=args.repeats)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--step-layers", type=int, default=0, help="also time compiled steps of a model this deep")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    result = gpu(args) if args.device == "cuda" else cpu(args)
    result["fullcg"] = fullcg.__file__
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
