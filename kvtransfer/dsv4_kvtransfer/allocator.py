"""First-fit extent allocator over the staging region (pure logic, exact byte counts).

Each transfer gets one contiguous extent, so a pull is a byte range and a send is one
memoryview. Extents are rounded up to ``align`` bytes; freeing coalesces with free neighbours,
so when everything is freed the region is one free extent again.
"""

from __future__ import annotations

import bisect

from dsv4_kvtransfer.buffers import align_up


class ExtentAllocator:
    def __init__(self, start: int, size: int, align: int = 4096) -> None:
        if start % align or size < 0:
            raise ValueError(f"start {start} must be a multiple of align {align}, size >= 0")
        self.start = start
        self.size = size - size % align
        self.align = align
        # free extents: sorted offsets and their lengths; never two adjacent ones
        self._free_off: list[int] = [start] if self.size else []
        self._free_len: list[int] = [self.size] if self.size else []
        self._used: dict[int, int] = {}

    @property
    def free_bytes(self) -> int:
        return sum(self._free_len)

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    @property
    def largest_free(self) -> int:
        return max(self._free_len, default=0)

    def free_extents(self) -> list[tuple[int, int]]:
        return list(zip(self._free_off, self._free_len, strict=True))

    def size_of(self, offset: int) -> int:
        return self._used[offset]

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new extent of at least ``nbytes`` (rounded up to ``align``, at least one
        unit), or ``None`` if no free extent is large enough."""
        need = max(align_up(nbytes, self.align), self.align)
        for i, length in enumerate(self._free_len):
            if length >= need:
                off = self._free_off[i]
                if length == need:
                    del self._free_off[i]
                    del self._free_len[i]
                else:
                    self._free_off[i] = off + need
                    self._free_len[i] = length - need
                self._used[off] = need
                return off
        return None

    def free(self, offset: int) -> int:
        """Return an extent; -> its size. Freeing an unknown offset is a bug, so it raises."""
        try:
            size = length = self._used.pop(offset)
        except KeyError:
            raise ValueError(f"offset {offset} is not an allocated extent") from None
        i = bisect.bisect_left(self._free_off, offset)
        # merge with the free extent after, then with the one before
        if i < len(self._free_off) and offset + length == self._free_off[i]:
            length += self._free_len[i]
            del self._free_off[i]
            del self._free_len[i]
        if i > 0 and self._free_off[i - 1] + self._free_len[i - 1] == offset:
            self._free_len[i - 1] += length
        else:
            self._free_off.insert(i, offset)
            self._free_len.insert(i, length)
        return size
