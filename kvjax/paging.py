"""Pages of a paged cache handed out on the host: a free list and reference counts.

A paged cache (a spec's ``page=N`` clause, :mod:`kvjax.cache`) keeps the coded tokens of
every row in one pool of pages; each row's block table names the pool page of each of
its logical pages. :class:`PagePool` decides which pages a row gets, outside ``jit``:
the device arrays keep fixed shapes and only the tables change between steps
(:func:`kvjax.cache.with_pages`).

Rows that share a prompt prefix share its pages: :meth:`PagePool.share` counts a page
once more for every row that holds it. A page is written only while one row holds it:
before a row appends into a shared page, :meth:`PagePool.writable` gives it a fresh
page (the caller copies the codes, :func:`kvjax.cache.copy_pages`) and drops its hold on
the shared one (copy-on-write). Pages of a complete prefix are never written again, so
only the page a prefix ends inside is ever copied.

A pool that has no page left raises :class:`OutOfPagesError`: the caller pauses a
request, or refuses it, rather than write over another row's codes.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

import numpy as np


class OutOfPagesError(MemoryError):
    """Fewer free pages than a request needs: ``needed`` and ``free`` say how many."""

    def __init__(self, needed: int, free: int, total: int):
        super().__init__(f"the page pool has {free} free pages of {total}, {needed} needed")
        self.needed, self.free, self.total = needed, free, total


class PagePool:
    """The pages ``0 .. num_pages - 1`` of a paged cache's pool, each free or held by
    one or more rows (its reference count). Free pages are handed out lowest first, so
    a sequence of calls gives the same pages every time."""

    def __init__(self, num_pages: int):
        if not isinstance(num_pages, int | np.integer) or isinstance(num_pages, bool) \
                or num_pages < 1:
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        self.num_pages = int(num_pages)
        self.refs = np.zeros(self.num_pages, np.int32)
        self._free = list(range(self.num_pages))  # a heap: lowest page first

    @property
    def free(self) -> int:
        """Pages no row holds."""
        return len(self._free)

    @property
    def used(self) -> int:
        """Pages some row holds."""
        return self.num_pages - self.free

    def allocate(self, count: int) -> list[int]:
        """``count`` free pages, now held once each; :class:`OutOfPagesError` (and
        nothing taken) when fewer are free."""
        if not isinstance(count, int | np.integer) or count < 0:
            raise ValueError(f"count must be a non-negative int, got {count!r}")
        if count > self.free:
            raise OutOfPagesError(int(count), self.free, self.num_pages)
        pages = [heapq.heappop(self._free) for _ in range(count)]
        self.refs[pages] = 1
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """Count each of ``pages`` (held already) once more: another row holds it."""
        pages = self._held(pages)
        np.add.at(self.refs, pages, 1)

    def release(self, pages: Iterable[int]) -> None:
        """Drop one hold on each of ``pages``; a page nobody holds any more is free."""
        pages = self._held(pages)
        np.add.at(self.refs, pages, -1)
        if (self.refs < 0).any():
            bad = np.nonzero(self.refs < 0)[0].tolist()
            np.add.at(self.refs, pages, 1)
            raise ValueError(f"pages {bad} released more often than they were held")
        for page in sorted(set(pages)):
            if self.refs[page] == 0:
                heapq.heappush(self._free, page)

    def writable(self, page: int) -> tuple[int, int | None]:
        """The page a row holding ``page`` may write its next blocks to: ``(page,
        None)`` when it is the only holder, else ``(new page, page)``: a fresh page the
        row now holds instead (copy ``page``'s codes onto it before writing)."""
        (page,) = self._held([page])
        if self.refs[page] == 1:
            return page, None
        (fresh,) = self.allocate(1)
        self.refs[page] -= 1
        return fresh, page

    def _held(self, pages: Iterable[int]) -> list[int]:
        pages = [int(p) for p in pages]
        outside = [p for p in pages if not 0 <= p < self.num_pages]
        if outside:
            raise ValueError(f"pages {outside} are outside the pool 0..{self.num_pages - 1}")
        free = [p for p in pages if self.refs[p] == 0]
        if free:
            raise ValueError(f"pages {free} are not held by any row")
        return pages


def table(rows: Sequence[Sequence[int]], row_pages: int) -> np.ndarray:
    """The block tables ``[len(rows), row_pages]`` (int32, ``-1`` past each row's
    pages) of rows holding ``rows[b]``'s pages in order."""
    out = np.full((len(rows), row_pages), -1, np.int32)
    for b, pages in enumerate(rows):
        if len(pages) > row_pages:
            raise ValueError(f"row {b} holds {len(pages)} pages, its table has room for "
                             f"{row_pages}")
        out[b, : len(pages)] = pages
    return out
