"""Sliding-window attention: a long context under a short window should cost what its window costs.

    python benchmarks/sliding_window.py            # a GPU: writes benchmarks/results/sliding_window_h200.json
    TRITON_INTERPRET=1 python benchmarks/sliding_window.py --smoke   # the CPU, tiny sizes: checks the script

(From the repository root, with ``PYTHONPATH=.`` where fullcg is not installed.)

Two cases, bf16, each measured through fullcg's op path (a ``fullcg.Attention`` layer
called in a forward context, its k/v save included, as a model calls it):

(a) ``decode``: a gpt-oss-shaped layer (64 query heads, 8 KV heads, head dim 64), batch 64,
    32k keys per request (32767 cached + the new token), window 128.
    ``dense_ms_at_window``: the same implementation's dense decode (no window) over 128
    keys per request, same batch: what the window's work costs.
(b) ``prefill``: a Gemma-3-shaped sliding layer (32 query heads, 16 KV heads, head dim 128),
    one 32k-token prompt, window 1024.
    ``dense_ms_at_window``: the same implementation's dense causal prefill of the same
    prompt, scaled by the query-key pairs the window keeps over those causal attention
    keeps (``(W (W + 1) / 2 + (T - W) W) / (T (T + 1) / 2)``, 6.2% here): the dense cost
    of the window's work at the dense kernel's own speed.

Implementations: ``triton`` always, ``flashinfer`` when it is importable; one that refuses
a call (a window it does not take) is reported and left out. Target: ``ms /
dense_ms_at_window <= 1.3`` in both cases.

Timing: on a GPU the call is captured in a CUDA graph (eager calls where capture fails)
and the median over ``--repeats`` bursts of back-to-back replays is taken, each burst
timed with CUDA events. On the CPU (``--smoke``), wall-clock medians of eager calls.

Measured on an H200 (triton 3.6, torch 2.11, FlashInfer 0.6.18.post1, ``--flashinfer-fa2``;
docs/benchmarks.md has the table): decode 1.07 (triton) and 0.96 (flashinfer); prefill
1.24 (triton) and 1.42 (flashinfer, whose windowed FA2 prefill is still 1.9x faster than
Triton's). About two minutes with FlashInfer's first builds, 20 s for Triton alone.

Output: a JSON list of rows ``{impl, phase, context, window, batch, ms, dense_ms_at_window}``
(``context``: keys per request for decode, prompt tokens for prefill).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import time

import torch

import fullcg
from fullcg.ops.attention import step_implementations

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "sliding_window_h200.json")


def timed(fn, device: torch.device, repeats: int, burst: int) -> float:
    """Median milliseconds of one ``fn()`` over ``repeats`` bursts of ``burst`` calls, after warm-up."""
    fn()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(burst):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / burst)
        else:
            t0 = time.perf_counter()
            for _ in range(burst):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / burst)
    return statistics.median(times)


def make_step(query_lens: list[int], prefix_lens: list[int], heads: int, kv_heads: int, head_dim: int,
              window: int | None, dtype: torch.dtype, device: torch.device, page: int, seed: int = 0):
    """A layer with a filled KV cache, the step's metadata and its new q/k/v (random)."""
    g = torch.Generator(device=device).manual_seed(seed)
    pages = [math.ceil((q + p) / page) for q, p in zip(query_lens, prefix_lens)]
    table = torch.zeros(len(pages), max(pages), dtype=torch.int32)
    start = 0
    for r, n in enumerate(pages):
        table[r, :n] = torch.arange(start, start + n)
        start += n
    layer = fullcg.Attention(heads, head_dim, kv_heads, layer_id=0, sliding_window=window)
    cache = layer.allocate_kv_cache(start, page, dtype=dtype, device=device)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    md = fullcg.AttentionMetadata.build(query_lens, prefix_lens, table, page, device=device)
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, head_dim, generator=g, device=device).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g, device=device).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=g, device=device).to(dtype)
    return layer, md, q, k, v


def time_layer(impl: str, step, tiles: dict, repeats: int, burst: int) -> float:
    """Milliseconds of one layer call of ``step`` with implementation ``impl`` (raises if it refuses)."""
    layer, md, q, k, v = step
    device = q.device
    cfg = fullcg.FullCGConfig(attention_impl=impl, skip_softmax=fullcg.SkipSoftmaxConfig(**tiles))
    with torch.no_grad(), fullcg.forward_context(md, layer, config=cfg) as ctx:
        layer(q, k, v)  # warm-up: compiles the kernels; an implementation that refuses the call raises here
        run = lambda: layer(q, k, v)  # noqa: E731
        if device.type == "cuda":
            for used in step_implementations(ctx):
                used.plan(ctx)
            torch.cuda.synchronize()
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    layer(q, k, v)
                run = graph.replay
            except Exception as e:  # noqa: BLE001  (timed eagerly instead; said so)
                print(f"  {impl}: capture failed ({type(e).__name__}: {str(e)[:120]}); timing eager calls", flush=True)
                torch.cuda.synchronize()
        return timed(run, device, repeats, burst)


def decode_case(impl: str, a, dtype, device, tiles) -> dict:
    heads, kv_heads, head_dim = a.decode_heads
    step = make_step([1] * a.decode_batch, [a.decode_context - 1] * a.decode_batch, heads, kv_heads, head_dim,
                     a.decode_window, dtype, device, a.page)
    ms = time_layer(impl, step, tiles, a.repeats, a.decode_burst)
    del step
    dense = make_step([1] * a.decode_batch, [a.decode_window - 1] * a.decode_batch, heads, kv_heads, head_dim, None,
                      dtype, device, a.page, seed=1)
    dense_ms = time_layer(impl, dense, tiles, a.repeats, a.decode_burst)
    return dict(impl=impl, phase="decode", context=a.decode_context, window=a.decode_window, batch=a.decode_batch,
                ms=ms, dense_ms_at_window=dense_ms)


def prefill_case(impl: str, a, dtype, device, tiles) -> dict:
    heads, kv_heads, head_dim = a.prefill_heads
    n, w = a.prefill_tokens, a.prefill_window
    step = make_step([n], [0], heads, kv_heads, head_dim, w, dtype, device, a.page)
    ms = time_layer(impl, step, tiles, a.repeats, 1)
    step[0].sliding_window = None  # the same prompt, dense causal
    dense_ms = time_layer(impl, step, tiles, a.prefill_dense_repeats, 1)
    w = min(w, n)
    window_pairs = w * (w + 1) // 2 + (n - w) * w
    causal_pairs = n * (n + 1) // 2
    return dict(impl=impl, phase="prefill", context=n, window=a.prefill_window, batch=1, ms=ms,
                dense_ms_at_window=dense_ms * window_pairs / causal_pairs)


def heads_arg(text: str) -> tuple[int, int, int]:
    parts = tuple(int(x) for x in text.split("/"))
    if len(parts) != 3:
        raise argparse.ArgumentTypeError("heads are q_heads/kv_heads/head_dim, e.g. 64/8/64")
    return parts


def main() -> None:
    defaults = fullcg.SkipSoftmaxConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help=f"JSON output (default: {os.path.relpath(DEFAULT_OUT)}; "
                                               "with --smoke nothing is written unless given)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, float32: runs on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--impls", nargs="*", default=None, help="default: triton, and flashinfer when importable")
    p.add_argument("--cases", nargs="*", default=["decode", "prefill"], choices=["decode", "prefill"])
    p.add_argument("--decode-heads", type=heads_arg, default=(64, 8, 64), help="q_heads/kv_heads/head_dim")
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--decode-context", type=int, default=32768, help="keys per request, the new token included")
    p.add_argument("--decode-window", type=int, default=128)
    p.add_argument("--decode-burst", type=int, default=20, help="replays per timed burst")
    p.add_argument("--prefill-heads", type=heads_arg, default=(32, 16, 128), help="q_heads/kv_heads/head_dim")
    p.add_argument("--prefill-tokens", type=int, default=32768)
    p.add_argument("--prefill-window", type=int, default=1024)
    p.add_argument("--prefill-dense-repeats", type=int, default=5)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--page", type=int, default=64, help="KV-cache page size")
    p.add_argument("--tile-q", type=int, default=defaults.tile_q, help="SkipSoftmaxConfig.tile_q (Triton prefill rows)")
    p.add_argument("--tile-kv", type=int, default=defaults.tile_kv, help="SkipSoftmaxConfig.tile_kv")
    p.add_argument("--flashinfer-fa2", action="store_true",
                   help="FlashInfer's dense prefill on FA2 too (the kernel its windowed prefill runs on) instead of "
                        "FMHAv2, whose first build on a machine takes minutes")
    a = p.parse_args()
    if a.flashinfer_fa2:
        from fullcg.ops.impl.flashinfer import FlashInferAttention

        FlashInferAttention.use_fmha_v2 = False
    if a.smoke:
        a.decode_heads, a.decode_batch, a.decode_context, a.decode_window = (4, 2, 16), 3, 1024, 16
        a.prefill_heads, a.prefill_tokens, a.prefill_window = (4, 2, 16), 256, 32
        a.repeats, a.prefill_dense_repeats, a.decode_burst, a.page, a.tile_kv = 3, 3, 2, 16, 16
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("no CUDA device: run with TRITON_INTERPRET=1 and --smoke to check the script on the CPU")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter has no bf16
    impls = a.impls if a.impls is not None else ["triton"] + (
        ["flashinfer"] if importlib.util.find_spec("flashinfer") is not None else [])
    tiles = dict(tile_q=a.tile_q, tile_kv=a.tile_kv)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreted)"
    print(f"{name}, torch {torch.__version__}, impls {impls}", flush=True)

    out = a.out if a.out is not None else (None if a.smoke else DEFAULT_OUT)

    def write(rows: list[dict]) -> None:
        if out is not None:
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            with open(out, "w") as f:
                json.dump(rows, f, indent=1)

    rows = []
    t0 = time.time()
    for case in a.cases:
        for impl in impls:
            try:
                row = (decode_case if case == "decode" else prefill_case)(impl, a, dtype, device, tiles)
            except (ValueError, RuntimeError, TypeError, NotImplementedError) as e:
                if isinstance(e, torch.OutOfMemoryError):
                    raise
                print(f"{case} {impl}: left out, the implementation refused ({type(e).__name__}: {str(e)[:200]})",
                      flush=True)
                continue
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            write(rows)  # after every row: a run cut short keeps what it measured
            ratio = row["ms"] / row["dense_ms_at_window"]
            print(f"{case:8s} {impl:10s} context {row['context']:6d} window {row['window']:5d} batch {row['batch']:3d}: "
                  f"{row['ms']:.4f} ms, dense at window {row['dense_ms_at_window']:.4f} ms, ratio {ratio:.2f} "
                  f"({'meets' if ratio <= 1.3 else 'misses'} <= 1.3) [{time.time() - t0:.0f}s]", flush=True)
    if out is not None:
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
