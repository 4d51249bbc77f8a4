"""KV slot pool: the memory GroupQueryAttention reads, owned by the runtime and bound by pointer.

One array per layer and per K/V (float32, or int8 for --kv-cache int8 engines), shaped
[num_slots, kv_heads, capacity, head_dim] (BNSH). A
running sequence owns one slot; a step over sequences in the contiguous slot range [start, start+count)
binds the pool at that offset, so ONNX Runtime writes new K/V in place and nothing is copied per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SlotRange:
    start: int
    count: int


class SlotPool:
    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: str = "float32"):
        shape = (num_slots, kv_heads, capacity, head_dim)
        self.dtype = np.dtype(dtype)
        self.keys = [np.zeros(shape, self.dtype) for _ in range(num_layers)]    # [slots, kvh, cap, hd] each
        self.values = [np.zeros(shape, self.dtype) for _ in range(num_layers)]  # [slots, kvh, cap, hd] each
        self.num_slots, self.capacity, self.num_layers = num_slots, capacity, num_layers
        self.slot_shape = shape[1:]
        self.slot_bytes = int(np.prod(shape[1:])) * self.dtype.itemsize

    def prefault(self) -> None:
        """Touch every page now. GroupQueryAttention writes across a slot's whole capacity the first time the slot
        is used, so untouched (lazily allocated) slots cost up to a second of page faults inside a request;
        the budget is reserved up front instead, as GPU servers reserve theirs."""
        for array in self.keys + self.values:
            array.fill(0)

    def pointer(self, array: np.ndarray, slots: SlotRange) -> int:
        assert 0 <= slots.start and slots.start + slots.count <= self.num_slots, slots
        return array.ctypes.data + slots.start * self.slot_bytes
