"""KV slot pool: the memory GroupQueryAttention reads, owned by the runtime and bound by pointer.

One array per layer and per K/V (float32, or int8 for --kv-cache int8 engines), shaped
[num_slots, kv_heads, capacity, head_dim] (BNSH). A
running sequence owns one slot; a step over sequences in the contiguous slot range [start, start+count)
binds the pool at that offset, so ONNX Runtime writes new K/V in place and nothing is copied per step.

The arrays are reserved address space (kv/memory.py): a slot's rows become resident when `ensure` asks for them
(a granule of tokens ahead of the writes, so decode steps take no page faults) and go back to the OS on
`release`. What is resident is what the KV manager counts against the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...kv.memory import PAGE, ReservedArray


@dataclass(frozen=True)
class SlotRange:
    start: int
    count: int


class SlotPool:
    GRANULE_TOKENS = 64     # at least this many tokens per populate: one call per 64 decode steps

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: str = "float32"):
        shape = (num_slots, kv_heads, capacity, head_dim)
        self.dtype = np.dtype(dtype)
        self._maps = [ReservedArray(shape, self.dtype) for _ in range(2 * num_layers)]
        self.keys = [m.array for m in self._maps[:num_layers]]      # [slots, kvh, cap, hd] each
        self.values = [m.array for m in self._maps[num_layers:]]    # [slots, kvh, cap, hd] each
        self.num_slots, self.capacity, self.num_layers, self.kv_heads = num_slots, capacity, num_layers, kv_heads
        self.slot_shape = shape[1:]
        self.row_bytes = head_dim * self.dtype.itemsize
        self.slot_bytes = kv_heads * capacity * self.row_bytes
        # Rows that fill whole pages (so a head's populated rows end on a page boundary), in a multiple covering
        # GRANULE_TOKENS; a row size that would need more than 4 granules for that just takes GRANULE_TOKENS.
        whole = PAGE // math.gcd(PAGE, self.row_bytes)
        self.granule = whole * -(-self.GRANULE_TOKENS // whole) if whole <= 4 * self.GRANULE_TOKENS else self.GRANULE_TOKENS
        self.token_bytes = 2 * num_layers * kv_heads * self.row_bytes      # one token of one slot, all layers
        self._resident = [0] * num_slots

    def rounded(self, num_tokens: int) -> int:
        """The resident tokens `ensure(slot, num_tokens)` leaves: a granule multiple, at most the capacity."""
        return min(self.capacity, -(-num_tokens // self.granule) * self.granule)

    def resident_tokens(self, slot: int) -> int:
        return self._resident[slot]

    @property
    def resident_bytes(self) -> int:
        return sum(self._resident) * self.token_bytes

    def _head_ranges(self, slot: int):
        """First byte of the slot's rows of each kv head ([capacity, head_dim] contiguous, BNSH)."""
        for h in range(self.kv_heads):
            yield (slot * self.kv_heads + h) * self.capacity * self.row_bytes

    def ensure(self, slot: int, num_tokens: int) -> int:
        """Rows [0, num_tokens) of `slot` resident in every layer, K and V (populated up to `rounded`); returns the
        slot's resident tokens. A comparison when they already are."""
        have = self._resident[slot]
        if num_tokens <= have:
            return have
        want = self.rounded(num_tokens)
        for m in self._maps:
            for start in self._head_ranges(slot):
                m.populate(start + have * self.row_bytes, start + want * self.row_bytes)
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
