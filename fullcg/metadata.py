"""One batch: which tokens belong to which request, and where their KV lives.

:class:`AttentionMetadata` is built once per step by the engine (``AttentionMetadata.build``)
and read by every attention call of the step through the forward context. Host-side
tuples serve planning and the reference implementation; device tensors serve kernels.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Sequence

import torch

__all__ = ["ForwardMode", "PrefixChunk", "AttentionMetadata"]


class ForwardMode(enum.Enum):
    """What a request does in this step."""

    PREFILL = "prefill"  #: no cached prefix yet: all tokens are new
    EXTEND = "extend"  #: new tokens on a cached prefix (chunked prefill)
    DECODE = "decode"  #: one new token on a cached prefix

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


def _as_int_tuple(values: Sequence[int] | torch.Tensor, name: str) -> tuple[int, ...]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    out = []
    for x in values:
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name} must hold integers, got {x!r}")
        out.append(x)
    return tuple(out)


@dataclasses.dataclass(frozen=True, eq=False)
class PrefixChunk:
    """One chunk of every request's cached prefix, for the chunked-prefix pattern.

    Request ``r`` contributes prefix positions ``[starts[r], starts[r] + lens[r])``,
    packed at rows ``[offsets[r], offsets[r] + lens[r])`` of the gathered k/v.
    ``kv_start_loc`` is ``offsets`` as an ``int32`` tensor on the batch's device, for kernels.
    (Chunk attention always runs eagerly between pieces, so a per-step tensor is safe.)
    """

    starts: tuple[int, ...]
    lens: tuple[int, ...]
    offsets: tuple[int, ...]  # len R + 1
    kv_start_loc: torch.Tensor


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionMetadata:
    """Describes one batch: which tokens belong to which request, and where their KV lives.

    Build it with :meth:`build`. Host-side tuples serve the reference implementation and
    validation; the tensors (on the batch's device) serve GPU kernels.

    Attributes:
        query_lens: new tokens per request; the batch's ``q`` packs them in request order.
        prefix_lens: tokens already in the KV cache per request.
        forward_modes: :class:`ForwardMode` per request.
        page_size: tokens per KV-cache page.
        page_table: ``int32 [num_requests, max_pages]``: page ids of each request's KV.
        slot_mapping: ``int64 [num_tokens]``: flat cache slot (``page * page_size + offset``)
            of each new token.
        query_start_loc: ``int32 [num_requests + 1]``: cumulative query lengths.
        seq_lens: ``int32 [num_requests]``: prefix plus new tokens.
        prefix_lens_tensor: ``int32 [num_requests]``.
        is_decode: ``bool [num_requests]``: which requests are in decode mode.
        num_tokens_tensor: ``int32 [1]``: real (unpadded) new tokens, for kernels that must
            not read the count on the host (CUDA graphs replay with other counts).
        prefix_chunk_tokens: capacity of one gathered prefix chunk (all requests together).
        prefix_chunks: the chunk plan for the chunked-prefix pattern.
    """

    query_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    forward_modes: tuple[ForwardMode, ...]
    page_size: int
    page_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens_tensor: torch.Tensor
    is_decode: torch.Tensor
    num_tokens_tensor: torch.Tensor
    prefix_chunk_tokens: int
    prefix_chunks: tuple[PrefixChunk, ...]

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int] | torch.Tensor,
        prefix_lens: Sequence[int] | torch.Tensor,
        page_table: torch.Tensor,
        page_size: int,
        forward_modes: Sequence[ForwardMode | str] | None = None,
        *,
        prefix_chunk_tokens: int = 4096,
        device: torch.device | str | None = None,
    ) -> AttentionMetadata:
        """Validate a batch description and derive the rest.

        ``forward_modes`` defaults to: prefill when there is no prefix, decode for a single
        new token on a prefix, extend otherwise. ``device`` defaults to the page table's.
        """
        q_lens = _as_int_tuple(query_lens, "query_lens")
        p_lens = _as_int_tuple(prefix_lens, "prefix_lens")
        num_reqs = len(q_lens)
        if num_reqs == 0:
            raise ValueError("a batch needs at least one request, got query_lens=()")
        if len(p_lens) != num_reqs:
            raise ValueError(
                f"query_lens and prefix_lens must have one entry per request, got {num_reqs} and {len(p_lens)}"
            )
        if any(n <= 0 for n in q_lens):
            raise ValueError(f"every request needs at least one new token, got query_lens={list(q_lens)}")
        if any(n < 0 for n in p_lens):
            raise ValueError(f"prefix_lens must be >= 0, got {list(p_lens)}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        if isinstance(prefix_chunk_tokens, bool) or not isinstance(prefix_chunk_tokens, int) or prefix_chunk_tokens <= 0:
            raise ValueError(f"prefix_chunk_tokens must be a positive integer, got {prefix_chunk_tokens!r}")

        if forward_modes is None:
            modes = tuple(
                ForwardMode.PREFILL if p == 0 else ForwardMode.DECODE if q == 1 else ForwardMode.EXTEND
                for q, p in zip(q_lens, p_lens)
            )
        else:
            if len(forward_modes) != num_reqs:
                raise ValueError(f"forward_modes needs one entry per request ({num_reqs}), got {len(forward_modes)}")
            modes = tuple(ForwardMode(m) if isinstance(m, str) else m for m in forward_modes)
        for r, (mode, q, p) in enumerate(zip(modes, q_lens, p_lens)):
            if not isinstance(mode, ForwardMode):
                raise TypeError(f"forward_modes[{r}] must be a fullcg.ForwardMode, got {mode!r}")
            if mode is ForwardMode.PREFILL and p != 0:
                raise ValueError(f"request {r} is in prefill mode but has a cached prefix of {p} tokens: use extend")
            if mode is ForwardMode.EXTEND and p == 0:
                raise ValueError(f"request {r} is in extend mode but has no cached prefix: use prefill")
            if mode is ForwardMode.DECODE and (q != 1 or p == 0):
                raise ValueError(
                    f"request {r} is in decode mode, which needs exactly one new token on a cached prefix; "
                    f"got {q} new tokens on a prefix of {p}"
                )

        if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2:
            raise ValueError("page_table must be a 2-D integer tensor [num_requests, max_pages]")
        if page_table.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"page_table must be int32 or int64, got {page_table.dtype}")
        if page_table.shape[0] != num_reqs:
            raise ValueError(f"page_table has {page_table.shape[0]} rows for {num_reqs} requests")
        seq = [q + p for q, p in zip(q_lens, p_lens)]
        capacity = page_table.shape[1] * page_size
        if max(seq) > capacity:
            raise ValueError(
                f"a request needs {max(seq)} KV slots but page_table has room for {capacity} "
                f"({page_table.shape[1]} pages of {page_size}); add pages"
            )
        dev = torch.device(device) if device is not None else page_table.device
        page_table = page_table.to(device=dev, dtype=torch.int32)

        # Slot of each new token: its absolute position looked up through the page table.
        req_idx = torch.repeat_interleave(torch.arange(num_reqs), torch.tensor(q_lens))
        starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
        pos = torch.arange(sum(q_lens)) - starts[req_idx] + torch.tensor(p_lens)[req_idx]
        pt_cpu = page_table.cpu().long()
        slot_mapping = pt_cpu[req_idx, pos // page_size] * page_size + pos % page_size

        # Prefix chunks: split the gather capacity evenly over requests that have a prefix.
        with_prefix = sum(1 for p in p_lens if p > 0)
        chunks: list[PrefixChunk] = []
        if with_prefix:
            per_req = max(1, prefix_chunk_tokens // with_prefix)
            for c in range(math.ceil(max(p_lens) / per_req)):
                lens = tuple(max(0, min(per_req, p - c * per_req)) for p in p_lens)
                offsets = (0, *torch.tensor(lens).cumsum(0).tolist())
                chunks.append(
                    PrefixChunk(
                        tuple(c * per_req for _ in p_lens), lens, tuple(offsets),
                        torch.tensor(offsets, dtype=torch.int32, device=dev),
                    )
                )

        return cls(
            query_lens=q_lens,
            prefix_lens=p_lens,
            forward_modes=modes,
            page_size=page_size,
            page_table=page_table,
            slot_mapping=slot_mapping.to(dev),
            query_start_loc=starts.to(device=dev, dtype=torch.int32),
            seq_lens=torch.tensor(seq, dtype=torch.int32, device=dev),
            prefix_lens_tensor=torch.tensor(p_lens, dtype=torch.int32, device=dev),
            is_decode=torch.tensor([m.is_decode for m in modes], dtype=torch.bool, device=dev),
            num_tokens_tensor=torch.tensor([sum(q_lens)], dtype=torch.int32, device=dev),
            prefix_chunk_tokens=prefix_chunk_tokens,
            prefix_chunks=tuple(chunks),
        )

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    # Cached: every attention call of a step asks (the dataclass is frozen, so they never change).
    @functools.cached_property
    def num_tokens(self) -> int:
        """Real (unpadded) new tokens in the batch."""
        return sum(self.query_lens)

    @functools.cached_property
    def is_decode_only(self) -> bool:
        return all(self.decode_flags)

    @functools.cached_property
    def decode_flags(self) -> tuple[bool, ...]:
        """Whether each request is in decode mode (host side of ``is_decode``)."""
        return tuple(m is ForwardMode.DECODE for m in self.forward_modes)

    @functools.cached_property
    def has_decode(self) -> bool:
        return any(self.decode_flags)

    @functools.cached_property
    def pages_needed(self) -> int:
        """Page-table columns the longest request reads (prefix plus new tokens)."""
        return -(-max(q + p for q, p in zip(self.query_lens, self.prefix_lens)) // self.page_size)

    @functools.cached_property
    def query_starts(self) -> tuple[int, ...]:
        out = [0]
        for n in self.query_lens:
            out.append(out[-1] + n)
        return tuple(out)
