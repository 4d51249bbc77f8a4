"""Block tables for paged attention (the GPU path): sequences own KV blocks directly, no slots, no copies.

`PagedKVManager` gives each running sequence a list of blocks of the shared BlockPool. A prompt whose
leading full blocks are in the prefix cache simply references them (refcount +1) — the hit costs no copy
at all, unlike the CPU path's copy into a slot. Fresh blocks are allocated as the sequence grows and
registered under their chained hash once every token in them is computed, so later prompts can share
them. A sequence never writes into a block it shares: it only writes at positions ≥ num_computed, and
the cached prefix stops at least one token short of the prompt.

`build_paged_batch` turns one step's sequences into what the kernels and ORT's PagedAttention read:
block_tables, past_lens, cu_seqlens_q and the slot of every new token (seq_lens and positions follow).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...request import Request
from ...kv.block_pool import BlockPool
from ...kv.hashing import extend_keys
from ...kv.layout import CacheStats


@dataclass(frozen=True)
class PagedBatch:
    block_tables: np.ndarray   # int32 [seqs, max_blocks]   physical block of each logical block (pad: 0, never read)
    past_lens: np.ndarray      # int32 [seqs]               tokens already in the cache
    cu_seqlens_q: np.ndarray   # int32 [seqs + 1]           packed query offsets
    slot_mapping: np.ndarray   # int64 [tokens]             block * block_size + offset (-1: do not write)

    @property
    def seq_lens(self) -> np.ndarray:
        """int32 [seqs]: KV length after this step (past + new)."""
        return (self.past_lens + np.diff(self.cu_seqlens_q)).astype(np.int32)

    @property
    def positions(self) -> np.ndarray:
        """int32 [tokens]: absolute position of each new token."""
        lens = np.diff(self.cu_seqlens_q)
        return (np.repeat(self.past_lens - self.cu_seqlens_q[:-1], lens) + np.arange(lens.sum())).astype(np.int32)

    @property
    def max_query_len(self) -> int:
        return int(np.diff(self.cu_seqlens_q).max(initial=0))

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max(initial=0))


def build_paged_batch(seqs: Sequence[tuple[Sequence[int], int, int]], block_size: int,
                      max_blocks: int | None = None, num_blocks: int | None = None) -> PagedBatch:
    """seqs: (blocks, past_len, num_new) per sequence, in batch order. Every sequence must own enough blocks
    for past_len + num_new tokens; block ids must lie in [0, num_blocks) when num_blocks is given."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, not {block_size}")
    need = [(past + new + block_size - 1) // block_size for _, past, new in seqs]
    width = max_blocks if max_blocks is not None else max([len(b) for b, _, _ in seqs] + [1])
    tables = np.zeros((len(seqs), width), np.int32)
    past_lens = np.zeros(len(seqs), np.int32)
    cu = np.zeros(len(seqs) + 1, np.int32)
    slots = []
    for i, ((blocks, past, new), n) in enumerate(zip(seqs, need)):
        if past < 0 or new < 0:
            raise ValueError(f"sequence {i}: past_len ({past}) and num_new ({new}) must be >= 0")
        if len(blocks) < n:
            raise ValueError(f"sequence {i} needs {n} blocks for {past + new} tokens but owns {len(blocks)}")
        if len(blocks) > width:
            raise ValueError(f"sequence {i} owns {len(blocks)} blocks; the table holds {width}")
        ids = np.asarray(blocks, np.int64)
        if len(ids) and (ids.min() < 0 or (num_blocks is not None and ids.max() >= num_blocks)):
            raise ValueError(f"sequence {i}: block ids must lie in [0, {num_blocks}), got {ids.min()}..{ids.max()}")
        tables[i, :len(ids)] = ids
        past_lens[i] = past
        cu[i + 1] = cu[i] + new
        pos = np.arange(past, past + new, dtype=np.int64)
        slots.append(ids[pos // block_size] * block_size + pos % block_size)
    return PagedBatch(tables, past_lens, cu, np.concatenate(slots) if slots else np.zeros(0, np.int64))


class PagedKVManager:
    """Owns the block lists of running sequences over one BlockPool (bookkeeping only: the KV lives on the
    device, laid out [num_blocks, block_size, kv_heads, head_dim] per layer).

    Admission reserves a request's worst case (prompt + max_tokens, capped at max_model_len) up front, so a
    running sequence never runs out of blocks mid-generation (no eviction, as TensorRT-LLM's guaranteed-no-
    evict policy); cached blocks nobody references count as free and are evicted LRU when needed. It implements
    the backends' KVManager protocol, as the CPU backend's KVCacheManager does, so the scheduler drives both.
    """

    min_chunk = 1                 # paged attention computes a one-token chunk as any other

    def __init__(self, num_blocks: int, block_size: int, num_slots: int | None = None, max_model_len: int | None = None,
                 with_draft: bool = False, prefix_cache: bool = True):
        """with_draft: a draft model keeps its KV under the same tables; a block is cached only once both
        models have computed it. prefix_cache False: blocks are never made findable."""
        self.blocks = BlockPool([], num_blocks, block_size)
        self.block_size = block_size
        self.num_slots = num_slots or num_blocks
        self.max_model_len = max_model_len
        self._free_slots = list(range(self.num_slots))      # sequence indices: `req.slot` marks a holder
        self._tables: dict[str, list[int]] = {}     # request id → its blocks, in logical order
        self._keys: dict[str, list[int]] = {}       # request id → chained keys of its full blocks
        self._registered: dict[str, int] = {}       # request id → leading blocks that are findable
        self.stats = CacheStats()
        self.with_draft, self.prefix_cache = with_draft, prefix_cache
        self._pending: dict[str, Request] = {}      # computed since the last flush

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running sequences (the KV usage reported in metrics)."""
        return self.blocks.num_in_use / self.blocks.num_blocks

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_free_blocks(self) -> int:
        return len(self.blocks.free)

    def table(self, req: Request) -> list[int]:
        return self._tables[req.request_id]

    def _keys_for(self, req: Request) -> list[int]:
        return extend_keys(self._keys.setdefault(req.request_id, []), req.all_ids, self.block_size)

    def allocate(self, req: Request) -> int | None:
        """Start `req`: reference its cached prefix blocks and reserve blocks for its worst case; returns the
        cached tokens, or None (holding nothing) if no sequence index or not enough blocks are free."""
        assert req.request_id not in self._tables, "a request is allocated only while it holds nothing"
        if not self._free_slots:
            return None
        limit = self.blocks.hit_limit(req.num_tokens) if self.prefix_cache else 0
        table = self.blocks.acquire_prefix(self._keys_for(req), req.all_ids, limit)
        self._tables[req.request_id] = table
        self._registered[req.request_id] = hits = len(table)
        if not self.reserve(req, self.worst_case_tokens(req)):
            self.free(req, cache=False)
            return None
        req.slot = heapq.heappop(self._free_slots)
        hit = req.num_computed_draft = hits * self.block_size
        self.stats.queries += len(req.prompt_ids)
        self.stats.hits += min(hit, len(req.prompt_ids))
        return hit

    def worst_case_tokens(self, req: Request) -> int:
        """Tokens `req` reserves blocks for at admission: prompt + max_tokens, capped by the context."""
        worst = req.num_tokens + max(0, req.params.max_tokens - len(req.output_ids))
        return min(worst, self.max_model_len) if self.max_model_len else req.num_tokens

    def can_ever_fit(self, req: Request) -> bool:
        """Whether the whole pool could hold `req`'s reservation (else it would wait at the head forever)."""
        return -(-self.worst_case_tokens(req) // self.block_size) <= self.blocks.num_blocks

    def reserve(self, req: Request, num_tokens: int) -> bool:
        """Make sure `req` owns blocks for its first `num_tokens` tokens; False (nothing taken) if the pool
        cannot supply them — the scheduler then preempts or waits."""
        table = self._tables[req.request_id]
        need = (num_tokens + self.block_size - 1) // self.block_size - len(table)
        if need <= 0:
            return True
        if need > len(self.blocks.free):
            return False
        table.extend(self.blocks.allocate() for _ in range(need))
        return True

    def computed(self, req: Request) -> None:
        if self.prefix_cache:
            self._pending[req.request_id] = req

    def flush(self) -> None:
        for req in self._pending.values():
            self.cache_computed(req)
        self._pending.clear()

    def idle(self) -> bool:
        """Nothing to prepare: blocks are registered in place (flush copies nothing) and device memory is allocated
        up front."""
        return False

    def cache_computed(self, req: Request) -> None:
        """Register the blocks `req` has completely computed, so later prompts can share them (no copy: the
        blocks it holds become findable)."""
        if req.request_id not in self._tables:
            return
        bs, registered = self.block_size, self._registered[req.request_id]
        computed = min(req.num_computed, req.num_computed_draft) if self.with_draft else req.num_computed
        if computed // bs <= registered:
            return                                  # no newly completed block (most steps): nothing to hash
        table, keys = self._tables[req.request_id], self._keys_for(req)
        done = min(computed // bs, len(keys), len(table))
        for i in range(registered, done):
            self.blocks.register(table[i], keys[i], keys[i - 1] if i else 0, tuple(req.tokens(i * bs, (i + 1) * bs)))
        self._registered[req.request_id] = max(done, self._registered[req.request_id])

    def free(self, req: Request, cache: bool = True) -> None:
        """Release every block of `req` (idempotent); registered blocks stay cached until evicted, and with
        `cache` its newly computed blocks are registered first."""
        self._pending.pop(req.request_id, None)
        if cache and self.prefix_cache:
            self.cache_computed(req)
        for block in self._tables.pop(req.request_id, []):
            self.blocks.release(block)
        self._keys.pop(req.request_id, None)
        self._registered.pop(req.request_id, None)
        if req.slot is not None:
            heapq.heappush(self._free_slots, req.slot)
            req.slot = None

    def step_batch(self, reqs: Sequence[Request], num_new: Sequence[int], max_blocks: int | None = None) -> PagedBatch:
        """The paged batch for computing num_new[i] tokens of reqs[i] after its num_computed."""
        return build_paged_batch([(self._tables[r.request_id], r.num_computed, n) for r, n in zip(reqs, num_new)],
                                 self.block_size, max_blocks, self.blocks.num_blocks)
