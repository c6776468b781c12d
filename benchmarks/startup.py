"""Startup time: from process start to the first captured decode step, in fresh processes.

    python benchmarks/startup.py --out benchmarks/results/startup_cpu.json        # tiny Llama, CPU
    python benchmarks/startup.py --device cuda --repeats 1 --cpu-tiny \\
        --out benchmarks/results/startup_h200.json                               # Llama-3-8B shape, one GPU

Every figure is one fresh Python process (this script in its worker mode) that imports
torch and fullcg, builds the model (random weights; bf16 on CUDA, fp32 on the CPU),
allocates the KV cache, compiles it with ``fullcg.compile`` (``full_and_piecewise``, 8
capture sizes by default), runs a first prefill step, captures every capture size and
runs the first decode step (``fullcg.capture``), and synchronises. The figure is the time
from just before the process was spawned to that decode step done, *less* the time to
build the model and put its weights on the device, which is reported apart as
``weights_s``. Per repeat:

- ``cold``: empty fullcg, Inductor and Triton caches (``FULLCG_CACHE_DIR``,
  ``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR`` pointed at fresh directories);
- ``warm``: a second process on the same directories;
- ``no_compiler``: ``compiler="none"`` (capture without a compiler), fresh directories;
  null with the reason when this fullcg refuses that compiler;
- ``no_compiler_warm``: a second ``compiler="none"`` process on the same directories
  (Triton's compiled attention kernels cached: an engine's restart);
- ``compiler_eager``: ``compiler="eager"`` (Dynamo traces, the pieces run as traced, no
  Inductor), fresh directories.

The output holds the medians over ``--repeats`` (``cold_s``, ``warm_s``, ``no_compiler_s``,
``no_compiler_warm_s``, ``compiler_eager_s``, ``weights_s``), the floor every engine pays
(``floor_s``: import torch, the CUDA context and the weights) and each kind's time over it
(``cold_over_floor_s`` and so on: each run's whole time less its own process's floor), the breakdown of each kind's
median run (``breakdown``) and every run (``runs``). ``--cpu-tiny`` also measures the tiny model on the CPU of the same
machine and stores it, with the same keys, under ``cpu_tiny``.

Weights get torch's default initialisation, made on the device (``LlamaModel(seed=None)``
under ``torch.device``): a seeded draw on the host takes minutes for the 8B shape. On a GPU
``--repeats 1`` keeps the run to minutes; ``--kinds`` runs only some kinds (a kind not run
is null in the output).
"""

from __future__ import annotations

import time

# The worker's own clock starts here, before anything heavy is imported.
_T0 = time.perf_counter()
_T0_WALL = time.time()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PAGE = 16
DEFAULT_CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]
# The phases of a worker, back to back from just before its spawn to the first decode step done.
STARTUP_PHASES = (
    "python_start_s", "script_s", "import_torch_s", "import_fullcg_s", "cuda_init_s", "weights_s", "kv_cache_s",
    "torch_compile_s", "first_prefill_s", "capture_and_first_decode_s",
)
KINDS = ("cold", "warm", "no_compiler", "no_compiler_warm", "compiler_eager")
# Which compiler each kind uses; "warm" reuses the directories "cold" just filled.
COMPILER_OF = {"cold": "inductor", "warm": "inductor", "no_compiler": "none", "no_compiler_warm": "none",
               "compiler_eager": "eager"}
#: A kind that runs on the directories the kind before it filled (its warm start).
WARM_OF = {"warm": "cold", "no_compiler_warm": "no_compiler"}

# Dynamo's timers (``torch._dynamo.utils.compile_times``) kept in a run's breakdown, by the
# name the breakdown gives them. A timer this torch does not have is left out.
DYNAMO_TIMERS = {
    "dynamo_bytecode_tracing_s": "bytecode_tracing",
    "dynamo_build_guards_s": "build_guards",
    "aot_dispatcher_s": "create_aot_dispatcher_function",
    "inductor_compile_s": "fx_codegen_and_compile",
    "inductor_codegen_s": "GraphLowering.codegen",
    "inductor_compile_file_s": "compile_file",
    "inductor_cache_load_s": "AOTAutogradCache.inductor_load",
    "load_compiled_module_s": "PyCodeCache.load_by_key_path",
}


# ---------------------------------------------------------------------------- the worker


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    """One measurement in this (fresh) process; returns the run's figures."""
    run: dict[str, Any] = {"python_start_s": _T0_WALL - args.spawn_time}
    mark = _T0

    def phase(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        run[name] = now - mark
        mark = now

    phase("script_s")  # this script's own imports and arguments
    import torch

    phase("import_torch_s")
    import fullcg
    from fullcg.errors import InvalidConfigError
    from fullcg.models.generate import Scheduler
    from fullcg.models.llama import LlamaConfig, LlamaModel

    phase("import_fullcg_s")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a visible GPU (torch.cuda.is_available() is False); use --device cpu")
    base = fullcg.FullCGConfig(
        graph_mode=args.graph_mode, capture_sizes=tuple(args.capture_sizes),
        attention_impl=args.attention_impl or ("triton" if device.type == "cuda" else "reference"),
        trace_layers_once=not args.no_trace_layers_once,
    )
    try:
        config = base.replace(compiler=args.compiler)
    except InvalidConfigError as exc:  # a compiler this fullcg does not have yet: recorded, not fatal
        return {"unsupported": f"FullCGConfig refuses compiler={args.compiler!r} ({exc})"}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if device.type == "cuda":
        # CUDA's context is part of every start; made here so it is not counted with the weights.
        torch.empty(1, device=device)
        sync()
    phase("cuda_init_s")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = LlamaConfig.preset(args.model, **({"num_layers": args.layers} if args.layers else {}))
    # Weights are built on the device with torch's default initialisation (seed=None): a
    # seeded draw runs on the host, minutes for the 8B shape, and startup is not about them.
    with torch.device(device):
        model = LlamaModel(cfg, seed=None, dtype=dtype, device=device).eval()
    sync()
    phase("weights_s")
    new_tokens = 3  # the prefill's token, the first decode (captured), one more decode (replayed)
    num_pages = args.batch * math.ceil((args.prompt_len + new_tokens) / PAGE) + 1
    model.allocate_kv_cache(num_pages, PAGE)
    sync()
    phase("kv_cache_s")
    compiled = fullcg.compile(model, config)
    phase("torch_compile_s")  # with a compiler, torch.compile imports Dynamo here
    timers: Counter[str] = Counter()
    compiles = _TritonCompiles(("first_prefill", "capture_and_first_decode", "second_decode"))
    _instrument(timers)
    compiles.install(timers)
    profiler = _Profiler(args.profile_out)
    prompts = [[(7 * r + i) % cfg.vocab_size for i in range(args.prompt_len)] for r in range(args.batch)]
    sched = Scheduler(prompts, new_tokens, num_pages=num_pages, page_size=PAGE, device=device)
    with torch.inference_mode():
        step = sched.next_step()
        assert step is not None and not step.metadata.is_decode_only
        with profiler("first_prefill"), fullcg.forward_context(step.metadata, model, config=config):
            logits = compiled(step.input_ids, step.positions)
            sync()
        phase("first_prefill_s")
        compiles.phase = "capture_and_first_decode"
        # Bookkeeping, left out of every phase: Dynamo's frames so far (none without Dynamo).
        prefill_frames = _dynamo_frames()
        sched.commit(step, logits)
        mark = time.perf_counter()
        step = sched.next_step()
        assert step is not None and step.metadata.is_decode_only
        # Captures every capture size, then runs this decode step as a replay.
        with profiler("capture_and_first_decode"):
            logits = fullcg.capture(compiled, step.metadata, model, step.input_ids, step.positions)
            sync()
        phase("capture_and_first_decode_s")
        decode_captured = any(k.endswith(":captured") for k in fullcg.graph_mode_counts())
        sched.commit(step, logits)
        step = sched.next_step()
        assert step is not None
        compiles.phase = "second_decode"
        mark = time.perf_counter()
        with fullcg.forward_context(step.metadata, model, config=config):
            compiled(step.input_ids, step.positions)
        sync()
        phase("second_decode_s")

    from torch._dynamo.utils import compile_times, counters

    frames = _dynamo_frames()
    frame_s = sum(m.entire_frame_compile_time_s or 0.0 for m in frames)
    backend_s = sum(m.backend_compile_time_s or 0.0 for m in frames)
    names, values = compile_times(repr="csv", aggregate=True)
    dynamo_times = dict(zip(names, (float(v) for v in values)))
    # The phases are back to back from the worker's first line (bookkeeping between them is
    # left out), so their sum is the time to the first decode step.
    total = sum(v for k, v in run.items() if k in STARTUP_PHASES)
    run.update({
        "total_s": total,
        "startup_s": total - run["weights_s"],
        # What every engine pays before any of fullcg's work: import torch, the CUDA context and
        # the weights; a kind's time over it is fullcg's and the compiler's share.
        "floor_s": (floor := run["import_torch_s"] + run["cuda_init_s"] + run["weights_s"]),
        "over_floor_s": total - floor,
        # Dynamo's own share of compiling a frame: tracing, guards, bookkeeping (not the backend).
        "dynamo_s": frame_s - backend_s,
        "backend_s": backend_s,
        # The prefill's own run, and what the first call does outside Dynamo's frame compile.
        "prefill_outside_compile_s": run["first_prefill_s"] - sum(
            m.entire_frame_compile_time_s or 0.0 for m in prefill_frames),
        **{k: dynamo_times[v] for k, v in DYNAMO_TIMERS.items() if v in dynamo_times},
        **timers,
        "frames_compiled": len(frames),
        "decode_captured": decode_captured,
        "unique_graphs": counters["stats"]["unique_graphs"],
        "fullcg_cache": dict(fullcg.compile_cache.cache_stats()),
        "inductor_cache": {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")},
        "steps": dict(fullcg.graph_mode_counts()),
        "trace_layers_once": config.trace_layers_once,
        # (layer calls, distinct regions Dynamo traced) per compiled graph: (32, 1) = one layer traced.
        "layer_regions": [list(r.regions) for r in getattr(compiled, "runners", [])],
        # Triton kernels compiled (or loaded from Triton's cache) per phase, by kernel name.
        "triton_kernels": {phase: dict(names) for phase, names in compiles.by_phase.items()},
        "triton_specialisations": sorted(compiles.specialisations),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
        "torch": torch.__version__,
        "triton": _triton_version(),
    })
    return run


def _dynamo_frames() -> list[Any]:
    """Dynamo's compilation metrics, one per frame compiled so far; none when Dynamo never ran
    (it is not imported for the sake of asking)."""
    if "torch._dynamo" not in sys.modules:
        return []
    from torch._dynamo.utils import get_compilation_metrics

    return list(get_compilation_metrics())


def _instrument(timers: Counter[str]) -> None:
    """Time fullcg's compile cache (key, load, store), its build of the attention and fused
    kernels before the first capture (``kernel_build_s``: its Triton kernels compile on
    threads of their own, so their compiles count here, not in ``triton_jit_s``), Triton's C
    modules (``triton_host_modules_s``: each kernel's launcher and Triton's CUDA utilities,
    built with the host's compiler or loaded; summed over threads) and, where
    torch has already imported it, Inductor's probe of the CPU's vector instructions
    (seconds by name, summed)."""
    from fullcg import kernel_build
    from fullcg.compile_cache import CompileCache

    targets: list[tuple[Any, str, str]] = [(CompileCache, n, f"fullcg_cache_{n}_s") for n in ("key", "load", "store")]
    targets.append((kernel_build, "build_kernels", "kernel_build_s"))
    try:  # Triton's C modules (each kernel's launcher, its CUDA utilities): built with gcc once, then loaded
        from triton.backends.nvidia import driver as triton_driver

        targets.append((triton_driver, "compile_module_from_src", "triton_host_modules_s"))
    except ImportError:
        pass
    # Importing it here would move Inductor's import into this benchmark's bookkeeping.
    vec_isa = sys.modules.get("torch._inductor.cpu_vec_isa")
    if vec_isa is not None and hasattr(getattr(vec_isa, "VecISA", None), "check_build"):
        targets.append((vec_isa.VecISA, "check_build", "inductor_cpu_isa_probe_s"))
    for owner, name, label in targets:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*a: Any, _original: Any = original, _label: str = label, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return _original(*a, **k)
            finally:
                timers[_label] += time.perf_counter() - start

        setattr(owner, name, timed)


class _TritonCompiles:
    """Triton's JIT compiles (a miss in the JIT's in-memory cache: a compile, or a load from
    Triton's disk cache), counted by kernel name into the current ``phase``, with each
    specialisation's constants and attributes (what tells it from the kernel's others)."""

    def __init__(self, phases: tuple[str, ...]) -> None:
        self.by_phase: dict[str, Counter[str]] = {name: Counter() for name in phases}
        self.phase = phases[0]
        self.specialisations: set[str] = set()

    def install(self, timers: Counter[str]) -> None:
        """Wrap Triton's compile entry; its time goes to ``timers["triton_jit_s"]``."""
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:
            return
        original = getattr(JITFunction, "_do_compile", None)
        if original is None:  # another Triton: not counted
            return

        @functools.wraps(original)
        def timed(fn: Any, key: Any, signature: Any, device: Any, constexprs: Any, options: Any, attrs: Any,
                  *a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(fn, key, signature, device, constexprs, options, attrs, *a, **k)
            finally:
                timers["triton_jit_s"] += time.perf_counter() - start
                name = getattr(fn, "__name__", "?")
                self.by_phase[self.phase][name] += 1
                self.specialisations.add(f"{name} {sorted(constexprs.items())} {sorted(attrs.items())}")

        JITFunction._do_compile = timed


class _Profiler:
    """``with profiler("phase"):`` profiles that phase with cProfile into ``<prefix>_<phase>.txt``
    (the 60 costliest functions by cumulative and by own time) and ``<prefix>_<phase>.prof``
    (the whole profile, for ``pstats``: callers, callees); does nothing without a prefix."""

    def __init__(self, prefix: str | None) -> None:
        self.prefix = prefix

    @contextlib.contextmanager
    def __call__(self, name: str) -> Any:
        if not self.prefix:
            yield
            return
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        try:
            yield
        finally:
            prof.disable()
            out = io.StringIO()
            stats = pstats.Stats(prof, stream=out)
            stats.sort_stats("cumulative").print_stats(60)
            stats.sort_stats("tottime").print_stats(60)
            Path(f"{self.prefix}_{name}.txt").write_text(out.getvalue())
            prof.dump_stats(f"{self.prefix}_{name}.prof")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"cpu ({os.cpu_count()} cores)"


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


# ---------------------------------------------------------------------------- the driver


def _spawn(args: argparse.Namespace, device: str, model: str, compiler: str, dirs: Path,
           profile_out: str | None = None) -> dict[str, Any]:
    """Run one worker process on cache directories under ``dirs``; its figures."""
    env = dict(os.environ)
    env.update({
        "FULLCG_CACHE_DIR": str(dirs / "fullcg"),
        "TORCHINDUCTOR_CACHE_DIR": str(dirs / "inductor"),
        "TRITON_CACHE_DIR": str(dirs / "triton"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    })
    # A warm start is what the compile cache is for: measuring one with it off would be meaningless.
    env.pop("FULLCG_DISABLE_COMPILE_CACHE", None)
    worker_args = [
        "--worker", "--device", device, "--model", model, "--graph-mode", args.graph_mode, "--compiler", compiler,
        "--batch", str(args.batch), "--prompt-len", str(args.prompt_len),
        *(["--layers", str(args.layers)] if args.layers else []),
        *(["--no-trace-layers-once"] if args.no_trace_layers_once else []),
        "--capture-sizes", *map(str, args.capture_sizes),
        *(["--profile-out", profile_out] if profile_out else []),
        # An implementation named for the main device (triton) would not run the CPU measurement.
        *(["--attention-impl", args.attention_impl] if args.attention_impl and device == args.device else []),
    ]
    spawn_time = time.time()
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *worker_args, "--spawn-time", repr(spawn_time)],
        env=env, capture_output=True, text=True, timeout=args.timeout, cwd=REPO,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-30:])
        raise SystemExit(
            f"the {compiler} worker failed (exit {proc.returncode}); its output ends with:\n{tail}\n"
            f"rerun it alone to see everything: {shlex.join([sys.executable, __file__, *worker_args, '--spawn-time', '0'])}"
        )
    return json.loads(lines[-1])


def _measure(args: argparse.Namespace, device: str, model: str) -> dict[str, Any]:
    """Every kind, ``--repeats`` times; the medians, the breakdowns and the raw runs."""
    runs: list[dict[str, Any]] = []
    unsupported: dict[str, str] = {}
    load_before = os.getloadavg()[0]
    for repeat in range(args.repeats):
        kept: dict[str, Path] = {}  # each kind's directories, for the kind that warm-starts from it
        try:
            for kind in args.kinds:
                if kind in unsupported:
                    continue
                dirs = kept.get(WARM_OF.get(kind, ""))
                if dirs is None:
                    dirs = kept[kind] = Path(tempfile.mkdtemp(prefix="fullcg-startup-"))
                profile_out = None
                if args.profile_dir:
                    Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
                    profile_out = str(Path(args.profile_dir) / f"{device}_{model}_{kind}_{repeat}")
                run = _spawn(args, device, model, COMPILER_OF[kind], dirs, profile_out)
                if "unsupported" in run:
                    unsupported[kind] = run["unsupported"]
                    print(f"{device}/{model} {kind}: not measured: {run['unsupported']}", flush=True)
                    continue
                runs.append({"kind": kind, "repeat": repeat, **run})
                print(f"{device}/{model} {kind} #{repeat}: {run['startup_s']:.2f} s to the first decode step "
                      f"(+ weights {run['weights_s']:.2f} s; prefill {run['first_prefill_s']:.2f} s, "
                      f"capture + decode {run['capture_and_first_decode_s']:.2f} s)", flush=True)
                if device == "cuda" and not run["decode_captured"]:
                    print(f"{device}/{model} {kind} #{repeat}: the first decode step was not replayed from a CUDA "
                          f"graph (steps: {run['steps']}); check --attention-impl and --graph-mode", flush=True)
                if kind == "warm" and not run["fullcg_cache"].get("hit"):
                    print(f"{device}/{model} warm #{repeat}: fullcg's compile cache missed, so this warm start was "
                          "served by Inductor's cache alone; the key covers fullcg's source files, so an edit "
                          "between the cold and the warm process causes this (rerun on an unchanged tree)", flush=True)
        finally:
            for dirs in kept.values():
                shutil.rmtree(dirs, ignore_errors=True)
    if not runs:
        raise SystemExit(f"nothing was measured: {unsupported}")

    def median(kind: str, key: str) -> float | None:  # None: the kind did not run
        values = [r[key] for r in runs if r["kind"] == kind]
        return statistics.median(values) if values else None

    # The breakdown is one whole run (the median one), so its parts add up to its total.
    breakdown = {}
    for kind in KINDS:
        of_kind = sorted((r for r in runs if r["kind"] == kind), key=lambda r: r["startup_s"])
        if of_kind:
            middle = of_kind[(len(of_kind) - 1) // 2]
            breakdown[kind] = {k: round(v, 4) for k, v in middle.items()
                               if k.endswith("_s") and isinstance(v, (int, float))}
    first = runs[0]
    result: dict[str, Any] = {
        "device": first["device_name"],
        "model": model,
        "layers": args.layers,
        "dtype": "bfloat16" if device == "cuda" else "float32",
        "graph_mode": args.graph_mode,
        "capture_sizes": args.capture_sizes,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "torch": first["torch"],
        "triton": first["triton"],
        "repeats": args.repeats,
        # On a shared machine other work stretches every figure: the load says how much there was.
        "load_average_1min": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
    }
    result["floor_s"] = round(statistics.median(r["floor_s"] for r in runs), 3)
    for kind in KINDS:
        value = median(kind, "startup_s")
        result[f"{kind}_s"] = None if value is None else round(value, 3)
        over = median(kind, "over_floor_s")  # each run against its own process's floor
        result[f"{kind}_over_floor_s"] = None if over is None else round(over, 3)
        if kind in unsupported:
            result[f"{kind}_reason"] = unsupported[kind]
        elif value is None:
            result[f"{kind}_reason"] = "not run (--kinds)"
    result["weights_s"] = round(statistics.median(r["weights_s"] for r in runs), 3)
    result["breakdown"] = breakdown
    result["runs"] = runs
    return result


def _print_summary(result: dict[str, Any]) -> None:
    print(f"\n{result['device']}, {result['model']} ({result['dtype']}), {result['graph_mode']}, "
          f"capture sizes {result['capture_sizes']}, torch {result['torch']}, median of {result['repeats']}:")
    for kind in KINDS:
        value = result[f"{kind}_s"]
        over = result[f"{kind}_over_floor_s"]
        print(f"  {kind:15s} " + (f"{value:7.2f} s; {over:.2f} s over the floor" if value is not None
                                   else f"    n/a  ({result[f'{kind}_reason']})"))
    print(f"  {'weights (apart)':15s} {result['weights_s']:7.2f} s")
    print(f"  {'floor':15s} {result['floor_s']:7.2f} s  (import torch, CUDA context, weights)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", default=None, choices=["tiny", "mid", "llama3_8b"],
                    help="default: llama3_8b on cuda, tiny on cpu")
    ap.add_argument("--layers", type=int, default=None,
                    help="layers of the model (default: the preset's); e.g. the tiny model at 32 layers on a CPU")
    ap.add_argument("--graph-mode", default="full_and_piecewise")
    ap.add_argument("--no-trace-layers-once", action="store_true",
                    help="trace every layer (FullCGConfig.trace_layers_once=False), for comparison")
    ap.add_argument("--capture-sizes", type=int, nargs="+", default=DEFAULT_CAPTURE_SIZES)
    ap.add_argument("--attention-impl", default=None, help="default: triton on cuda, reference on cpu")
    ap.add_argument("--batch", type=int, default=4, help="requests in the prefill and decode steps")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per kind (cold, warm, ...)")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                    help="which processes to run per repeat (warm needs cold, which fills its caches)")
    ap.add_argument("--cpu-tiny", action="store_true", help="also measure the tiny model on this machine's CPU")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one worker process may take")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--profile-dir", default=None,
                    help="profile each worker's first prefill and capture with cProfile into text files here "
                         "(the profiler slows Python-heavy phases: time without it)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--compiler", default="inductor", help=argparse.SUPPRESS)
    ap.add_argument("--spawn-time", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.model = args.model or ("llama3_8b" if args.device == "cuda" else "tiny")
    for warm, cold in WARM_OF.items():
        if warm in args.kinds and cold not in args.kinds:
            ap.error(f"--kinds {warm} needs {cold} too: the {warm} process starts on the caches the {cold} one filled")
    args.kinds = [k for k in KINDS if k in args.kinds]  # cold always runs before warm

    if args.worker:
        if args.spawn_time is None or args.spawn_time <= 0:
            args.spawn_time = _T0_WALL  # run by hand: the interpreter's own start is not counted
        print(json.dumps(_worker(args)), flush=True)
        return

    result = _measure(args, args.device, args.model)
    _print_summary(result)
    if args.cpu_tiny:
        result["cpu_tiny"] = _measure(args, "cpu", "tiny")
        _print_summary(result["cpu_tiny"])
    result["command"] = shlex.join(["python", "benchmarks/startup.py", *sys.argv[1:]])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
