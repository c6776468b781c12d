"""GPU time of one dense decode-attention launch (8B layer shape) by split count and options.

    python benchmarks/decode_kernel.py [--batches 1 64] [--context 1024] [--only default "no fused save"]

One layer's decode attention over the paged cache (32 query / 8 KV heads of 128, bf16,
page 16), as the Triton implementation plans it (``plan_decode``), with the split count,
the merge's unrolling, the fused k/v save and the launch options varied one at a
time. Each figure is the median over 5 repeats of (CUDA-event time of 200 back-to-back
launches) / 200, so host launch cost is hidden behind the GPU's work. Prints one line per
variant, with the compiled kernel's registers, spills and shared memory.
"""

from __future__ import annotations

import argparse
import math

import torch

import fullcg
from fullcg.ops.kernels import decode as decode_module
from fullcg.ops.kernels.decode import plan_decode

from decode import PAGE, time_ms


def time_us(fn, calls: int = 200, repeats: int = 5) -> float:
    """Median microseconds per call over ``repeats`` bursts of ``calls`` back-to-back calls."""

    def burst() -> None:
        for _ in range(calls):
            fn()

    return time_ms(burst, repeats) * 1e3 / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                    help="time only the variants whose name contains one of these (e.g. default 'no fused save')")
    args = ap.parse_args()
    dev = torch.device("cuda")
    hq, hkv, d = 32, 8, 128
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; {hq}q/{hkv}kv heads, head dim {d}, bf16, "
          f"page {PAGE}, context {args.context}")
    for batch in args.batches:
        pages = math.ceil((args.context + 1) / PAGE)
        num_pages = batch * pages + 8
        k = torch.randn(num_pages, PAGE, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
        md = fullcg.AttentionMetadata.build([1] * batch, [args.context] * batch, table, PAGE, device=dev)
        q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
        k_new, v_new = torch.randn(batch, hkv, d, device=dev, dtype=torch.bfloat16), torch.randn(
            batch, hkv, d, device=dev, dtype=torch.bfloat16)
        out = torch.empty(batch, hq, d, device=dev, dtype=torch.bfloat16)
        lse = torch.empty(batch, hq, device=dev, dtype=torch.float32)
        kv_bytes = batch * (args.context + 1) * hkv * d * 2 * 2

        def plan(num_splits=None, save=True, wide=False, **launch):
            table_ = md.page_table
            if wide:  # a full graph's static page table: as wide as a 64k-token request
                table_ = torch.zeros(batch, 4168, dtype=torch.int32, device=dev)
                table_[:, :pages] = md.page_table
            return plan_decode(
                q, k, v, out, lse, query_start_loc=md.query_start_loc, is_decode=md.is_decode, scale=d**-0.5,
                factor=None, tile_kv=64, split_tiles=None, max_kv_len=table_.shape[1] * PAGE, page_table=table_,
                seq_lens=md.seq_lens, num_tokens=md.num_tokens_tensor, num_splits=num_splits,
                slot_mapping=md.slot_mapping if save else None, new_kv=(k_new, v_new) if save else None,
                workspace={}, **launch,
            )

        variants = [("default (as the implementation plans it)", {})]
        variants += [(f"num_splits={s}", {"num_splits": s}) for s in (1, 2, 4, 8, 16, 33, 64)]
        variants += [("no fused save", {"save": False}), ("no fused save, num_splits=1", {"save": False, "num_splits": 1}),
                     ("wide page table (full graph)", {"wide": True}),
                     ("num_warps=8", {"num_warps": 8}), ("num_stages=1", {"num_stages": 1}),
                     ("num_stages=3", {"num_stages": 3})]
        variants += [(f"merge unrolled by {n}", {"MERGE_UNROLL": n}) for n in (1, 2, 8)]
        if args.only:
            variants = [(name, options) for name, options in variants if any(text in name for text in args.only)]
        for name, options in variants:
            # Module constants the plan reads (upper case), set for this plan only.
            constants = {key: options.pop(key) for key in [k for k in options if k.isupper()]}
            saved = {key: getattr(decode_module, key) for key in constants}
            for key, value in constants.items():
                setattr(decode_module, key, value)
            try:
                launch = plan(**options)
            finally:
                for key, value in saved.items():
                    setattr(decode_module, key, value)
            us = time_us(lambda: launch(q, k, v, out, lse, None, k_new, v_new))
            print(f"batch {batch:3d}  {us:8.2f} us  {kv_bytes / us / 1e6:6.2f} TB/s  {name}  [{_resources(launch)}]",
                  flush=True)


def _resources(launch) -> str:
    """Registers, spills and shared memory of the compiled kernel a plan launches."""
    planned = launch.launch
    found = decode_module._DECODE._by_static_key.get((planned.static_key, planned.device_index))
    kernels = list(found[1].values()) if found is not None else []
    return "; ".join(f"regs {getattr(k, 'n_regs', '?')}, spills {getattr(k, 'n_spills', '?')}, "
                     f"shared {getattr(getattr(k, 'metadata', None), 'shared', '?')}" for k in kernels[:1])


if __name__ == "__main__":
    main()
