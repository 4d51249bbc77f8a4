"""KV slot pool: the memory GroupQueryAttention reads, owned by the runtime and bound by pointer.

One array per layer and per K/V (float32, or int8 for --kv-cache int8 engines), shaped
[num_slots, kv_heads, capacity, head_dim] (BNSH). A
running sequence owns one slot; a step over sequences in the contiguous slot range [start, start+count)
binds the pool at that offset, so ONNX Runtime writes new K/V in place and nothing is copied per step.

The arrays are reserved address space (kv/memory.py): a slot's rows become resident when `ensure` asks for them
(a granule of tokens ahead of the writes, so decode steps take no page faults) and go back to the OS on
`release`. What is resident is what the KV manager counts against the budget.

With `huge_pages` (serve --kv-huge-pages), long sequences read their KV through 2 MiB pages: each head's rows
start on a huge-page boundary (the rows per head, `rows`, are `capacity` rounded up to whole huge pages: address
space only), and once a slot holds `huge_from` tokens (an eighth of a huge page of rows) it grows by whole huge
pages of every head, each populated at once on transparent huge pages. On 4 KiB pages attention pays a TLB walk
and a cold prefetch stream every 4 KiB (one KV group from memory: 0.77-0.91x the time on huge pages; batch-1 steps
at 2k-8k tokens ~0.96-0.98x, docs/performance.md). A short sequence keeps 64-token granules; a long one holds at
most one partly filled huge page a head beyond its rows (at most 8x its rows at `huge_from`, under 2x past half a
page). Off by default: where the host takes freed huge pages back (a VM with free page reporting, as ours),
populating one costs 5-8 ms, 0.4-2.1 s at a long prompt's admission.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...kv.memory import HUGE_PAGE, PAGE, ReservedArray, huge_pages_offered


@dataclass(frozen=True)
class SlotRange:
    start: int
    count: int


class SlotPool:
    GRANULE_TOKENS = 64     # at least this many tokens per populate: one call per 64 decode steps
    HUGE_FROM = 8           # a slot grows by huge pages once it holds 1/HUGE_FROM of one's rows

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: str = "float32", huge_pages: bool = False):
        """`huge_pages`: grow long sequences by transparent huge pages (where the kernel offers them)."""
        self.dtype = np.dtype(dtype)
        self.row_bytes = head_dim * self.dtype.itemsize
        # rows of one head in a huge page; 0 (none) where rows do not tile one or a head holds less than one
        per_page = HUGE_PAGE // self.row_bytes if HUGE_PAGE % self.row_bytes == 0 else 0
        huge_pages = huge_pages and huge_pages_offered()
        self.huge_rows = per_page if huge_pages and per_page and capacity >= per_page else 0
        self.huge_from = self.huge_rows // self.HUGE_FROM
        self.rows = -(-capacity // self.huge_rows) * self.huge_rows if self.huge_rows else capacity
        shape = (num_slots, kv_heads, self.rows, head_dim)
        align = HUGE_PAGE if self.huge_rows else PAGE
        self._maps = [ReservedArray(shape, self.dtype, align) for _ in range(2 * num_layers)]
        self.keys = [m.array for m in self._maps[:num_layers]]      # [slots, kvh, rows, hd] each
        self.values = [m.array for m in self._maps[num_layers:]]    # [slots, kvh, rows, hd] each
        self.num_slots, self.capacity, self.num_layers, self.kv_heads = num_slots, capacity, num_layers, kv_heads
        self.slot_shape = shape[1:]
        self.slot_bytes = kv_heads * self.rows * self.row_bytes
        # Rows that fill whole pages (so a head's populated rows end on a page boundary), in a multiple covering
        # GRANULE_TOKENS; a row size that would need more than 4 granules for that just takes GRANULE_TOKENS.
        whole = PAGE // math.gcd(PAGE, self.row_bytes)
        self.granule = whole * -(-self.GRANULE_TOKENS // whole) if whole <= 4 * self.GRANULE_TOKENS else self.GRANULE_TOKENS
        self.token_bytes = 2 * num_layers * kv_heads * self.row_bytes      # one token of one slot, all layers
        self._resident = [0] * num_slots

    def rounded(self, num_tokens: int, have: int = 0) -> int:
        """The resident tokens `ensure(slot, num_tokens)` leaves a slot holding `have`: a granule multiple, or, from
        `huge_from` tokens on, the end of the huge page the last token falls in when that page is not begun yet
        (one begun in granules goes on in them); at most the capacity."""
        if num_tokens <= have:
            return have
        fine = min(self.capacity, -(-num_tokens // self.granule) * self.granule)
        if not self.huge_rows or num_tokens < self.huge_from:
            return fine
        page = (num_tokens - 1) // self.huge_rows * self.huge_rows
        return fine if have > page else min(self.capacity, page + self.huge_rows)

    def resident_tokens(self, slot: int) -> int:
        return self._resident[slot]

    @property
    def resident_bytes(self) -> int:
        return sum(self._resident) * self.token_bytes

    @property
    def huge_bytes(self) -> int:
        """Bytes of the pool on transparent huge pages now (read from /proc: for reports, not the step path)."""
        return sum(m.huge_bytes() for m in self._maps)

    def _head_ranges(self, slot: int):
        """First byte of the slot's rows of each kv head ([rows, head_dim] contiguous, BNSH)."""
        for h in range(self.kv_heads):
            yield (slot * self.kv_heads + h) * self.rows * self.row_bytes

    def ensure(self, slot: int, num_tokens: int) -> int:
        """Rows [0, num_tokens) of `slot` resident in every layer, K and V (populated up to `rounded`, whole huge
        pages of rows on huge pages); returns the slot's resident tokens. A comparison when they already are."""
        have = self._resident[slot]
        if num_tokens <= have:
            return have
        want = self.rounded(num_tokens, have)
        # [have, lo) and [hi, want) in 4 KiB pages, the huge pages between them whole
        lo = hi = want
        if self.huge_rows:
            lo, hi = -(-have // self.huge_rows) * self.huge_rows, want // self.huge_rows * self.huge_rows
            lo, hi = (lo, hi) if lo < hi else (want, want)
        rb = self.row_bytes
        for m in self._maps:
            for start in self._head_ranges(slot):
                m.populate(start + have * rb, start + lo * rb)
                m.populate(start + lo * rb, start + hi * rb, huge=True)
                m.populate(start + hi * rb, start + want * rb)
        self._resident[slot] = want
        return want

    def release(self, slot: int) -> None:
        """Give the slot's memory back to the OS (its rows read as zeros afterwards). A slot's heads are contiguous,
        so this is one range per layer and K/V; a page it shares with a neighbouring slot goes too when that
        slot holds nothing resident (what a slot holds outside its resident rows is never read)."""
        if not self._resident[slot]:
            return
        lo, hi = slot * self.slot_bytes, (slot + 1) * self.slot_bytes
        page_lo, page_hi = lo - lo % PAGE, -(-hi // PAGE) * PAGE
        if not any(self._resident[page_lo // self.slot_bytes:slot]):
            lo = page_lo
        if not any(self._resident[slot + 1:-(-page_hi // self.slot_bytes)]):
            hi = page_hi
        for m in self._maps:
            m.release(lo, hi)
        self._resident[slot] = 0

    def pointer(self, array: np.ndarray, slots: SlotRange) -> int:
        assert 0 <= slots.start and slots.start + slots.count <= self.num_slots, slots
        return array.ctypes.data + slots.start * self.slot_bytes
