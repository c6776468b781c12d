"""Does torch's AOT path skip Dynamo's tracing on a warm start of a fullcg model?

    python benchmarks/aot_probe.py                      # the tiny Llama on the CPU
    python benchmarks/aot_probe.py --out benchmarks/results/aot_probe_cpu_torch2.13.json

A warm start of a compiled model still runs Dynamo's bytecode tracing (seconds for a
32-layer model). torch's AOT path would skip it: ``torch._dynamo.config.enable_aot_compile``,
``torch.compile(fn, fullgraph=True).aot_compile(((args), {}))``, ``save_compiled_function``,
then ``torch.compiler.load_compiled_function`` in the next process. This script asks
whether that works for a model of ``fullcg.Attention`` layers on the installed torch, under
each of the two modes a step may run in (``torch.no_grad()`` and ``torch.inference_mode()``).

Per mode, one fresh process traces the tiny Llama at 5 tokens and saves the function; a
second fresh process loads it and calls it at 7 tokens (the token dimension is dynamic),
next to the uncompiled model. A third way calls the loaded function of an inference-mode
step inside ``torch.inference_mode(False)`` and ``torch.no_grad()``. The backend hands Dynamo's graph back as it is (torch's
``GraphModuleSerializableCallable``): what is probed is Dynamo's half, tracing and guards,
not fullcg's passes. Guards are filtered as torch's AOT path filters them by default (no
globals, no guard types it cannot serialize) and, in addition, guards on functions'
default arguments: on torch 2.11 a guard on ``Attention.forward``'s keyword defaults is
saved but cannot be loaded back.

The output says, per mode: whether the save worked, whether the loaded function passed
its guards and matched the model (``max_abs_diff``), else the first line of the failure,
and the seconds to trace and save, and to load.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
#: How a step runs. ``inference_mode_inner_no_grad``: the step is in inference mode (inputs
#: made there, the model run there), but the loaded function is called inside
#: ``torch.inference_mode(False)`` and ``torch.no_grad()``.
MODES = ("no_grad", "inference_mode", "inference_mode_inner_no_grad")


def _mode(name: str) -> Any:
    import torch

    return torch.no_grad() if name == "no_grad" else torch.inference_mode()


def _call_mode(name: str) -> Any:
    """The mode the loaded function is called in, inside the step's own."""
    import contextlib

    import torch

    if name != "inference_mode_inner_no_grad":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())
    return stack


def _model_and_step(num_tokens: int, mode: str) -> tuple[Any, Any, Any, Any]:
    import torch

    import fullcg
    from fullcg.models.llama import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig.tiny()).eval()
    model.allocate_kv_cache(64, 4)
    table = torch.arange(16, dtype=torch.int32)[None]
    metadata = fullcg.AttentionMetadata.build([num_tokens], [0], table, 4)
    with _mode(mode):  # inputs made as a step's inputs are made
        ids, pos = torch.arange(num_tokens) % 200, torch.arange(num_tokens)
    return model, metadata, ids, pos


def _keep_guard(entry: Any, keep_defaults: bool) -> bool:
    from torch._dynamo.guards import CheckFunctionManager

    if entry.is_global or entry.guard_type in CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES:
        return False  # torch's own default for AOT compiles
    return keep_defaults or ("__defaults__" not in entry.name and "__kwdefaults__" not in entry.name)


def _save(mode: str, path: str, keep_defaults: bool) -> dict[str, Any]:
    import torch
    import torch._dynamo
    from torch._dynamo.aot_compile_types import GraphModuleSerializableCallable

    import fullcg
    from fullcg.models.llama import LlamaModel

    model, metadata, ids, pos = _model_and_step(5, mode)
    torch._dynamo.config.enable_aot_compile = True
    torch._dynamo.mark_dynamic(ids, 0)
    torch._dynamo.mark_dynamic(pos, 0)
    compiled = torch.compile(
        LlamaModel.forward, fullgraph=True, backend=lambda gm, _: GraphModuleSerializableCallable(gm),
        options={"guard_filter_fn": lambda entries: [_keep_guard(e, keep_defaults) for e in entries]},
    )
    start = time.perf_counter()
    with _mode(mode), fullcg.forward_context(metadata, model):
        function = compiled.aot_compile(((model, ids, pos), {}))
    function.save_compiled_function(path)
    return {"save_s": time.perf_counter() - start}


def _load(mode: str, path: str, keep_defaults: bool) -> dict[str, Any]:
    import torch

    import fullcg

    model, metadata, ids, pos = _model_and_step(7, mode)
    start = time.perf_counter()
    with open(path, "rb") as f:
        function = torch.compiler.load_compiled_function(f)
    result: dict[str, Any] = {"load_s": time.perf_counter() - start}
    with _mode(mode), fullcg.forward_context(metadata, model):
        want = model(ids, pos)
        try:
            with _call_mode(mode):
                got = function(model, ids, pos)
        except Exception as exc:  # the finding, not a crash of the probe
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            reason = next((line for line in lines if "mismatch" in line or "changed" in line), lines[0] if lines else "")
            result.update(loaded_runs=False, error=f"{type(exc).__name__}: {reason}"[:400])
            return result
    result.update(loaded_runs=True, max_abs_diff=float((got - want).abs().max()))
    return result


def _child(step: str, mode: str, path: str, keep_defaults: bool) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", step, "--mode", mode, "--path", path,
         *(["--keep-defaults-guards"] if keep_defaults else [])],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        lines_err = [line for line in (proc.stderr or "").splitlines() if line.strip()]
        return {f"{step}_ok": False, f"{step}_error": (lines_err[-1] if lines_err else f"exit {proc.returncode}")[:400]}
    return {f"{step}_ok": True, **json.loads(lines[-1])}


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--keep-defaults-guards", action="store_true",
                    help="keep the guards on functions' default arguments (torch 2.11 then fails to load them)")
    ap.add_argument("--out", default=None, help="write the findings as JSON here")
    ap.add_argument("--child", choices=["save", "load"], help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        sys.path.insert(0, str(REPO))
        step = _save if args.child == "save" else _load
        print(json.dumps(step(args.mode, args.path, args.keep_defaults_guards)), flush=True)
        return None

    import torch

    result: dict[str, Any] = {"torch": torch.__version__, "model": "tiny Llama (CPU, fp32)",
                              "defaults_guards_kept": args.keep_defaults_guards, "modes": {}}
    with tempfile.TemporaryDirectory(prefix="fullcg-aot-probe-") as tmp:
        for mode in args.modes:
            path = str(Path(tmp) / f"{mode}.bin")
            found = _child("save", mode, path, args.keep_defaults_guards)
            if found["save_ok"]:
                found.update(_child("load", mode, path, args.keep_defaults_guards))
            result["modes"][mode] = found
            print(f"torch {result['torch']}, {mode}: {found}", flush=True)
    result["command"] = shlex.join(["python", "benchmarks/aot_probe.py", *(argv if argv is not None else sys.argv[1:])])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
