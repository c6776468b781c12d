"""Offline generation on a Hugging Face LlamaForCausalLM: HF's ways vs ``fullcg.generate``.

    python benchmarks/generate.py --device cuda --out generate_h200.json   # Llama-3-8B shape, bf16
    python benchmarks/generate.py --smoke                                   # tiny model on the CPU

One process, one model (random bf16 weights from a seed, built from a config: no
download), the same prompts for every engine. Engines, side by side:

- ``hf``: ``model.generate`` with HF's default attention (sdpa) and dynamic cache;
- ``hf_static_compiled``: HF's documented fast recipe, a static cache with the forward
  compiled by ``torch.compile(mode="reduce-overhead", fullgraph=True)``;
- ``hf_continuous``: HF's continuous batching (paged attention, one request per prompt),
  when the installed transformers has it;
- ``fullcg``: ``fullcg.generate`` on the same model after
  ``fullcg.integrations.transformers.prepare`` (step ``n + 1`` prepared and launched while
  step ``n`` runs); ``fullcg_sync``: the same with ``overlap=False``.

fullcg rows also carry, from the last timed run, ``steps``, ``host_ms_per_step`` and
``gpu_idle_fraction`` (:class:`fullcg.GenerateStats`), ``step_replay_ms`` (one decode step
of one request at the workload's mean context, run through the compiled model with
nothing else to do: the graph's replay and its dispatch, the lower bound of a batch-1
step) and a roofline: ``roofline_s`` is the sum over the steps fullcg ran of
max(bytes moved / copy bandwidth, FLOPs / matmul rate), with the weights read once a step
and the keys and values of every request's context once, FLOPs those of the weights'
matmuls per token plus attention's query-key pairs, both rates measured in this process;
``roofline_ratio`` is ``roofline_s`` over the wall time.

Workloads: ``batch1`` (one 512-token prompt, 256 new tokens) and ``mixed64`` (64 prompts
of 128-2048 tokens, 128-512 new tokens each, seeded). Generation never stops early (no
end-of-sequence token), so every engine produces the same number of tokens. ``hf`` and
``hf_static_compiled`` take one ``max_new_tokens`` per batch: they pad prompts (left) and
generate the largest count for every prompt, and are credited only with the tokens that
were asked for. Reported per engine and workload (median over ``--repeats`` timed runs,
after ``--warmup`` untimed runs that include compilation and CUDA-graph capture):
wall time, tokens per second (prompt + generated), output tokens per second, and time per
output token (wall time / generated tokens).

``--smoke`` runs a tiny model and tiny workloads on the CPU (fp32): it checks that every
engine runs, not how fast it is.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable

import torch

import fullcg

logger = logging.getLogger("benchmarks.generate")

PAGE_SIZE = 16
ENGINES = ("hf", "hf_static_compiled", "hf_continuous", "fullcg", "fullcg_sync")


def llama_config(smoke: bool):
    """Llama-3-8B's shape (or a tiny one for --smoke) as a transformers LlamaConfig."""
    from transformers import LlamaConfig

    if smoke:
        return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                       max_position_embeddings=8192, rms_norm_eps=1e-5)


def workloads(smoke: bool, vocab: int, seed: int) -> dict[str, tuple[list[list[int]], list[int]]]:
    """name -> (prompts, new tokens per prompt)."""
    g = torch.Generator().manual_seed(seed)

    def prompts(lengths: list[int]) -> list[list[int]]:
        return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]

    if smoke:
        lens = torch.randint(4, 25, (6,), generator=g).tolist()
        return {"batch1": (prompts([16]), [8]),
                "mixed64": (prompts(lens), torch.randint(3, 9, (6,), generator=g).tolist())}
    lens = torch.randint(128, 2049, (64,), generator=g).tolist()
    return {"batch1": (prompts([512]), [256]),
            "mixed64": (prompts(lens), torch.randint(128, 513, (64,), generator=g).tolist())}


def build_model(smoke: bool, device: torch.device, dtype: torch.dtype, seed: int):
    from transformers import LlamaForCausalLM

    config = llama_config(smoke)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype on the device: no fp32 copy of 8B weights
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    # Random weights never end a sequence: no end-of-sequence token, a pad token for batches.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- engines: each returns the generated ids per prompt (the requested count of each) ---


def run_hf(model, prompts: list[list[int]], new: list[int], *, static: bool) -> list[list[int]]:
    from transformers import GenerationConfig

    device = model.device
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as HF batches decoder-only prompts
        ids[i, width - len(p):] = torch.tensor(p, device=device)
        mask[i, width - len(p):] = 1
    kw = dict(max_new_tokens=max(new), min_new_tokens=max(new), do_sample=False, pad_token_id=0, eos_token_id=None)
    if static:
        from transformers import CompileConfig

        kw.update(cache_implementation="static",
                  compile_config=CompileConfig(mode="reduce-overhead", fullgraph=True))
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=GenerationConfig(**kw))
    return [out[i, width: width + n].tolist() for i, n in enumerate(new)]


def run_hf_continuous(model, prompts: list[list[int]], new: list[int]) -> list[list[int]]:
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=max(new))
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, new)]
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("HF continuous batching stopped before finishing every request")
    return [results[i].generated_tokens for i in ids]


def run_fullcg(model, prompts: list[list[int]], new: list[int], *, config: fullcg.FullCGConfig,
               max_num_tokens: int, max_num_seqs: int, overlap: bool, stats: list) -> list[list[int]]:
    out, run_stats = fullcg.generate(model, prompts, new, stop_token_ids=(), config=config,
                                     max_num_tokens=max_num_tokens, max_num_seqs=max_num_seqs, progress=False,
                                     overlap=overlap, return_stats=True)
    stats[:] = [run_stats]
    return out


def machine_rates(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(copy bandwidth in bytes/s, read plus written; matmul rate in FLOP/s) of this device."""
    n = (1 << 30) if device.type == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    m = 8192 if device.type == "cuda" else 256
    a = torch.randn(m, m, dtype=dtype, device=device)
    b = torch.randn(m, m, dtype=dtype, device=device)

    def best(fn: Callable[[], object], reps: int = 10) -> float:
        fn()
        _sync(device)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return 2 * n / best(lambda: dst.copy_(src)), 2 * m**3 / best(lambda: a @ b)


def roofline_seconds(model, stats: fullcg.GenerateStats, bandwidth: float, flop_rate: float) -> float:
    """Sum over the run's steps of max(bytes / bandwidth, FLOPs / rate) (see the module doc)."""
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    matmul_params = params - cfg.vocab_size * cfg.hidden_size  # the embedding is a lookup
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = next(model.parameters()).element_size()
    kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * elem
    attn_flops_per_pair = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim
    total = 0.0
    for tokens, keys, pairs in stats.step_shapes:
        moved = weight_bytes + keys * kv_bytes_per_token
        flops = 2 * matmul_params * tokens + attn_flops_per_pair * pairs
        total += max(moved / bandwidth, flops / flop_rate)
    return total


def step_replay_ms(model, config: fullcg.FullCGConfig, context: int, device: torch.device, steps: int = 50) -> float:
    """Milliseconds of one batch-1 decode step at ``context`` through the compiled model
    ``fullcg.generate`` used (replayed back to back, nothing else between them)."""
    module, run = model.__dict__["_fullcg_compiled"][config]
    table = torch.arange(-(-(context + 1) // PAGE_SIZE), dtype=torch.int32)[None]
    md = fullcg.AttentionMetadata.build([1], [context], table, PAGE_SIZE, device=device)
    ids = torch.zeros(1, dtype=torch.long, device=device)
    pos = torch.full((1,), context, dtype=torch.long, device=device)
    with torch.inference_mode(), fullcg.forward_context(md, module, config=config):
        for _ in range(3):
            run(ids, pos)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            run(ids, pos)
        _sync(device)
    return (time.perf_counter() - t0) * 1e3 / steps


def fullcg_config(device: torch.device, args: argparse.Namespace) -> fullcg.FullCGConfig:
    given = {k: v for k, v in {"graph_mode": args.graph_mode, "attention_impl": args.attention_impl,
                               "compiler": args.compiler}.items() if v}
    if args.smoke:
        given.setdefault("compiler", "eager")  # --smoke checks plumbing; Inductor would only add minutes
    config = fullcg.FullCGConfig.from_env(**given)
    if device.type == "cuda" and config.attention_impl == "auto" and importlib.util.find_spec("flashinfer") is None:
        config = config.replace(attention_impl="triton")  # 'auto' would pick the reference, which full graphs cannot capture
    return config


def measure(fn: Callable[[], list[list[int]]], device: torch.device, warmup: int, repeats: int):
    """(median seconds over timed runs, the warm-up seconds, the last output)."""
    start = time.perf_counter()
    out = None
    for _ in range(warmup):
        out = fn()
    _sync(device)
    warm = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), warm, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cuda for the real benchmark; cpu only makes sense with --smoke")
    parser.add_argument("--smoke", action="store_true", help="tiny model and workloads, fp32 (checks that it runs)")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {', '.join(ENGINES)}")
    parser.add_argument("--workloads", default="batch1,mixed64", help="comma-separated subset of batch1, mixed64")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs first (compilation, capture)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported")
    parser.add_argument("--graph-mode", default=None, help="fullcg graph mode (default: full_and_piecewise)")
    parser.add_argument("--attention-impl", default=None, help="fullcg attention implementation (default: auto)")
    parser.add_argument("--compiler", default=None, choices=["inductor", "eager", "none"], help="fullcg compiler: inductor (default), eager or none")
    parser.add_argument("--no-fused-ops", action="store_true",
                        help="prepare without fused_ops (transformers' own norm, activation and rotary kernels "
                             "on eager steps; matters with --compiler none)")
    parser.add_argument("--max-num-tokens", type=int, default=2048, help="fullcg per-step token budget")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="fullcg requests in flight at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda asked for, but torch sees no CUDA device", file=sys.stderr)
        return 2
    if device.type == "cpu" and not args.smoke:
        print("error: the full-size benchmark needs --device cuda (use --smoke on a CPU)", file=sys.stderr)
        return 2
    engines = [e for e in args.engines.split(",") if e]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        print(f"error: unknown engines {sorted(unknown)}; choose from {', '.join(ENGINES)}", file=sys.stderr)
        return 2
    dtype = torch.float32 if args.smoke else torch.bfloat16
    model = build_model(args.smoke, device, dtype, args.seed)
    loads = {k: v for k, v in workloads(args.smoke, model.config.vocab_size, args.seed).items()
             if k in args.workloads.split(",")}
    if "hf_continuous" in engines and not hasattr(model, "continuous_batching_context_manager"):
        logger.warning("this transformers has no continuous batching; skipping hf_continuous")
        engines.remove("hf_continuous")
    config = fullcg_config(device, args)
    # fullcg runs last: prepare() switches the model's attention to fullcg and allocates its cache.
    engines.sort(key=lambda e: e.startswith("fullcg"))
    bandwidth, flop_rate = machine_rates(device, dtype)

    results = []
    outputs: dict[tuple[str, str], list[list[int]]] = {}
    record = {
        "command": " ".join(sys.argv), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "dtype": str(dtype), "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
        "matmul_TFLOPs": round(flop_rate / 1e12, 1), "results": results,
    }

    def write() -> None:
        # After every row, so a run stopped part-way still leaves what it measured.
        if args.out:
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
    prepared = False
    for engine in engines:
        if engine.startswith("fullcg") and not prepared:
            from fullcg.integrations import transformers as fhf

            prepared = True
            need = sum(-(-(len(p) + n) // PAGE_SIZE) for prompts, news in loads.values() for p, n in zip(prompts, news))
            fhf.prepare(model, num_pages=need, page_size=PAGE_SIZE, fused_ops=not args.no_fused_ops)
        for name, (prompts, new) in loads.items():
            if engine == "hf":
                fn = lambda: run_hf(model, prompts, new, static=False)  # noqa: E731
            elif engine == "hf_static_compiled":
                fn = lambda: run_hf(model, prompts, new, static=True)  # noqa: E731
            elif engine == "hf_continuous":
                fn = lambda: run_hf_continuous(model, prompts, new)  # noqa: E731
            else:
                stats: list = []
                fn = lambda: run_fullcg(model, prompts, new, config=config,  # noqa: E731
                                        max_num_tokens=args.max_num_tokens, max_num_seqs=args.max_num_seqs,
                                        overlap=engine == "fullcg", stats=stats)
            logger.info("%s on %s: %d prompts", engine, name, len(prompts))
            fullcg.reset_graph_mode_counts()
            with torch.inference_mode() if engine == "fullcg" else contextlib.nullcontext():
                seconds, warm, out = measure(fn, device, args.warmup, args.repeats)
            if [len(o) for o in out] != new:
                raise RuntimeError(f"{engine} on {name} generated {[len(o) for o in out]} tokens, asked for {new}")
            outputs[(engine, name)] = out
            prompt_tokens, new_tokens = sum(len(p) for p in prompts), sum(new)
            row = {
                "engine": engine, "workload": name, "requests": len(prompts), "prompt_tokens": prompt_tokens,
                "new_tokens": new_tokens, "seconds": seconds, "warmup_seconds": warm,
                "tokens_per_s": (prompt_tokens + new_tokens) / seconds, "output_tokens_per_s": new_tokens / seconds,
                "ms_per_output_token": 1e3 * seconds / new_tokens,
            }
            if engine.startswith("fullcg"):
                run_stats = stats[0]
                roofline = roofline_seconds(model, run_stats, bandwidth, flop_rate)
                context = round(sum(len(p) + n / 2 for p, n in zip(prompts, new)) / len(prompts))
                row.update(
                    steps=run_stats.steps, host_ms_per_step=round(run_stats.host_ms_per_step, 4),
                    gpu_idle_fraction=run_stats.gpu_idle_fraction, overlap=run_stats.overlap,
                    roofline_s=roofline, roofline_ratio=roofline / seconds,
                    step_replay_ms=step_replay_ms(model, config, context, device),
                )
                row["graph_mode_counts"] = dict(fullcg.graph_mode_counts())
                row["fullcg_config"] = {"graph_mode": config.graph_mode, "attention_impl": config.attention_impl,
                                        "compiler": config.compiler, "fused_ops": not args.no_fused_ops,
                                        "max_num_tokens": args.max_num_tokens,
                                        "max_num_seqs": args.max_num_seqs}
            results.append(row)
            write()
            print(f"{engine:>20s} {name:>8s}: {seconds:8.3f} s  {row['tokens_per_s']:10.1f} tok/s  "
                  f"{row['output_tokens_per_s']:9.1f} out tok/s  {row['ms_per_output_token']:8.3f} ms/out tok  "
                  f"(warm-up {warm:.1f} s)", flush=True)

    # How often greedy outputs agree with HF's (bf16 rounding differs between kernels, so
    # sequences may diverge after a near-tie; in fp32 --smoke they must agree exactly). The
    # base is HF's default engine, or its compiled static-cache recipe when only that ran.
    agreement, bases = {}, {}
    for (engine, name), out in outputs.items():
        base_engine = "hf" if ("hf", name) in outputs else "hf_static_compiled"
        base = outputs.get((base_engine, name))
        if engine != base_engine and base is not None:
            same = sum(a == b for o, r in zip(out, base) for a, b in zip(o, r))
            agreement[f"{engine}/{name}"] = same / sum(len(r) for r in base)
            bases[f"{engine}/{name}"] = base_engine
    print("greedy tokens equal to HF's:", {f"{k} (vs {bases[k]})": round(v, 4) for k, v in agreement.items()})
    record["greedy_agreement_with_hf"] = agreement
    record["greedy_agreement_base"] = bases
    write()
    if args.smoke and any(abs(v - 1.0) > 0 for k, v in agreement.items() if k.startswith("fullcg/")):
        print("error: in fp32 fullcg must agree with HF token for token", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
