"""`RangeAllocator`: first-fit byte ranges of one registered staging region.

P is the only writer into RLD's and MD's staging regions, so P hands out their ranges;
a receiver gives a range back (through the front) once it has unpacked it.
"""

from __future__ import annotations

import bisect

__all__ = ["RangeAllocator"]


class RangeAllocator:
    """Contiguous ranges of ``[0, size)``, aligned to ``align`` bytes.

    Example::

        ranges = RangeAllocator(1 << 20)
        off = ranges.alloc(4096)       # None when no free run is long enough
        ranges.free(off)
    """

    def __init__(self, size: int, align: int = 64):
        if size <= 0 or align <= 0:
            raise ValueError(f"size and align must be positive, got {size}, {align}")
        self.size = size
        self.align = align
        self._free: list[tuple[int, int]] = [(0, size)]  # sorted (offset, length), never adjacent
        self._used: dict[int, int] = {}

    @property
    def bytes_free(self) -> int:
        return sum(length for _, length in self._free)

    def alloc(self, nbytes: int) -> int | None:
        if nbytes <= 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        need = -(-nbytes // self.align) * self.align
        for i, (off, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (off + need, length - need)
                self._used[off] = need
                return off
        return None

    def free(self, offset: int) -> None:
        length = self._used.pop(offset, None)
        if length is None:
            raise ValueError(f"offset {offset} is not an allocated range")
        i = bisect.bisect(self._free, (offset, 0))
        self._free.insert(i, (offset, length))
        if i + 1 < len(self._free) and offset + length == self._free[i + 1][0]:
            self._free[i] = (offset, length + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            prev = self._free.pop(i - 1)
            self._free[i - 1] = (prev[0], prev[1] + self._free[i - 1][1])
