"""`PageAllocator`: hands out page ids of a paged KV pool, with reference counts so
that a prefix cache and the sequences built on it can share full pages."""

from __future__ import annotations

import operator
from typing import Iterable

__all__ = ["PageAllocator", "PoolExhaustedError"]


class PoolExhaustedError(RuntimeError):
    """The KV pool has fewer free pages than a request needs; nothing was allocated."""


class PageAllocator:
    """Page ids ``0 .. num_pages-1``; each allocated page has a reference count >= 1.

    Every method checks its whole argument before changing anything, so a failed call
    leaves the allocator as it was.
    """

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = int(num_pages)
        self._refs = [0] * self.num_pages
        # Popped from the end, so the lowest ids go out first (deterministic layouts).
        self._free = list(range(self.num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        (page,) = self._check_ids([page], allocated=False)
        return self._refs[page]

    def alloc(self, count: int) -> list[int]:
        """``count`` fresh pages with reference count 1."""
        if count < 0:
            raise ValueError(f"cannot allocate {count} pages")
        if count > len(self._free):
            raise PoolExhaustedError(f"KV pool exhausted: need {count} pages, {len(self._free)} of "
                                     f"{self.num_pages} are free")
        pages = [self._free.pop() for _ in range(count)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def retain(self, pages: Iterable[int]) -> None:
        """Adds one reference to each allocated page."""
        pages = self._check_ids(pages, allocated=True)
        for p in pages:
            self._refs[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drops one reference from each page; a page with no references left is free again."""
        pages = self._check_ids(pages, allocated=True)
        drops: dict[int, int] = {}
        for p in pages:
            drops[p] = drops.get(p, 0) + 1
        over = [p for p, n in drops.items() if n > self._refs[p]]
        if over:
            raise ValueError(f"pages {over[:8]} would be freed more often than they are referenced")
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def _check_ids(self, pages: Iterable[int], *, allocated: bool) -> list[int]:
        try:
            pages = [operator.index(p) for p in pages]
        except TypeError as e:
            raise TypeError(f"page ids must be integers: {e}") from None
        bad = [p for p in pages if not 0 <= p < self.num_pages]
        if bad:
            raise ValueError(f"page ids {bad[:8]} are outside [0, {self.num_pages})")
        if allocated:
            unowned = [p for p in pages if self._refs[p] == 0]
            if unowned:
                raise ValueError(f"pages {unowned[:8]} are not allocated")
        return pages
