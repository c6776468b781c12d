"""Skip-softmax decode: where its time goes, against the dense kernel, per launch option.

    python benchmarks/decode_skip_variants.py [--heads 64/4 32/8] [--contexts 16384] \
        [--batch 64] [--out results/decode_skip_variants.json]

On the structured k/v of ``skip_softmax.py`` (batch ``--batch``, head dim 128, bf16, pages
of 64), one process times in CUDA graphs (``decode_sweep.time_us``):

- the dense plan (``dense``), and the dense kernel over the skip rule's tiles and runs
  (``dense_tiled``: same tile and split as the skip variants, no skip test compiled in);
- the skip-softmax kernel at a factor that skips nothing (``factor >= context``: the cost
  of the skip test and its branch alone) and at each ``--factors`` (the skipped fraction
  is counted), for every tile, split, warps and stages given.

The gaps between ``dense``, ``dense_tiled`` and the skip kernel at zero skipped split the
skip kernel's overhead into the part due to its tiling (a rule parameter) and the part due
to the skip test and the branch around V's load.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time

import torch

from decode_sweep import time_us
from fullcg.ops.kernels.decode import plan_decode
from skip_softmax import HEAD_DIM, PAGE, structured_qk


def _label(row: dict) -> str:
    """``d=us`` for the tiled dense kernel, ``s<factor>(<skipped>)=us`` for a skip one."""
    if row["factor"] is None:
        return f"d={row['us']:.1f}"
    return f"s{int(row['factor'])}({row['skipped_fraction'] or 0:.2f})={row['us']:.1f}"


def shape_variants(hq: int, hkv: int, batch: int, n: int, args) -> dict:
    dev = torch.device("cuda")
    pages = n // PAGE
    k_cache = torch.empty(batch * pages, PAGE, hkv, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn(batch * pages, PAGE, hkv, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    q = torch.empty(batch, hq, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    pos = torch.arange(n, device=dev)
    for b in range(batch):
        qb, kb = structured_qk(pos[-1:], pos, hq, hkv, sink_logit=14.0, window_logit=10.0, heavy_logit=8.0, seed=b)
        q[b] = qb[0]
        k_cache[b * pages : (b + 1) * pages] = kb.view(pages, PAGE, hkv, HEAD_DIM)
    meta = dict(
        query_start_loc=torch.arange(batch + 1, device=dev, dtype=torch.int32),
        is_decode=torch.ones(batch, dtype=torch.bool, device=dev),
        page_table=torch.arange(batch * pages, device=dev, dtype=torch.int32).view(batch, pages),
        seq_lens=torch.full((batch,), n, device=dev, dtype=torch.int32),
    )
    out = torch.empty(batch, hq, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    lse = torch.empty(batch, hq, device=dev, dtype=torch.float32)
    ctr = torch.zeros(2, 2, dtype=torch.int64, device=dev)
    kv_bytes = 2 * batch * n * hkv * HEAD_DIM * 2

    def timed(factor, **options) -> dict:
        launch = plan_decode(q, k_cache, v_cache, out, lse, scale=1 / math.sqrt(HEAD_DIM), factor=factor,
                             max_kv_len=n, workspace={}, **meta, **options)
        ctr.zero_()
        launch(q, k_cache, v_cache, out, lse, ctr)
        torch.cuda.synchronize()
        visited, skipped = ctr[1].tolist()
        us = time_us(lambda: launch(q, k_cache, v_cache, out, lse, ctr), repeats=args.repeats)
        return dict(factor=factor, **options, us=us, tbps=kv_bytes / us / 1e6,
                    skipped_fraction=skipped / visited if factor is not None and visited else None)

    res = dict(heads=[hq, hkv], batch=batch, n=n, kv_bytes=kv_bytes,
               dense=timed(None, tile_kv=64, split_tiles=None), variants=[])
    print(f"{hq}/{hkv} b{batch} n{n}: dense {res['dense']['us']:.1f} us", flush=True)
    for tile, split, warps, stages in itertools.product(args.tiles, args.splits, args.warps, args.stages):
        opts = dict(tile_kv=tile, split_tiles=split, num_warps=warps, num_stages=stages)
        try:
            rows = [dict(kind="dense_tiled", **timed(None, **opts))]
            rows += [dict(kind="skip", **timed(f, **opts)) for f in [float(n)] + args.factors if f <= n]
        except Exception as e:  # out of resources for this config: record, go on
            res["variants"].append(dict(**opts, error=str(e)[:160]))
            continue
        res["variants"] += rows
        line = " ".join(_label(r) for r in rows)
        print(f"  tile {tile} split {split} warps {warps} stages {stages}: {line}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", nargs="+", default=["64/4", "32/8"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[16384])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--factors", type=float, nargs="+", default=[10000.0, 14000.0])
    ap.add_argument("--tiles", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--splits", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="decode_skip_variants.json")
    args = ap.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    doc = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, args=vars(args), results=[])
    t0 = time.time()
    for heads, n in itertools.product(args.heads, args.contexts):
        hq, hkv = (int(x) for x in heads.split("/"))
        doc["results"].append(shape_variants(hq, hkv, args.batch, n, args))
        print(f"[{time.time() - t0:.0f}s]", flush=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
