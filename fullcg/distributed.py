"""Tensor parallelism on ``torch.distributed``: the group, the all-reduce op, sharded linears.

- :class:`TensorParallel`: the tensor-parallel process group, this process's rank in it
  and its size. Size 1 needs no ``torch.distributed`` at all (:meth:`TensorParallel.single`).
- ``fullcg::all_reduce(Tensor x, str group_name) -> Tensor``: a sum over the group, out of
  place. Dynamo traces it as one node; it is *not* a split point (:mod:`fullcg.passes.split`
  splits at attention and prefix-chunk ops only), so it stays inside compiled pieces, and
  on a GPU inside their CUDA graphs (NCCL collectives can be captured). The group is named,
  not passed: the schema has no ``ProcessGroup`` argument, and the kernel looks the name up
  in this module's registry, filled when a :class:`TensorParallel` is made. The collective
  completes inside the op (no async work handle outlives it, so none crosses a piece or
  graph boundary).
- :class:`ColumnParallelLinear` (its output rows split across ranks; fused outputs such as
  ``[gate | up]`` split section by section), :class:`QKVParallelLinear` (a fused q/k/v
  projection split by heads, KV heads replicated when there are fewer than ranks) and
  :class:`RowParallelLinear` (its input columns split; the partial outputs all-reduced,
  the bias added once after the reduce). Each takes its slice of a full weight with
  ``load_full``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "TensorParallel",
    "ColumnParallelLinear",
    "QKVParallelLinear",
    "RowParallelLinear",
    "all_reduce",
    "tp_rank",
    "tp_size",
]

logger = logging.getLogger(__name__)

#: ``group name -> process group``: what ``fullcg::all_reduce`` resolves its ``group_name``
#: through at run time, filled by :class:`TensorParallel`.
_GROUPS: dict[str, Any] = {}


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _group_name(group: Any) -> str:
    name = getattr(group, "group_name", None)
    if not name:  # older torch: the name lives in c10d's own table
        name = torch.distributed.distributed_c10d._get_process_group_name(group)
    return str(name)


class TensorParallel:
    """The tensor-parallel group a model is sharded over: process group, rank and size.

    ``TensorParallel(group)`` takes a group of an initialised ``torch.distributed``;
    ``TensorParallel()`` takes the default (world) group when ``torch.distributed`` is
    initialised, and is size 1 otherwise. :meth:`single` is size 1 whatever the process.
    At size 1 nothing is reduced and ``torch.distributed`` is never touched.

    A model deep-copied keeps the same ``TensorParallel`` (a process group is a resource of
    the process, not of the model).
    """

    def __init__(self, group: Any | None = None) -> None:
        if group is None and not _dist_ready():
            self._set(None, "", rank=0, size=1)
            return
        if not _dist_ready():
            raise RuntimeError(
                "TensorParallel(group): torch.distributed is not initialised; call "
                "torch.distributed.init_process_group(...) first, or use TensorParallel.single() for no parallelism"
            )
        if group is None:
            group = torch.distributed.group.WORLD
        size = torch.distributed.get_world_size(group)
        rank = torch.distributed.get_rank(group)
        if rank < 0:
            raise ValueError("TensorParallel(group): this process is not a member of the group; pass a group it belongs to")
        name = _group_name(group)
        known = _GROUPS.get(name)
        if known is not None and known is not group:
            logger.debug("fullcg: tensor-parallel group name %r now names another group", name)
        _GROUPS[name] = group
        self._set(group, name, rank=rank, size=size)

    @classmethod
    def single(cls) -> TensorParallel:
        """No tensor parallelism: size 1, rank 0, no group (works without ``torch.distributed``)."""
        tp = cls.__new__(cls)
        tp._set(None, "", rank=0, size=1)
        return tp

    def _set(self, group: Any | None, name: str, *, rank: int, size: int) -> None:
        self.group = group
        #: The name ``fullcg::all_reduce`` finds the group by ("" without a group).
        self.group_name = name
        self.rank = rank
        self.size = size

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, size={self.size}" + (f", group={self.group_name!r})" if self.group_name else ")")

    def __deepcopy__(self, memo: dict[int, Any]) -> TensorParallel:
        return self

    def divide(self, total: int, what: str) -> int:
        """``total // size``, or an error naming ``what`` when the size does not divide it."""
        if total % self.size:
            raise ValueError(
                f"{what} ({total}) must be divisible by the tensor-parallel size ({self.size}); "
                f"choose a tensor-parallel size that divides it"
            )
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the group, as a new tensor (``x`` itself at size 1)."""
        if self.size == 1:
            return x
        return torch.ops.fullcg.all_reduce.default(x, self.group_name)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the group's first rank has it, on every rank, in place (the engine's
        sampled tokens: every rank then feeds the same tokens back, whatever it sampled)."""
        if self.size > 1:
            torch.distributed.broadcast(x, src=torch.distributed.get_global_rank(self.group, 0), group=self.group)
        return x


def tp_size(tp: TensorParallel | None = None) -> int:
    """The tensor-parallel size of ``tp`` (1 for None: no tensor parallelism)."""
    return 1 if tp is None else tp.size


def tp_rank(tp: TensorParallel | None = None) -> int:
    """This process's rank in ``tp`` (0 for None: no tensor parallelism)."""
    return 0 if tp is None else tp.rank


# --- the op -----------------------------------------------------------------------------

_lib = torch.library.Library("fullcg", "FRAGMENT")


def _resolve(group_name: str) -> Any:
    group = _GROUPS.get(group_name)
    if group is None:
        raise RuntimeError(
            f"fullcg::all_reduce: no tensor-parallel group named {group_name!r} in this process; make the model's "
            f"TensorParallel(group) in this process (after torch.distributed.init_process_group) before running it"
        )
    return group


def _all_reduce_kernel(x: torch.Tensor, group_name: str) -> torch.Tensor:
    # Out of place: the input may be a value the graph still reads (or an activation a
    # CUDA graph keeps), and functional ops are what Dynamo and Inductor reason about.
    out = x.clone(memory_format=torch.contiguous_format)
    # Synchronous: the collective is finished (on the host for gloo, on the stream for
    # NCCL) when the op returns, so no work handle crosses a piece or graph boundary.
    torch.distributed.all_reduce(out, group=_resolve(group_name))
    return out


def _all_reduce_fake(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_lib.define("all_reduce(Tensor x, str group_name) -> Tensor", tags=(torch.Tag.pt2_compliant_tag,))
_lib.impl("all_reduce", _all_reduce_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("fullcg::all_reduce", _all_reduce_fake, lib=_lib)

#: ``fullcg::all_reduce``: the sum of ``x`` over the group named ``group_name``, out of place.
all_reduce = torch.ops.fullcg.all_reduce.default


# --- sharded linears ---------------------------------------------------------------------


class _ShardedLinear(nn.Linear):
    """An ``nn.Linear`` holding one rank's slice of a full weight (and bias)."""

    full_in_features: int
    full_out_features: int
    tp: TensorParallel

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full parameter ``name`` (``"weight"`` or ``"bias"``)."""
        raise NotImplementedError

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The shape of the full (unsharded) parameter ``name``."""
        if name == "weight":
            return (self.full_out_features, self.full_in_features)
        if name == "bias":
            return (self.full_out_features,)
        raise KeyError(f"{type(self).__name__} has no parameter {name!r}")

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's slice of the full ``weight`` (and ``bias``) into the layer."""
        for name, full in (("weight", weight), ("bias", bias)):
            param = getattr(self, name)
            if full is None:
                if param is not None:
                    raise ValueError(f"{type(self).__name__}.load_full: the layer has a bias; pass the full bias too")
                continue
            if param is None:
                raise ValueError(f"{type(self).__name__}.load_full: the layer has no bias; build it with bias=True")
            if tuple(full.shape) != self.full_shape(name):
                raise ValueError(
                    f"{type(self).__name__}.load_full: the full {name} must be {self.full_shape(name)}, "
                    f"got {tuple(full.shape)}"
                )
            param.copy_(self.shard(name, full))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}/{self.full_in_features}, out_features={self.out_features}/"
            f"{self.full_out_features}, bias={self.bias is not None}, tp_rank={self.tp.rank}, tp_size={self.tp.size}"
        )


class ColumnParallelLinear(_ShardedLinear):
    """A linear layer whose output rows are split across the ranks; no communication.

    ``output_sizes`` is the full output size, or the sizes of fused sections (e.g.
    ``[intermediate, intermediate]`` for a ``[gate | up]`` projection): each section is
    split evenly, and a rank's output is its slice of every section, in order, so that
    ``chunk(len(output_sizes))`` of the local output gives the local sections.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: int | Sequence[int],
        *,
        tp: TensorParallel | None = None,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        tp = tp if tp is not None else TensorParallel.single()
        sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        rows, start = [], 0
        for i, size in enumerate(sizes):
            part = tp.divide(size, "out_features" if len(sizes) == 1 else f"output section {i}")
            rows.append((start + tp.rank * part, start + (tp.rank + 1) * part))
            start += size
        self._init_shard(in_features, start, rows, tp, bias, device, dtype)

    def _init_shard(
        self, in_features: int, full_out: int, rows: Sequence[tuple[int, int]], tp: TensorParallel, bias: bool,
        device: torch.device | str | None, dtype: torch.dtype | None,
    ) -> None:
        nn.Linear.__init__(self, in_features, sum(b - a for a, b in rows), bias=bias, device=device, dtype=dtype)
        self.tp = tp
        self.full_in_features = in_features
        self.full_out_features = full_out
        #: ``(start, stop)`` ranges of the full output rows this rank holds, in order.
        self.rows = tuple(rows)

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return torch.cat([full[a:b] for a, b in self.rows])


class QKVParallelLinear(ColumnParallelLinear):
    """A fused ``[q | k | v]`` projection split by heads.

    Each rank holds ``num_heads / size`` consecutive query heads and the KV heads those use:
    ``num_kv_heads / size`` of them, or, with fewer KV heads than ranks, the one KV head its
    query heads share (replicated on ``size / num_kv_heads`` ranks). The local output is
    ``[local q | local k | local v]``; :attr:`num_heads` and :attr:`num_kv_heads` are the
    local head counts.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        tp: TensorParallel | None = None,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        tp = tp if tp is not None else TensorParallel.single()
        heads = tp.divide(num_heads, "num_heads")
        if num_kv_heads >= tp.size:
            kv_heads = tp.divide(num_kv_heads, "num_kv_heads")
            kv_start = tp.rank * kv_heads
        else:
            if tp.size % num_kv_heads:
                raise ValueError(
                    f"the tensor-parallel size ({tp.size}) must be a multiple of num_kv_heads ({num_kv_heads}) "
                    f"when there are fewer KV heads than ranks (each KV head is replicated on size / num_kv_heads "
                    f"ranks); choose a tensor-parallel size that num_kv_heads divides or that divides it"
                )
            kv_heads, kv_start = 1, tp.rank // (tp.size // num_kv_heads)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        rows = [
            (tp.rank * heads * head_dim, (tp.rank + 1) * heads * head_dim),
            (q_size + kv_start * head_dim, q_size + (kv_start + kv_heads) * head_dim),
            (q_size + kv_size + kv_start * head_dim, q_size + kv_size + (kv_start + kv_heads) * head_dim),
        ]
        self._init_shard(hidden_size, q_size + 2 * kv_size, rows, tp, bias, device, dtype)
        self.num_heads = heads
        self.num_kv_heads = kv_heads
        self.head_dim = head_dim
        #: The first query head (of the full model) this rank holds.
        self.head_start = tp.rank * heads


class RowParallelLinear(_ShardedLinear):
    """A linear layer whose input columns are split across the ranks.

    Each rank multiplies its slice of the input (the output of a column-parallel layer)
    by its slice of the weight; the partial outputs are summed with ``fullcg::all_reduce``,
    and the bias (held whole on every rank) is added once, after the sum.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp: TensorParallel | None = None,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        tp = tp if tp is not None else TensorParallel.single()
        local_in = tp.divide(in_features, "in_features")
        super().__init__(local_in, out_features, bias=bias, device=device, dtype=dtype)
        self.tp = tp
        self.full_in_features = in_features
        self.full_out_features = out_features
        #: ``(start, stop)`` of the full input columns this rank holds.
        self.columns = (tp.rank * local_in, (tp.rank + 1) * local_in)

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if name == "bias":
            return full
        a, b = self.columns
        return full[:, a:b]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(nn.functional.linear(x, self.weight))
        return y if self.bias is None else y + self.bias
