"""Skip-softmax attention on a Hopper GPU, per implementation, against dense attention.

Shapes as published for skip-softmax (64 q / 4 kv heads and 32 / 8, head dim 128, bf16):
prefill batch 1 at 16k, 32k, 64k tokens; decode batch 64 at 16k and 64k keys. Each point
(``kind``, ``n``, ``heads``; ``batch`` for decode) holds torch SDPA's dense time
(``sdpa_ms``) and, under ``impls``, per implementation:

* ``triton``: our kernels, launched with the implementation's own defaults (the tile
  sizes of :class:`fullcg.SkipSoftmaxConfig`, the dense decode plan of the kernel);
* ``flashinfer`` (with FlashInfer installed): prefill through FMHAv2 on SM90, called as
  the ``flashinfer`` implementation calls it for a prompt with no cached prefix (dense over
  paged K/V of one allocation, with a factor over the prompt's own k/v rows: ``layouts``
  names both); decode through FlashInfer's dense decode wrapper, as the implementation
  plans it. FlashInfer has no skip-softmax decode on Hopper, so its decode sweep is empty.
  With ``--fmha-v2-layouts`` its prefill entry also holds ``other_layouts``: FMHAv2 with
  the k/v rows given in each of these layouts (``SEPARATE_Q_K_V``, ``CONTIGUOUS_Q_KV``),
  dense and swept, called directly.

Each holds ``dense_ms`` (with TFLOP/s for prefill, counting 2 matmuls x 2 flops x N^2/2 x
heads x dim, or TB/s of K and V read for decode), its dense error and a ``sweep`` over
skip-softmax factors of ``factor``, ``skipped_fraction`` (the kernels' own counters; null
where the kernel counts no tiles, as FMHAv2), ``ms``, ``speedup`` (over its own dense),
``speedup_vs_sdpa`` and ``rel_err``: the relative output error against float64 on a
subset of rows (``||o - o64|| / ||o64||``). A plot shows speed-up over SDPA, error and
skipped fraction against the factor.

Random Q/K skip nothing, so inputs have controllable structure: attention sinks (the
first keys), a local window (sinusoidal position features shared by q and k), a few heavy
keys, over unit-variance noise. Logit sizes are arguments.

Run: ``python benchmarks/skip_softmax.py --out results/`` (needs a CUDA GPU and triton).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import time

import torch

import fullcg
from fullcg.ops.impl import fmha_v2
from fullcg.ops.kernels.decode import plan_decode
from fullcg.ops.kernels.prefill import plan_prefill

HEAD_DIM = 128
DTYPE = torch.bfloat16
PAGE = 64
#: Decode timings: medians of 5 bursts of 10 back-to-back calls (a decode call is short
#: enough that one call timed alone would count the host's launch of it).
DECODE_TIMING = (5, 10)


def structured_qk(
    positions_q: torch.Tensor,
    positions_k: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    sink_logit: float,
    window_logit: float,
    heavy_logit: float,
    num_sinks: int = 4,
    num_heavy: int = 16,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Q ``[nq, Hq, 128]`` and K ``[nk, Hkv, 128]`` (bf16) whose scaled logits are noise
    (std ~1, dims 0-63) + a local window (``window_logit`` at distance 0, dims 64-95)
    + sinks and heavy keys (dims 96-127, one shared query direction)."""
    dev = positions_q.device
    g = torch.Generator(device=dev).manual_seed(seed)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    nq, nk = positions_q.numel(), positions_k.numel()
    q = torch.empty(nq, num_heads, HEAD_DIM, device=dev, dtype=torch.float32)
    k = torch.empty(nk, num_kv_heads, HEAD_DIM, device=dev, dtype=torch.float32)
    q[..., :64].normal_(generator=g).mul_(math.sqrt(2.0))
    k[..., :64].normal_(generator=g)
    freqs = 2 * math.pi / torch.logspace(math.log10(64), math.log10(8192), 16, device=dev)
    amp = math.sqrt(window_logit / (16 * scale))
    for pos, t in ((positions_q, q), (positions_k, k)):
        ang = pos.float()[:, None] * freqs[None, :]
        t[..., 64:96:2] = (amp * torch.cos(ang))[:, None, :]
        t[..., 65:96:2] = (amp * torch.sin(ang))[:, None, :]
    u = torch.zeros(32, device=dev)
    u[0] = 1.0
    q[..., 96:] = u
    k[..., 96:] = 0.0
    k[:num_sinks, :, 96:] = u * (sink_logit / scale)
    heavy = torch.randint(num_sinks, max(num_sinks + 1, nk), (num_heavy,), generator=g, device=dev)
    k[heavy, :, 96:] = u * (heavy_logit / scale)
    return q.to(DTYPE), k.to(DTYPE)


def timed(fn, reps: int, burst: int = 1) -> float:
    """Median milliseconds of one ``fn`` call over ``reps`` bursts of ``burst`` back-to-back
    calls, after one warm-up call. A burst keeps the GPU busy while the host launches the
    next call, so a short kernel's time is not padded with host launch time."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(burst):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / burst)
    times.sort()
    return times[len(times) // 2]


def exact_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Float64 causal attention of query rows ``q [n, Hq, D]`` at ``q_pos`` over ``k, v``."""
    group = q.shape[1] // k.shape[1]
    out = []
    for h in range(k.shape[1]):
        qh = q[:, h * group : (h + 1) * group].double()  # [n, G, D]
        s = torch.einsum("ngd,ld->gnl", qh, k[:, h].double()) / math.sqrt(HEAD_DIM)
        mask = torch.arange(k.shape[0], device=q.device)[None, :] <= q_pos[:, None]
        s = s.masked_fill(~mask[None], float("-inf"))
        out.append(torch.einsum("gnl,ld->ngd", torch.softmax(s, -1), v[:, h].double()))
    return torch.cat(out, 1)


def rel_err(o: torch.Tensor, ref: torch.Tensor) -> float:
    return float((o.double() - ref).norm() / ref.norm())


def dense_and_sweep(run, factors: list[float], timing: tuple[int, ...], sdpa_ms: float | None, error,
                    counters: torch.Tensor | None = None, kind_row: int = 0) -> dict:
    """One implementation's ``dense_ms``, ``dense_rel_err`` and ``sweep``: ``run(factor)``
    returns the call (factor None: dense), ``error()`` the relative error of the output it
    just wrote; ``counters`` (row ``kind_row``: visited, skipped) give the skipped fraction,
    which is null without them."""
    dense = run(None)
    dense_ms = timed(dense, *timing)
    dense()
    res = dict(dense_ms=dense_ms, dense_rel_err=error(), sweep=[])
    for factor in factors:
        call = run(factor)
        if counters is not None:
            counters.zero_()
        call()
        skipped = None
        if counters is not None:
            torch.cuda.synchronize()
            visited, n_skipped = counters[kind_row].tolist()
            skipped = n_skipped / max(visited, 1)
        err = error()
        ms = timed(call, *timing)
        res["sweep"].append(dict(factor=factor, skipped_fraction=skipped, ms=ms, speedup=dense_ms / ms,
                                 speedup_vs_sdpa=(sdpa_ms / ms) if sdpa_ms else None, rel_err=err))
    return res


def bench_prefill(n: int, heads: tuple[int, int], factors: list[float], args) -> dict:
    hq, hkv = heads
    dev = torch.device("cuda")
    pos = torch.arange(n, device=dev)
    q, k = structured_qk(pos, pos, hq, hkv, sink_logit=args.sink_logit, window_logit=args.window_logit,
                         heavy_logit=args.heavy_logit, seed=n + hq)
    v = torch.randn(n, hkv, HEAD_DIM, device=dev, dtype=DTYPE)
    # One allocation, V after K, as KVCache.allocate makes it (FMHAv2 reads both through it).
    both = torch.stack((k.view(n // PAGE, PAGE, hkv, HEAD_DIM), v.view(n // PAGE, PAGE, hkv, HEAD_DIM)))
    k_cache, v_cache = both[0], both[1]
    page_table = torch.arange(n // PAGE, device=dev, dtype=torch.int32)[None]
    meta = dict(
        query_start_loc=torch.tensor([0, n], device=dev, dtype=torch.int32),
        is_decode=torch.zeros(1, dtype=torch.bool, device=dev),
        page_table=page_table,
        seq_lens=torch.tensor([n], device=dev, dtype=torch.int32),
        prefix_lens=torch.zeros(1, device=dev, dtype=torch.int32),
    )
    out = torch.empty(n, hq, HEAD_DIM, device=dev, dtype=DTYPE)
    lse = torch.empty(n, hq, device=dev, dtype=torch.float32)
    ctr = torch.zeros(2, 2, dtype=torch.int64, device=dev)
    cfg = dict(tile_q=args.prefill_tile_q, tile_kv=args.prefill_tile_kv, num_warps=args.prefill_warps,
               num_stages=args.prefill_stages)

    def ours(factor):
        launch = plan_prefill(q, k_cache, v_cache, out, lse, scale=1 / math.sqrt(HEAD_DIM), causal=True,
                              factor=factor, **cfg, **meta)
        return lambda: launch(q, k_cache, v_cache, out, lse, ctr)

    flops = 4 * (n * n / 2) * hq * HEAD_DIM
    reps = 3 if n >= 32768 else 5
    sub = torch.arange(n - args.err_rows, n, device=dev)
    exact = exact_rows(q[sub], k, v, sub)

    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)))
    qt, kt, vt = qt.contiguous(), kt.contiguous(), vt.contiguous()
    t_sdpa = timed(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True), reps)
    del qt, kt, vt

    triton = dense_and_sweep(ours, factors, (reps,), t_sdpa, lambda: rel_err(out[sub], exact), ctr, kind_row=0)
    triton["dense_tflops"] = flops / triton["dense_ms"] / 1e9
    impls = {"triton": triton}
    if fmha_v2.available(dev.index or 0):
        impls["flashinfer"] = bench_fmha_v2(q, k_cache, v_cache, page_table, out, sub, exact, factors, reps, flops,
                                            t_sdpa, args.fmha_v2_layouts)
    return dict(kind="prefill", n=n, heads=list(heads), sdpa_ms=t_sdpa, sdpa_tflops=flops / t_sdpa / 1e9,
                impls=impls)


def bench_fmha_v2(q, k_cache, v_cache, page_table, out, sub, exact, factors, reps, flops, t_sdpa,
                  layouts=()) -> dict:
    """FlashInfer's FMHAv2 on the same prefill, called as the ``flashinfer`` implementation
    calls it for a prompt with no cached prefix: dense over the cache's pages, with a factor
    over the prompt's own k/v rows (copied into FMHAv2's packed layout, as the
    implementation does); it counts no skipped tiles."""
    n, dev = q.shape[0], q.device
    cache = fullcg.KVCache(k_cache, v_cache)
    tables = fmha_v2.paged_tables(page_table, fmha_v2.v_offset_pages(cache))
    k, v = k_cache.reshape(n, *k_cache.shape[2:]), v_cache.reshape(n, *v_cache.shape[2:])
    cu = torch.tensor([0, n], device=dev, dtype=torch.int32)
    ws = torch.zeros(fmha_v2.WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    scale = 1 / math.sqrt(HEAD_DIM)

    def run(factor):
        if factor is None:
            return lambda: fmha_v2.attend_paged(q, out, cache, tables, cu, cu, n, n, scale, None, ws)
        return lambda: fmha_v2.attend_contiguous(q, k, v, n, out, cu, n, True, scale, False, ws, factor)

    res = dict(kernel="fmha_v2", layouts=dict(dense="Q_PAGED_KV_NHD", skip="CONTIGUOUS_Q_KV"),
               **dense_and_sweep(run, factors, (reps,), t_sdpa, lambda: rel_err(out[sub], exact)))
    res["dense_tflops"] = flops / res["dense_ms"] / 1e9
    if layouts:
        res["other_layouts"] = {
            layout: _fmha_v2_layout(layout, q, k_cache, v_cache, out, sub, exact, factors, reps, t_sdpa)
            for layout in layouts
        }
    return res


def _fmha_v2_layout(layout, q, k_cache, v_cache, out, sub, exact, factors, reps, t_sdpa) -> dict:
    """FMHAv2 on the same prefill with k/v given as rows (a fresh prompt's own k/v, no
    cache), called directly: what a batch of prefills without a prefix could run. Each
    layout is a JIT build of its own (a minute or more the first time)."""
    from flashinfer.prefill import trtllm_fmha_v2_prefill

    n, dev = q.shape[0], q.device
    k, v = k_cache.reshape(n, *k_cache.shape[2:]), v_cache.reshape(n, *v_cache.shape[2:])
    qkv = (q, k, v) if layout == "SEPARATE_Q_K_V" else (q, torch.stack((k, v), 1))
    cu = torch.tensor([0, n], device=dev, dtype=torch.int32)
    ws = torch.zeros(fmha_v2.WORKSPACE_BYTES, dtype=torch.uint8, device=dev)

    def run(factor):
        return lambda: trtllm_fmha_v2_prefill(
            qkv, layout, workspace_buffer=ws, seq_lens=cu[1:], max_q_len=n, max_kv_len=n,
            bmm1_scale=1 / math.sqrt(HEAD_DIM), bmm2_scale=1.0, batch_size=1, cum_seq_lens_q=cu,
            cum_seq_lens_kv=cu, out=out, mask_mode="causal", skip_softmax_threshold_scale_factor=factor or 0.0)

    try:
        return dense_and_sweep(run, factors, (reps,), t_sdpa, lambda: rel_err(out[sub], exact))
    except Exception as e:  # an unsupported layout here: recorded, the run goes on
        return dict(error=f"{type(e).__name__}: {str(e)[:300]}")


def bench_flashinfer_decode(q, k_cache, v_cache, page_table, out, check, exact, kv_bytes) -> dict:
    """FlashInfer's dense decode, planned as the ``flashinfer`` implementation plans it."""
    import flashinfer

    from fullcg.ops.impl.flashinfer import DENSE_BACKEND, WORKSPACE_BYTES

    batch, pages = page_table.shape
    hq, hkv, dev = q.shape[1], k_cache.shape[2], q.device
    ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True, backend=DENSE_BACKEND)
    wrapper.plan(
        torch.arange(0, batch * pages + 1, pages, dtype=torch.int32, device=dev), page_table.flatten(),
        torch.full((batch,), PAGE, dtype=torch.int32, device=dev), hq, hkv, HEAD_DIM, PAGE,
        sm_scale=1 / math.sqrt(HEAD_DIM), q_data_type=DTYPE, kv_data_type=DTYPE,
    )

    def run(factor):
        assert factor is None, "FlashInfer has no skip-softmax decode on this GPU"
        return lambda: wrapper.run(q, (k_cache, v_cache), out=out)

    res = dict(kernel=f"decode ({DENSE_BACKEND}, tensor cores)",
               **dense_and_sweep(run, [], DECODE_TIMING, None, lambda: rel_err(out[check], exact)),
               note="FlashInfer has no skip-softmax decode on this GPU")
    res["dense_tbps"] = kv_bytes / res["dense_ms"] / 1e9
    return res


def bench_decode(n: int, batch: int, heads: tuple[int, int], factors: list[float], args) -> dict:
    hq, hkv = heads
    dev = torch.device("cuda")
    pages = n // PAGE
    k_cache = torch.empty(batch * pages, PAGE, hkv, HEAD_DIM, device=dev, dtype=DTYPE)
    v_cache = torch.randn(batch * pages, PAGE, hkv, HEAD_DIM, device=dev, dtype=DTYPE)
    q = torch.empty(batch, hq, HEAD_DIM, device=dev, dtype=DTYPE)
    pos = torch.arange(n, device=dev)
    for b in range(batch):
        qb, kb = structured_qk(pos[-1:], pos, hq, hkv, sink_logit=args.sink_logit, window_logit=args.window_logit,
                               heavy_logit=args.heavy_logit, seed=b)
        q[b] = qb[0]
        k_cache[b * pages : (b + 1) * pages] = kb.view(pages, PAGE, hkv, HEAD_DIM)
    page_table = torch.arange(batch * pages, device=dev, dtype=torch.int32).view(batch, pages)
    meta = dict(
        query_start_loc=torch.arange(batch + 1, device=dev, dtype=torch.int32),
        is_decode=torch.ones(batch, dtype=torch.bool, device=dev),
        page_table=page_table,
        seq_lens=torch.full((batch,), n, device=dev, dtype=torch.int32),
    )
    out = torch.empty(batch, hq, HEAD_DIM, device=dev, dtype=DTYPE)
    lse = torch.empty(batch, hq, device=dev, dtype=torch.float32)
    ctr = torch.zeros(2, 2, dtype=torch.int64, device=dev)

    def ours(factor):
        # Dense is the implementation's dense plan (its own tiles and split count); runs of
        # --decode-split tiles are the skip rule's, so only skipping uses them.
        # Planned once, as the implementation plans a step: each timed call is the launch alone.
        split = args.decode_split if factor is not None else None
        launch = plan_decode(q, k_cache, v_cache, out, lse, scale=1 / math.sqrt(HEAD_DIM), factor=factor,
                             tile_kv=args.decode_tile_kv, split_tiles=split, max_kv_len=n, workspace={}, **meta)
        return lambda: launch(q, k_cache, v_cache, out, lse, ctr)

    kv_bytes = 2 * batch * n * hkv * HEAD_DIM * 2
    check = list(range(0, batch, max(1, batch // 16)))
    exact = torch.stack([
        exact_rows(q[b : b + 1], k_cache[b * pages : (b + 1) * pages].flatten(0, 1),
                   v_cache[b * pages : (b + 1) * pages].flatten(0, 1), pos[-1:])[0]
        for b in check
    ])

    t_sdpa, sdpa_note = None, None
    try:
        kt = k_cache.view(batch, n, hkv, HEAD_DIM).transpose(1, 2)
        vt = v_cache.view(batch, n, hkv, HEAD_DIM).transpose(1, 2)
        qt = q[:, :, None, :]
        t_sdpa = timed(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True),
                       *DECODE_TIMING)
    except (RuntimeError, torch.OutOfMemoryError) as e:  # report, don't fail the whole run
        sdpa_note = str(e)[:200]

    triton = dense_and_sweep(ours, factors, DECODE_TIMING, t_sdpa, lambda: rel_err(out[check], exact), ctr,
                             kind_row=1)
    triton["dense_tbps"] = kv_bytes / triton["dense_ms"] / 1e9
    impls = {"triton": triton}
    if importlib.util.find_spec("flashinfer") is not None:
        impls["flashinfer"] = bench_flashinfer_decode(q, k_cache, v_cache, page_table, out, check, exact, kv_bytes)
    res = dict(kind="decode", n=n, batch=batch, heads=list(heads), sdpa_ms=t_sdpa,
               sdpa_tbps=(kv_bytes / t_sdpa / 1e9) if t_sdpa else None, impls=impls)
    if sdpa_note is not None:
        res["sdpa_note"] = sdpa_note
    return res


def plot(results: list[dict], path: str) -> None:
    """Speed-up over SDPA dense, error and (where counted) skipped fraction against the
    factor, one line per point and implementation (dense drawn at factor 0.1 for prefill,
    10 for decode: left of every factor swept)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    lines = [(r, name, impl) for r in results for name, impl in r["impls"].items() if impl["sweep"] and r["sdpa_ms"]]
    colours = plt.get_cmap("tab20").colors  # one colour per line: the default cycle repeats after 10
    for i, (r, name, impl) in enumerate(lines):
        label = f"{r['kind']} {r['n'] // 1024}k {r['heads'][0]}/{r['heads'][1]} {name}"
        style = dict(linestyle="-" if name == "triton" else "--", color=colours[i % len(colours)])
        dense_x = 0.1 if r["kind"] == "prefill" else 10.0
        xs = [dense_x] + [s["factor"] for s in impl["sweep"]]
        axes[0].plot(xs, [r["sdpa_ms"] / impl["dense_ms"]] + [s["speedup_vs_sdpa"] for s in impl["sweep"]],
                     marker="o", label=label, **style)
        axes[1].plot(xs, [impl["dense_rel_err"]] + [s["rel_err"] for s in impl["sweep"]], marker="o", label=label,
                     **style)
        if impl["sweep"][0]["skipped_fraction"] is not None:
            axes[2].plot(xs, [0.0] + [s["skipped_fraction"] for s in impl["sweep"]], marker="o", label=label,
                         **style)
    for ax, ylabel in zip(axes, ("speed-up over SDPA dense", "relative output error vs float64",
                                 "skipped fraction of tiles (counted)")):
        ax.set_xscale("log")
        ax.set_xlabel("skip-softmax factor (leftmost point: dense)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    defaults = fullcg.SkipSoftmaxConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmark_results")
    p.add_argument("--prefill-lens", type=int, nargs="*", default=[16384, 32768, 65536])
    p.add_argument("--decode-lens", type=int, nargs="*", default=[16384, 65536])
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--heads", nargs="*", default=["64/4", "32/8"], help="query/kv head layouts")
    p.add_argument("--prefill-factors", type=float, nargs="*", default=[1.0, 3.0, 30.0, 100.0, 300.0, 3000.0])
    p.add_argument("--decode-factors", type=float, nargs="*",
                   default=[1000.0, 3000.0, 10000.0, 14000.0, 30000.0, 50000.0])
    p.add_argument("--prefill-tile-q", type=int, default=defaults.tile_q)
    p.add_argument("--prefill-tile-kv", type=int, default=defaults.tile_kv)
    p.add_argument("--prefill-warps", type=int, default=None, help="default: the kernel's plan")
    p.add_argument("--prefill-stages", type=int, default=None, help="default: the kernel's plan")
    p.add_argument("--decode-tile-kv", type=int, default=defaults.tile_kv)
    p.add_argument("--decode-split", type=int, default=32, help="tiles per skip-softmax decode run")
    p.add_argument("--fmha-v2-layouts", nargs="*", default=[], choices=["SEPARATE_Q_K_V", "CONTIGUOUS_Q_KV"],
                   help="also time FMHAv2 prefill over k/v given as rows in these layouts (under other_layouts)")
    p.add_argument("--sink-logit", type=float, default=14.0)
    p.add_argument("--window-logit", type=float, default=10.0)
    p.add_argument("--heavy-logit", type=float, default=8.0)
    p.add_argument("--err-rows", type=int, default=64)
    p.add_argument("--replot", metavar="JSON", help="only draw the plot of an earlier run's results, beside them")
    args = p.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f)["results"], os.path.splitext(args.replot)[0] + ".png")
        return
    heads_list = [tuple(int(x) for x in h.split("/")) for h in args.heads]
    os.makedirs(args.out, exist_ok=True)
    versions = dict(torch=torch.__version__, triton=importlib.import_module("triton").__version__)
    if importlib.util.find_spec("flashinfer") is not None:
        versions["flashinfer"] = importlib.import_module("flashinfer").__version__
    doc = dict(args=vars(args), device=torch.cuda.get_device_name(), versions=versions, results=[])
    results = doc["results"]
    t0 = time.time()
    points = [("prefill", heads, n) for heads in heads_list for n in args.prefill_lens]
    points += [("decode", heads, n) for heads in heads_list for n in args.decode_lens]
    for kind, heads, n in points:
        if kind == "prefill":
            results.append(bench_prefill(n, heads, args.prefill_factors, args))
        else:
            results.append(bench_decode(n, args.decode_batch, heads, args.decode_factors, args))
        print(json.dumps(results[-1]), f"[{time.time() - t0:.0f}s]", flush=True)
        torch.cuda.empty_cache()
        with open(os.path.join(args.out, "skip_softmax.json"), "w") as f:  # after every point: a cut run keeps its part
            json.dump(doc, f, indent=1)
    plot(results, os.path.join(args.out, "skip_softmax.png"))


if __name__ == "__main__":
    main()
