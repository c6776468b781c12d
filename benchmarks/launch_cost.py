"""Host time of launching one Triton kernel of 30 arguments, each way fullcg could launch it.

    python benchmarks/launch_cost.py        # needs a CUDA GPU

The kernel does nothing (every program exits), so each figure is host time per launch:

- ``jit_call``: ``kernel[grid](...)``, Triton's binder and cache lookup on every call;
- ``run_tensors``: the compiled kernel's ``run`` given tensors (Triton's launcher calls
  ``data_ptr()`` and a driver query per tensor);
- ``run_ints``: the same given device addresses;
- ``c_launch_ints``: the compiled launcher's C entry point, given addresses (what
  ``fullcg.ops.kernels.launch.PlannedLaunch`` calls);

and, for scale, ten ``data_ptr()`` calls, one small in-place torch op and the current
stream and device queries. Medians over bursts of 200 launches, synchronised between bursts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from op_overhead import per_call_us


@triton.jit
def _thirty_arguments(A, B, C, D, E, F, G, H, I, J, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13,  # noqa: E741
                      a14, a15, a16, a17, a18, f0, X: tl.constexpr, Y: tl.constexpr):
    if tl.program_id(0) < 0:  # never: every program exits at once
        tl.store(A, a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11 + a12 + a13 + a14 + a15 + a16 + a17
                 + a18 + f0)


def main() -> None:
    tensors = [torch.empty(64, device="cuda") for _ in range(10)]
    ints = [16 * (i + 1) for i in range(19)]
    kernel = _thirty_arguments[(4, 1, 1)](*tensors, *ints, 0.5, X=1, Y=2)
    torch.cuda.synchronize()
    stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
    ptrs = [t.data_ptr() for t in tensors]
    run = kernel.run
    fixed = (kernel.function, run.launch_cooperative_grid, run.launch_pdl, None, None, kernel.packed_metadata,
             None, None, None)
    a, b = torch.empty(64, device="cuda"), torch.empty(64, device="cuda")
    figures = {
        "jit_call": lambda: _thirty_arguments[(4, 1, 1)](*tensors, *ints, 0.5, X=1, Y=2),
        "run_tensors": lambda: kernel.run(4, 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None,
                                          *tensors, *ints, 0.5, 1, 2),
        "run_ints": lambda: kernel.run(4, 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None,
                                       *ptrs, *ints, 0.5, 1, 2),
        "c_launch_ints": lambda: run.launch(4, 1, 1, stream, *fixed, *ptrs, *ints, 0.5, 1, 2),
        "data_ptr_x10": lambda: [t.data_ptr() for t in tensors],
        "torch_add_": lambda: a.add_(b),
        "raw_stream": lambda: torch._C._cuda_getCurrentRawStream(torch.cuda.current_device()),
        "current_device": torch.cuda.current_device,
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for name, fn in figures.items():
        print(f"{name:16s} {per_call_us(fn, 200, 30, torch.cuda.synchronize):7.2f} us")


if __name__ == "__main__":
    main()
