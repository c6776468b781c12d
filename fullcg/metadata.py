"""One batch: which tokens belong to which request, and where their KV lives.

:class:`AttentionMetadata` is built once per step by the engine (``AttentionMetadata.build``)
and read by every attention call of the step through the forward context. Host-side
tuples serve planning and the reference implementation; device tensors serve kernels.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import threading
from collections.abc import Sequence

import numpy as np
import torch

from fullcg.errors import InvalidBatchError, MetadataChangedError, PageConflictError, PageOutOfRangeError

__all__ = ["ForwardMode", "PrefixChunk", "AttentionMetadata"]


class ForwardMode(enum.Enum):
    """What a request does in this step."""

    PREFILL = "prefill"  #: no cached prefix yet: all tokens are new
    EXTEND = "extend"  #: new tokens on a cached prefix (chunked prefill)
    DECODE = "decode"  #: one new token on a cached prefix

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


_INT = {int}


def _as_int_tuple(values: Sequence[int] | torch.Tensor, name: str) -> tuple[int, ...]:
    out = tuple(values.tolist() if isinstance(values, torch.Tensor) else values)
    if not {*map(type, out)} <= _INT:  # exact type, tested in C (no bools)
        bad = next(x for x in out if type(x) is not int)
        if not isinstance(bad, int) or isinstance(bad, bool):
            raise TypeError(f"{name} must hold integers, got {bad!r}")
        out = tuple(int(x) for x in out)  # int subclasses (IntEnum members) as plain ints
    return out


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


def _modes(
    forward_modes: Sequence[ForwardMode | str] | None, q_lens: tuple[int, ...], p_lens: tuple[int, ...]
) -> tuple[ForwardMode, ...]:
    """Each request's mode: given (and checked against its lengths) or derived from them."""
    if forward_modes is None:
        return tuple(
            ForwardMode.PREFILL if p == 0 else ForwardMode.DECODE if q == 1 else ForwardMode.EXTEND
            for q, p in zip(q_lens, p_lens)
        )
    if len(forward_modes) != len(q_lens):
        raise InvalidBatchError(f"forward_modes needs one entry per request ({len(q_lens)}), got {len(forward_modes)}")
    modes = tuple(ForwardMode(m) if isinstance(m, str) else m for m in forward_modes)
    for r, (mode, q, p) in enumerate(zip(modes, q_lens, p_lens)):
        if not isinstance(mode, ForwardMode):
            raise TypeError(f"forward_modes[{r}] must be a fullcg.ForwardMode, got {mode!r}")
        if mode is ForwardMode.PREFILL and p != 0:
            raise InvalidBatchError(f"request {r} is in prefill mode but has a cached prefix of {p} tokens: use extend")
        if mode is ForwardMode.EXTEND and p == 0:
            raise InvalidBatchError(f"request {r} is in extend mode but has no cached prefix: use prefill")
        if mode is ForwardMode.DECODE and (q != 1 or p == 0):
            raise InvalidBatchError(
                f"request {r} is in decode mode, which needs exactly one new token on a cached prefix; "
                f"got {q} new tokens on a prefix of {p}"
            )
    return modes


_MODE_OF_CODE = (ForwardMode.PREFILL, ForwardMode.DECODE, ForwardMode.EXTEND)


def _modes_and_flags(
    forward_modes: Sequence[ForwardMode | str] | None,
    q_lens: tuple[int, ...],
    p_lens: tuple[int, ...],
    q: np.ndarray,
    p: np.ndarray,
    decode_only: bool,
) -> tuple[tuple[ForwardMode, ...], np.ndarray]:
    """:func:`_modes`, and which requests decode (``bool [R]``), without a Python step per request
    when the modes are derived or given as derived (other given modes are checked one by one)."""
    if decode_only:
        derived = (ForwardMode.DECODE,) * len(q_lens)
        flags = np.ones(len(q_lens), dtype=np.bool_)
    else:
        has_prefix = p > 0
        flags = has_prefix & (q == 1)
        code = has_prefix.astype(np.int8) + (has_prefix ^ flags)  # 0 prefill, 1 decode, 2 extend
        derived = tuple(map(_MODE_OF_CODE.__getitem__, code.tolist()))
    if forward_modes is None or (isinstance(forward_modes, (tuple, list)) and tuple(forward_modes) == derived):
        return derived, flags
    modes = _modes(forward_modes, q_lens, p_lens)
    return modes, np.array([m is ForwardMode.DECODE for m in modes], dtype=np.bool_)


def _used_pages(pt: np.ndarray, seq: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(table, the page ids requests read or write in row-major order, which entries those are)."""
    pt = pt.astype(np.int64, copy=False)
    used_mask = np.arange(pt.shape[1])[None, :] < (-(-seq // page_size))[:, None]
    return pt, pt[used_mask], used_mask


def _check_page_range(pt: np.ndarray, used: np.ndarray, used_mask: np.ndarray, num_pages: int | None) -> int:
    """Raise if a used page id is negative or (given the cache's page count) too large; the largest id."""
    lo, hi = int(used.min()), int(used.max())
    too_high = num_pages is not None and hi >= num_pages
    if lo >= 0 and not too_high:
        return hi
    bad = used < 0 if lo < 0 else used >= num_pages
    i = int(np.flatnonzero(bad)[0])
    rows, cols = np.nonzero(used_mask)
    r, c, page = int(rows[i]), int(cols[i]), int(used[i])
    allowed = f"the KV cache's pages 0..{num_pages - 1}" if num_pages is not None else "page ids >= 0"
    raise PageOutOfRangeError(
        f"request {r} reads or writes page {page} (page_table[{r}, {c}]), outside {allowed}: give every request "
        f"pages the KV cache has (the first ceil((prefix + new) / page_size) columns of its row are used; "
        "a negative id is not padding there)"
    )


def _check_no_shared_writes(
    used: np.ndarray, used_mask: np.ndarray, written: np.ndarray, req_idx: np.ndarray, max_page: int
) -> None:
    """Raise if a page some request writes appears more than once among the pages the batch uses.

    Pages that are only read may be shared (a common prefix); a written page shared with
    another row (or used twice by its own row) would have its KV overwritten.
    """
    if max_page < 8 * used.size:  # dense enough: counting is cheaper than sorting
        shared = np.bincount(used, minlength=max_page + 1)[written] > 1
    else:
        s = np.sort(used)
        dup = s[1:][s[1:] == s[:-1]]
        if not dup.size:
            return
        shared = np.isin(written, dup)
    if not shared.any():
        return
    i = int(np.flatnonzero(shared)[0])
    page, writer = int(written[i]), int(req_idx[i])
    users = sorted(set(np.nonzero(used_mask)[0][used == page].tolist()))
    who = f"requests {users}" if len(users) > 1 else f"request {writer} twice"
    raise PageConflictError(
        f"page {page} is written by request {writer} but used by {who} of the batch: a written page must belong to "
        "one request only (give each request its own pages; only pages that are read, never written, may be shared)"
    )


# The page checks' fast path marks written pages in an array indexed by page id: a fresh
# bool array for ids below _DENSE_PAGES (zeroing and counting it is cheap), else a
# per-thread int32 scratch kept all zeros between calls, for ids below _SCRATCH_PAGES
# (16 MiB). Larger ids, or too many entries for int32 entry numbers, take the exact checks.
_DENSE_PAGES = 1 << 15
_SCRATCH_PAGES = 1 << 22
_MAX_ENTRIES = np.iinfo(np.int32).max
_scratch = threading.local()  # per thread: two threads may build metadata at once


def _check_pages(
    pt: np.ndarray,
    seq: np.ndarray,
    page_size: int,
    query_lens: np.ndarray,
    num_pages: int | None,
    entries: np.ndarray | None,
    written: np.ndarray | None,
) -> int:
    """Check the pages a batch reads and writes; returns a bound on the page ids it uses.

    ``pt`` is the page table cut to the columns some request uses (C-contiguous intp);
    ``entries`` is, per new token, the flat index into ``pt`` of the entry it is written
    through and ``written`` that entry's page (both None: the batch writes nothing).

    One gather over the table settles the common case (all valid); anything else goes
    to the exact checks, which find the first offence and raise its message.
    """
    # Negative ids read as huge unsigned ones, so one max bounds the table on both sides.
    hi = int(pt.view(np.uint64 if pt.itemsize == 8 else np.uint32).max())
    if hi >= min(num_pages or _SCRATCH_PAGES, _SCRATCH_PAGES) or pt.size >= _MAX_ENTRIES:
        return _check_pages_exactly(pt, seq, page_size, query_lens, num_pages, written)
    if written is None:
        return hi
    if hi < _DENSE_PAGES:
        # Each written page is used at least once, by its writer; so the used entries that
        # hold a written page are exactly as many as the written pages iff none is used
        # twice (by another row, by its own row again, or by two writers).
        marks = np.zeros(hi + 1, dtype=np.bool_)
        marks[written] = True
        ok = _used_hits(marks.take(pt), np.count_nonzero(marks), seq, page_size)
    else:
        # owner[page] = 1 + the entry written through it. Of two entries writing one page,
        # one is left disowned; past that, the used entries that hold a written page are
        # exactly the written entries iff no other entry uses one. (A leftover in the
        # scratch could only send a valid batch to the exact checks.)
        owner = getattr(_scratch, "owner", None)
        if owner is None or owner.size <= hi:  # grown by doubling: page ids creep up step by step
            size = max(hi + 1, 2 * (0 if owner is None else owner.size))
            owner = _scratch.owner = np.zeros(min(size, _SCRATCH_PAGES), dtype=np.int32)
        ids = np.add(entries, 1, dtype=np.int32, casting="unsafe")  # fits: pt.size < _MAX_ENTRIES
        # Tokens are in request order, so a request's tokens on one entry are adjacent.
        num_entries = ids.size if ids.size == pt.shape[0] else 1 + np.count_nonzero(ids[1:] != ids[:-1])
        owner[written] = ids
        try:
            ok = not np.count_nonzero(owner.take(written) != ids)  # no page has two writers
            ok = ok and _used_hits(owner.take(pt), num_entries, seq, page_size)
        finally:
            owner[written] = 0
    if not ok:
        _check_pages_exactly(pt, seq, page_size, query_lens, num_pages, written)
    return hi


def _used_hits(hits: np.ndarray, expected: int, seq: np.ndarray, page_size: int) -> bool:
    """Whether the used entries of ``hits`` (a table's worth) hold ``expected`` nonzeros.

    The whole table is counted first: unused columns rarely hold a written page.
    """
    if np.count_nonzero(hits) == expected:
        return True
    hits *= np.arange(hits.shape[1]) < ((seq + (page_size - 1)) // page_size)[:, None]
    return np.count_nonzero(hits) == expected


def _check_pages_exactly(
    pt: np.ndarray,
    seq: np.ndarray,
    page_size: int,
    query_lens: np.ndarray,
    num_pages: int | None,
    written: np.ndarray | None,
) -> int:
    """The page checks on the used entries alone: raise for the first offence (in row-major
    order, as the messages name it); the largest used page id."""
    pt, used, used_mask = _used_pages(pt, seq, page_size)
    max_page = _check_page_range(pt, used, used_mask, num_pages)
    if written is not None:
        req_idx = np.repeat(np.arange(query_lens.size), query_lens)
        _check_no_shared_writes(used, used_mask, written, req_idx, max_page)
    return max_page


def _check_positions(positions: Sequence[int] | torch.Tensor, expected: np.ndarray, query_lens: np.ndarray) -> None:
    given = positions.cpu().numpy() if isinstance(positions, torch.Tensor) else np.asarray(positions)
    n = expected.shape[0]
    if given.ndim != 1 or given.shape[0] < n:
        raise InvalidBatchError(f"positions must hold one position per new token ({n}), got shape {given.shape}")
    wrong = given[:n] != expected
    if wrong.any():
        i = int(np.flatnonzero(wrong)[0])
        r = int(np.searchsorted(np.cumsum(query_lens), i, side="right"))
        raise InvalidBatchError(
            f"token {i} (request {r}) is at position {int(given[i])} but the metadata puts it at {int(expected[i])}: "
            f"a new token's position is its request's prefix length plus its index among the request's new tokens "
            "(else its k/v is rotated for one position and cached at another)"
        )


def _chunk_shape(p: np.ndarray, prefix_chunk_tokens: int) -> tuple[int, int]:
    """(chunks, prefix positions per request in one chunk): the gather capacity split evenly
    over the requests that have a prefix."""
    with_prefix = int(np.count_nonzero(p))  # prefixes are >= 0; plain ints: Dynamo reads the count
    if not with_prefix:
        return 0, 0
    per_req = max(1, prefix_chunk_tokens // with_prefix)
    return -(-int(p.max()) // per_req), per_req


def _prefix_chunks(p: np.ndarray, prefix_chunk_tokens: int, dev: torch.device) -> tuple[PrefixChunk, ...]:
    """The chunk plan (one host array for all chunks, one copy to the device)."""
    num_chunks, per_req = _chunk_shape(p, prefix_chunk_tokens)
    if not num_chunks:
        return ()
    lens = np.subtract(p, np.arange(0, num_chunks * per_req, per_req)[:, None])
    np.maximum(lens, 0, out=lens)  # two ufuncs: np.clip costs more per call than it does here
    np.minimum(lens, per_req, out=lens)
    offsets = np.zeros((num_chunks, p.shape[0] + 1), dtype=np.int64)
    np.cumsum(lens, axis=1, out=offsets[:, 1:])
    # One copy to the device for every chunk; unbind makes the per-chunk views in one call.
    kv_start = torch.from_numpy(offsets.astype(np.int32)).to(dev).unbind(0)
    num_reqs = p.shape[0]
    return tuple(
        PrefixChunk((c * per_req,) * num_reqs, lens_c, offsets_c, kv_c)
        for c, lens_c, offsets_c, kv_c in zip(
            range(num_chunks), map(tuple, lens.tolist()), map(tuple, offsets.tolist()), kv_start
        )
    )


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
        prefix_chunks: the chunk plan for the chunked-prefix pattern (made on first use;
            chunk attention runs eagerly between pieces, never inside a captured graph,
            so its one copy to the device never happens during a capture).
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
        num_pages: int | None = None,
        positions: Sequence[int] | torch.Tensor | None = None,
        _writes: bool = True,
    ) -> AttentionMetadata:
        """Validate a batch description and derive the rest.

        ``forward_modes`` defaults to: prefill when there is no prefix, decode for a single
        new token on a prefix, extend otherwise. ``device`` defaults to the page table's.

        What is checked (see docs/ops.md, "What build validates"): lengths and modes agree;
        the page table is wide enough; every page a request reads or writes (its first
        ``ceil((prefix + new) / page_size)`` columns) is ``>= 0`` and, with ``num_pages``
        (the KV cache's page count), ``< num_pages``; a page that a request writes is used
        by no other row and only once by its own; with ``positions`` (the model's position
        input), each new token's position is its request's prefix length plus its index.
        Without ``num_pages`` the upper bound is checked against the caches when the
        forward context is entered.
        """
        q_lens = _as_int_tuple(query_lens, "query_lens")
        p_lens = _as_int_tuple(prefix_lens, "prefix_lens")
        num_reqs = len(q_lens)
        if num_reqs == 0:
            raise InvalidBatchError("a batch needs at least one request, got query_lens=()")
        if len(p_lens) != num_reqs:
            raise InvalidBatchError(
                f"query_lens and prefix_lens must have one entry per request, got {num_reqs} and {len(p_lens)}"
            )
        q = np.array(q_lens, dtype=np.int64)
        p = np.array(p_lens, dtype=np.int64)
        if q.min() <= 0:
            raise InvalidBatchError(f"every request needs at least one new token, got query_lens={list(q_lens)}")
        if p.min() < 0:
            raise InvalidBatchError(f"prefix_lens must be >= 0, got {list(p_lens)}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise InvalidBatchError(f"page_size must be a positive integer, got {page_size!r}")
        if isinstance(prefix_chunk_tokens, bool) or not isinstance(prefix_chunk_tokens, int) or prefix_chunk_tokens <= 0:
            raise InvalidBatchError(f"prefix_chunk_tokens must be a positive integer, got {prefix_chunk_tokens!r}")
        if num_pages is not None and (isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0):
            raise InvalidBatchError(f"num_pages must be the KV cache's page count (a positive integer), got {num_pages!r}")
        num_tokens = sum(q_lens)
        decode_only = num_tokens == num_reqs and p.min() > 0  # every request one new token on a prefix
        modes, is_decode = _modes_and_flags(forward_modes, q_lens, p_lens, q, p, decode_only)

        if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2:
            raise InvalidBatchError("page_table must be a 2-D integer tensor [num_requests, max_pages]")
        if page_table.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"page_table must be int32 or int64, got {page_table.dtype}")
        if page_table.shape[0] != num_reqs:
            raise InvalidBatchError(f"page_table has {page_table.shape[0]} rows for {num_reqs} requests")
        dev = torch.device(device) if device is not None else page_table.device
        if dev.type == "meta" or page_table.device.type == "meta":
            raise InvalidBatchError(
                "metadata cannot live on the meta device: kernels read its page table and slots; "
                "build it on the KV cache's device (device='cpu' or 'cuda')"
            )
        seq = q + p
        capacity = page_table.shape[1] * page_size
        longest = int(seq.max())
        if longest > capacity:
            r = int(seq.argmax())
            raise InvalidBatchError(
                f"request {r} needs {longest} KV slots but page_table has room for {capacity} "
                f"({page_table.shape[1]} pages of {page_size}); add pages"
            )
        # Only the columns some request uses matter; the checks and lookups read just those,
        # as intp (numpy's index type: lookups through the table convert nothing).
        width = -(-longest // page_size)
        pt = np.ascontiguousarray(page_table.cpu().numpy()[:, :width], dtype=np.intp)

        # Slot of each new token: its absolute position looked up through the page table.
        row_base = np.arange(0, num_reqs * width, width)
        if decode_only:
            starts = np.arange(num_reqs + 1)
            pos = p
        else:
            starts = np.zeros(num_reqs + 1, dtype=np.int64)
            np.cumsum(q, out=starts[1:])
            pos = np.arange(num_tokens) + np.repeat(p - starts[:-1], q)
            row_base = np.repeat(row_base, q)
        if _writes:
            col, offset = np.divmod(pos, page_size)
            entries = row_base + col  # flat index into pt of the entry each token is written through
            written = pt.take(entries)
            max_page = _check_pages(pt, seq, page_size, q, num_pages, entries, written)
            slots = np.multiply(written, page_size, dtype=np.int64)
            slots += offset
        else:
            max_page = _check_pages(pt, seq, page_size, q, num_pages, None, None)
            slots = np.full(num_tokens, -1, dtype=np.int64)
        if positions is not None:
            _check_positions(positions, pos, q)

        md = object.__new__(cls)  # skips __post_init__: everything it checks was checked above
        md.__dict__.update(
            query_lens=q_lens,
            prefix_lens=p_lens,
            forward_modes=modes,
            page_size=page_size,
            page_table=page_table.to(device=dev, dtype=torch.int32),
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(starts.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq.astype(np.int32)).to(dev),
            prefix_lens_tensor=torch.from_numpy(p.astype(np.int32)).to(dev),
            is_decode=torch.from_numpy(is_decode).to(dev),
            num_tokens_tensor=torch.from_numpy(np.array([num_tokens], dtype=np.int32)).to(dev),
            prefix_chunk_tokens=prefix_chunk_tokens,
            # prefix_chunks is made on first use (see __getattr__): most models never read
            # it, and it is the largest part of build's cost. Its size is known now.
            num_prefix_chunks=_chunk_shape(p, prefix_chunk_tokens)[0],
            _chunk_plan_inputs=(p, dev),
            _max_page=max_page,
        )
        return md

    def __getattr__(self, name: str) -> object:
        # Called only for attributes not in the instance: prefix_chunks before its first use.
        if name == "prefix_chunks":
            inputs = self.__dict__.get("_chunk_plan_inputs")
            if inputs is not None:
                chunks = _prefix_chunks(inputs[0], self.prefix_chunk_tokens, inputs[1])
                self.__dict__["prefix_chunks"] = chunks
                return chunks
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @functools.cached_property
    def num_prefix_chunks(self) -> int:
        """How many chunks the chunked-prefix pattern walks (``len(prefix_chunks)``, known
        without making the plan)."""
        return len(self.prefix_chunks)

    @classmethod
    def stand_in(
        cls,
        query_lens: Sequence[int],
        prefix_lens: Sequence[int],
        page_table: torch.Tensor,
        page_size: int,
        forward_modes: Sequence[ForwardMode | str] | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> AttentionMetadata:
        """A batch that writes nothing to the cache (every slot -1), for capturing graphs.

        Its rows may share pages (they only read them); everything else is checked as in
        :meth:`build`.
        """
        return cls.build(query_lens, prefix_lens, page_table, page_size, forward_modes, device=device, _writes=False)

    def __post_init__(self) -> None:
        # Runs for direct construction and dataclasses.replace (build bypasses it): fields
        # must still agree, and page ids are re-checked against the caches on first use.
        r = len(self.query_lens)
        n = sum(self.query_lens)

        def changed(what: str) -> MetadataChangedError:
            return MetadataChangedError(
                f"AttentionMetadata fields disagree: {what}; metadata is immutable after build, so build a new "
                "one with AttentionMetadata.build(...) instead of editing it (dataclasses.replace)"
            )

        if len(self.prefix_lens) != r or len(self.forward_modes) != r:
            raise changed(f"{r} query_lens, {len(self.prefix_lens)} prefix_lens, {len(self.forward_modes)} forward_modes")
        for name in ("page_table", "slot_mapping", "query_start_loc", "seq_lens", "prefix_lens_tensor", "is_decode",
                     "num_tokens_tensor"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise changed(f"{name} must be a tensor, got {type(getattr(self, name)).__name__}")
        if self.page_table.dim() != 2 or self.page_table.shape[0] != r:
            raise changed(f"page_table has shape {tuple(self.page_table.shape)} for {r} requests")
        if self.slot_mapping.dim() != 1 or self.slot_mapping.shape[0] < n:
            raise changed(f"slot_mapping has {tuple(self.slot_mapping.shape)} slots for {n} new tokens")
        if self.query_start_loc.shape != (r + 1,):
            raise changed(f"query_start_loc has shape {tuple(self.query_start_loc.shape)} for {r} requests")
        for name in ("seq_lens", "prefix_lens_tensor", "is_decode"):
            if getattr(self, name).shape != (r,):
                raise changed(f"{name} has shape {tuple(getattr(self, name).shape)} for {r} requests")
        if r and max(a + b for a, b in zip(self.query_lens, self.prefix_lens)) > self.page_table.shape[1] * self.page_size:
            raise changed(f"page_table has {self.page_table.shape[1]} pages of {self.page_size}, too few for the requests")
        try:
            _modes(self.forward_modes, self.query_lens, self.prefix_lens)
        except (ValueError, TypeError) as e:
            raise changed(str(e)) from None

    def verified(self, num_pages: int) -> AttentionMetadata:
        """Check this batch against KV caches of ``num_pages`` pages (the forward context
        does, on entry); returns ``self``. Cheap for metadata from :meth:`build` (one
        comparison); metadata made otherwise (``dataclasses.replace``) is re-derived once
        from its host fields and compared, field by field."""
        max_page = self.__dict__.get("_max_page")
        if max_page is None:
            max_page = self._reverify(num_pages)
        if max_page >= num_pages:
            # _max_page bounds the table's first columns, padding included: look at the used
            # entries alone (raises if one is out of range) and keep their exact largest id.
            seq = np.add(self.query_lens, self.prefix_lens)
            max_page = _check_page_range(*_used_pages(self.page_table.cpu().numpy(), seq, self.page_size), num_pages)
            object.__setattr__(self, "_max_page", max_page)
        return self

    def _reverify(self, num_pages: int) -> int:
        fresh = AttentionMetadata.build(
            self.query_lens, self.prefix_lens, self.page_table, self.page_size, self.forward_modes,
            prefix_chunk_tokens=self.prefix_chunk_tokens, device="cpu", num_pages=num_pages,
        )
        n = self.num_tokens
        slots = self.slot_mapping.cpu()
        real = slots[:n]
        if not bool(((real == fresh.slot_mapping) | (real < 0)).all()) or bool((slots[n:] >= 0).any()):
            raise MetadataChangedError(
                "AttentionMetadata fields disagree: slot_mapping does not follow page_table, query_lens and "
                "prefix_lens (slots < 0 are padding); metadata is immutable after build, so build a new one with "
                "AttentionMetadata.build(...) instead of editing it"
            )
        for name in ("query_start_loc", "seq_lens", "prefix_lens_tensor", "is_decode", "num_tokens_tensor"):
            if not torch.equal(getattr(self, name).cpu(), getattr(fresh, name)):
                raise MetadataChangedError(
                    f"AttentionMetadata fields disagree: {name} does not follow query_lens and prefix_lens; metadata "
                    "is immutable after build, so build a new one with AttentionMetadata.build(...) instead of editing it"
                )
        if [(c.starts, c.lens, c.offsets) for c in self.prefix_chunks] != \
                [(c.starts, c.lens, c.offsets) for c in fresh.prefix_chunks]:
            raise MetadataChangedError(
                "AttentionMetadata fields disagree: prefix_chunks do not follow prefix_lens and prefix_chunk_tokens; "
                "build a new one with AttentionMetadata.build(...)"
            )
        object.__setattr__(self, "_max_page", fresh._max_page)
        return fresh._max_page

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
    def positions(self) -> torch.Tensor:
        """``int64 [num_tokens]`` on the batch's device: each new token's position, its
        request's prefix length plus its index among the request's new tokens (what a
        model's rotary embedding must be given)."""
        q = np.asarray(self.query_lens, dtype=np.int64)
        starts = np.zeros(q.size + 1, dtype=np.int64)
        np.cumsum(q, out=starts[1:])
        pos = np.arange(int(starts[-1])) + np.repeat(np.asarray(self.prefix_lens, dtype=np.int64) - starts[:-1], q)
        return torch.from_numpy(pos).to(self.slot_mapping.device)

    def check_positions(self, positions: Sequence[int] | torch.Tensor) -> None:
        """Raise :class:`~fullcg.errors.InvalidBatchError` unless the first ``num_tokens``
        entries of ``positions`` are :attr:`positions` (padding rows past them are not read).
        Reads ``positions`` on the host: a debugging check, not for every step."""
        _check_positions(positions, self.positions.cpu().numpy(), np.asarray(self.query_lens))

    @functools.cached_property
    def query_starts(self) -> tuple[int, ...]:
        out = [0]
        for n in self.query_lens:
            out.append(out[-1] + n)
        return tuple(out)
