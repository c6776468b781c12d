"""Launching a Triton kernel with little host work.

``kernel[grid](...)`` binds and specialises every argument, builds a cache key and checks
globals on each call: tens of microseconds for a kernel of thirty arguments, paid per
layer per step when attention runs eagerly between captured pieces. :class:`Launcher`
keeps the compiled kernel per specialisation under a key it builds cheaply (exact int
values, tensor dtypes and 16-byte alignment: never coarser than Triton's own key, so a
hit is always the kernel Triton would pick) and calls its launcher directly.

That call passes tensors as their device addresses (ints). Given a tensor, Triton's
launcher calls its ``data_ptr()`` and then ``cuPointerGetAttribute`` to check the address
is device memory: one driver call per tensor argument per launch, the larger part of a
launch's host time for kernels of a dozen tensors. The first launch of a specialisation
goes through Triton with the tensors themselves (all of its checks), and fullcg's ops check
that every tensor is on q's device before anything launches.

:meth:`Launcher.plan` goes further for the per-layer path: a :class:`PlannedLaunch` fixes
grid, options and every argument but a few leading tensors once per step and shape, and
once its specialisation is compiled it calls the compiled launcher's C entry point with
nothing left to derive: the leading tensors' addresses, the stream, one call.

Under ``TRITON_INTERPRET=1`` (CPU tests) it launches the ordinary way.
"""

from __future__ import annotations

import functools
import inspect
import operator
import os
from collections.abc import Sequence
from typing import Any

import torch
import triton

from fullcg.compat import current_device_index, current_raw_stream

__all__ = ["Launcher", "PlannedLaunch", "raw_stream"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _key(arg: Any) -> Any:
    kind = type(arg)
    if kind is int:
        return arg  # exact: finer than Triton's (== 1, divisible by 16, 32/64 bit)
    if kind is torch.Tensor or isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() & 15
    return kind  # float, bool, None: Triton does not specialise on their values


def _unspecialised_key(arg: Any) -> Any:
    # Parameters marked do_not_specialize: Triton only tells 32-bit from 64-bit ints.
    return -(2**31) <= arg < 2**31 if type(arg) is int else _key(arg)


def raw_stream(device: torch.device) -> int:
    """The current CUDA stream as the raw handle kernel launchers take (0 on the CPU).

    Like Triton's own launch, this is the current device's stream: Triton compiles and
    launches for the current device, so tensors must live there.
    """
    if device.type != "cuda":
        return 0
    return current_raw_stream(torch.cuda.current_device())


def _hooked() -> bool:
    """Whether a launch hook (a profiler) is installed: then launch the ordinary way, which feeds it."""
    hook = triton.knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


class Launcher:
    """Calls one ``@triton.jit`` kernel: ``launcher(grid, args, constexprs, num_warps, num_stages)``.

    ``args`` are the kernel's runtime arguments in signature order and ``constexprs`` its
    ``tl.constexpr`` parameters (which follow them) in order.
    """

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        params = inspect.signature(fn.fn).parameters.values()
        is_constexpr = [("constexpr" in str(p.annotation)) for p in params]
        self.constexpr_names = tuple(p.name for p, c in zip(params, is_constexpr) if c)
        num_runtime = len(is_constexpr) - len(self.constexpr_names)
        if any(is_constexpr[:num_runtime]):
            raise TypeError(f"{fn.fn.__name__}: constexpr parameters must come after the runtime ones")
        # A JITFunction keeps do_not_specialize; the interpreter's stand-in keeps the decorator's kwargs.
        unspecialised = set(getattr(fn, "do_not_specialize", None) or getattr(fn, "kwargs", {}).get("do_not_specialize")
                            or ())
        self._key_fns = tuple(
            _unspecialised_key if p.name in unspecialised or i in unspecialised else _key
            for i, p in enumerate(list(params)[:num_runtime])
        )
        self._compiled: dict[tuple[Any, ...], Any] = {}
        self._by_static_key: dict[Any, tuple[tuple[int, ...], dict[tuple[int, ...], Any]]] = {}
        #: ``(static key, device, alignment of the trailing tensors) -> (C launch, its fixed
        #: arguments after the stream)`` for specialisations whose leading tensors are aligned.
        self._direct: dict[Any, tuple[Any, tuple[Any, ...]]] = {}

    def __call__(
        self, grid: tuple[int, int, int], args: Sequence[Any], constexprs: tuple[Any, ...], num_warps: int, num_stages: int
    ) -> None:
        """Launch with the key built from every argument (for launches not planned per step)."""
        if _INTERPRET or _hooked():
            self._launch_jit(grid, args, constexprs, num_warps, num_stages)
            return
        device = torch.cuda.current_device()
        key = (device, constexprs, num_warps, num_stages, *[f(a) for f, a in zip(self._key_fns, args)])
        kernel = self._compiled.get(key)
        if kernel is None:
            self._compiled[key] = self._launch_jit(grid, args, constexprs, num_warps, num_stages)
            return
        stream = current_raw_stream(device)
        kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, None, None, None,
                   *[a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args], *constexprs)

    def static_key(
        self, args: Sequence[Any], constexprs: tuple[Any, ...], num_warps: int, num_stages: int
    ) -> tuple[Any, ...]:
        """A key that fixes the specialisation of ``args`` but for tensor alignment: tensor
        dtypes, ints exactly (only their width for ``do_not_specialize`` parameters, as
        Triton itself: a new batch size is then the same kernel), constexprs and launch
        options. Built once per step and shape."""
        return (constexprs, num_warps, num_stages, *[
            a.dtype if isinstance(a, torch.Tensor) else f(a) if type(a) is int else type(a)
            for f, a in zip(self._key_fns, args)
        ])

    def plan(
        self,
        grid: tuple[int, int, int],
        leading: Sequence[torch.Tensor],
        tail: Sequence[Any],
        constexprs: tuple[Any, ...],
        num_warps: int,
        num_stages: int,
        device: torch.device | None = None,
    ) -> PlannedLaunch:
        """A launch whose arguments after the leading tensors (given per call) are ``tail``,
        fixed: see :class:`PlannedLaunch`. ``leading`` are example leading tensors, read only
        for their dtypes (the specialisation); ``device`` (default: theirs) is where it runs."""
        key = self.static_key((*leading, *tail), constexprs, num_warps, num_stages)
        return PlannedLaunch(self, grid, len(leading), tuple(tail), constexprs, num_warps, num_stages, key,
                             device if device is not None else leading[0].device)

    def launch_keyed(
        self,
        grid: tuple[int, int, int],
        args: Sequence[Any],
        constexprs: tuple[Any, ...],
        num_warps: int,
        num_stages: int,
        static_key: Any,
        stream: int,
    ) -> None:
        """Launch on ``stream`` (a raw CUDA stream) when the caller vouches that ``static_key``
        fixes the specialisation of every argument but the tensors' alignment (checked here):
        the per-layer path, which builds its key once per step and shape."""
        if _INTERPRET or _hooked():
            self._launch_jit(grid, args, constexprs, num_warps, num_stages)
            return
        # Triton compiles and loads kernels for the current device: a kernel is only valid there.
        device = torch.cuda.current_device()
        entry = self._by_static_key.get((static_key, device))
        if entry is None:
            positions = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
            entry = self._by_static_key[(static_key, device)] = (positions, {})
        positions, kernels = entry
        raw = list(args)
        for i in positions:
            raw[i] = args[i].data_ptr()
        alignment = tuple([raw[i] & 15 for i in positions])
        kernel = kernels.get(alignment)
        if kernel is None:
            kernels[alignment] = self._launch_jit(grid, args, constexprs, num_warps, num_stages)
            return
        kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, None, None, None,
                   *raw, *constexprs)

    def _direct_entry(self, static_key: Any, device: int, num_leading: int,
                      tail_alignment: tuple[int, ...]) -> tuple[Any, tuple[Any, ...]] | None:
        """The C launch of the compiled specialisation with ``num_leading`` aligned leading
        tensors, and the arguments it takes between the stream and the kernel's own (None
        until compiled)."""
        key = (static_key, device, tail_alignment)
        entry = self._direct.get(key)
        if entry is None:
            found = self._by_static_key.get((static_key, device))
            kernel = found[1].get((0,) * num_leading + tail_alignment) if found is not None else None
            if kernel is None:
                return None
            run = kernel.run
            # Kernels that need scratch memory get it from Triton's launcher wrapper per call.
            if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1) or \
                    not hasattr(run, "launch"):
                return None
            entry = self._direct[key] = (run.launch, (kernel.function, run.launch_cooperative_grid, run.launch_pdl,
                                                      None, None, kernel.packed_metadata, None, None, None))
        return entry

    def _launch_jit(
        self, grid: tuple[int, int, int], args: Sequence[Any], constexprs: tuple[Any, ...], num_warps: int, num_stages: int
    ) -> Any:
        kernel = self.fn[grid](
            *args, **dict(zip(self.constexpr_names, constexprs)), num_warps=num_warps, num_stages=num_stages
        )
        if hasattr(kernel, "result"):  # compiled asynchronously
            kernel = kernel.result()
        return kernel


_data_ptr = torch.Tensor.data_ptr


_current_device = current_device_index  # called on every planned launch


class PlannedLaunch:
    """One kernel launch of a step, for every layer of one shape: grid, options and the
    trailing arguments fixed when planned; ``launch(*leading)`` gives the leading tensors
    (those that differ per layer: q, k, v, out, ...), all on the planned device.

    Until its specialisation is compiled, and whenever a leading tensor is not 16-byte
    aligned, a launch profiler hook was installed when it was planned or the kernels are
    interpreted, it launches through :meth:`Launcher.launch_keyed`. Otherwise it passes
    the tensors' addresses straight to the compiled launcher's C entry point. (A hook
    installed mid-step sees the launches from the next step's plans on.)
    """

    __slots__ = ("launcher", "grid", "num_leading", "tail", "raw_tail", "constexprs", "num_warps", "num_stages",
                 "static_key", "device", "device_index", "_tail_alignment", "_direct")

    def __init__(self, launcher: Launcher, grid: tuple[int, int, int], num_leading: int, tail: tuple[Any, ...],
                 constexprs: tuple[Any, ...], num_warps: int, num_stages: int, static_key: Any,
                 device: torch.device) -> None:
        self.launcher, self.grid, self.num_leading, self.tail = launcher, grid, num_leading, tail
        self.constexprs, self.num_warps, self.num_stages = constexprs, num_warps, num_stages
        self.static_key, self.device = static_key, device
        self.device_index = device.index if device.index is not None else 0
        raw = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in tail)
        self.raw_tail = raw + constexprs
        # launch_keyed keys alignment over every tensor argument in order: leading, then these.
        self._tail_alignment = tuple(r & 15 for r, a in zip(raw, tail) if isinstance(a, torch.Tensor))
        self._direct: tuple[Any, tuple[Any, ...]] | None = None
        if device.type == "cuda" and not _INTERPRET and not _hooked():
            self._find_direct()

    def _find_direct(self) -> None:
        self._direct = self.launcher._direct_entry(self.static_key, self.device_index, self.num_leading,
                                                   self._tail_alignment)

    def __call__(self, *leading: torch.Tensor) -> None:
        direct = self._direct
        if direct is not None:
            ptrs = list(map(_data_ptr, leading))
            if not functools.reduce(operator.or_, ptrs) & 15 and _current_device() == self.device_index:
                grid = self.grid
                launch, fixed = direct
                launch(grid[0], grid[1], grid[2], current_raw_stream(self.device_index), *fixed,
                       *ptrs, *self.raw_tail)
                return
        self.launcher.launch_keyed(self.grid, leading + self.tail, self.constexprs, self.num_warps, self.num_stages,
                                   self.static_key, raw_stream(self.device))
        if direct is None and self.device.type == "cuda" and not _INTERPRET and not _hooked():
            self._find_direct()
