"""KV arrays as reserved address space: memory becomes resident where it is written and goes back to the OS on
release.

An anonymous private mapping with MAP_NORESERVE costs no memory until a page is touched and never fails on
overcommit, so every sequence slot can span the whole context. Huge pages are turned off for it: numpy's own
allocations ask for transparent huge pages, and then one write into a slot faults in 2 MiB at once (that, not
GroupQueryAttention, is why a slot used to become resident whole). `populate` makes a byte range resident ahead
of the writes (MADV_POPULATE_WRITE, or touching each page where the kernel lacks it), so ONNX Runtime never
takes a page fault mid-step; `release` hands a range back (MADV_DONTNEED: it reads as zeros afterwards).
A range populated with `huge=True` (2 MiB-aligned, in an array made with `align=HUGE_PAGE`) gets transparent huge
pages after all: a long sequence's KV is read through them (4 KiB pages cost attention a TLB walk and a cold
prefetch stream every 4 KiB), and `release` turns them off again for whatever the range holds next.
"""

from __future__ import annotations

import errno
import mmap
from pathlib import Path

import numpy as np

PAGE = mmap.PAGESIZE
HUGE_PAGE = 2 << 20
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MAP_NORESERVE = 0x4000
MADV_POPULATE_WRITE = 23          # Linux 5.14+; Python's mmap module does not name it
populate_write = True             # False once the kernel refused MADV_POPULATE_WRITE (EINVAL): touch pages instead


def huge_pages_offered() -> bool:
    """Whether madvise(MADV_HUGEPAGE) can give anonymous memory transparent huge pages here."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_ENABLED.read_text()
    except OSError:
        return False


class ReservedArray:
    """A zero-filled numpy array over its own anonymous mapping (kept alive with it), starting `align` bytes
    aligned (a page multiple; the mapping reserves `align` more address space for it)."""

    def __init__(self, shape: tuple[int, ...], dtype: str | np.dtype, align: int = PAGE):
        self.dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        nbytes = max(PAGE, count * self.dtype.itemsize)
        extra = align if align > PAGE else 0
        self.map = mmap.mmap(-1, nbytes + extra, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            self.map.madvise(mmap.MADV_NOHUGEPAGE)
        whole = np.frombuffer(self.map, np.uint8)
        self.offset = -whole.ctypes.data % align if extra else 0   # the array's first byte in the mapping
        self.size = len(self.map) - self.offset                     # its bytes and the reserve after them
        self.array = whole[self.offset:self.offset + count * self.dtype.itemsize].view(self.dtype).reshape(shape)
        self.bytes = self.array.reshape(-1).view(np.uint8)          # the same memory, flat
        self.huge = False                                           # whether any range was populated huge

    @property
    def address(self) -> int:
        return self.array.ctypes.data

    def huge_bytes(self) -> int:
        """Bytes of the mapping on transparent huge pages now (/proc/self/smaps: AnonHugePages of the mappings
        madvise split it into where a range's huge-page setting changed); 0 where smaps cannot be read."""
        first, last = self.address - self.offset, self.address + self.size
        total, inside = 0, False
        try:
            with open("/proc/self/smaps") as f:
                for line in f:
                    head = line.split(maxsplit=1)[0]
                    if "-" in head and not head.endswith(":"):
                        lo, hi = (int(x, 16) for x in head.split("-"))
                        inside = first <= lo and hi <= last
                    elif inside and head == "AnonHugePages:":
                        total += int(line.split()[1]) * 1024
        except OSError:
            return 0
        return total

    def populate(self, start: int, end: int, huge: bool = False) -> None:
        """Make bytes [start, end) resident (whole pages, rounded outward; contents unchanged); `huge`: on
        transparent huge pages (a 2 MiB-aligned range nothing of which is resident yet)."""
        global populate_write
        if end <= start:
            return
        lo, hi = start - start % PAGE, min(self.size, -(-end // PAGE) * PAGE)
        if hi <= lo:
            return
        if huge:
            assert lo % HUGE_PAGE == 0 and hi % HUGE_PAGE == 0 and (self.address + lo) % HUGE_PAGE == 0, (lo, hi)
            self.map.madvise(mmap.MADV_HUGEPAGE, self.offset + lo, hi - lo)
            self.huge = True
        if populate_write:
            try:
                self.map.madvise(MADV_POPULATE_WRITE, self.offset + lo, hi - lo)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:     # ENOMEM and the like are real failures, not a missing feature
                    raise
                populate_write = False          # a kernel before 5.14: touch the pages instead
        touch(self.bytes, lo, hi)

    def release(self, start: int, end: int) -> None:
        """Give bytes [start, end) back to the OS and leave them reading as zeros. Only pages wholly inside the range
        go (rounded inward), so no byte outside it is ever lost; the range's bytes on the partial pages at its ends
        are zeroed where they are not zero already (so an edge page that was never written is not faulted in).
        Pages of it populated huge are small again for what comes next."""
        end = min(end, self.size)
        lo, hi = -(-start // PAGE) * PAGE, end - end % PAGE if end < self.size else self.size
        if hi > lo:
            self.map.madvise(mmap.MADV_DONTNEED, self.offset + lo, hi - lo)
            if self.huge:
                self.map.madvise(mmap.MADV_NOHUGEPAGE, self.offset + lo, hi - lo)
            edges = [(start, lo), (hi, end)]
        else:                                   # within one or two pages that also hold other bytes
            edges = [(start, end)]
        for a, b in edges:
            if a < b and self.bytes[a:b].any():
                self.bytes[a:b] = 0


def touch(flat: np.ndarray, lo: int, hi: int) -> None:
    """Write-fault the pages of bytes [lo, hi) of a flat uint8 view without changing their contents."""
    flat[lo:hi:PAGE] |= 0
