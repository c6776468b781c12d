"""Decode step latency of a Llama-3-8B-shaped model: eager vs the gpt-fast peer vs fullcg.

    python benchmarks/decode.py --out results.json

One process, one GPU, everything measured side by side: the same weights (random bf16,
seeded), the same batches. For each batch size and context length it reports the median
step time over ``--repeats`` of

- ``eager``: the model uncompiled (fullcg.Attention with the chosen implementation);
- ``peer``: gpt-fast style static KV cache + SDPA under ``torch.compile(mode="reduce-overhead")``;
- ``piecewise``, ``full`` and ``default``: ``fullcg.compile(model, config)`` (the fullcg
  backend under ``torch.compile``, steps after a graph's first dispatched without Dynamo)
  in the graph modes ``piecewise``, ``full`` and the default policy (``auto``);

plus the bandwidth floor (weights + KV bytes read per step over measured copy bandwidth),
compile and capture times, graph pool memory, and mixed / prefill steps in every mode
(``mixed_ms`` rows: ``name``, ``tokens``, ``eager``, ``piecewise``, ``full``, ``default``).
Step times include the host work before the step's first kernel (context entry, the
dispatch, the runner), so they move with the host's speed; ``full_replay_only`` and
``default_replay_only`` time the captured decode graph's replays alone (the GPU's time).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

import fullcg
from fullcg.models.llama import LlamaConfig, LlamaModel

PAGE = 16


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read plus written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times[2:])


def time_ms(fn, repeats: int, before=None) -> float:
    """Median milliseconds of ``fn()`` (CUDA events), after warm-up; ``before()``, when
    given, is queued ahead of each timed call, outside the events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if before is not None:
            before()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def floor_bytes(model: LlamaModel, batch: int, context: int) -> int:
    """Bytes a decode step of ``batch`` requests at ``context`` must read at least.

    Every weight but the embedding (a step reads only its tokens' rows of it) and every
    request's keys and values of ``context + 1`` tokens (its new token's included).
    """
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    cfg = model.cfg
    kv_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * model.lm_head.weight.element_size()
    return weights + batch * (context + 1) * kv_token


def captured_full_graph(backend: fullcg.Backend, batch: int):
    """``replay`` of the decode-only full graph a step of ``batch`` tokens ran, if captured."""
    import fullcg.runner

    padded_size = getattr(fullcg.runner, "padded_size", None) or fullcg.cudagraph.padded_size  # older fullcg
    for runner in backend.runners:
        size = padded_size(batch, runner.sizes)
        entry = runner.full_graphs.get((size, True)) if size is not None else None
        if entry is not None:
            return entry.graph.replay
    return None


def decode_metadata(batch: int, context: int, device: torch.device) -> fullcg.AttentionMetadata:
    pages = math.ceil((context + 1) / PAGE)
    table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
    return fullcg.AttentionMetadata.build([1] * batch, [context] * batch, table, PAGE, device=device)


def prefill_metadata(lens: list[int], prefixes: list[int], device: torch.device) -> fullcg.AttentionMetadata:
    pages = [math.ceil((q + p) / PAGE) for q, p in zip(lens, prefixes)]
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    start = 0
    for r, n in enumerate(pages):
        table[r, :n] = torch.arange(start, start + n)
        start += n
    return fullcg.AttentionMetadata.build(lens, prefixes, table, PAGE, device=device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3_8b", choices=["tiny", "mid", "llama3_8b"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--peer-batches", type=int, nargs="+", default=[1, 64], help="peer recompiles per shape")
    ap.add_argument("--capture-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 48, 64, 128, 256])
    ap.add_argument("--impl", default="triton", help="attention implementation for eager and fullcg")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=None, help="write all figures as JSON here")
    ap.add_argument("--no-skinny-linears", action="store_true",
                    help="the library GEMM for every linear (an A/B of fullcg's one-pass GEMV)")
    ap.add_argument("--peer-only", action="store_true", help="time only the peer (and the floor)")
    ap.add_argument("--no-peer", action="store_true", help="skip the peer (it compiles for minutes)")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager model (its first steps JIT-build kernels)")
    ap.add_argument("--no-mixed", action="store_true", help="skip the mixed and prefill steps (decode steps only)")
    ap.add_argument("--modes", nargs="+", default=["piecewise", "full", "default"],
                    help="fullcg graph modes to time ('default' is the default policy)")
    args = ap.parse_args()

    dev = torch.device("cuda")
    torch.manual_seed(0)
    results: dict = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "args": vars(args)}
    bw = copy_bandwidth(dev)
    results["copy_bandwidth_TBps"] = bw / 1e12
    print(f"{results['gpu']}, torch {torch.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)

    cfg = LlamaConfig.preset(args.model)
    model = LlamaModel(cfg, seed=0, dtype=torch.bfloat16, device=dev).eval()
    max_b, max_ctx = max(args.batches), max(args.contexts)
    num_pages = max_b * math.ceil((max_ctx + 1) / PAGE) + 8
    model.allocate_kv_cache(num_pages, PAGE)
    for layer in model.attention_layers():
        layer.kv_cache.k.normal_()
        layer.kv_cache.v.normal_()

    def floor_ms(batch: int, context: int) -> float:
        return floor_bytes(model, batch, context) / bw * 1e3

    base = fullcg.FullCGConfig(attention_impl=args.impl, capture_sizes=tuple(args.capture_sizes),
                               skinny_linears=not args.no_skinny_linears)
    points = [(b, c) for c in args.contexts for b in args.batches]
    # Non-decode steps at several token counts: where a full graph stops paying over pieces.
    mixed_steps = [] if args.no_mixed else [
        ("mixed 1x32 extend + 31 decode", [32] + [1] * 31, [256] * 32),
        ("mixed 1x96 extend + 32 decode", [96] + [1] * 32, [256] * 33),
        ("mixed 1x224 extend + 32 decode", [224] + [1] * 32, [256] * 33),
        ("prefill 1x64", [64], [0]),
        ("prefill 1x128", [128], [0]),
        ("prefill 1x256", [256], [0]),
        ("prefill 4x512 (uncaptured)", [512] * 4, [0] * 4),
    ]
    mixed: dict[str, dict[str, float]] = {name: {"tokens": sum(lens)} for name, lens, _ in mixed_steps}

    def mixed_inputs(lens, prefixes):
        md = prefill_metadata(lens, prefixes, dev)
        ids = torch.randint(0, cfg.vocab_size, (sum(lens),), device=dev)
        pos = torch.cat([torch.arange(p, p + q) for q, p in zip(lens, prefixes)]).to(dev)
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(pos, 0)
        return md, ids, pos
    table: dict[tuple[int, int], dict[str, float]] = {p: {"floor": floor_ms(*p)} for p in points}

    def dump() -> None:  # after every phase, so a run cut short still leaves its figures
        if args.out:
            partial = {**results, "decode_ms_partial": [{"batch": b, "context": c, **t} for (b, c), t in table.items()],
                       "mixed_ms_partial": [{"name": k, **v} for k, v in mixed.items()]}
            with open(args.out, "w") as f:
                json.dump(partial, f, indent=1, default=str)

    def step_fn(fn, batch, context, config):
        md = decode_metadata(batch, context, dev)
        ids = torch.randint(0, cfg.vocab_size, (batch,), device=dev)
        pos = torch.full((batch,), context, dtype=torch.long, device=dev)
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(pos, 0)

        def run():
            with fullcg.forward_context(md, model, config=config):
                return fn(ids, pos)

        return run

    with torch.inference_mode():
        for b, c in ([] if args.peer_only or args.no_eager else points):
            table[(b, c)]["eager"] = time_ms(step_fn(model, b, c, base), args.repeats)
        if not (args.peer_only or args.no_eager):
            print("eager: " + ", ".join(f"b{b}/ctx{c} {table[(b, c)]['eager']:.2f} ms" for b, c in points), flush=True)
            for name, lens, prefixes in mixed_steps:
                md, ids, pos = mixed_inputs(lens, prefixes)

                def run_eager(md=md, ids=ids, pos=pos):
                    with fullcg.forward_context(md, model, config=base):
                        return model(ids, pos)

                mixed[name]["eager"] = time_ms(run_eager, args.repeats)
            dump()

        for mode in [] if args.peer_only else args.modes:
            torch._dynamo.reset()
            config = base.replace(graph_mode="auto" if mode == "default" else mode)
            compiled = fullcg.compile(model, config)
            backend = compiled.backend
            before = torch.cuda.memory_reserved(dev)
            t0 = time.perf_counter()
            step_fn(compiled, 1, 16, config)()  # compile + capture of size 1
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            md = decode_metadata(1, 16, dev)
            ids = torch.zeros(1, dtype=torch.long, device=dev)
            fullcg.capture(compiled, md, model, ids, ids)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            results[f"{mode}_compile_plus_first_capture_s"] = t1 - t0
            results[f"{mode}_capture_all_s"] = t2 - t1
            results[f"{mode}_graph_pool_GiB"] = (torch.cuda.memory_reserved(dev) - before) / 2**30
            print(f"{mode}: compile + first capture {t1 - t0:.1f} s, capture of {len(args.capture_sizes)} sizes "
                  f"{t2 - t1:.1f} s, +{results[f'{mode}_graph_pool_GiB']:.2f} GiB", flush=True)
            fullcg.reset_graph_mode_counts()
            for b, c in points:
                table[(b, c)][mode] = time_ms(step_fn(compiled, b, c, config), args.repeats)
                replay = captured_full_graph(backend, b)
                if replay is not None:
                    # The captured graph alone (its static inputs still hold this batch): the
                    # step's GPU time, without the host work before the first kernel.
                    table[(b, c)][f"{mode}_replay_only"] = time_ms(replay, args.repeats)
            results[f"{mode}_steps"] = dict(fullcg.graph_mode_counts())
            print(f"{mode}: " + ", ".join(f"b{b}/ctx{c} {table[(b, c)][mode]:.2f} ms" for b, c in points), flush=True)
            dump()

            fullcg.reset_graph_mode_counts()
            for name, lens, prefixes in mixed_steps:
                md, ids, pos = mixed_inputs(lens, prefixes)

                def run(md=md, ids=ids, pos=pos, fn=compiled, cfg_=config):
                    with fullcg.forward_context(md, model, config=cfg_):
                        return fn(ids, pos)

                mixed[name][mode] = time_ms(run, args.repeats)
            results[f"{mode}_mixed_steps"] = dict(fullcg.graph_mode_counts())
            print(f"{mode}: " + ", ".join(f"{name} {mixed[name][mode]:.2f} ms" for name, _, _ in mixed_steps), flush=True)
            dump()
            del compiled, backend

        # The peer needs its own static cache; free ours first.
        for layer in model.attention_layers():
            layer.kv_cache = None
        torch.cuda.empty_cache()
        from peer import PeerDecoder

        for c in [] if args.no_peer else args.contexts:
            for b in args.peer_batches:
                torch._dynamo.reset()
                peer = PeerDecoder(model, b, c + 16)
                peer.fill_random()
                compiled_peer = torch.compile(peer, mode="reduce-overhead", fullgraph=True)
                ids = torch.randint(0, cfg.vocab_size, (b,), device=dev)
                pos = torch.full((b,), c, dtype=torch.long, device=dev)
                t0 = time.perf_counter()
                compiled_peer(ids, pos)
                compiled_peer(ids, pos)
                torch.cuda.synchronize()
                results.setdefault("peer_compile_s", []).append(time.perf_counter() - t0)
                table[(b, c)]["peer"] = time_ms(lambda: compiled_peer(ids, pos), args.repeats)
                print(f"peer b{b}/ctx{c}: {table[(b, c)]['peer']:.2f} ms (compile {results['peer_compile_s'][-1]:.0f} s)",
                      flush=True)
                dump()
                del peer, compiled_peer
                torch.cuda.empty_cache()
        print("peer done", flush=True)

    if args.peer_only:
        print(json.dumps({f"{b}/{c}": t for (b, c), t in table.items()}, indent=1))
        dump()
        return
    rows = []
    def ms(t: dict, key: str) -> str:
        return f"{t[key]:.2f}" if key in t else "-"

    print("| batch | context | floor | eager | peer | piecewise | full | default | full / floor | piecewise / full |")
    print("|" + "---|" * 10)
    for (b, c), t in table.items():
        ratio = f"{t['piecewise'] / t['full']:.2f}" if "piecewise" in t and "full" in t else "-"
        floor = f"{t['floor'] / t['full']:.0%}" if "full" in t else "-"
        print(f"| {b} | {c} | {t['floor']:.2f} | {ms(t, 'eager')} | {ms(t, 'peer')} | {ms(t, 'piecewise')} | "
              f"{ms(t, 'full')} | {ms(t, 'default')} | {floor} | {ratio} |")
        rows.append({"batch": b, "context": c, **t})
    print("| step | tokens | eager | piecewise | full | default | piecewise / full | default / best |")
    print("|" + "---|" * 8)
    for name, t in mixed.items():
        best = min((t[m] for m in ("piecewise", "full") if m in t), default=None)
        print(f"| {name} | {t['tokens']} | {ms(t, 'eager')} | {ms(t, 'piecewise')} | {ms(t, 'full')} | "
              f"{ms(t, 'default')} | "
              + (f"{t['piecewise'] / t['full']:.2f} | " if "piecewise" in t and "full" in t else "- | ")
              + (f"{t['default'] / best:.2f} |" if best and "default" in t else "- |"))
    results["mixed_ms"] = [{"name": name, **t} for name, t in mixed.items()]
    results["decode_ms"] = rows
    print(json.dumps({k: v for k, v in results.items() if k not in ("decode_ms", "mixed_ms")}, indent=1, default=str))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
