"""GPU time of one MLA decode launch (DeepSeek-V3 layer shape) against its bandwidth floor.

    python benchmarks/mla_kernel.py [--heads 16 128] [--batches 1 8 64] [--contexts 4096 8192 16384 32768]
    python benchmarks/mla_kernel.py --heads 128 --batches 64 --contexts 8192 \\
        --block-h 16 32 64 --block-n 16 32 64 --num-warps 4 8 --num-stages 1 2 3   # a tuning sweep

One layer's absorbed MLA decode over the latent cache (latent 512 + rope 64 values per
token, one KV head, bf16, page 64) as the ``triton`` implementation plans it
(:func:`fullcg.ops.kernels.mla.plan_mla`), the new token saved inside the kernel. Every
launch reads a different copy of the cache (copies enough to exceed L2 several times),
so the time is DRAM-bound as in a model, not served from L2. Each figure is the median
over 5 repeats of (CUDA-event time of a burst of back-to-back launches) / launches.

The floor is the latent bytes one launch must read (``batch * (context + 1) * 576 * 2``)
over the device's copy bandwidth (a large device-to-device copy: bytes read plus
written over its time). Prints one JSON row per shape and launch option, with the
compiled kernel's registers, spills and shared memory.

``--compile-only`` needs no GPU: it compiles each launch option for sm_90 (Triton's own
ptxas) and prints its shared memory, registers and stack (spills), whether the key
tiles' loads are pipelined (``cp.async``) and each warpgroup MMA's tile and warp layout
(``dots``), without running anything.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import tempfile

import torch

import fullcg
from fullcg.mla import allocate_latent_cache
from fullcg.ops import device_facts
from fullcg.ops.kernels import mla as mla_kernels

RANK, ROPE, PAGE = 512, 64, 64
#: Bytes of cache copies a burst rotates through: several times an H200's 60 MiB L2.
ROTATION_BYTES = 512 << 20


def time_us(fn, calls: int, repeats: int = 5) -> float:
    """Median microseconds per call over ``repeats`` bursts of ``calls`` calls (``fn(i)``, CUDA events)."""
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def copy_bandwidth(dev: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes per second a large device-to-device copy moves (read plus written)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    us = time_us(lambda i: dst.copy_(src), calls=10)
    return 2 * nbytes / (us * 1e-6)


def _resources(launch: mla_kernels.MLALaunch) -> dict[str, object]:
    """Registers, spills and shared memory of the compiled kernel a plan launches."""
    planned = launch.launch
    found = mla_kernels._MLA._by_static_key.get((planned.static_key, planned.device_index))
    kernels = list(found[1].values()) if found is not None else []
    if not kernels:
        return {}
    k = kernels[0]
    return {"regs": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None),
            "shared": getattr(getattr(k, "metadata", None), "shared", None)}


def bench_shape(heads: int, batch: int, context: int, options: list[dict[str, int | None]], bandwidth: float,
                dev: torch.device) -> None:
    dtype = torch.bfloat16
    pages = math.ceil((context + 1) / PAGE)
    one = allocate_latent_cache(batch * pages + 1, PAGE, RANK, ROPE, dtype=dtype, device=dev)
    copies = max(1, min(128, ROTATION_BYTES // one.k.numel() // one.k.element_size()))
    caches = [one.k] + [torch.randn_like(one.k) for _ in range(copies - 1)]
    one.k.normal_()
    # Requests' pages scattered over the cache, as an engine's page allocator leaves them.
    table = torch.randperm(batch * pages, dtype=torch.int32).view(batch, pages)
    md = fullcg.AttentionMetadata.build([1] * batch, [context] * batch, table, PAGE, device=dev)
    q = torch.randn(batch, heads, RANK + ROPE, device=dev, dtype=dtype)
    k_new = torch.randn(batch, 1, RANK + ROPE, device=dev, dtype=dtype)
    v_new = k_new[..., :RANK]
    out = torch.empty(batch, heads, RANK, device=dev, dtype=dtype)
    lse = torch.empty(batch, heads, device=dev, dtype=torch.float32)
    read = batch * (context + 1) * (RANK + ROPE) * 2
    floor_us = read / bandwidth * 1e6
    for opts in options:
        row: dict[str, object] = {"heads": heads, "batch": batch, "context": context, **opts}
        try:
            launch = mla_kernels.plan_mla(
                q, one.k, out, lse, query_start_loc=md.query_start_loc, page_table=md.page_table,
                seq_lens=md.seq_lens, scale=(128 + 64) ** -0.5, num_tokens=md.num_tokens_tensor,
                slot_mapping=md.slot_mapping, new_kv=(k_new, v_new), workspace={}, **opts)
            us = time_us(lambda i: launch(q, caches[i % copies], out, lse, k_new, v_new),
                         calls=max(20, 4 * copies))
        except Exception as exc:  # a launch shape that does not compile (shared memory, registers)
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            print(json.dumps(row), flush=True)
            continue
        row.update(tuning=list(launch.tuning), num_splits=launch.num_splits, us=round(us, 2),
                   floor_us=round(floor_us, 2), of_floor=round(floor_us / us, 3),
                   tb_per_s=round(read / us / 1e6, 3), **_resources(launch))
        print(json.dumps(row), flush=True)


def compile_only(heads: int, opts: dict[str, int | None]) -> dict[str, object]:
    """Resources of the kernel compiled for sm_90 as :func:`plan_mla` would launch it (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # The default as an sm_90 device would plan it, whether or not this machine has one.
    shared_memory = device_facts.shared_memory_per_block
    device_facts.shared_memory_per_block = lambda device: SM90_SHARED_MEMORY
    try:
        tuning = mla_kernels.default_tuning(heads, torch.bfloat16, torch.device("cuda"))
    finally:
        device_facts.shared_memory_per_block = shared_memory
    tuning = mla_kernels.MLATuning(*(opts.get(name) or default for name, default in zip(
        ("block_h", "block_n", "num_warps", "num_stages"), tuning)))
    fn = mla_kernels._mla_kernel
    params = list(inspect.signature(fn.fn).parameters)
    pointers = {"Q": "bf16", "KV": "bf16", "Out": "bf16", "Lse": "fp32", "KNew": "bf16", "VNew": "bf16",
                "PartOut": "fp32", "PartLse": "fp32", "Sem": "i32", "Slots": "i64", "PageTable": "i32", "QLoc": "i32",
                "SeqLens": "i32", "NumTokens": "i32"}
    constexprs = dict(NUM_HEADS=heads, NUM_HEAD_BLOCKS=triton.cdiv(heads, tuning.block_h), RANK=RANK, ROPE=ROPE,
                      BLOCK_H=tuning.block_h, BLOCK_N=tuning.block_n, PAGE_SIZE=PAGE, BLOCK_R=mla_kernels.REQUEST_BLOCK,
                      BLOCK_S=mla_kernels.MAX_SPLITS, MERGE_BLOCK=mla_kernels.MERGE_D, UNROLL=mla_kernels.MERGE_UNROLL,
                      DOT_F32=False, SAVE=True)
    signature = {p: "*" + pointers[p] if p in pointers else "constexpr" if p in constexprs
                 else "fp32" if p in ("qk_scale2", "min_run_scale") else "i32" for p in params}
    # What Triton specialises at launch: 16-byte aligned tensors, strides that are multiples of 16.
    aligned = {*pointers} - {"Sem", "Slots", "PageTable", "QLoc", "SeqLens", "NumTokens"}
    aligned |= {p for p in params if p.startswith("stride_") and p != "stride_pt"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if p in aligned}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=tuning.num_warps, num_stages=tuning.num_stages))
    row: dict[str, object] = {"heads": heads, "tuning": list(tuning), "shared": kernel.metadata.shared,
                              "cp_async": kernel.asm["ptx"].count("cp.async.cg") + kernel.asm["ptx"].count("cp.async.ca"),
                              "wgmma": "wgmma.mma_async" in kernel.asm["ptx"]}
    row["dots"] = _dot_layouts(kernel.asm["ttgir"])
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    for name, key in (("REG", "regs"), ("STACK", "stack"), ("LOCAL", "local")):
        found = re.search(rf"\b{name}:(\d+)", usage)
        row[key] = int(found.group(1)) if found else None
    return row


#: Shared memory one program may opt into on sm_90 (H100, H200): 227 KiB.
SM90_SHARED_MEMORY = 232448


def _dot_layouts(ttgir: str) -> list[dict[str, object]]:
    """Each distinct warpgroup MMA of the compiled kernel: its result tile, how the warps
    share it (``warpsPerCTA``: rows, columns) and the instruction shape, with a count.
    A tile of 64 rows with warps ``[8, 1]`` is computed by both warpgroups in full."""
    layouts = {name: (warps, instr) for name, warps, instr in re.findall(
        r"^(#mma\d*) = #ttg\.nvidia_mma<\{[^}]*warpsPerCTA = \[([\d, ]+)\][^}]*instrShape = \[([\d, ]+)\]",
        ttgir, re.M)}
    found: dict[tuple[str, str], int] = {}
    for shape, layout in re.findall(r"ttng\.warp_group_dot .*-> tensor<([\dx]+)xf32, (#mma\d*)>", ttgir):
        found[(shape, layout)] = found.get((shape, layout), 0) + 1
    return [{"tile": shape, "warps": [int(x) for x in layouts[layout][0].split(",")],
             "instr": [int(x) for x in layouts[layout][1].split(",")], "count": n}
            for (shape, layout), n in found.items() if layout in layouts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--block-h", type=int, nargs="+", default=[None])
    ap.add_argument("--block-n", type=int, nargs="+", default=[None])
    ap.add_argument("--num-warps", type=int, nargs="+", default=[None])
    ap.add_argument("--num-stages", type=int, nargs="+", default=[None])
    ap.add_argument("--num-splits", type=int, nargs="+", default=[None])
    ap.add_argument("--programs-per-sm", type=int, nargs="+", default=[mla_kernels.PROGRAMS_PER_SM])
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 and print resources; no GPU needed")
    args = ap.parse_args()
    if args.compile_only:
        for heads, combo in itertools.product(args.heads, itertools.product(
                args.block_h, args.block_n, args.num_warps, args.num_stages)):
            opts = dict(zip(("block_h", "block_n", "num_warps", "num_stages"), combo))
            try:
                print(json.dumps(compile_only(heads, opts)), flush=True)
            except Exception as exc:  # a launch shape that does not compile
                print(json.dumps({"heads": heads, **opts, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}),
                      flush=True)
        return
    dev = torch.device("cuda")
    bandwidth = copy_bandwidth(dev)
    print(json.dumps({"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                      "copy_tb_per_s": round(bandwidth / 1e12, 3), "rank": RANK, "rope": ROPE, "page": PAGE}),
          flush=True)
    options = [dict(zip(("block_h", "block_n", "num_warps", "num_stages", "num_splits", "programs_per_sm"), combo))
               for combo in itertools.product(args.block_h, args.block_n, args.num_warps, args.num_stages,
                                              args.num_splits, args.programs_per_sm)]
    for heads, batch, context in itertools.product(args.heads, args.batches, args.contexts):
        bench_shape(heads, batch, context, options, bandwidth, dev)


if __name__ == "__main__":
    main()
