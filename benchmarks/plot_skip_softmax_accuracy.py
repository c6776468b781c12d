"""Plot skip-softmax accuracy curves from a ``benchmarks/skip_softmax_accuracy.py`` JSON file.

    python benchmarks/plot_skip_softmax_accuracy.py benchmarks/results/skip_softmax_accuracy_h200.json docs/skip_softmax_accuracy.png

Two panels against the skipped fraction of tiles: top-1 agreement with dense, and mean
KL(dense || skip); a line per context and phase, each point a factor (labelled), and the
calibrated configs as stars (held-out text).
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    data = json.load(open(src))
    rows = data["rows"]
    fig, (top, kl) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"prefill": "-", "decode": "--"}
    for phase in ("prefill", "decode"):
        for context in sorted({r["context"] for r in rows}):
            sel = sorted((r for r in rows if r["phase"] == phase and r["context"] == context and r["skipped_fraction"] > 0),
                         key=lambda r: r["skipped_fraction"])
            if not sel:
                continue
            x = [100 * r["skipped_fraction"] for r in sel]
            (line,) = top.plot(x, [100 * r["top1_agreement"] for r in sel], styles[phase], marker="o",
                               label=f"{phase} {context // 1024}k")
            kl.plot(x, [r["kl"] for r in sel], styles[phase], marker="o", color=line.get_color())
            for r, xi in zip(sel, x):
                top.annotate(f"{r['factor']:g}", (xi, 100 * r["top1_agreement"]), fontsize=6, alpha=0.7,
                             xytext=(2, 2), textcoords="offset points")
    for entry in data.get("calibration", []):
        held = entry["held_out"]
        marker = "*" if "per_layer" in entry["targets"] else "X"
        top.plot(100 * held["skipped_fraction"], 100 * held["top1_agreement"], marker, color="k", markersize=9)
        kl.plot(100 * held["skipped_fraction"], held["kl"], marker, color="k", markersize=9)
    top.axhline(98, color="grey", lw=0.8, ls=":")
    top.set_ylabel("top-1 agreement with dense (%)")
    kl.set_ylabel("mean KL(dense || skip) per token")
    kl.set_yscale("log")
    for ax in (top, kl):
        ax.set_xlabel("tiles skipped (%)")
        ax.grid(alpha=0.3)
    top.legend(fontsize=8)
    fig.suptitle(f"{data['model']}, {data['text'].split(' (')[0]}, {data['device']} ({data['attention_impl']}); "
                 "points: factors; X: calibrated global, *: calibrated per layer (held-out text)", fontsize=9)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
