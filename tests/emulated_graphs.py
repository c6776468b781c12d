"""CUDA-graph semantics on the CPU, for testing capture logic without a GPU.

An :class:`EmulatedGraphs` is a :class:`fullcg.eager_capture.Graphs`: while a segment is
"captured" a dispatch mode records every op call (the op, its arguments, its outputs)
and lets it run as usual; a "replay" calls the recorded ops again on the very same
tensor objects and copies each fresh result into the tensor the capture produced (ops
that write in place just run again; views and other results at the address the capture
saw are left alone; allocations are not replayed). That is what a CUDA graph does: it replays fixed
kernels on fixed addresses. Anything that does not flow through fixed buffers (inputs
not staged, a fresh result not bridged) replays stale, so comparing replayed results
with eager ones over changing batches checks staging and bridges.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_ALLOCATIONS = {_aten.empty, _aten.empty_strided, _aten.empty_like, _aten.new_empty, _aten.new_empty_strided}


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return _tensors(list(value.values()))
    return []


@dataclasses.dataclass
class _Call:
    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Any

    @property
    def allocates(self) -> bool:
        """An allocation: a CUDA graph holds no node for it, a replay leaves the memory as it is."""
        return self.func.overloadpacket in _ALLOCATIONS

    @property
    def aliases(self) -> bool:
        """Every result is (a view of) an input: no kernel ran, unless the op wrote in place."""
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((self.args, self.kwargs))}
        return all(t.untyped_storage().data_ptr() in inputs for t in _tensors(self.out))


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[_Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append(_Call(func, args, kwargs, out))
        return out


def _copy_results(recorded: Any, fresh: Any) -> None:
    if isinstance(recorded, torch.Tensor):
        if isinstance(fresh, torch.Tensor) and fresh.data_ptr() != recorded.data_ptr():
            recorded.copy_(fresh)
    elif isinstance(recorded, (tuple, list)):
        for r, f in zip(recorded, fresh):
            _copy_results(r, f)


class EmulatedGraphs:
    """Graphs for :class:`fullcg.eager_capture.SegmentedGraph` on any device, with counts."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = object()  # a stand-in: the runner captures when it has a pool
        self.captured = 0  # segments captured with something to replay
        self.empty = 0  # segments that only allocated and made views
        self.replayed = 0  # segment replays, the replays of capture included

    def synchronize(self) -> None:
        pass

    def begin(self) -> _Recorder:
        recorder = _Recorder()
        recorder.__enter__()
        return recorder

    def end(self, recorder: _Recorder, launched: bool) -> list[_Call] | None:
        recorder.__exit__(None, None, None)
        calls = [c for c in recorder.calls if not c.allocates]
        if not launched:
            ran = [c.func for c in calls if not (c.func.is_view and c.aliases)]
            assert not ran, f"a segment said to launch nothing ran {ran}"
            self.empty += 1
            return None
        self.captured += 1
        # The capture ran its ops eagerly (a CUDA capture computes nothing and is then
        # replayed once): the segment's results are there already.
        return calls

    def abort(self, recorder: _Recorder) -> None:
        recorder.__exit__(None, None, None)

    def replay(self, calls: list[_Call]) -> None:
        self.replayed += 1
        for call in calls:
            _copy_results(call.out, call.func(*call.args, **call.kwargs))
