"""Host time of one attention call through fullcg, with an implementation that does nothing.

    python benchmarks/op_overhead.py

Piecewise steps run attention eagerly between captured pieces, so this host time is paid
per layer per step. Runs on the CPU (the host path is the same on a GPU machine).
"""

from __future__ import annotations

import statistics
import time

import torch

import fullcg
from fullcg.ops.impl import register_implementation


class _Noop:
    name = "noop"

    def save_kv(self, call, ctx, cache) -> None:
        pass

    def forward(self, call, ctx, cache) -> None:
        return None


def per_call_us(fn, n: int = 2000, repeats: int = 5) -> float:
    for _ in range(200):
        fn()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(runs)


def main() -> None:
    register_implementation(_Noop())
    layer = fullcg.Attention(32, 128, 8, layer_id=0)
    layer.allocate_kv_cache(64, 16)
    md = fullcg.AttentionMetadata.build([1] * 8, [100] * 8, torch.arange(64, dtype=torch.int32).view(8, 8), 16)
    q, k, v = torch.randn(8, 32, 128), torch.randn(8, 8, 128), torch.randn(8, 8, 128)
    out = torch.empty_like(q)
    config = fullcg.FullCGConfig(attention_impl="noop")
    op = fullcg.ops.ATTENTION_OPS[(True, False)]
    with fullcg.forward_context(md, layer, config=config), torch.inference_mode():
        layer_us = per_call_us(lambda: layer(q, k, v))
        op_us = per_call_us(lambda: op(q, k, v, out, 0))
    def enter_and_leave() -> None:
        with fullcg.forward_context(md, layer, config=config):
            pass

    ctx_us = per_call_us(enter_and_leave)
    print(f"Attention.forward: {layer_us:.1f} us/call; attention op alone: {op_us:.1f} us/call; "
          f"forward_context enter + exit: {ctx_us:.1f} us")


if __name__ == "__main__":
    main()
