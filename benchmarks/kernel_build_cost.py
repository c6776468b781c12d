"""One cold build of the kernels a Llama-3-8B-shaped model runs without a compiler.

    python benchmarks/kernel_build_cost.py [--threads N]

A fresh process on fresh fullcg and Triton cache directories (temporary), one CUDA GPU:
the model (two layers of the 8B shape, bf16, ``attention_impl="triton"``) and its KV cache,
then, each timed: Triton's driver and source key (made in the background from the first
attention layer on; the figure is the wait for them), ``fullcg.kernel_build.build_kernels``
of the attention kernels and the fused element-wise kernels the eager model launches
(compiled, then loaded as their first launch would: ``--threads`` at once, default
``kernel_build.MAX_BUILD_THREADS``), and a first prefill and decode step run eagerly (what
the build left for the first launches). Prints one JSON line of seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="build threads (1: one kernel at a time)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="fullcg-kernel-build-")
    os.environ["FULLCG_CACHE_DIR"] = os.path.join(root, "fullcg")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(root, "triton")
    seconds: dict[str, float] = {}

    def timed(name: str, start: float) -> None:
        seconds[name] = round(time.perf_counter() - start, 3)

    start = time.perf_counter()
    import torch

    import fullcg
    from fullcg import kernel_build, source_keys
    from fullcg.models.llama import LlamaConfig, LlamaModel

    torch.zeros(1, device="cuda")
    timed("imports_and_cuda_s", start)
    if args.threads is not None:
        kernel_build.MAX_BUILD_THREADS = args.threads
    start = time.perf_counter()
    model = LlamaModel(LlamaConfig.preset("llama3_8b", num_layers=2), seed=None, dtype=torch.bfloat16, device="cuda")
    model.allocate_kv_cache(64, 16)
    timed("model_s", start)
    config = fullcg.FullCGConfig(attention_impl="triton", compiler="none")
    start = time.perf_counter()
    source_keys.wait_for_triton()
    timed("wait_for_triton_s", start)
    device = torch.device("cuda", torch.cuda.current_device())
    kernels = (kernel_build.plan_for(kernel_build.layer_shapes(model, config), config, device, 16)
               + kernel_build.fused_kernels(model))
    start = time.perf_counter()
    kernel_build.build_kernels(kernels, device, config)
    timed("build_s", start)
    table = torch.arange(16, dtype=torch.int32, device="cuda").view(2, 8)
    for name, q_lens, prefixes in (("first_prefill_s", [64, 64], [0, 0]), ("first_decode_s", [1, 1], [64, 64])):
        md = fullcg.AttentionMetadata.build(q_lens, prefixes, table, 16, device="cuda")
        positions = torch.cat([torch.arange(p, p + q) for q, p in zip(q_lens, prefixes)]).cuda()
        start = time.perf_counter()
        with torch.inference_mode(), fullcg.forward_context(md, model, config=config):
            model(torch.zeros(sum(q_lens), dtype=torch.long, device="cuda"), positions)
        torch.cuda.synchronize()
        timed(name, start)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "kernels": len(kernels),
                      "threads": kernel_build.MAX_BUILD_THREADS, **seconds}))


if __name__ == "__main__":
    main()
