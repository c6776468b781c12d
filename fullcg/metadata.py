"""One batch: which tokens belong to which request, and where their KV lives.

:class:`AttentionMetadata` is built once per step by the engine (``AttentionMetadata.build``)
and read by every attention call of the step through the forward context. Host-side
tuples serve planning and the reference implementation; device tensors serve kernels.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import operator
import threading
from collections.abc import Sequence

import numpy as np
import torch

from fullcg.errors import InvalidBatchError, MetadataChangedError, PageConflictError, PageOutOfRangeError
from fullcg.host_copy import upload

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
) -> tuple[tuple[ForwardMode, ...], np.ndarray, bool, bool]:
    """:func:`_modes`, which requests decode (``bool [R]``), whether all do and whether some
    does, without a Python step per request when the modes are derived or given as derived
    (other given modes are checked one by one). ``decode_only``: every request has one new
    token on a prefix (so its derived mode is decode)."""
    if decode_only:
        derived = (ForwardMode.DECODE,) * len(q_lens)
        flags = np.empty(len(q_lens), dtype=np.bool_)
        flags.fill(True)  # np.ones, at half its cost (it is Python code around these two calls)
        some = True
    else:
        has_prefix = p > 0
        flags = has_prefix & (q == 1)
        code = (has_prefix.astype(np.int8) + (has_prefix ^ flags)).tolist()  # 0 prefill, 1 decode, 2 extend
        derived = tuple(map(_MODE_OF_CODE.__getitem__, code))
        some = 1 in code
    if forward_modes is None or (isinstance(forward_modes, (tuple, list)) and tuple(forward_modes) == derived):
        return derived, flags, decode_only, some
    modes = _modes(forward_modes, q_lens, p_lens)
    flag_tuple = _decode_flags_of(modes)
    return modes, np.array(flag_tuple, dtype=np.bool_), all(flag_tuple), any(flag_tuple)


def _decode_flags_of(modes: tuple[ForwardMode, ...]) -> tuple[bool, ...]:
    """Whether each request decodes, from its mode."""
    return tuple(map(operator.is_, modes, itertools.repeat(ForwardMode.DECODE)))


def _query_starts_of(query_lens: tuple[int, ...]) -> tuple[int, ...]:
    """Cumulative query lengths, from 0."""
    return tuple(itertools.accumulate(query_lens, initial=0))


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


def _chunk_layout(with_prefix: int, longest_prefix: int, prefix_chunk_tokens: int) -> tuple[int, int]:
    """(chunks, prefix positions per request in one chunk): the gather capacity split evenly
    over the ``with_prefix`` requests that have a prefix (plain ints: Dynamo reads the count)."""
    if not with_prefix:
        return 0, 0
    if prefix_chunk_tokens < with_prefix:
        raise InvalidBatchError(
            f"prefix_chunk_tokens ({prefix_chunk_tokens}) must be at least the number of requests with a cached prefix "
            f"({with_prefix}): one prefix chunk holds at least one position of each; raise prefix_chunk_tokens"
        )
    per_req = prefix_chunk_tokens // with_prefix
    return -(-longest_prefix // per_req), per_req


def _chunk_shape(p: np.ndarray, prefix_chunk_tokens: int) -> tuple[int, int]:
    """:func:`_chunk_layout` of the prefix lengths ``p`` (all >= 0)."""
    with_prefix = int(np.count_nonzero(p))
    return _chunk_layout(with_prefix, int(p.max()) if with_prefix else 0, prefix_chunk_tokens)


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
    kv_start = upload([offsets.astype(np.int32)], dev)[0].unbind(0)
    num_reqs = p.shape[0]
    return tuple(
        PrefixChunk((c * per_req,) * num_reqs, lens_c, offsets_c, kv_c)
        for c, lens_c, offsets_c, kv_c in zip(
            range(num_chunks), map(tuple, lens.tolist()), map(tuple, offsets.tolist()), kv_start
        )
    )


#: The device tensors: what :meth:`AttentionMetadata.with_device_tensors` replaces.
_DEVICE_FIELDS = ("page_table", "slot_mapping", "query_start_loc", "seq_lens", "prefix_lens_tensor", "is_decode",
                  "num_tokens_tensor")
#: The public fields, in the order of ``AttentionMetadata(...)``'s parameters.
_FIELDS = ("query_lens", "prefix_lens", "forward_modes", "page_size", *_DEVICE_FIELDS, "prefix_chunk_tokens")
#: Values derived from the host fields alone, set by the constructors.
_HOST_DERIVED = ("num_tokens", "is_decode_only", "has_decode", "pages_needed", "num_prefix_chunks")


def _immutable(name: str) -> dataclasses.FrozenInstanceError:
    # FrozenInstanceError (an AttributeError), as when AttentionMetadata was a frozen dataclass.
    return dataclasses.FrozenInstanceError(
        f"cannot assign or delete AttentionMetadata.{name}: metadata is immutable after build; build a new one "
        "with AttentionMetadata.build(...) (metadata.replace(...) makes a copy with changed fields, re-verified "
        "on first use)"
    )


# The decorator makes no method (no __init__, __repr__, __eq__, nor a frozen __setattr__): it
# only declares the public fields to the dataclasses module, so dataclasses.fields(metadata)
# and dataclasses.replace(metadata, ...) (which calls __init__, so it validates) keep working.
@dataclasses.dataclass(init=False, repr=False, eq=False)
class AttentionMetadata:
    """Describes one batch: which tokens belong to which request, and where their KV lives.

    Build it with :meth:`build`. Host-side tuples serve the reference implementation and
    validation; the tensors (on the batch's device) serve GPU kernels.

    Immutable: assigning an attribute raises. Made by :meth:`build` (validates a batch and
    derives the rest: how engines make it), :meth:`stand_in` (graph capture's batches),
    ``AttentionMetadata(...)`` and :meth:`replace` (fields given one by one: checked to
    agree, and re-derived and compared on first use) and :meth:`with_device_tensors` (the
    batch over the static buffers that CUDA graphs read).

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

    Derived from the host fields alone, when the metadata is made (every attention call of a
    step reads some of them; ``decode_flags`` and ``query_starts`` of a batch that is not all
    decodes, on first read):
        num_tokens: real (unpadded) new tokens in the batch.
        is_decode_only: whether every request is in decode mode.
        decode_flags: whether each request is in decode mode (host side of ``is_decode``).
        has_decode: whether some request is in decode mode.
        pages_needed: page-table columns the longest request reads (prefix plus new tokens).
        query_starts: cumulative query lengths (host side of ``query_start_loc``).
        num_prefix_chunks: how many chunks the chunked-prefix pattern walks
            (``len(prefix_chunks)``, known without making the plan).
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

    __slots__ = (
        *_FIELDS,
        *_HOST_DERIVED,
        # Also derived from the host fields alone, by _decode_flags_of and _query_starts_of: set by
        # the constructor when cheap (a decode batch), else None until first read (fill reads
        # them, for a full graph's replay; a piecewise step of a mixed batch may never).
        "_decode_flags",
        "_query_starts",
        # The prefix-chunk plan, None until prefix_chunks is first read: most models never read
        # it, and making it (a copy to the device) is the largest part of build's cost.
        "_prefix_chunks",
        # The positions tensor, None until positions is first read (a copy to the device).
        "_positions",
        # The verification bound: no page id that the batch uses exceeds it (build's page
        # checks give it; verified() tightens it to the exact largest used id when the table's
        # padding exceeds the caches). None: made by __init__, not checked yet; verified()
        # re-derives the metadata from its host fields once and sets it.
        "_max_page",
        # The page table's used columns on the host (numpy, intp), when build had them: what
        # implementations that plan on the host read (host_page_table), so a step whose
        # table lives on the device is planned without copying it back, which would make
        # the host wait for the GPU. None: read from the device on first use.
        "_page_table_host",
        # Implementations key per-step plans to the batch by weak reference (flashinfer's).
        "__weakref__",
    )

    def __init__(
        self,
        query_lens: Sequence[int],
        prefix_lens: Sequence[int],
        forward_modes: Sequence[ForwardMode | str],
        page_size: int,
        page_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        prefix_lens_tensor: torch.Tensor,
        is_decode: torch.Tensor,
        num_tokens_tensor: torch.Tensor,
        prefix_chunk_tokens: int,
        prefix_chunks: Sequence[PrefixChunk] | None = None,
    ) -> None:
        """Metadata from its fields given one by one: what :meth:`replace` and
        ``dataclasses.replace`` call, for tests and tools that make a batch by hand.

        Checks now that the fields agree (lengths, tensor shapes, modes; else
        :class:`~fullcg.errors.MetadataChangedError` naming the fix); page ids, slots and the
        tensors' values are re-derived from the host fields and compared the first time
        :meth:`verified` runs (entering a forward context). ``prefix_chunks``: the plan, or
        None to make it from the host fields on first use. Engines use :meth:`build`.
        """

        def changed(what: str) -> MetadataChangedError:
            return MetadataChangedError(
                f"AttentionMetadata fields disagree: {what}; metadata is immutable after build, so build a new "
                "one with AttentionMetadata.build(...) instead of editing it (metadata.replace, dataclasses.replace)"
            )

        try:
            q_lens = _as_int_tuple(query_lens, "query_lens")
            p_lens = _as_int_tuple(prefix_lens, "prefix_lens")
        except TypeError as e:
            raise changed(str(e)) from None
        r = len(q_lens)
        n = sum(q_lens)
        if len(p_lens) != r or len(forward_modes) != r:
            raise changed(f"{r} query_lens, {len(p_lens)} prefix_lens, {len(forward_modes)} forward_modes")
        if min(q_lens, default=1) <= 0 or min(p_lens, default=0) < 0:
            raise changed(f"query_lens must be >= 1 and prefix_lens >= 0, got {list(q_lens)} and {list(p_lens)}")
        for name, value in (("page_size", page_size), ("prefix_chunk_tokens", prefix_chunk_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise changed(f"{name} must be a positive integer, got {value!r}")
        tensors = (
            page_table, slot_mapping, query_start_loc, seq_lens, prefix_lens_tensor, is_decode, num_tokens_tensor
        )
        for name, value in zip(_DEVICE_FIELDS, tensors):
            if not isinstance(value, torch.Tensor):
                raise changed(f"{name} must be a tensor, got {type(value).__name__}")
        if page_table.dim() != 2 or page_table.shape[0] != r:
            raise changed(f"page_table has shape {tuple(page_table.shape)} for {r} requests")
        if slot_mapping.dim() != 1 or slot_mapping.shape[0] < n:
            raise changed(f"slot_mapping has {tuple(slot_mapping.shape)} slots for {n} new tokens")
        if query_start_loc.shape != (r + 1,):
            raise changed(f"query_start_loc has shape {tuple(query_start_loc.shape)} for {r} requests")
        per_request = (("seq_lens", seq_lens), ("prefix_lens_tensor", prefix_lens_tensor), ("is_decode", is_decode))
        for name, value in per_request:
            if value.shape != (r,):
                raise changed(f"{name} has shape {tuple(value.shape)} for {r} requests")
        longest = max(map(int.__add__, q_lens, p_lens), default=0)
        if longest > page_table.shape[1] * page_size:
            raise changed(f"page_table has {page_table.shape[1]} pages of {page_size}, too few for the requests")
        try:
            modes = _modes(forward_modes, q_lens, p_lens)
        except (ValueError, TypeError) as e:
            raise changed(str(e)) from None
        num_chunks = _chunk_layout(r - p_lens.count(0), max(p_lens, default=0), prefix_chunk_tokens)[0]
        if prefix_chunks is not None:
            prefix_chunks = tuple(prefix_chunks)
            if not all(isinstance(c, PrefixChunk) for c in prefix_chunks):
                raise changed("prefix_chunks must hold fullcg.PrefixChunk plans")
            if len(prefix_chunks) != num_chunks:
                raise changed(
                    f"prefix_chunks has {len(prefix_chunks)} chunks but prefix_lens and prefix_chunk_tokens make "
                    f"{num_chunks}"
                )
        decode_flags = _decode_flags_of(modes)
        self._set_slots(
            q_lens, p_lens, modes, page_size, *tensors, prefix_chunk_tokens,
            n, all(decode_flags), any(decode_flags), -(-longest // page_size), num_chunks,
            decode_flags, _query_starts_of(q_lens),
            prefix_chunks, None, None,  # the plan (or None: made on first use), positions, no bound yet
            None,  # the host page table: read from page_table on first use
        )

    def _set_slots(self, *values: object) -> None:
        # Every slot, in __slots__ order, past __setattr__ (which refuses every assignment):
        # for __init__ and __setstate__. The fast constructors (_from_checked,
        # with_device_tensors) write theirs one by one, which costs less.
        for name, value in zip(_SLOTS, values, strict=True):
            object.__setattr__(self, name, value)

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
        shortest_prefix = int(p.min())  # a plain int: is_decode_only derives from it, a plain bool
        if shortest_prefix < 0:
            raise InvalidBatchError(f"prefix_lens must be >= 0, got {list(p_lens)}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise InvalidBatchError(f"page_size must be a positive integer, got {page_size!r}")
        if isinstance(prefix_chunk_tokens, bool) or not isinstance(prefix_chunk_tokens, int) or prefix_chunk_tokens <= 0:
            raise InvalidBatchError(f"prefix_chunk_tokens must be a positive integer, got {prefix_chunk_tokens!r}")
        if num_pages is not None and (isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0):
            raise InvalidBatchError(f"num_pages must be the KV cache's page count (a positive integer), got {num_pages!r}")
        num_tokens = sum(q_lens)
        decode_only = num_tokens == num_reqs and shortest_prefix > 0  # every request one new token on a prefix
        modes, is_decode, all_decode, some_decode = _modes_and_flags(
            forward_modes, q_lens, p_lens, q, p, decode_only
        )

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
        given = page_table.cpu().numpy()
        pt = np.ascontiguousarray(given[:, :width], dtype=np.intp)
        if np.may_share_memory(pt, given):
            pt = pt.copy()  # kept by the metadata: never a view of the caller's table

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
        # The chunk count, without reading the prefixes again when every request decodes.
        if decode_only:
            num_chunks = _chunk_layout(num_reqs, longest - 1, prefix_chunk_tokens)[0]
        else:
            num_chunks = _chunk_shape(p, prefix_chunk_tokens)[0]
        # The six host-built vectors (and the page table, unless it is already there) reach
        # the device in one copy that never makes the host wait for the GPU.
        host = [slots, starts.astype(np.int32), seq.astype(np.int32), p.astype(np.int32), is_decode,
                np.array([num_tokens], dtype=np.int32)]
        table_there = page_table.device == dev and page_table.dtype == torch.int32
        if not table_there:
            host.append(page_table.cpu().numpy().astype(np.int32, copy=False))
        tensors = upload(host, dev)
        table = page_table if table_there else tensors[6]
        return cls._from_checked(
            q_lens, p_lens, modes, page_size, table, *tensors[:6],
            prefix_chunk_tokens,
            num_tokens, all_decode, some_decode, width, num_chunks,
            # A decode batch's flags and starts cost next to nothing now; others', on first read.
            (True,) * num_reqs if all_decode else None,
            tuple(range(num_reqs + 1)) if decode_only else None,
            max_page, pt,
        )

    @classmethod
    def _from_checked(
        cls,
        query_lens: tuple[int, ...],
        prefix_lens: tuple[int, ...],
        forward_modes: tuple[ForwardMode, ...],
        page_size: int,
        page_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        prefix_lens_tensor: torch.Tensor,
        is_decode: torch.Tensor,
        num_tokens_tensor: torch.Tensor,
        prefix_chunk_tokens: int,
        num_tokens: int,
        is_decode_only: bool,
        has_decode: bool,
        pages_needed: int,
        num_prefix_chunks: int,
        decode_flags: tuple[bool, ...] | None,
        query_starts: tuple[int, ...] | None,
        max_page: int,
        page_table_host: np.ndarray | None = None,
    ) -> AttentionMetadata:
        """Metadata from fields that :meth:`build` has checked and derived, the derived
        values included (from the host fields alone; ``decode_flags`` and ``query_starts``
        may be None: made on first read), and ``max_page``, the bound its page checks
        found: nothing is checked again, so :meth:`verified` costs one comparison."""
        md = object.__new__(cls)
        set_ = object.__setattr__  # past __setattr__, which refuses every assignment
        set_(md, "query_lens", query_lens)
        set_(md, "prefix_lens", prefix_lens)
        set_(md, "forward_modes", forward_modes)
        set_(md, "page_size", page_size)
        set_(md, "page_table", page_table)
        set_(md, "slot_mapping", slot_mapping)
        set_(md, "query_start_loc", query_start_loc)
        set_(md, "seq_lens", seq_lens)
        set_(md, "prefix_lens_tensor", prefix_lens_tensor)
        set_(md, "is_decode", is_decode)
        set_(md, "num_tokens_tensor", num_tokens_tensor)
        set_(md, "prefix_chunk_tokens", prefix_chunk_tokens)
        set_(md, "num_tokens", num_tokens)
        set_(md, "is_decode_only", is_decode_only)
        set_(md, "has_decode", has_decode)
        set_(md, "pages_needed", pages_needed)
        set_(md, "num_prefix_chunks", num_prefix_chunks)
        set_(md, "_decode_flags", decode_flags)
        set_(md, "_query_starts", query_starts)
        set_(md, "_prefix_chunks", None)
        set_(md, "_positions", None)
        set_(md, "_max_page", max_page)
        set_(md, "_page_table_host", page_table_host)
        return md

    def with_device_tensors(
        self,
        *,
        page_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        prefix_lens_tensor: torch.Tensor,
        is_decode: torch.Tensor,
        num_tokens_tensor: torch.Tensor,
    ) -> AttentionMetadata:
        """This batch with its device tensors replaced: for CUDA graphs, whose kernels read
        static buffers refilled before each replay (:meth:`StaticMetadata.fill
        <fullcg.runner.StaticMetadata.fill>` writes the batch into them, then calls this).

        The new tensors may describe the batch padded (to a capture size: more requests and
        tokens past the real ones); they are not checked, as the caller has just filled them.
        The copy keeps this batch's host fields and the values derived from them as they
        are. None can come from a device tensor: they are derived by functions given the
        host fields, never the metadata, when the metadata is made (or, for
        ``decode_flags`` and ``query_starts``, on first read). The verification bound comes
        along (the buffers hold the same pages); so do ``positions`` and the prefix-chunk
        plan if made, when they are on the new tensors' device (else they are made anew
        there on first use).
        """
        chunks, positions = self._prefix_chunks, self._positions
        if chunks and chunks[0].kv_start_loc.device != slot_mapping.device:
            chunks = None
        if positions is not None and positions.device != slot_mapping.device:
            positions = None
        md = object.__new__(type(self))
        set_ = object.__setattr__  # past __setattr__, which refuses every assignment
        # Host fields and host-derived values: this batch's, as they are.
        set_(md, "query_lens", self.query_lens)
        set_(md, "prefix_lens", self.prefix_lens)
        set_(md, "forward_modes", self.forward_modes)
        set_(md, "page_size", self.page_size)
        set_(md, "prefix_chunk_tokens", self.prefix_chunk_tokens)
        set_(md, "num_tokens", self.num_tokens)
        set_(md, "is_decode_only", self.is_decode_only)
        set_(md, "has_decode", self.has_decode)
        set_(md, "pages_needed", self.pages_needed)
        set_(md, "num_prefix_chunks", self.num_prefix_chunks)
        set_(md, "_decode_flags", self._decode_flags)  # made or not, as here
        set_(md, "_query_starts", self._query_starts)
        # Device tensors: the given ones.
        set_(md, "page_table", page_table)
        set_(md, "slot_mapping", slot_mapping)
        set_(md, "query_start_loc", query_start_loc)
        set_(md, "seq_lens", seq_lens)
        set_(md, "prefix_lens_tensor", prefix_lens_tensor)
        set_(md, "is_decode", is_decode)
        set_(md, "num_tokens_tensor", num_tokens_tensor)
        set_(md, "_prefix_chunks", chunks)
        set_(md, "_positions", positions)
        set_(md, "_max_page", self._max_page)
        set_(md, "_page_table_host", self._page_table_host)  # the real batch's rows: what host planners read
        return md

    def replace(self, **changes: object) -> AttentionMetadata:
        """A copy with the public fields named in ``changes`` replaced (``prefix_chunks=``
        gives a plan; else the copy makes its own from its fields on first read), checked
        like ``AttentionMetadata(...)``: the fields must agree
        (:class:`~fullcg.errors.MetadataChangedError` otherwise), and the copy is re-derived
        from its host fields and compared the first time :meth:`verified` runs. For tests and
        tools that alter a batch; an engine builds each step's metadata with :meth:`build`.
        ``dataclasses.replace(metadata, ...)`` does the same."""
        fields = {name: getattr(self, name) for name in _FIELDS}
        fields.update(changes)
        return type(self)(**fields)

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

    def __setattr__(self, name: str, value: object) -> None:
        raise _immutable(name)

    def __delattr__(self, name: str) -> None:
        raise _immutable(name)

    # copy.copy, copy.deepcopy and pickle restore the slots through these (the default
    # restore assigns attributes, which __setattr__ refuses).
    def __getstate__(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in _SLOTS}

    def __setstate__(self, state: dict[str, object]) -> None:
        self._set_slots(*(state[name] for name in _SLOTS))

    def __repr__(self) -> str:
        modes = tuple(m.value for m in self.forward_modes)
        return (
            f"{type(self).__name__}(query_lens={self.query_lens}, prefix_lens={self.prefix_lens}, "
            f"forward_modes={modes}, page_size={self.page_size}, prefix_chunk_tokens={self.prefix_chunk_tokens}, "
            f"device={self.slot_mapping.device})"
        )

    @property
    def prefix_chunks(self) -> tuple[PrefixChunk, ...]:
        """The chunk plan for the chunked-prefix pattern, made on first read (from the host
        fields, on the batch's device) and kept."""
        chunks = self._prefix_chunks
        if chunks is None:
            chunks = _prefix_chunks(np.array(self.prefix_lens, dtype=np.int64), self.prefix_chunk_tokens,
                                    self.slot_mapping.device)
            object.__setattr__(self, "_prefix_chunks", chunks)
        return chunks

    def verified(self, num_pages: int) -> AttentionMetadata:
        """Check this batch against KV caches of ``num_pages`` pages (the forward context
        does, on entry); returns ``self``. Cheap for metadata from :meth:`build` (one
        comparison); metadata made otherwise (``AttentionMetadata(...)``, :meth:`replace`)
        is re-derived once from its host fields and compared, field by field."""
        max_page = self._max_page
        if max_page is None:
            max_page = self._reverify(num_pages)
        if max_page >= num_pages:
            # _max_page bounds the table's first columns, padding included: look at the used
            # entries alone (raises if one is out of range) and keep their exact largest id.
            seq = np.add(self.query_lens, self.prefix_lens)
            max_page = _check_page_range(*_used_pages(self.host_page_table().numpy(), seq, self.page_size), num_pages)
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
        # A plan made here from the host fields agrees by construction; a given one is compared.
        if self._prefix_chunks is not None and [(c.starts, c.lens, c.offsets) for c in self._prefix_chunks] != \
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

    def host_page_table(self) -> torch.Tensor:
        """The page table on the host, a CPU tensor ``[num_requests, >= pages_needed]``: each
        request's row covers at least the pages it reads (later columns may be cut off).

        For implementations that plan on the host: metadata from :meth:`build` keeps the
        table it was given, so reading it never copies from the device (which would make
        the host wait for the GPU and end the overlap of host and GPU between steps). Other
        metadata copies ``page_table`` once, on first use. Do not write into it.
        """
        host = self._page_table_host
        if host is None:
            host = self.page_table.cpu().numpy()
            object.__setattr__(self, "_page_table_host", host)
        return torch.from_numpy(host[: self.num_requests])

    @property
    def decode_flags(self) -> tuple[bool, ...]:
        """Whether each request is in decode mode (host side of ``is_decode``)."""
        flags = self._decode_flags
        if flags is None:
            flags = _decode_flags_of(self.forward_modes)
            object.__setattr__(self, "_decode_flags", flags)
        return flags

    @property
    def query_starts(self) -> tuple[int, ...]:
        """Cumulative query lengths, from 0 (host side of ``query_start_loc``)."""
        starts = self._query_starts
        if starts is None:
            starts = _query_starts_of(self.query_lens)
            object.__setattr__(self, "_query_starts", starts)
        return starts

    @property
    def positions(self) -> torch.Tensor:
        """``int64 [num_tokens]`` on the batch's device: each new token's position, its
        request's prefix length plus its index among the request's new tokens (what a
        model's rotary embedding must be given). Made on first read and kept."""
        pos = self._positions
        if pos is None:
            q = np.asarray(self.query_lens, dtype=np.int64)
            starts = np.zeros(q.size + 1, dtype=np.int64)
            np.cumsum(q, out=starts[1:])
            pos = np.arange(int(starts[-1])) + np.repeat(np.asarray(self.prefix_lens, dtype=np.int64) - starts[:-1], q)
            pos = torch.from_numpy(pos).to(self.slot_mapping.device)
            object.__setattr__(self, "_positions", pos)
        return pos

    def check_positions(self, positions: Sequence[int] | torch.Tensor) -> None:
        """Raise :class:`~fullcg.errors.InvalidBatchError` unless the first ``num_tokens``
        entries of ``positions`` are :attr:`positions` (padding rows past them are not read).
        Reads ``positions`` on the host: a debugging check, not for every step."""
        _check_positions(positions, self.positions.cpu().numpy(), np.asarray(self.query_lens))


#: The slots that hold a batch's state, in ``__slots__`` order (``__weakref__`` is Python's).
_SLOTS = tuple(name for name in AttentionMetadata.__slots__ if name != "__weakref__")
