"""KV arrays as reserved address space: memory becomes resident where it is written and goes back to the OS on
release.

An anonymous private mapping with MAP_NORESERVE costs no memory until a page is touched and never fails on
overcommit, so every sequence slot can span the whole context. Huge pages are turned off for it: numpy's own
allocations ask for transparent huge pages, and then one write into a slot faults in 2 MiB at once (that, not
GroupQueryAttention, is why a slot used to become resident whole). `populate` makes a byte range resident ahead
of the writes (MADV_POPULATE_WRITE, or touching each page where the kernel lacks it), so ONNX Runtime never
takes a page fault mid-step; `release` hands a range back (MADV_DONTNEED: it reads as zeros afterwards).
"""

from __future__ import annotations

import errno
import mmap

import numpy as np

PAGE = mmap.PAGESIZE
MAP_NORESERVE = 0x4000
MADV_POPULATE_WRITE = 23          # Linux 5.14+; Python's mmap module does not name it
populate_write = True             # False once the kernel refused MADV_POPULATE_WRITE (EINVAL): touch pages instead


class ReservedArray:
    """A zero-filled numpy array over its own anonymous mapping (kept alive with it)."""

    def __init__(self, shape: tuple[int, ...], dtype: str | np.dtype):
        self.dtype = np.dtype(dtype)
        nbytes = max(PAGE, int(np.prod(shape)) * self.dtype.itemsize)
        self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            self.map.madvise(mmap.MADV_NOHUGEPAGE)
        self.array = np.frombuffer(self.map, self.dtype, int(np.prod(shape))).reshape(shape)
        self.bytes = self.array.reshape(-1).view(np.uint8)      # the same memory, flat

    @property
    def address(self) -> int:
        return self.array.ctypes.data

    def populate(self, start: int, end: int) -> None:
        """Make bytes [start, end) resident (whole pages, rounded outward; contents unchanged)."""
        global populate_write
        lo, hi = start - start % PAGE, min(len(self.map), -(-end // PAGE) * PAGE)
        if hi <= lo:
            return
        if populate_write:
            try:
                self.map.madvise(MADV_POPULATE_WRITE, lo, hi - lo)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:     # ENOMEM and the like are real failures, not a missing feature
                    raise
                populate_write = False          # a kernel before 5.14: touch the pages instead
        touch(self.bytes, lo, hi)

    def release(self, start: int, end: int) -> None:
        """Give bytes [start, end) back to the OS and leave them reading as zeros. Only pages wholly inside the range
        go (rounded inward), so no byte outside it is ever lost; the range's bytes on the partial pages at its ends
        are zeroed where they are not zero already (so an edge page that was never written is not faulted in)."""
        end = min(end, len(self.bytes))
        lo, hi = -(-start // PAGE) * PAGE, end - end % PAGE if end < len(self.map) else len(self.map)
        if hi > lo:
            self.map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            edges = [(start, lo), (hi, end)]
        else:                                   # within one or two pages that also hold other bytes
            edges = [(start, end)]
        for a, b in edges:
            if a < b and self.bytes[a:b].any():
                self.bytes[a:b] = 0


def touch(flat: np.ndarray, lo: int, hi: int) -> None:
    """Write-fault the pages of bytes [lo, hi) of a flat uint8 view without changing their contents."""
    flat[lo:hi:PAGE] |= 0
