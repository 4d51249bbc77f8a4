"""The prefix cache's bookkeeping, exactly: BlockPool reference counts and LRU eviction order, hash-collision
safety, and KVCacheManager's copies between slots and blocks (what is copied, where, for target and draft)."""

import numpy as np
import pytest

from runtime.kv.block_pool import BlockPool
from runtime.kv.memory import huge_pages_offered
from runtime.backends.cpu.kv import KVCacheManager
from runtime.kv.layout import KVLayout
from runtime.request import Request, SamplingParams


def test_block_pool_refcounts_and_lru_eviction_order():
    pool = BlockPool([], num_blocks=3, block_size=2)
    a = pool.allocate(101, 0, (1, 2))
    b = pool.allocate(102, 101, (3, 4))
    c = pool.allocate(103, 0, (5, 6))
    assert (a, b, c) == (0, 1, 2) and pool.allocate() is None and pool.num_in_use == 3
    pool.acquire(a)                                      # a second holder
    assert pool.ref == [2, 1, 1]
    for blk in (c, b, a, a):                             # released in the order c, b, a: evicted in that order
        pool.release(blk)
    assert pool.ref == [0, 0, 0] and list(pool.free) == [c, b, a]
    assert pool.lookup(102, 101, (3, 4)) == b            # released blocks keep their contents and stay findable
    assert pool.acquire_prefix([101, 102], [1, 2, 3, 4], limit=2) == [a, b]   # a hit takes them off the free queue
    assert list(pool.free) == [c] and pool.ref == [1, 1, 0]
    d = pool.allocate(104, 0, (7, 8))                    # the only free block: c is evicted
    assert d == c and pool.evictions == 1 and pool.lookup(103, 0, (5, 6)) is None
    pool.release(d)
    with pytest.raises(AssertionError, match="released more often"):
        pool.release(d)


def test_block_pool_never_returns_a_colliding_block():
    pool = BlockPool([], num_blocks=2, block_size=2)
    blk = pool.allocate(7, 0, (1, 2))
    assert pool.lookup(7, 0, (1, 3)) is None and pool.lookup(7, 5, (1, 2)) is None and pool.lookup(7, 0, (1, 2)) == blk
    assert not pool.register(pool.allocate(), 7, 0, (9, 9))      # a key is held by one block only
    assert pool.acquire_prefix([7], [1, 3], limit=1) == []


def test_manager_copies_blocks_out_of_and_into_slots_for_every_model():
    target, draft = KVLayout(num_layers=2, kv_heads=2, head_dim=3), KVLayout(num_layers=1, kv_heads=1, head_dim=4)
    kv = KVCacheManager([target, draft], num_slots=2, slot_capacity=16, num_blocks=4, block_size=4)
    first = Request(list(range(10, 21)), SamplingParams(max_tokens=1), request_id="first")     # 11 tokens
    assert kv.allocate(first) == 0                       # nothing cached yet
    rng = np.random.default_rng(0)
    for pool in kv.pools:                                # "compute" the slot's KV: random rows
        for arr in pool.keys + pool.values:
            arr[first.slot] = rng.standard_normal(arr[first.slot].shape)
    first.num_computed = first.num_computed_draft = 11
    kv.cache_computed(first)                             # two full blocks of 4: rows [0, 8)
    assert kv.blocks.num_in_use == 2
    for j, (pool, layer) in enumerate(kv._layers):
        for blocks, slots in ((kv.blocks.keys, pool.keys), (kv.blocks.values, pool.values)):
            for i, blk in enumerate(kv._held["first"]):
                np.testing.assert_array_equal(blocks[j][blk], slots[layer][first.slot, :, 4 * i:4 * i + 4])
    kv.free(first)
    second = Request(list(range(10, 20)) + [99, 98], SamplingParams(max_tokens=1), request_id="second")
    assert kv.allocate(second) == 8                      # two cached blocks: rows [0, 8)
    assert second.slot == 0                              # the lowest free slot: the one `first` had
    for pool in kv.pools:                                # wipe, then the hit copies rows [0, 8) back in
        for arr in pool.keys + pool.values:
            arr[second.slot] = 0
    kv._copy_in(second.slot, kv._held["second"], draft_blocks=2)
    for j, (pool, layer) in enumerate(kv._layers):
        for blocks, slots in ((kv.blocks.keys, pool.keys), (kv.blocks.values, pool.values)):
            got = slots[layer][second.slot]
            for i, blk in enumerate(kv._held["second"]):
                np.testing.assert_array_equal(got[:, 4 * i:4 * i + 4], blocks[j][blk])
            assert not got[:, 8:].any()                  # nothing past the hit
    kv.free(second)
    assert kv.blocks.num_in_use == 0 and kv.num_free_slots == 2


def test_flush_spreads_a_burst_of_completed_blocks_over_steps():
    """A step that completed many blocks (a burst of prompts computed whole) copies at most FLUSH_BYTES of them
    into the prefix cache per flush; the rest follow at the next flushes, every byte equal to the slot's rows."""
    target = KVLayout(num_layers=2, kv_heads=2, head_dim=4)
    kv = KVCacheManager([target], num_slots=2, slot_capacity=64, num_blocks=32, block_size=4)
    kv._flush_blocks = 3                                 # (FLUSH_BYTES over the bytes of a block)
    reqs = [Request(list(range(100 * i, 100 * i + 21)), SamplingParams(max_tokens=1), request_id=f"r{i}")
            for i in range(2)]
    rng = np.random.default_rng(0)
    for req in reqs:
        kv.allocate(req)
        for arr in kv.slots.keys + kv.slots.values:
            arr[req.slot] = rng.standard_normal(arr[req.slot].shape)
        req.num_computed = 21                            # five full blocks each
        kv.computed(req)
    cached = []
    for _ in range(4):
        kv.flush()
        cached.append(kv.blocks.num_in_use)
    assert cached == [3, 6, 9, 10]                       # three blocks a flush, then the last one
    for req in reqs:
        for j, layer in enumerate(range(target.num_layers)):
            for blocks, slots in ((kv.blocks.keys, kv.slots.keys), (kv.blocks.values, kv.slots.values)):
                for i, blk in enumerate(kv._held[req.request_id]):
                    np.testing.assert_array_equal(blocks[j][blk], slots[layer][req.slot, :, 4 * i:4 * i + 4])
    assert len(kv._held["r0"]) == len(kv._held["r1"]) == 5


def test_blocks_are_cached_before_the_draft_computes_them_and_get_its_kv_when_it_does():
    """A draft that skipped a prompt (speculation off at that batch size) must not keep the target's blocks out of
    the cache; a hit tells the draft which leading blocks hold its KV, and a draft that catches up later adds its
    KV to blocks cached without it."""
    target, draft = KVLayout(num_layers=2, kv_heads=2, head_dim=3), KVLayout(num_layers=1, kv_heads=1, head_dim=4)
    kv = KVCacheManager([target, draft], num_slots=3, slot_capacity=16, num_blocks=4, block_size=4)
    ids = list(range(10, 21))                                          # 11 tokens: two full blocks of 4
    first = Request(ids, SamplingParams(max_tokens=1), request_id="first")
    assert kv.allocate(first) == 0 and first.num_computed_draft == 0
    rows = filled(kv, first, np.random.default_rng(0))
    first.num_computed, first.num_computed_draft = 11, 5               # the draft computed one block only
    kv.cache_computed(first)
    held = list(kv._held["first"])
    assert len(held) == 2 and [kv.blocks.has_draft[b] for b in held] == [True, False]
    for j, (pool, layer) in enumerate(kv._layers):
        for blocks, slots in ((kv.blocks.keys, pool.keys), (kv.blocks.values, pool.values)):
            for i, blk in enumerate(held[:2 if j < 2 else 1]):         # target: both blocks; draft: the first
                np.testing.assert_array_equal(blocks[j][blk], slots[layer][first.slot, :, 4 * i:4 * i + 4])
    second = Request(ids[:8] + [99, 98, 97], SamplingParams(max_tokens=1), request_id="second")
    assert kv.allocate(second) == 8 and second.num_computed_draft == 4  # the target's hit; the draft's first block
    got = [arr[second.slot] for pool in kv.pools for arr in pool.keys + pool.values]
    for arr, want in zip(got[:4], rows[:4]):                            # target layers: rows [0, 8) copied in
        np.testing.assert_array_equal(arr[:, :8], want[:, :8])
    for arr, want in zip(got[4:], rows[4:]):                            # draft: rows [0, 4) only
        np.testing.assert_array_equal(arr[:, :4], want[:, :4])
        assert not arr[:, 4:].any()
    first.num_computed_draft = 11                                      # the draft catches up: its KV joins block 2
    kv.cache_computed(first)
    assert [kv.blocks.has_draft[b] for b in held] == [True, True] and kv._held["first"] == held
    for blocks, slots in ((kv.blocks.keys[2], kv.pools[1].keys[0]), (kv.blocks.values[2], kv.pools[1].values[0])):
        np.testing.assert_array_equal(blocks[held[1]], slots[first.slot, :, 4:8])
    third = Request(ids[:8] + [1, 2, 3], SamplingParams(max_tokens=1), request_id="third")
    assert kv.allocate(third) == 8 and third.num_computed_draft == 8
    for req in (second, third):
        kv.free(req, cache=False)
    kv.free(first)
    assert kv.blocks.num_in_use == 0


def test_a_retained_slot_gives_the_draft_what_it_had_computed():
    target, draft = KVLayout(num_layers=1, kv_heads=1, head_dim=2), KVLayout(num_layers=1, kv_heads=1, head_dim=2)
    kv = KVCacheManager([target, draft], num_slots=2, slot_capacity=32, num_blocks=0, block_size=4,
                        retained_slots=1)
    first = Request(list(range(10, 23)), SamplingParams(max_tokens=1), request_id="first")    # 13 tokens
    assert kv.allocate(first) == 0
    first.num_computed, first.num_computed_draft = 13, 6
    kv.free(first)
    turn = Request(list(range(10, 23)) + [5, 6, 7], SamplingParams(max_tokens=1), request_id="turn")
    assert kv.allocate(turn) == 13 and turn.slot == 0 and turn.num_computed_draft == 6
    kv.free(turn, cache=False)
    short = Request(list(range(10, 18)) + [1, 2], SamplingParams(max_tokens=1), request_id="short")
    first.num_computed = first.num_computed_draft = 0
    assert kv.allocate(first) == 0
    first.num_computed, first.num_computed_draft = 13, 13
    kv.free(first)
    assert kv.allocate(short) == 8 and short.num_computed_draft == 8   # the common prefix bounds both


def test_a_retained_slot_is_taken_only_by_a_prompt_that_continues_it():
    """A prompt sharing less than half of what a retained slot keeps (a new user behind a shared system prompt)
    gets an empty slot and leaves the retained conversation in place for its own next turn."""
    kv = KVCacheManager([KVLayout(num_layers=1, kv_heads=1, head_dim=2)], num_slots=3, slot_capacity=64,
                        num_blocks=0, block_size=4, retained_slots=2)
    chat = Request(list(range(10, 30)), SamplingParams(max_tokens=1), request_id="chat")      # 20 tokens
    assert kv.allocate(chat) == 0 and chat.slot == 0
    chat.num_computed = 20
    kv.free(chat)
    stranger = Request(list(range(10, 19)) + [1, 2, 3], SamplingParams(max_tokens=1), request_id="stranger")
    assert kv.allocate(stranger) == 0 and stranger.slot == 1            # shares 9 of 20: not a continuation
    assert kv.retained_rows() == {0: 20}
    turn = Request(list(range(10, 30)) + [4, 5], SamplingParams(max_tokens=1), request_id="turn")
    assert kv.allocate(turn) == 20 and turn.slot == 0
    turn.num_computed = 22
    kv.free(turn)
    half = Request(list(range(10, 21)) + [6, 7], SamplingParams(max_tokens=1), request_id="half")
    assert kv.allocate(half) == 11 and half.slot == 0                   # 11 of 22: half, a continuation


def filled(kv, req, rng):
    for pool in kv.pools:
        for arr in pool.keys + pool.values:
            arr[req.slot] = rng.standard_normal(arr[req.slot].shape)
    return [arr[req.slot].copy() for pool in kv.pools for arr in pool.keys + pool.values]


def test_retained_slots_keep_their_kv_for_a_follow_up_and_give_way_first():
    layout = KVLayout(num_layers=1, kv_heads=1, head_dim=16)       # 64-byte rows: a 64-token granule
    kv = KVCacheManager([layout], num_slots=3, slot_capacity=256, num_blocks=4, block_size=4,
                        budget_tokens=3 * 64, retained_slots=1)
    rng = np.random.default_rng(1)
    first = Request(list(range(10, 21)), SamplingParams(max_tokens=1), request_id="first")     # 11 tokens
    assert kv.allocate(first) == 0 and first.slot == 0
    rows = filled(kv, first, rng)
    first.num_computed = 11
    kv.free(first)
    assert kv.retained_rows() == {0: 11} and kv.retained_tokens == 64 == kv.resident_tokens
    other = Request([1, 2, 3], SamplingParams(max_tokens=1), request_id="other")
    assert kv.allocate(other) == 0 and other.slot == 1            # an empty slot, the retained one untouched
    follow = Request(list(range(10, 20)) + [99, 98, 97], SamplingParams(max_tokens=1), request_id="follow")
    assert kv.allocate(follow) == 10 and follow.slot == 0          # 10 shared tokens, not a whole number of blocks
    assert [arr[0].copy() for pool in kv.pools for arr in pool.keys + pool.values][0].tolist() == rows[0].tolist()
    assert kv.retained_rows() == {} and kv.resident_tokens == 128
    follow.num_computed, other.num_computed = 13, 3
    kv.free(other)
    kv.free(follow)                                               # one retained at most: `other` goes back
    assert kv.retained_rows() == {0: 13} and kv.resident_tokens == 64
    assert kv.pools[0].resident_tokens(1) == 0
    big = Request(list(range(500, 700)), SamplingParams(max_tokens=1), request_id="big")     # needs 256 > 192 free
    assert kv.allocate(big) is None and kv.retained_rows() == {0: 13}   # no room even without it: nothing given back
    wide = Request(list(range(500, 620)), SamplingParams(max_tokens=1), request_id="wide")   # 128: fits free budget
    assert kv.allocate(wide) == 0 and wide.slot == 1 and kv.retained_rows() == {0: 13}
    assert kv.reserve(wide, 190) and kv.retained_rows() == {}      # growth takes the retained slot's memory
    assert kv.resident_tokens == 192 and kv.pools[0].resident_tokens(0) == 0
    kv.free(wide, cache=False)                                    # after an error: never retained
    assert kv.retained_rows() == {} and kv.resident_tokens == 0


def test_a_request_evicting_a_far_slot_takes_one_beside_the_running_ones():
    """With no empty slot, a request frees the least recently retained slot; where that lies away from the running
    sequences, the retained slot beside them moves its KV there (rows equal, target's and draft's, its place in the
    retention order kept) and the request takes its place: the running slots stay one range. A follow-up of the
    moved conversation still finds every token of it."""
    target, draft = KVLayout(num_layers=2, kv_heads=2, head_dim=3), KVLayout(num_layers=1, kv_heads=1, head_dim=4)
    kv = KVCacheManager([target, draft], num_slots=6, slot_capacity=32, num_blocks=0, block_size=4,
                        retained_slots=4)
    rng = np.random.default_rng(3)
    reqs = [Request([100 * i + t for t in range(9)], SamplingParams(max_tokens=1), request_id=f"r{i}")
            for i in range(6)]
    rows = {}
    for r in reqs:                                        # slots 0..5, in order
        kv.allocate(r)
        rows[r.request_id] = filled(kv, r, rng)
        r.num_computed, r.num_computed_draft = 9, 7
    assert [r.slot for r in reqs] == list(range(6))
    for r in reqs[:4]:                                    # slots 0..3 retained, oldest first; 4 and 5 keep running
        kv.free(r)
    assert list(kv.retained_rows()) == [0, 1, 2, 3]
    new = Request([7, 7, 7], SamplingParams(max_tokens=1), request_id="new")
    assert kv.allocate(new) == 0
    assert new.slot == 3                                  # beside 4 and 5; slot 0 (least recent) gave its KV back
    assert list(kv.retained_rows()) == [1, 2, 0]          # r3's KV now in slot 0, where the oldest entry stood
    moved = [arr[0] for pool in kv.pools for arr in pool.keys + pool.values]
    for j, (got, want) in enumerate(zip(moved, rows["r3"])):
        n = 9 if j < 2 * target.num_layers else 7        # the target's computed rows, the draft's
        np.testing.assert_array_equal(got[:, :n], want[:, :n])
    follow = Request(reqs[3].prompt_ids + [1, 2], SamplingParams(max_tokens=1), request_id="follow")
    assert kv.allocate(follow) == 9 and follow.slot == 0 and follow.num_computed_draft == 7


def test_requests_take_empty_slots_that_keep_the_running_ones_together():
    """Nothing running: the first slot of the longest run of empty ones (not a lone empty slot among retained
    ones); something running: the empty slot nearest the running ones' range."""
    layout = KVLayout(num_layers=1, kv_heads=1, head_dim=4)
    kv = KVCacheManager([layout], num_slots=8, slot_capacity=32, num_blocks=0, block_size=4, retained_slots=4)
    reqs = [Request([10 * i + t for t in range(5)], SamplingParams(max_tokens=1), request_id=f"r{i}") for i in range(8)]
    for r in reqs[:5]:
        kv.allocate(r)
        r.num_computed = 5
    assert [r.slot for r in reqs[:5]] == [0, 1, 2, 3, 4]
    for r in (reqs[1], reqs[2], reqs[3], reqs[4]):        # 1-4 retained, slot 0 running, 5-7 empty
        kv.free(r)
    kv.free(reqs[0], cache=False)                         # slot 0 empty too: nothing runs
    assert sorted(kv.retained_rows()) == [1, 2, 3, 4]
    kv.allocate(reqs[5])
    assert reqs[5].slot == 5                              # the run 5-7, not the lone empty slot 0
    kv.allocate(reqs[6])
    assert reqs[6].slot == 6                              # beside the running one


@pytest.mark.skipif(not huge_pages_offered(), reason="this kernel offers no transparent huge pages")
def test_target_and_draft_slots_hold_the_same_tokens_when_they_round_to_different_huge_pages():
    """The target's 256-byte rows fill a huge page with 8,192 tokens (huge pages from 1,024), the draft's 128-byte
    rows with 16,384 (from 2,048): the manager grows a slot to the least count both pools keep as it is, and what
    it counts against the budget is what they hold."""
    target, draft = KVLayout(num_layers=1, kv_heads=1, head_dim=64), KVLayout(num_layers=1, kv_heads=1, head_dim=32)
    kv = KVCacheManager([target, draft], num_slots=2, slot_capacity=32768, num_blocks=0, block_size=4, huge_pages=True)
    assert [(p.huge_rows, p.huge_from) for p in kv.pools] == [(8192, 1024), (16384, 2048)]

    def held(req):
        counts = {pool.resident_tokens(req.slot) for pool in kv.pools}
        assert len(counts) == 1 and sum(p.resident_bytes for p in kv.pools) == kv.resident_tokens * sum(
            m.token_bytes for m in (target, draft))
        return counts.pop()

    long = Request(list(range(1500)), SamplingParams(max_tokens=1), request_id="long")
    assert kv.allocate(long) == 0 and held(long) == 16384          # 8,192 for the target, then 16,384 for the draft
    short = Request(list(range(100)), SamplingParams(max_tokens=4000), request_id="short")
    assert kv.allocate(short) == 0 and held(short) == 128
    grown = []
    for n in (1100, 2100, 8200, 16400):
        assert kv.reserve(short, n)
        grown.append(held(short))
    # page 0 begun in granules stays in them (both pools); then whole pages: the target's page 1 (to 16,384), the
    # draft's page 1 (to 32,768, the target following it)
    assert grown == [1152, 2112, 16384, 32768]
    assert kv.resident_tokens == 16384 + 32768
    kv.free(long, cache=False)
    kv.free(short, cache=False)
    assert kv.resident_tokens == 0 and all(p.resident_bytes == 0 for p in kv.pools)
