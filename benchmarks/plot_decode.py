"""Plot decode step latency from a ``benchmarks/decode.py --out`` JSON file.

    python benchmarks/plot_decode.py benchmarks/results/decode_h200_earlier.json docs/benchmarks_decode.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    data = json.load(open(src))
    rows = data.get("decode_ms") or data["decode_ms_partial"]
    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4), sharey=True)
    for ax, ctx in zip(axes if len(contexts) > 1 else [axes], contexts):
        sel = sorted((r for r in rows if r["context"] == ctx), key=lambda r: r["batch"])
        batches = [r["batch"] for r in sel]
        for key, style in [("floor", "k--"), ("eager", "o-"), ("piecewise", "s-"), ("full", "^-"), ("peer", "D")]:
            pts = [(r["batch"], r[key]) for r in sel if key in r]
            if pts:
                ax.plot(*zip(*pts), style, label=key)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_title(f"decode step, context {ctx}")
        ax.set_xlabel("batch")
        ax.grid(alpha=0.3)
    (axes[0] if len(contexts) > 1 else axes).set_ylabel("ms (median)")
    (axes[0] if len(contexts) > 1 else axes).legend()
    fig.suptitle(f"Llama-3-8B shape, bf16, {data['gpu']}, torch {data['torch']}")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
