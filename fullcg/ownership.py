"""A cross-step guard on KV-cache page ownership, for engines (a debugging aid).

One batch cannot show that a new request was handed a page that another, still running
request keeps its prefix in: both page tables look valid on their own. Engines own page
allocation; :class:`PageOwnership` lets them (or :class:`fullcg.engine.BatchScheduler`
with ``check_page_ownership=True``) record who owns each page and check every step
against it before the step writes anything.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fullcg.errors import PageOwnershipError
from fullcg.metadata import AttentionMetadata

__all__ = ["PageOwnership"]

_FREE = -1


class PageOwnership:
    """Which live request owns each of a KV cache's ``num_pages`` pages.

    ``claim`` when a request gets pages, ``release`` when it gives them back, ``check``
    each step's metadata (with the request id of each row) before running it. All three
    are vectorised over pages; ``check`` reads the page table on the host.
    """

    def __init__(self, num_pages: int) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
        self.owner = np.full(num_pages, _FREE, dtype=np.int64)

    def _pages(self, pages: Sequence[int]) -> np.ndarray:
        arr = np.asarray(pages, dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= self.owner.shape[0]):
            raise PageOwnershipError(
                f"pages {arr.tolist()} include ids outside the cache's 0..{self.owner.shape[0] - 1}: allocate from the "
                "cache's pages only"
            )
        return arr

    def claim(self, request_id: int, pages: Sequence[int]) -> None:
        """Record that ``request_id`` now owns ``pages``; raises if a live request owns one of them."""
        arr = self._pages(pages)
        held = self.owner[arr]
        taken = (held != _FREE) & (held != request_id)
        if taken.any():
            i = int(np.flatnonzero(taken)[0])
            raise PageOwnershipError(
                f"page {int(arr[i])} is given to request {request_id} but live request {int(held[i])} owns it (its KV "
                "would be overwritten): hand out only free pages, and free a request's pages only when it finishes"
            )
        self.owner[arr] = request_id

    def release(self, request_id: int, pages: Sequence[int]) -> None:
        """Return ``pages`` of ``request_id`` to the free pool; raises if it does not own one of them."""
        arr = self._pages(pages)
        wrong = self.owner[arr] != request_id
        if wrong.any():
            i = int(np.flatnonzero(wrong)[0])
            raise PageOwnershipError(
                f"request {request_id} releases page {int(arr[i])}, which it does not own (owner: "
                f"{int(self.owner[arr[i]])}, -1 = free): release only the pages a request claimed"
            )
        self.owner[arr] = _FREE

    def check(self, metadata: AttentionMetadata, request_ids: Sequence[int]) -> None:
        """Raise unless every page each row of ``metadata`` reads or writes is owned by that row's request."""
        ids = np.asarray(request_ids, dtype=np.int64)
        if ids.shape != (metadata.num_requests,):
            raise ValueError(f"request_ids needs one id per request ({metadata.num_requests}), got {len(request_ids)}")
        table = metadata.host_page_table().numpy().astype(np.int64, copy=False)
        seq = np.add(metadata.query_lens, metadata.prefix_lens)
        used_mask = np.arange(table.shape[1])[None, :] < (-(-seq // metadata.page_size))[:, None]
        pages = self._pages(table[used_mask])
        rows = np.nonzero(used_mask)[0]
        wrong = self.owner[pages] != ids[rows]
        if wrong.any():
            i = int(np.flatnonzero(wrong)[0])
            r, page = int(rows[i]), int(pages[i])
            owner = int(self.owner[page])
            whose = "no request (it is free)" if owner == _FREE else f"request {owner}"
            raise PageOwnershipError(
                f"row {r} (request {int(ids[r])}) uses page {page}, which {whose} owns: a step may only touch pages "
                "its requests were given (claim them first; never hand out a live request's pages)"
            )
