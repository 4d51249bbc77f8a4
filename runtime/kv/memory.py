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

import mmap

import numpy as np

PAGE = mmap.PAGESIZE
MAP_NORESERVE = 0x4000
MADV_POPULATE_WRITE = 23          # Linux 5.14+; Python's mmap module does not name it


class ReservedArray:
    """A zero-filled numpy array over its own anonymous mapping (kept alive with it)."""

    def __init__(self, shape: tuple[int, ...], dtype: str | np.dtype):
        self.dtype = np.dtype(dtype)
        nbytes = max(PAGE, int(np.prod(shape)) * self.dtype.itemsize)
        self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            self.map.madvise(mmap.MADV_NOHUGEPAGE)
        self.array = np.frombuffer(self.map, self.dtype, int(np.prod(shape))).reshape(shape)
        self._populate_ok = True

    def populate(self, start: int, end: int) -> None:
        """Make bytes [start, end) resident (whole pages, rounded outward)."""
        lo, hi = start - start % PAGE, min(len(self.map), -(-end // PAGE) * PAGE)
        if hi <= lo:
            return
        if self._populate_ok:
            try:
                self.map.madvise(MADV_POPULATE_WRITE, lo, hi - lo)
                return
            except OSError:                 # EINVAL: an older kernel; touch the pages instead
                self._populate_ok = False
        touch(self.array, lo, hi)

    def release(self, start: int, end: int) -> None:
        """Give bytes [start, end) back to the OS — only pages wholly inside the range (rounded inward), so no
        byte outside it is ever lost."""
        lo, hi = -(-start // PAGE) * PAGE, end - end % PAGE if end < len(self.map) else len(self.map)
        if hi > lo:
            self.map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def touch(array: np.ndarray, lo: int, hi: int) -> None:
    """Write-fault pages [lo, hi) of `array`'s buffer without changing their contents."""
    flat = array.reshape(-1).view(np.uint8)
    flat[lo:hi:PAGE] |= 0
