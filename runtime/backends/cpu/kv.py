"""KVCacheManager: the CPU backend's one owner of KV memory — running sequences' slots and the prefix cache's blocks.

Each running sequence owns a slot of the SlotPool whose memory becomes resident as it grows; full blocks of
computed tokens go into the BlockPool under their chained hash; a finished sequence's slot may be retained for a
follow-up that continues it. No other module frees or copies KV. How and why: docs/design.md, "KV memory on the
CPU".
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from contextlib import contextmanager

import numpy as np

from ...request import Request
from ...kv.block_pool import BlockPool
from ...kv.hashing import extend_keys
from .slots import SlotPool
from ...kv.layout import CacheStats, KVLayout


class _Finished:
    """What a retained slot still has to copy into the prefix cache, apart from the request that left it: its
    tokens and computed counts as they were, and its block references under a key of its own. (The live request
    was kept here before: a preempted one is zeroed and requeued, and freeing it again while it waited dropped the
    block list the next flush read — a KeyError in every later step.)"""

    def __init__(self, req: Request, slot: int):
        self.request_id = f"{req.request_id}@{slot}"
        self.all_ids = req.all_ids
        self.num_computed, self.num_computed_draft = req.num_computed, req.num_computed_draft

    def tokens(self, start: int, end: int) -> list[int]:
        return self.all_ids[start:end]


class KVCacheManager:
    min_chunk = 2                 # GroupQueryAttention's one-row kernel rounds apart: see scheduler.prompt_chunk
    # Bytes copied into the prefix cache per step at most: a burst of prompts computed in one step completes ~170
    # blocks (62 MB on a smollm2 shape) whose copy, all before the next step, made every stream's second token
    # 50-100 ms late at the API (22 ms otherwise); spread over steps it costs about a millisecond a step.
    FLUSH_BYTES = 8 << 20

    def __init__(self, layouts: list[KVLayout], num_slots: int, slot_capacity: int, num_blocks: int, block_size: int,
                 budget_tokens: int | None = None, retained_slots: int = 0, reserve_bytes: int = 0,
                 huge_pages: bool = False):
        """layouts[0] is the target; further layouts (the draft) get slots with the same indices. `budget_tokens`:
        tokens that may be resident in slots at once (None: every slot full); num_blocks 0: no prefix cache;
        `retained_slots`: finished sequences whose slots keep their KV for a follow-up; `reserve_bytes`: never-used
        prefix-cache blocks made resident ahead while the engine is idle (`idle`), so that most of a burst's copies
        (3,560 prompt tokens: 82 MB on a smollm2 shape) land in memory already faulted in; `huge_pages`: long
        sequences' slots grow by transparent huge pages (slots.py)."""
        self.pools = [SlotPool(m.num_layers, num_slots, m.kv_heads, slot_capacity, m.head_dim, m.dtype, huge_pages)
                      for m in layouts]
        self.slots = self.pools[0]
        self.blocks = BlockPool([(m.kv_heads, m.head_dim, m.dtype) for m in layouts for _ in range(m.num_layers)],
                                num_blocks, block_size, reserve_bytes)
        # (pool, layer) of every block-pool layer, in the block pool's order
        self._layers = [(pool, layer) for pool in self.pools for layer in range(pool.num_layers)]
        self.block_size, self.num_slots, self.capacity = block_size, num_slots, slot_capacity
        self.budget_tokens = budget_tokens if budget_tokens is not None else num_slots * slot_capacity
        self._resident = [0] * num_slots                    # tokens resident per slot (a granule multiple)
        self.resident_tokens = 0
        self._free_slots = list(range(num_slots))          # min-heap: lowest slot first keeps batches dense
        self._busy: set[int] = set()
        self._held: dict[str, list[int]] = {}               # request id → blocks it references, in order
        self._keys: dict[str, list[int]] = {}               # request id → chained keys of its full blocks
        self._held_draft: dict[str, int] = {}               # request id → leading held blocks cached with draft KV
        self._target_layers = self.pools[0].num_layers       # block-pool layers [0, this) are the target's
        self._pending: dict[str, Request] = {}              # with completed blocks not yet in the prefix cache
        # retained slot → its finished request, whose completed blocks are still being copied into the prefix cache
        # from the slot (free); done before anything writes, moves or releases that slot (_finish_deferred)
        self._deferred: dict[int, _Finished] = {}
        self._flush_blocks = max(1, self.FLUSH_BYTES // (block_size * sum(m.token_bytes for m in layouts)))
        self.max_retained = retained_slots
        # free slot → (token ids its target KV holds, how many of them the draft's KV holds), LRU first
        self._retained: OrderedDict[int, tuple[np.ndarray, int]] = OrderedDict()
        self.stats = CacheStats()

    # -- capacity ---------------------------------------------------------------------------------
    def _rounded(self, num_tokens: int, have: int = 0) -> int:
        """The tokens every pool holds when a slot holding `have` grows to `num_tokens`: the least count that each
        pool's rounding leaves as it is (pools round to different granules and huge pages)."""
        tokens = num_tokens
        while (more := max(pool.rounded(tokens, have) for pool in self.pools)) != tokens:
            tokens = more
        return tokens

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def usage(self) -> float:
        """Fraction of the slot budget held by sequences (the KV usage reported in metrics; retained slots are a
        cache, given back on demand, as the prefix cache's blocks are)."""
        return (self.resident_tokens - self.retained_tokens) / self.budget_tokens

    def fenced_slots(self, own: set[int]) -> set[int]:
        """Slots a batched call over the slots `own` must not span: other running sequences' (a spanned slot gets a
        dummy row, whose KV write would land in their rows) and retained ones (the dummy would overwrite a row they
        keep, or, written past them, attend over all of it: with many retained chats a decode of two streams
        spanned dozens of those)."""
        return (self._busy - own) | self._retained.keys()

    def decode_fence(self, own: set[int], pool: int = 0) -> tuple[set[int], dict[int, int]]:
        """For a batched decode over the slots `own` (in the target's pool, or pool 1: the draft's): the slots it
        must not span (other running sequences'), and the retained slots it may span with their dummy rows'
        positions — just past the tokens each keeps in that pool, which nobody reads (a prompt continuing it
        recomputes from there). Splitting the batch there instead costs a second call, which reads every weight
        again (conc-8 decode steps 3.5 → 4.4 ms on the bundled target). A retained slot whose memory ends at its
        last kept token stays fenced."""
        dummies = {}
        for slot, (kept, kept_draft) in self._retained.items():
            at = len(kept) if pool == 0 else kept_draft
            if at < self._resident[slot]:
                dummies[slot] = at
        return self.fenced_slots(own) - dummies.keys(), dummies

    def retained_rows(self) -> dict[int, int]:
        """Retained slots → the tokens their KV holds."""
        return {slot: len(ids) for slot, (ids, _) in self._retained.items()}

    @property
    def retained_tokens(self) -> int:
        """Tokens resident in retained slots (counted in `resident_tokens`, given back on demand)."""
        return sum(self._resident[slot] for slot in self._retained)

    def can_ever_fit(self, req: Request) -> bool:
        worst = min(self.capacity, req.num_tokens + req.params.max_tokens)
        return self._rounded(worst) <= self.budget_tokens

    def _keys_for(self, req: Request, ids: list[int] | None = None) -> list[int]:
        """Chained keys of `req`'s full blocks (`ids`: its all_ids, when the caller has them already)."""
        return extend_keys(self._keys.setdefault(req.request_id, []), req.all_ids if ids is None else ids,
                           self.block_size)

    # -- lifecycle --------------------------------------------------------------------------------
    def allocate(self, req: Request) -> int | None:
        """Give `req` a slot with memory for its tokens and one more, holding its longest known prefix — a retained
        slot that starts with it, else cached blocks copied in; returns the tokens it need not compute, or None
        (holding nothing) if no slot or not enough budget is free. Sets `req.num_computed_draft` to the tokens of
        that prefix the draft's KV holds."""
        ids = req.all_ids
        held = self.blocks.acquire_prefix(self._keys_for(req, ids), ids, self.blocks.hit_limit(req.num_tokens))
        cached = len(held) * self.block_size
        slot, kept, kept_draft = self._retained_match(ids, max(0, req.num_tokens - 2))   # the last two: computed
        if slot is None or kept < max(cached, 1):
            slot, kept = self._fresh_slot(), 0
        need = self._rounded(req.num_tokens + 1, 0 if slot is None else self._resident[slot])
        if slot is None or not self._make_room(max(0, need - self._resident[slot]), keep=slot):
            for block in held:
                self.blocks.release(block)
            return None
        if kept:        # it continues the slot's tokens and caches them as its own; what it overwrites is lost
            self._drop_deferred(slot)
        self._retained.pop(slot, None)
        self._free_slots.remove(slot)
        heapq.heapify(self._free_slots)
        req.slot = slot
        self._busy.add(slot)
        self._grow(slot, need)
        assert not self._held.get(req.request_id), "a request is allocated only while it holds nothing"
        self._held[req.request_id] = held
        self._held_draft[req.request_id] = self._draft_prefix(held, 0)
        if not kept:
            self._copy_in(slot, held, self._held_draft[req.request_id])
        hit = max(kept, cached)
        req.num_computed_draft = kept_draft if kept else self._held_draft[req.request_id] * self.block_size
        self.stats.queries += len(req.prompt_ids)
        self.stats.hits += min(hit, len(req.prompt_ids))
        return hit

    # A retained slot is taken by a prompt that continues it: one sharing at least this fraction of what it keeps
    # (llama-server's --slot-prompt-similarity, 0.5 there too). A prompt sharing less — a new user behind the
    # shared system prompt — would otherwise take some other conversation's slot for that short prefix (the
    # blocks give it as well), and that conversation's next turn would find its history only in the prefix
    # cache, or nowhere (#20's workload: a new user took one at every first turn; hit rate 0.92 → 0.87-0.90).
    CONTINUES = 0.5

    def _retained_match(self, ids, limit: int) -> tuple[int | None, int, int]:
        """The retained slot sharing the longest prefix with `ids` (at most `limit` tokens) among those it continues
        (CONTINUES), that length, and how much of it the slot's draft KV holds."""
        best, best_len, best_draft = None, 0, 0
        if not self._retained:
            return best, best_len, best_draft
        ids = np.asarray(ids[:limit])
        for slot, (kept, kept_draft) in self._retained.items():
            need = max(1, math.ceil(self.CONTINUES * len(kept)))     # common tokens that make `ids` continue it
            if len(ids) < need or kept[need - 1] != ids[need - 1]:
                continue                    # cannot continue it: no whole comparison (32 slots, every admission)
            n = min(len(kept), len(ids))
            differ = np.flatnonzero(kept[:n] != ids[:n])
            common = int(differ[0]) if len(differ) else n
            if common > best_len and common >= self.CONTINUES * len(kept):
                best, best_len, best_draft = slot, common, min(common, kept_draft)
        return best, best_len, best_draft

    def _draft_prefix(self, held: list[int], start: int) -> int:
        """How many leading blocks of `held` are cached with the draft's KV, knowing the first `start` are."""
        if len(self.pools) == 1:
            return len(held)
        n = start
        while n < len(held) and self.blocks.has_draft[held[n]]:
            n += 1
        return n

    def _fresh_slot(self) -> int | None:
        """A free slot that holds nothing, else the least recently retained one's (its KV given back), chosen so
        that the running slots stay one range, which a batched decode takes in one call: the empty slot nearest
        the running ones, or with none running the first of the longest run of empty slots. Where the freed
        retained slot lies away from the running ones and another retained slot lies between or beside them, that
        one's KV moves into the freed slot and the request takes its place. (A wave of 8 whose first request took
        the lowest empty slot, 30 retained ones below the next empty ones, split every decode step of the wave in
        two calls, each reading every weight: 4.4 against 3.5 ms on the bundled target.)"""
        empty = sorted(slot for slot in self._free_slots if slot not in self._retained)
        if empty:
            if self._busy:
                lo, hi = min(self._busy), max(self._busy)
                return min(empty, key=lambda s: (max(lo - s, s - hi, 0), s))
            runs = [[empty[0]]]
            for slot in empty[1:]:
                if slot == runs[-1][-1] + 1:
                    runs[-1].append(slot)
                else:
                    runs.append([slot])
            return max(runs, key=len)[0]
        if not self._retained:
            return None
        slot = next(iter(self._retained))
        self._evict(slot)
        near = self._retained_beside_busy()
        if near is None or min(self._busy) - 1 <= slot <= max(self._busy) + 1:   # (near: something runs)
            return slot
        kept, kept_draft = self._retained[near]
        if self.resident_tokens + self._rounded(self._resident[near]) > self.budget_tokens:
            return slot                                     # no room for the copy: the request goes where it was
        self._finish_deferred(near)
        self._grow(slot, self._resident[near])
        for j, pool in enumerate(self.pools):
            n = len(kept) if j == 0 else kept_draft
            for arr in pool.keys + pool.values:
                arr[slot, :, :n] = arr[near, :, :n]
        # the moved entry keeps its place in the retention order
        self._retained = OrderedDict((slot if s == near else s, v) for s, v in self._retained.items())
        self._release(near)
        return near

    def _retained_beside_busy(self) -> int | None:
        """A retained slot between the running ones, else one just below or above their range."""
        if not self._busy:
            return None
        lo, hi = min(self._busy), max(self._busy)
        inside = [s for s in self._retained if lo < s < hi]
        if inside:
            return inside[0]
        return next((s for s in (lo - 1, hi + 1) if s in self._retained), None)

    def _make_room(self, tokens: int, keep: int | None = None) -> bool:
        """Give back retained slots (least recent first, never `keep`) until `tokens` more fit the budget; none if
        all of them would not be enough."""
        others = [s for s in self._retained if s != keep]
        if self.resident_tokens - sum(self._resident[s] for s in others) + tokens > self.budget_tokens:
            return False
        for slot in others:
            if self.resident_tokens + tokens <= self.budget_tokens:
                break
            self._evict(slot)
        return self.resident_tokens + tokens <= self.budget_tokens

    def _evict(self, slot: int) -> None:
        self._finish_deferred(slot)
        del self._retained[slot]
        self._release(slot)

    def _release(self, slot: int) -> None:
        for pool in self.pools:
            pool.release(slot)
        self.resident_tokens -= self._resident[slot]
        self._resident[slot] = 0

    def reserve(self, req: Request, num_tokens: int) -> bool:
        """Memory for `req`'s first `num_tokens` tokens in its slot (every model's), populated a granule ahead;
        False if the budget cannot supply it now. The common case — still inside the granule — is a comparison."""
        slot = req.slot
        if num_tokens <= self._resident[slot]:
            return True
        target = self._rounded(num_tokens, self._resident[slot])
        if not self._make_room(target - self._resident[slot]):
            return False
        self._grow(slot, target)
        return True

    def _grow(self, slot: int, tokens: int) -> None:
        tokens = self._rounded(tokens, self._resident[slot])    # a retained slot may already hold more
        for pool in self.pools:
            pool.ensure(slot, tokens)
        self.resident_tokens += tokens - self._resident[slot]
        self._resident[slot] = tokens

    @contextmanager
    def scratch_slots(self, num_slots: int, num_tokens: int):
        """Slots [0, num_slots) with `num_tokens` resident for warm-up runs, given back afterwards (outside the
        budget: nothing runs yet)."""
        assert len(self._free_slots) == self.num_slots, "scratch slots only before anything runs"
        try:
            for slot in range(num_slots):
                for pool in self.pools:
                    pool.ensure(slot, num_tokens)
            yield
        finally:
            for slot in range(num_slots):
                for pool in self.pools:
                    pool.release(slot)

    def computed(self, req: Request) -> None:
        """After a step: `req`'s newly completed blocks go to the prefix cache from the next step on, into blocks
        made resident now (BlockPool.prepare) — as many as the most any pending request has left to copy, not their
        sum: requests that share a new prompt copy its blocks once (the others find them), and a burst of distinct
        ones has the rest made resident as they are copied."""
        if not self.blocks.num_blocks:
            return
        self._pending[req.request_id] = req
        if self._uncopied(req):
            self.blocks.prepare(max(map(self._uncopied, self._pending.values())))

    def _uncopied(self, req: Request) -> int:
        """Completed blocks of `req` that it does not hold in the prefix cache yet."""
        return max(0, req.num_computed // self.block_size - len(self._held.get(req.request_id, ())))

    def flush(self) -> None:
        """Copy what the last steps completed into the prefix cache, at most FLUSH_BYTES a step (the rest stays
        pending for the next steps): running requests' blocks first, then finished ones' from their retained
        slots."""
        left = self._flush_blocks
        for rid, req in list(self._pending.items()):
            if left <= 0:
                break
            copied = self.cache_computed(req, left) if req.slot is not None else 0
            if copied < left:                       # stopped short of the limit: nothing of it is left to copy
                del self._pending[rid]
            left -= copied
        for slot in list(self._deferred):
            if left <= 0:
                break
            left -= self._finish_deferred(slot, left)

    def idle(self) -> bool:
        """While nothing runs: the pending copies first (FLUSH_BYTES at a time), then never-used blocks made
        resident up to `reserve_bytes` ahead. True while more is left."""
        if self._pending or self._deferred:
            self.flush()
            return True
        return self.blocks.populate_ahead()

    def cache_computed(self, req: Request, limit: int | None = None, slot: int | None = None) -> int:
        """Copy newly completed full blocks of `req` into the prefix cache: the target's KV of every block it has
        computed, the draft's of every block the draft has computed too (also into blocks cached without it).
        At most `limit` block copies; returns how many were made. `slot`: where its KV is (default its own)."""
        rid, bs = req.request_id, self.block_size
        held, held_draft = self._held[rid], self._held_draft[rid]
        done = req.num_computed // bs
        done_draft = done if len(self.pools) == 1 else min(req.num_computed, req.num_computed_draft) // bs
        if done <= len(held) and min(done_draft, len(held)) <= held_draft:
            return 0                                # no newly completed block (most steps): nothing to hash
        keys = self._keys_for(req)
        most = float("inf") if limit is None else limit
        copies: list[tuple[int, int]] = []          # (block position in the sequence, cache block): target KV
        draft_copies: list[tuple[int, int]] = []    # the same for the draft's KV
        with_draft = len(self.pools) > 1
        for i in range(held_draft, min(done_draft, len(held)) if with_draft else 0):
            if len(draft_copies) >= most:
                break
            if not self.blocks.has_draft[held[i]]:
                draft_copies.append((i, held[i]))
        for i in range(len(held), min(done, len(keys))):
            if len(copies) + len(draft_copies) >= most:
                break
            parent = keys[i - 1] if i else 0
            tokens = tuple(req.tokens(i * bs, (i + 1) * bs))
            block = self.blocks.lookup(keys[i], parent, tokens)
            if block is not None:
                self.blocks.acquire(block)          # someone cached the same prefix meanwhile
            else:
                block = self.blocks.allocate(keys[i], parent, tokens)
                if block is None:
                    break                           # every block is referenced: stop caching, nothing breaks
                copies.append((i, block))
            if with_draft and i < done_draft and not self.blocks.has_draft[block]:
                draft_copies.append((i, block))
            held.append(block)
        slot = req.slot if slot is None else slot
        self._copy_out(slot, copies, self._layers[:self._target_layers])
        self._copy_out(slot, draft_copies, self._layers[self._target_layers:], layer_offset=self._target_layers)
        for _, block in draft_copies:
            self.blocks.has_draft[block] = True
        self._held_draft[rid] = self._draft_prefix(held, held_draft)
        return len(copies) + len(draft_copies)

    def free(self, req: Request, cache: bool = True) -> None:
        """Release `req`'s slot and block references (idempotent); with `cache`, its computed full blocks go to the
        prefix cache and the slot may be retained with its KV, else its memory goes back to the OS. A retained
        slot's blocks are copied FLUSH_BYTES at a time by later flushes and idle calls (an 8k-token prompt's ~70 ms
        of copies at its end had delayed whatever came next: a conversation's next turn), the rest here."""
        self._pending.pop(req.request_id, None)
        retain = cache and self.max_retained and req.slot is not None and req.num_computed > 0
        deferred = False
        if cache and req.slot is not None and self.blocks.num_blocks and req.request_id in self._held:
            if not retain:
                self.cache_computed(req)
            elif self.cache_computed(req, self._flush_blocks) == self._flush_blocks:
                deferred = True                     # maybe more: the slot keeps the KV until it is copied
        if not deferred:
            self._forget(req)
        if req.slot is None:
            return
        slot, req.slot = req.slot, None
        done = req.num_computed
        if retain:
            if deferred:                            # its references move to the entry: the request may come back
                entry = self._deferred[slot] = _Finished(req, slot)
                self._held[entry.request_id] = self._held.pop(req.request_id)
                self._held_draft[entry.request_id] = self._held_draft.pop(req.request_id)
                self._keys[entry.request_id] = self._keys.pop(req.request_id, [])
            self._retained[slot] = (np.asarray(req.tokens(0, done)), min(done, req.num_computed_draft))
            while len(self._retained) > self.max_retained:
                self._evict(next(iter(self._retained)))
        else:
            self._release(slot)
        self._busy.discard(slot)
        heapq.heappush(self._free_slots, slot)

    def _forget(self, req: Request) -> None:
        """Drop `req`'s block references and keys."""
        for block in self._held.pop(req.request_id, []):
            self.blocks.release(block)
        self._held_draft.pop(req.request_id, None)
        self._keys.pop(req.request_id, None)

    def _drop_deferred(self, slot: int) -> None:
        """Forget what `slot`'s finished request had left to copy (a request that continues its tokens takes the
        slot: its own completed blocks, the same ones up to where it departs, go to the cache as it computes)."""
        req = self._deferred.pop(slot, None)
        if req is not None:
            self._forget(req)

    def _finish_deferred(self, slot: int, limit: int | None = None) -> int:
        """Copy on (at most `limit` blocks; all of them by default) what the finished request retained in `slot`
        still has to give the prefix cache; returns the copies made."""
        req = self._deferred.get(slot)
        if req is None:
            return 0
        copied = self.cache_computed(req, limit, slot=slot)
        if limit is None or copied < limit:
            del self._deferred[slot]
            self._forget(req)
        return copied

    # -- copies -----------------------------------------------------------------------------------
    def _copy_in(self, slot: int, blocks: list[int], draft_blocks: int) -> None:
        """Cached blocks → rows [0, n·bs) of `slot`, one gather per layer and K/V; the draft's layers only from the
        first `draft_blocks` (the ones cached with its KV)."""
        for j, (pool, layer) in enumerate(self._layers):
            use = blocks if j < self._target_layers else blocks[:draft_blocks]
            if not use:
                continue
            n, idx = len(use) * self.block_size, _index(use)
            for src, dst in ((self.blocks.keys[j], pool.keys[layer]), (self.blocks.values[j], pool.values[layer])):
                rows = dst[slot, :, :n, :]                                   # [kvh, n, hd]
                # the slot's rows as blocks (a view): the gathered blocks land in one strided copy (a reshape of the
                # transposed gather was one more pass over the whole prefix)
                rows.reshape(rows.shape[0], len(use), self.block_size, -1)[...] = src[idx].transpose(1, 0, 2, 3)

    def _copy_out(self, slot: int, copies: list[tuple[int, int]], layers: list, layer_offset: int = 0) -> None:
        """Rows of `slot` → cache blocks, for (block position, cache block) pairs, in the given (pool, layer)s
        (block-pool layers `layer_offset` on): one scatter per layer and K/V (a prompt's ~30 blocks copied one by
        one were ~1,800 small numpy copies, ~6 ms on the first decode step)."""
        if not copies:
            return
        bs, first = self.block_size, copies[0][0]
        span = copies[-1][0] + 1 - first
        picked, blocks = _index([i - first for i, _ in copies]), _index([b for _, b in copies])
        rows = slice(first * bs, (first + span) * bs)
        for j, (pool, layer) in enumerate(layers, layer_offset):
            for src, dst in ((pool.keys[layer], self.blocks.keys[j]), (pool.values[layer], self.blocks.values[j])):
                kv = src[slot, :, rows, :]                                   # [kvh, span·bs, hd]
                dst[blocks] = kv.reshape(kv.shape[0], span, bs, -1)[:, picked].transpose(1, 0, 2, 3)


def _index(ids: list[int]) -> slice | np.ndarray:
    """A slice where the ids run consecutively (a prompt's blocks, fresh blocks handed out in order: the usual case),
    so numpy copies through views in one pass instead of gathering into a temporary first; else an index array."""
    run = range(ids[0], ids[0] + len(ids))
    return slice(run.start, run.stop) if ids == list(run) else np.array(ids)
