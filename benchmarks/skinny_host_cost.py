"""Host time of one ``fullcg::skinny_linear`` call outside a CUDA graph, against ``F.linear``.

    python benchmarks/skinny_host_cost.py

A small bf16 product (``[64, 256] x [256, 256]`` on the GPU, so the host bounds the loop),
in inference mode as steps run: 2,000 calls back to back, then a synchronise; the median of
5 such loops, microseconds a call. Rows: ``F.linear``; the op on its library-GEMM path
(64 rows); ``F.linear`` then fullcg's ``silu_mul`` against the op's gated form; the op at
one row (the GEMV's launch). What every linear of an uncaptured step pays for the op.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from fullcg.ops.linear import skinny_linear


def per_call_us(fn, calls: int = 2000, loops: int = 5) -> float:
    times = []
    for _ in range(loops):
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    with torch.inference_mode():
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)

        def linear_then_silu_mul():
            y = F.linear(x, w)
            return torch.ops.fullcg.silu_mul.default(y[:, :128], y[:, 128:])

        rows = {
            "F.linear": lambda: F.linear(x, w),
            "skinny_linear (library GEMM)": lambda: skinny_linear(x, w, False),
            "F.linear + silu_mul": linear_then_silu_mul,
            "skinny_linear gated (library GEMM)": lambda: skinny_linear(x, w, True),
            "skinny_linear, one row (GEMV)": lambda: skinny_linear(x[:1], w, False),
        }
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        for name, fn in rows.items():
            print(f"{name}: {per_call_us(fn):.1f} us a call")


if __name__ == "__main__":
    main()
