"""KV memory that follows the tokens, measured: which pages of the reserved KV arrays hold memory (the page
tables of the arrays' own addresses) after SlotPool.ensure / release and BlockPool.allocate, what the rows hold
across them, and the page rounding that must never lose a neighbour's bytes."""

import ctypes
import errno
import mmap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.kv import memory
from runtime.kv.block_pool import BlockPool
from runtime.kv.memory import HUGE_PAGE, PAGE, ReservedArray, huge_pages_offered
from runtime.backends.cpu.slots import SlotPool, SlotRange

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def resident_pages(address: int, lo: int, hi: int) -> np.ndarray:
    """1 for each page holding bytes [lo, hi) of the mapping at `address` (page-aligned) that has a page of
    memory of its own: /proc/self/pagemap's present (bit 63) and exclusively mapped (bit 56) — a page only read
    maps the shared zero page, which mincore would count but costs nothing."""
    first, last = lo // PAGE, -(-hi // PAGE)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek((address // PAGE + first) * 8)
        entries = np.frombuffer(f.read(8 * max(0, last - first)), np.uint64)
    return ((entries >> np.uint64(63)) & (entries >> np.uint64(56)) & np.uint64(1)).astype(np.uint8)


def mincore_count(address: int, length: int) -> int:
    """Pages of [address, address + length) in memory at all, by mincore (one call, even for 64 GiB)."""
    n = -(-length // PAGE)
    vec = (ctypes.c_ubyte * n)()
    if _libc.mincore(address, n * PAGE, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return int((np.frombuffer(vec, np.uint8) & 1).sum())


def resident_count(m: ReservedArray, lo: int = 0, hi: int | None = None) -> int:
    return int(resident_pages(m.address, lo, m.size if hi is None else hi).sum())


def head_ranges(pool: SlotPool, slot: int) -> list[tuple[int, int]]:
    """Byte range [start, end) of every kv head's rows of `slot` (BNSH: [rows, head_dim] contiguous)."""
    size = pool.rows * pool.row_bytes
    return [((slot * pool.kv_heads + h) * size, (slot * pool.kv_heads + h + 1) * size) for h in range(pool.kv_heads)]


def expected_pages(pool: SlotPool, tokens: dict[int, int], total: int) -> np.ndarray:
    """Pages of one array that `ensure` leaves resident for `tokens` (slot → resident tokens): rows rounded out."""
    want = np.zeros(-(-total // PAGE), np.uint8)
    for slot, n in tokens.items():
        for start, _ in head_ranges(pool, slot):
            if n:
                want[start // PAGE:-(-(start + n * pool.row_bytes) // PAGE)] = 1
    return want


def check_residency(pool: SlotPool, tokens: dict[int, int]) -> None:
    """Exactly the pages of the resident rows hold memory — or, where slots do not end on a page boundary, those
    and at most the pages a released slot shares with a resident neighbour (bounded: one per slot boundary)."""
    for m in pool._maps:
        got, want = resident_pages(m.address, 0, m.size), expected_pages(pool, tokens, m.size)
        if pool.slot_bytes % PAGE == 0:
            assert np.array_equal(got, want)
        else:
            shared = np.zeros_like(want)
            shared[[k * pool.slot_bytes // PAGE for k in range(1, pool.num_slots)]] = 1
            assert (got >= want).all() and (got <= want | shared).all()


def small_pool(**kw) -> SlotPool:
    args = dict(num_layers=2, num_slots=3, kv_heads=2, capacity=256, head_dim=64, dtype="float32") | kw
    return SlotPool(**args)


# -- reserved address space ----------------------------------------------------------------------------

def test_reserving_more_than_ram_costs_no_memory():
    """64 GiB of address space — more than this machine's RAM, and so more than overcommit would grant without
    MAP_NORESERVE — is reserved with nothing resident; a populated range is exactly its pages, and returns."""
    m = ReservedArray((64, 1024, 1024, 1024), np.int8)
    assert m.array.nbytes == 64 << 30 and mincore_count(m.address, len(m.map)) == 0
    lo = (40 << 30) + 123
    m.populate(lo, lo + 3 * PAGE)                      # 3 pages of bytes, not aligned: 4 pages
    assert mincore_count(m.address, len(m.map)) == 4 and resident_count(m, lo, lo + 3 * PAGE) == 4
    m.release(lo - lo % PAGE, lo - lo % PAGE + 4 * PAGE)
    assert mincore_count(m.address, len(m.map)) == 0


def test_mapping_has_no_huge_pages():
    """The first write into a slot must fault in a 4 KiB page, not a 2 MiB huge page (numpy's own allocations
    ask for transparent huge pages; that is what used to make a whole slot resident)."""
    m = ReservedArray((16, 1 << 20), np.uint8)        # 16 MiB: room for huge pages
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.split("-")[0] == f"{m.address:x}")
    flags = next(line for line in lines[start + 1:] if line.startswith("VmFlags:"))
    assert " nh" in flags and " hg" not in flags
    m.array[5, 12345] = 1                              # one write: one page
    assert resident_count(m) == 1


def test_populate_rounds_out_and_release_rounds_in():
    m = ReservedArray((8 * PAGE,), np.uint8)
    m.populate(PAGE + 5, 3 * PAGE - 5)                 # bytes in pages 1 and 2
    assert list(resident_pages(m.address, 0, 8 * PAGE)) == [0, 1, 1, 0, 0, 0, 0, 0]
    m.populate(0, 8 * PAGE)
    m.bytes[:] = 7
    m.release(PAGE + 100, 5 * PAGE - 100)              # pages 2, 3 wholly inside; 1 and 4 are shared
    assert list(resident_pages(m.address, 0, 8 * PAGE)) == [1, 1, 0, 0, 1, 1, 1, 1]
    assert (m.bytes[PAGE + 100:5 * PAGE - 100] == 0).all()            # the range reads as zeros
    assert (m.bytes[:PAGE + 100] == 7).all() and (m.bytes[5 * PAGE - 100:] == 7).all()   # nothing outside lost
    m.release(6 * PAGE + 1, 6 * PAGE + 9)             # inside one page: zeroed, not freed
    assert resident_count(m) == 6 and (m.bytes[6 * PAGE + 1:6 * PAGE + 9] == 0).all() and m.bytes[6 * PAGE] == 7
    m.release(0, 8 * PAGE)
    assert resident_count(m) == 0 and not m.bytes.any()


def test_release_does_not_fault_in_pages_to_zero_them():
    """The range's bytes on a partial edge page are zeroed only where they are not zero already: releasing a
    range whose edge page was never touched leaves it untouched."""
    m = ReservedArray((4 * PAGE,), np.uint8)
    m.populate(0, 100)
    m.bytes[:100] = 1
    m.release(0, 2 * PAGE + 100)
    assert resident_count(m) == 0 and not m.bytes[:100].any()     # (reading page 2 mapped the zero page, no memory)


def test_populate_falls_back_to_touching_pages_where_the_kernel_refuses(monkeypatch):
    class OldKernel:                                   # a mapping whose madvise knows no MADV_POPULATE_WRITE
        def __init__(self, inner, err):
            self.inner, self.err, self.calls = inner, err, []

        def __len__(self):
            return len(self.inner)

        def madvise(self, option, *args):
            self.calls.append(option)
            if option == memory.MADV_POPULATE_WRITE:
                raise OSError(self.err, "madvise")
            return self.inner.madvise(option, *args)

    monkeypatch.setattr(memory, "populate_write", True)
    m = ReservedArray((8 * PAGE,), np.uint8)
    m.bytes[PAGE] = 9                                  # contents are kept: touching writes what is there
    m.map = OldKernel(m.map, errno.EINVAL)
    m.populate(PAGE + 1, 4 * PAGE - 1)
    assert memory.populate_write is False and list(resident_pages(m.address, 0, 8 * PAGE)) == [0, 1, 1, 1, 0, 0, 0, 0]
    assert m.bytes[PAGE] == 9 and m.bytes.sum() == 9
    m.populate(6 * PAGE, 7 * PAGE)                     # remembered: no second attempt
    assert m.map.calls == [memory.MADV_POPULATE_WRITE] and resident_count(m) == 4

    monkeypatch.setattr(memory, "populate_write", True)
    m.map = OldKernel(m.map.inner, errno.ENOMEM)      # out of memory is not a missing feature
    with pytest.raises(OSError):
        m.populate(0, PAGE)
    assert memory.populate_write is True


# -- SlotPool ------------------------------------------------------------------------------------------

def test_slot_pool_reserves_without_memory_and_keeps_its_interface():
    pool = SlotPool(num_layers=6, num_slots=64, kv_heads=4, capacity=2048, head_dim=64, dtype="float32")
    assert pool.keys[0].shape == (64, 4, 2048, 64) and len(pool.keys) == len(pool.values) == pool.num_layers == 6
    assert pool.slot_shape == (4, 2048, 64) and pool.slot_bytes == 4 * 2048 * 64 * 4 and pool.dtype == np.float32
    assert pool.pointer(pool.values[3], SlotRange(5, 2)) == pool.values[3].ctypes.data + 5 * pool.slot_bytes
    assert not hasattr(pool, "prefault")
    assert sum(resident_count(m) for m in pool._maps) == 0 and pool.resident_bytes == 0
    assert pool.granule == 64 and (pool.granule * pool.row_bytes) % PAGE == 0


@pytest.mark.parametrize("head_dim, dtype, granule", [(64, "float32", 64), (64, "int8", 64), (128, "float32", 64),
                                                      (96, "float32", 64), (48, "int8", 256), (24, "int8", 64),
                                                      (3, "int8", 64)])
def test_granule_is_whole_pages_where_it_can_be(head_dim, dtype, granule):
    pool = SlotPool(1, 1, 1, 4096, head_dim, dtype)
    assert pool.granule == granule
    assert pool.granule >= SlotPool.GRANULE_TOKENS and (head_dim in (3, 24) or pool.granule * pool.row_bytes % PAGE == 0)


def test_ensure_makes_exactly_the_slots_rows_resident():
    pool = small_pool(capacity=200)                    # not a granule multiple: the last granule is clamped
    assert [pool.rounded(n) for n in (0, 1, 64, 65, 190, 193, 500)] == [0, 64, 64, 128, 192, 200, 200]
    assert pool.ensure(1, 10) == 64 and pool.resident_tokens(1) == 64
    check_residency(pool, {1: 64})
    assert pool.resident_bytes == 64 * pool.token_bytes == 64 * 2 * 2 * 2 * 64 * 4
    assert pool.ensure(1, 65) == 128 and pool.ensure(2, 1) == 64
    check_residency(pool, {1: 128, 2: 64})
    assert pool.ensure(1, 10_000) == 200 and pool.resident_tokens(1) == 200
    check_residency(pool, {1: 200, 2: 64})
    assert pool.resident_bytes == 264 * pool.token_bytes and pool.resident_tokens(0) == 0


def test_ensure_fast_path_makes_no_call(monkeypatch):
    pool = small_pool()
    pool.ensure(0, 100)

    def fail(*_):
        raise AssertionError("populate called for rows already resident")
    for m in pool._maps:
        monkeypatch.setattr(m, "populate", fail)
    assert [pool.ensure(0, n) for n in (0, 1, 100, 128)] == [128] * 4


def test_growth_keeps_rows_and_release_returns_them_as_zeros():
    pool = small_pool()
    rng = np.random.default_rng(0)
    pool.ensure(1, 50)
    rows = [rng.standard_normal((2, 50, 64)).astype(np.float32) for _ in pool._maps]
    for m, r in zip(pool._maps, rows):
        m.array[1, :, :50] = r
    pool.ensure(1, 130)                                # two more granules: the first keeps its rows
    check_residency(pool, {1: 192})
    for m, r in zip(pool._maps, rows):
        assert np.array_equal(m.array[1, :, :50], r) and not m.array[1, :, 50:].any()
    pool.release(1)
    assert pool.resident_tokens(1) == 0 and pool.resident_bytes == 0
    check_residency(pool, {})                          # measured before reading: a read maps the zero page
    assert not any(m.array.any() for m in pool._maps)
    pool.release(1)                                    # nothing resident: nothing to do
    assert pool.ensure(1, 1) == 64                     # reusable
    check_residency(pool, {1: 64})


def test_ensure_through_the_fallback_gives_the_same_pages(monkeypatch):
    monkeypatch.setattr(memory, "populate_write", False)
    pool = small_pool(capacity=200)
    pool.ensure(0, 70)
    pool.ensure(2, 199)
    pool.keys[1][0, 1, :70] = 3.0
    pool.ensure(0, 150)
    check_residency(pool, {0: 192, 2: 200})
    assert (pool.keys[1][0, 1, :70] == 3.0).all() and not pool.keys[1][0, 1, 70:].any()
    pool.release(0)
    check_residency(pool, {2: 200})


@pytest.mark.parametrize("capacity, head_dim, dtype", [(100, 64, "float32"), (77, 24, "int8"), (200, 3, "int8"),
                                                       (64, 64, "float32")])
def test_release_never_loses_a_neighbours_bytes(capacity, head_dim, dtype):
    """Head row ranges that start and end mid-page (capacity × row bytes not a page multiple): releasing one
    slot zeroes its rows and keeps every other byte of every other slot."""
    pool = SlotPool(num_layers=2, num_slots=4, kv_heads=3, capacity=capacity, head_dim=head_dim, dtype=dtype)
    for slot in range(4):
        pool.ensure(slot, capacity)
    for i, m in enumerate(pool._maps):
        m.bytes[:] = np.arange(m.bytes.size) % 251 + 1 + i      # nonzero everywhere
    before = [m.bytes.copy() for m in pool._maps]
    pool.release(2)
    for m, b in zip(pool._maps, before):
        a = m.array.view(np.uint8).reshape(4, -1)
        assert not a[2].any()
        assert np.array_equal(np.delete(a, 2, axis=0), np.delete(b.reshape(4, -1), 2, axis=0))
    pool.release(0)
    pool.release(3)
    for m in pool._maps:                               # slot 1 alone still holds its rows
        assert m.array.view(np.uint8).reshape(4, -1)[[0, 2, 3]].sum() == 0
    for m, b in zip(pool._maps, before):
        assert np.array_equal(m.array.view(np.uint8).reshape(4, -1)[1], b.reshape(4, -1)[1])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["ensure", "release", "write"]), st.integers(0, 3), st.integers(0, 260)),
                max_size=30),
       st.sampled_from([(256, 64, "float32"), (200, 64, "float32"), (150, 24, "int8")]))
def test_ensure_release_sequences_match_a_model(ops, geometry):
    capacity, head_dim, dtype = geometry
    pool = SlotPool(num_layers=2, num_slots=4, kv_heads=2, capacity=capacity, head_dim=head_dim, dtype=dtype)
    model = {s: 0 for s in range(4)}                   # resident tokens per slot
    written = {s: 0 for s in range(4)}                 # rows [0, written) of the slot hold its pattern
    pattern = [[np.full((2, capacity, head_dim), 1 + s + 10 * i, dtype) for s in range(4)] for i in range(4)]
    for op, slot, n in ops:
        if op == "ensure":
            got = pool.ensure(slot, n)
            if n > model[slot]:
                model[slot] = min(capacity, -(-n // pool.granule) * pool.granule)
            assert got == model[slot]
        elif op == "release":
            pool.release(slot)
            model[slot], written[slot] = 0, 0
        else:                                          # the runtime writes only rows it ensured
            rows = min(n, model[slot])
            for i, m in enumerate(pool._maps):
                m.array[slot, :, :rows] = pattern[i][slot][:, :rows]
            written[slot] = max(written[slot], rows)
        assert [pool.resident_tokens(s) for s in range(4)] == [model[s] for s in range(4)]
        assert pool.resident_bytes == sum(model.values()) * pool.token_bytes
    check_residency(pool, model)
    for i, m in enumerate(pool._maps):
        for s in range(4):
            w = written[s]
            assert np.array_equal(m.array[s, :, :w], pattern[i][s][:, :w]) and not m.array[s, :, w:].any()


# -- huge pages for long sequences ---------------------------------------------------------------------

huge_only = pytest.mark.skipif(not huge_pages_offered(), reason="this kernel offers no transparent huge pages")


def long_pool(**kw) -> SlotPool:
    """256-byte rows: 8,192 of a head to a huge page, huge pages from 1,024 tokens; capacity 20,000 (the last
    huge page of a head only partly usable: its rows stay on 4 KiB pages)."""
    args = dict(num_layers=1, num_slots=3, kv_heads=2, capacity=20000, head_dim=64, dtype="float32",
                huge_pages=True) | kw
    return SlotPool(**args)


@huge_only
def test_long_sequences_grow_by_whole_huge_pages_and_short_ones_by_granules():
    pool = long_pool()
    H = pool.huge_rows
    assert (H, pool.huge_from, pool.rows, pool.slot_shape) == (8192, 1024, 24576, (2, 24576, 64))
    assert all(m.address % HUGE_PAGE == 0 and pool.slot_bytes % HUGE_PAGE == 0 for m in pool._maps)
    assert [pool.rounded(n) for n in (1, 1000, 1023, 1024, 8192, 8193, 16385, 30000)] == \
        [64, 1024, 1024, H, H, 2 * H, 20000, 20000]
    assert pool.rounded(1100, have=1024) == 1152         # page 0 begun in granules goes on in them
    assert pool.rounded(9000, have=1152) == pool.rounded(8300, have=H) == 2 * H      # the next page: whole
    assert pool.rounded(8300, have=8256) == 8320

    assert pool.ensure(0, 100) == 128                    # short: a granule on 4 KiB pages
    assert pool.ensure(1, 3000) == H                     # a long prompt: a whole huge page of each head
    check_residency(pool, {0: 128, 1: H})
    assert [m.huge_bytes() for m in pool._maps] == [2 * HUGE_PAGE] * 2
    rng = np.random.default_rng(0)
    rows = [rng.standard_normal((2, 2, 3000, 64)).astype(np.float32) for _ in pool._maps]
    for m, r in zip(pool._maps, rows):                   # the runtime writes only rows it ensured
        m.array[0, :, :128], m.array[1, :, :3000] = r[0, :, :128], r[1]
    assert pool.ensure(0, 1100) == 1152 and pool.ensure(0, H + 1) == 2 * H   # page 1 whole, page 0 in granules
    assert pool.ensure(1, 2 * H + 1) == 20000            # page 1 whole; page 2 past the capacity in granules
    check_residency(pool, {0: 2 * H, 1: 20000})
    assert [m.huge_bytes() for m in pool._maps] == [6 * HUGE_PAGE] * 2
    for m, r in zip(pool._maps, rows):                   # growth kept every row
        assert np.array_equal(m.array[0, :, :128], r[0, :, :128]) and not m.array[0, :, 128:].any()
        assert np.array_equal(m.array[1, :, :3000], r[1]) and not m.array[1, :, 3000:].any()

    pool.release(1)
    check_residency(pool, {0: 2 * H})
    assert [m.huge_bytes() for m in pool._maps] == [2 * HUGE_PAGE] * 2 and not any(m.array[1].any() for m in pool._maps)
    assert pool.ensure(1, 100) == 128                    # the slot's next short sequence: 4 KiB pages again
    check_residency(pool, {0: 2 * H, 1: 128})
    assert [m.huge_bytes() for m in pool._maps] == [2 * HUGE_PAGE] * 2


def test_no_huge_pages_where_turned_off_or_rows_do_not_tile_one():
    assert long_pool(huge_pages=False).huge_rows == 0 and long_pool(huge_pages=False).rows == 20000
    assert SlotPool(1, 3, 2, 20000, 64).huge_rows == 0           # off unless asked for
    assert long_pool(head_dim=96).huge_rows == 0                 # 384-byte rows do not tile 2 MiB
    assert long_pool(capacity=8191).huge_rows == 0               # a head never fills one
    pool = long_pool(huge_pages=False)
    assert pool.rounded(3000) == 3008 and pool.ensure(1, 3000) == 3008
    check_residency(pool, {1: 3008})
    assert [m.huge_bytes() for m in pool._maps] == [0, 0]


@huge_only
@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["ensure", "release", "write"]), st.integers(0, 1),
                          st.integers(0, 20000)), max_size=10))
def test_huge_page_growth_matches_a_model(ops):
    """Resident tokens, resident pages, which pages are huge, and the rows written — against a model of the rule:
    64-token granules below 1,024 tokens or on a page begun in them, else to the end of the last token's huge
    page (at most the capacity); a page populated whole at once is huge."""
    pool = long_pool(num_slots=2)
    H, capacity = 8192, 20000
    model = {0: 0, 1: 0}
    huge: dict[int, set[int]] = {0: set(), 1: set()}   # slot → its huge page indices
    written = {0: 0, 1: 0}
    for op, slot, n in ops:
        have = model[slot]
        if op == "ensure":
            if n > have:
                page = (n - 1) // H * H
                grain = min(capacity, -(-n // 64) * 64)
                model[slot] = grain if n < 1024 or have > page else min(capacity, page + H)
                huge[slot] |= {p for p in range(-(-have // H), model[slot] // H)}
            assert pool.ensure(slot, n) == model[slot]
        elif op == "release":
            pool.release(slot)
            model[slot], written[slot], huge[slot] = 0, 0, set()
        else:
            rows = min(n, have)
            for i, m in enumerate(pool._maps):
                m.array[slot, :, :rows] = 1 + slot + 10 * i
            written[slot] = max(written[slot], rows)
    check_residency(pool, model)
    assert [m.huge_bytes() for m in pool._maps] == [2 * HUGE_PAGE * sum(map(len, huge.values()))] * 2
    for i, m in enumerate(pool._maps):
        for s in range(2):
            w = written[s]
            assert (m.array[s, :, :w] == 1 + s + 10 * i).all() and not m.array[s, :, w:].any()


# -- BlockPool -----------------------------------------------------------------------------------------

def test_block_pool_populates_blocks_as_they_are_first_handed_out():
    layers = [(4, 64, "float32"), (4, 64, "float32"), (2, 64, "int8")]          # e.g. a target and a draft
    pool = BlockPool(layers, num_blocks=200, block_size=16)
    assert not hasattr(pool, "prefault") and sum(resident_count(m) for m in pool._maps) == 0
    n = pool.populate_blocks
    assert 1 < n < pool.num_blocks // 2        # POPULATE_BYTES of these blocks: several chunks in the pool

    def resident_blocks():
        counts = set()
        for m in pool._maps:
            per_block = m.array[0].nbytes
            pages = resident_pages(m.address, 0, m.size)
            blocks = [b for b in range(pool.num_blocks) if pages[b * per_block // PAGE:-(-(b + 1) * per_block // PAGE)].all()]
            assert int(pages.sum()) == -(-len(blocks) * per_block // PAGE)  # whole blocks, in index order, nothing else
            counts.add(len(blocks))
        assert len(counts) == 1
        return counts.pop()

    first = pool.allocate(1, 0, (1,))
    assert first == 0 and resident_blocks() == n       # one chunk ahead: the next n - 1 copies fault nothing
    held = [first] + [pool.allocate() for _ in range(n - 1)]
    assert resident_blocks() == n
    held.append(pool.allocate())
    assert resident_blocks() == 2 * n
    for b in held:
        pool.release(b)
    assert resident_blocks() == 2 * n                  # cached blocks stay resident
    assert pool.lookup(1, 0, (1,)) == 0
    while pool.allocate() is not None:
        pass
    assert resident_blocks() == pool.num_blocks == 200 and pool.num_in_use == 200


def test_block_pool_populates_a_reserve_ahead_while_idle():
    """populate_ahead (the engine's idle work) makes never-used blocks resident, a chunk a call, up to
    `reserve_blocks` past the last block ever handed out — never more, never beyond the pool — and blocks handed out
    later find their memory already resident."""
    layers = [(4, 64, "float32"), (2, 64, "int8")]
    pool = BlockPool(layers, num_blocks=300, block_size=16)
    n = pool.populate_blocks
    pool.reserve_blocks = 2 * n + 3                    # not a whole number of chunks

    def resident_block_count():                        # the float32 layers' blocks are whole pages
        counts = {resident_count(m) // (m.array[0].nbytes // PAGE) for m in pool._maps if m.array[0].nbytes % PAGE == 0}
        assert len(counts) == 1
        return counts.pop()

    calls = []
    while True:
        more = pool.populate_ahead()
        calls.append(resident_block_count())
        if not more:
            break
    assert calls == [n, 2 * n, 2 * n + 3]              # a chunk a call, stopping at the reserve
    assert pool.populate_ahead() is False and resident_block_count() == 2 * n + 3
    held = [pool.allocate() for _ in range(5)]         # handed out from the reserve: nothing new faulted in
    assert held == [0, 1, 2, 3, 4] and resident_block_count() == 2 * n + 3
    while pool.populate_ahead():
        pass
    assert resident_block_count() == 5 + 2 * n + 3     # the reserve is kept past the handed-out blocks
    pool.reserve_blocks = 10_000
    while pool.populate_ahead():
        pass
    assert resident_block_count() == pool.num_blocks   # and never past the pool
