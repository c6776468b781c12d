"""Plot offline generation from a ``benchmarks/generate.py --out`` JSON file: per workload,
time per output token and tokens per second of every engine, side by side.

    python benchmarks/plot_generate.py benchmarks/results/generate_h200.json docs/benchmarks_generate.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {
    "hf": "HF generate\n(sdpa, dynamic cache)",
    "hf_static_compiled": "HF static cache\n+ reduce-overhead",
    "hf_continuous": "HF continuous\nbatching",
    "fullcg": "fullcg.generate",
}


def main(src: str, dst: str) -> None:
    data = json.load(open(src))
    if "results" not in data:
        raise SystemExit(f"{src} is not the output of one generate.py run (no 'results'); plot a side-by-side run")
    rows = data["results"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(2, len(workloads), figsize=(5.5 * len(workloads), 7), squeeze=False)
    for col, workload in enumerate(workloads):
        sel = [r for r in rows if r["workload"] == workload]
        names = [LABELS.get(r["engine"], r["engine"]) for r in sel]
        colors = ["tab:orange" if r["engine"] == "fullcg" else "tab:gray" for r in sel]
        for row, (key, label) in enumerate([("ms_per_output_token", "ms per output token (lower is better)"),
                                            ("tokens_per_s", "tokens/s, prompt + generated (higher is better)")]):
            ax = axes[row][col]
            values = [r[key] for r in sel]
            bars = ax.bar(range(len(sel)), values, color=colors)
            ax.bar_label(bars, [f"{v:,.3g}" for v in values], fontsize=8)
            ax.set_xticks(range(len(sel)), names, fontsize=7)
            ax.set_ylabel(label, fontsize=9)
            ax.set_yscale("log")
            if row == 0:
                first = sel[0]
                ax.set_title(f"{workload}: {first['requests']} prompt{'s' * (first['requests'] != 1)}, {first['prompt_tokens']:,} prompt + "
                             f"{first['new_tokens']:,} new tokens", fontsize=10)
            ax.grid(alpha=0.3, axis="y")
    model = "tiny LlamaForCausalLM (--smoke)" if data["device"] == "cpu" else "Llama-3-8B-shaped LlamaForCausalLM"
    fig.suptitle(f"{model}, {data['dtype'].replace('torch.', '')}, {data['device']}, "
                 f"torch {data['torch']}, transformers {data['transformers']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python benchmarks/plot_generate.py GENERATE_JSON OUT_PNG")
    main(*sys.argv[1:3])
