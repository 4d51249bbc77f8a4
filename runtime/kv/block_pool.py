"""BlockPool: the prefix cache's full KV blocks — storage, reference counts, LRU free queue, hash → block.

A block holds the K and V of `block_size` consecutive tokens for every layer of every model that shares
the cache (the target, and the draft when speculating; [kv_heads, block_size, head_dim] per layer), keyed by
the chained hash of all tokens up to and including it. The draft computes a prompt only when it speculates on
it, so a block may be cached with the target's KV alone: `has_draft` says whether the draft's layers hold its
KV too. A block with reference count 0 sits in the free queue in least-recently-released order and keeps its
contents until it is reused, so it can still be hit; allocation takes the oldest. The tokens and parent key of
each block are stored and compared on lookup, so a hash collision can never return the wrong KV.

The storage is reserved address space (kv/memory.py): blocks become resident as they are first handed out
(populated a chunk of blocks ahead, so the copy into a block never page-faults) and stay resident while cached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from .memory import ReservedArray


class BlockPool:
    def __init__(self, layer_shapes: list[tuple[int, int, str]], num_blocks: int, block_size: int,
                 reserve_bytes: int = 0):
        """layer_shapes: (kv_heads, head_dim, dtype) of every layer of every model sharing the cache (target, draft);
        reserve_bytes: never-used blocks populate_ahead keeps resident."""
        self._maps = [ReservedArray((num_blocks, h, block_size, d), t) for _ in range(2) for h, d, t in layer_shapes]
        self.keys = [m.array for m in self._maps[:len(layer_shapes)]]      # [blocks, kvh, bs, hd]
        self.values = [m.array for m in self._maps[len(layer_shapes):]]    # [blocks, kvh, bs, hd]
        self._populated = 0                # blocks [0, _populated) are resident
        self._handed_out = 0               # blocks [0, _handed_out) have been handed out at least once
        block_bytes = max(1, sum(m.array.strides[0] for m in self._maps))   # one block in every layer, K and V
        self.populate_blocks = max(1, self.POPULATE_BYTES // block_bytes)
        self.reserve_blocks = min(num_blocks, reserve_bytes // block_bytes)   # never-used blocks kept resident
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self.key: list[int | None] = [None] * num_blocks
        self.identity: list[tuple | None] = [None] * num_blocks   # (parent key, token ids) to rule out collisions
        self.has_draft = [False] * num_blocks    # the draft's layers hold this block's KV (not only the target's)
        self.by_key: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.evictions = 0                 # cached blocks overwritten to make room

    # Never-used blocks are made resident this many bytes at a time, ahead of the copies (a copy into them would
    # take page faults mid-step). 64 blocks at a time were 24 MB on a smollm2 shape: a 10-25 ms stall inside one
    # decode step every third step of a burst's flush, where a few MB at a time spreads the same work evenly.
    POPULATE_BYTES = 4 << 20

    def _populate(self, block: int) -> None:
        """Make `block` resident (with the never-used ones after it, up to POPULATE_BYTES): free blocks are handed
        out in index order until every block has been used once."""
        self._handed_out = max(self._handed_out, block + 1)
        if block >= self._populated:
            self._populate_to(min(self.num_blocks, max(block + 1, self._populated + self.populate_blocks)))

    def _populate_to(self, end: int) -> None:
        """Blocks [_populated, end) made resident in every layer."""
        for m in self._maps:
            per_block = m.array[0].nbytes
            m.populate(self._populated * per_block, end * per_block)
        self._populated = end

    def prepare(self, blocks: int) -> None:
        """Make resident the never-used blocks that the next `blocks` allocations will take: the KV manager asks
        as a step completes blocks, so a long prompt's copies over the following decode steps land in memory made
        resident during the prompt's own (long) steps. Copied 8 MB a step, an 8k-token smollm2 prompt's blocks had
        cost each of its first 22 decode steps 5 ms, 3 of them the kernel making fresh pages resident."""
        target = min(self.num_blocks, self._handed_out + blocks)
        if self._populated < target:
            self._populate_to(target)

    def populate_ahead(self) -> bool:
        """Make never-used blocks resident ahead of need, POPULATE_BYTES at a time, until `reserve_blocks` of them
        are: run while the engine is idle, so that the copies after a burst of prompts (a step's worth of blocks)
        land in resident memory instead of faulting it in between two decode steps (6–11 ms a step on a Zen 4
        host, most of it the kernel zeroing pages). True while more is left to do."""
        target = min(self.num_blocks, self._handed_out + self.reserve_blocks)
        if self._populated >= target:
            return False
        self._populate_to(min(target, self._populated + self.populate_blocks))
        return self._populated < target

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - len(self.free)

    def lookup(self, key: int, parent: int, tokens: tuple[int, ...]) -> int | None:
        block = self.by_key.get(key)
        if block is None or self.identity[block] != (parent, tokens):
            return None
        return block

    def hit_limit(self, num_tokens: int) -> int:
        """Most blocks a sequence of `num_tokens` may take from the cache: its last two tokens are always computed
        (one gives the logits; two keep the prompt out of one-row attention, see scheduler.prompt_chunk)."""
        return max(0, num_tokens - 2) // self.block_size

    def acquire_prefix(self, keys: list[int], ids: Sequence[int], limit: int) -> list[int]:
        """Acquire the cached blocks of the longest prefix of `ids` (chained `keys`, at most `limit` blocks,
        normally `hit_limit(len(ids))`); returns them in order."""
        bs, blocks, parent = self.block_size, [], 0
        for i in range(min(len(keys), limit)):
            block = self.lookup(keys[i], parent, tuple(ids[i * bs:(i + 1) * bs]))
            if block is None:
                break
            self.acquire(block)
            blocks.append(block)
            parent = keys[i]
        return blocks

    def acquire(self, block: int) -> None:
        if self.ref[block] == 0:
            del self.free[block]
        self.ref[block] += 1

    def release(self, block: int) -> None:
        assert self.ref[block] > 0, f"block {block} released more often than acquired"
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free[block] = None        # most recently released: evicted last

    def allocate(self, key: int | None = None, parent: int | None = None, tokens: tuple[int, ...] | None = None) -> int | None:
        """Take the least recently used free block (evicting what it held), for `key` or — key None — for a
        sequence to fill before it is registered; None if all are in use."""
        if not self.free:
            return None
        block, _ = self.free.popitem(last=False)
        self._populate(block)
        if self.key[block] is not None:
            del self.by_key[self.key[block]]
            self.evictions += 1
        self.key[block], self.identity[block], self.has_draft[block] = None, None, False
        self.ref[block] = 1
        if key is not None:
            self.register(block, key, parent, tokens)
        return block

    def register(self, block: int, key: int, parent: int, tokens: tuple[int, ...]) -> bool:
        """Make a filled block findable under `key`; False (stays private) if another block already holds it."""
        if key in self.by_key:
            return False
        self.key[block], self.identity[block] = key, (parent, tokens)
        self.by_key[key] = block
        return True
