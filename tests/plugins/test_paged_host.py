"""Host side of the GPU path, on the CPU: block tables, slot mappings, block ownership and prefix sharing.

The paged reference attention reading through the tables must equal plain attention over each
sequence's contiguous K/V — so a wrong table, slot or length shows up as wrong numbers, not just a wrong
array.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.backends.paged.kv import PagedKVManager, build_paged_batch
from runtime.request import Request, SamplingParams

from paged_reference import paged_attention, write_kv


def dense_attention(q, k, v, past):
    """q [n, H, D] new tokens at positions past.., k/v [past+n, KVH, D] contiguous; causal."""
    n, heads, dim = q.shape
    group = heads // k.shape[1]
    out = np.zeros(q.shape)
    for i in range(n):
        for h in range(heads):
            s = k[:past + i + 1, h // group] @ q[i, h] / np.sqrt(dim)
            p = np.exp(s - s.max())
            out[i, h] = p / p.sum() @ v[:past + i + 1, h // group]
    return out


def test_build_paged_batch_packs_offsets_positions_and_slots():
    batch = build_paged_batch([([7, 2], 5, 3), ([4], 0, 2), ([9, 1, 3], 33, 1)], block_size=16, max_blocks=4)
    assert batch.block_tables.tolist() == [[7, 2, 0, 0], [4, 0, 0, 0], [9, 1, 3, 0]]
    assert batch.cu_seqlens_q.tolist() == [0, 3, 5, 6]
    assert batch.past_lens.tolist() == [5, 0, 33] and batch.seq_lens.tolist() == [8, 2, 34]
    assert batch.positions.tolist() == [5, 6, 7, 0, 1, 33]
    assert batch.slot_mapping.tolist() == [7 * 16 + 5, 7 * 16 + 6, 7 * 16 + 7, 4 * 16, 4 * 16 + 1, 3 * 16 + 1]
    assert batch.max_query_len == 3 and batch.max_seq_len == 34
    assert batch.block_tables.dtype == np.int32 and batch.slot_mapping.dtype == np.int64


@pytest.mark.parametrize("seqs, message", [
    ([([1], 10, 7)], "needs 2 blocks"),
    ([([1, 2, 3], 0, 1)], "table holds 2"),
    ([([1, 99], 0, 20)], r"block ids must lie in \[0, 8\)"),
    ([([1], -1, 1)], "must be >= 0"),
])
def test_build_paged_batch_refuses_inconsistent_sequences(seqs, message):
    with pytest.raises(ValueError, match=message):
        build_paged_batch(seqs, block_size=16, max_blocks=2, num_blocks=8)


@pytest.mark.parametrize("heads, kv_heads, block_size", [(4, 4, 4), (8, 2, 16), (6, 3, 8)])
def test_paged_reference_through_tables_equals_dense_attention(heads, kv_heads, block_size):
    rng = np.random.default_rng(heads * block_size)
    dim, num_blocks = 16, 64
    lens = [(0, 9), (21, 1), (7, 5), (40, 3)]                     # (past, new): prefill, decode, chunk, verify
    perm = rng.permutation(num_blocks).tolist()                    # scattered physical blocks
    seqs, dense = [], []
    for past, new in lens:
        n_blocks = -(-(past + new) // block_size)
        seqs.append(([perm.pop() for _ in range(n_blocks)], past, new))
        dense.append((rng.standard_normal((past + new, kv_heads, dim)), rng.standard_normal((past + new, kv_heads, dim))))
    k_cache = np.zeros((num_blocks, block_size, kv_heads, dim))
    v_cache = np.zeros_like(k_cache)
    # The cached part goes in first (as earlier steps wrote it), then this step's tokens through its slot mapping.
    past_batch = build_paged_batch([(b, 0, p) for b, p, _ in seqs], block_size)
    write_kv(k_cache, v_cache, np.concatenate([k[:p] for (k, _), (p, _) in zip(dense, lens)]),
             np.concatenate([v[:p] for (_, v), (p, _) in zip(dense, lens)]), past_batch.slot_mapping)
    batch = build_paged_batch(seqs, block_size)
    write_kv(k_cache, v_cache, np.concatenate([k[p:] for (k, _), (p, _) in zip(dense, lens)]),
             np.concatenate([v[p:] for (_, v), (p, _) in zip(dense, lens)]), batch.slot_mapping)
    q = rng.standard_normal((int(batch.cu_seqlens_q[-1]), heads, dim))
    out = paged_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q)
    for b, ((k, v), (past, new)) in enumerate(zip(dense, lens)):
        rows = slice(batch.cu_seqlens_q[b], batch.cu_seqlens_q[b + 1])
        np.testing.assert_allclose(out[rows], dense_attention(q[rows], k, v, past), atol=1e-12)


def _request(rid: str, ids: list[int]) -> Request:
    return Request(ids, SamplingParams(max_tokens=8), request_id=rid)


def test_manager_shares_cached_prefix_blocks_without_copies_and_frees_everything():
    mgr = PagedKVManager(num_blocks=8, block_size=4)
    a = _request("a", list(range(100, 110)))                       # 10 tokens: blocks 0,1 full, 2 partial
    assert mgr.allocate(a) == 0
    assert mgr.reserve(a, 10) and len(mgr.table(a)) == 3
    batch = mgr.step_batch([a], [10])
    assert batch.slot_mapping.tolist() == [mgr.table(a)[p // 4] * 4 + p % 4 for p in range(10)]
    a.num_computed = 10
    mgr.cache_computed(a)

    b = _request("b", list(range(100, 108)) + [7, 8, 9])           # shares a's first 2 full blocks
    assert mgr.allocate(b) == 8 and mgr.table(b)[:2] == mgr.table(a)[:2]  # same physical blocks, no copy
    b.num_computed = 8
    assert len(mgr.table(b)) == 3 and mgr.table(b)[2] not in mgr.table(a)  # its own block for what differs
    batch = mgr.step_batch([b], [3])
    assert batch.past_lens.tolist() == [8] and batch.positions.tolist() == [8, 9, 10]
    assert all(s // 4 == mgr.table(b)[2] for s in batch.slot_mapping)  # never writes a shared block

    # A prompt of exactly two full blocks reuses only one: its last token must be computed for logits.
    c = _request("c", list(range(100, 108)))
    assert mgr.allocate(c) == 4

    for r in (a, b, c):
        mgr.free(r)
        mgr.free(r)                                                   # idempotent
    assert mgr.num_free_blocks == 8 and all(ref == 0 for ref in mgr.blocks.ref)


def test_admission_reserves_the_worst_case_and_refuses_without_holding_anything():
    mgr = PagedKVManager(num_blocks=5, block_size=4, num_slots=4, max_model_len=64)
    a = _request("a", list(range(8)))                 # 8 prompt + 8 max_tokens → 4 blocks up front
    assert mgr.allocate(a) == 0 and len(mgr.table(a)) == 4 and a.slot is not None
    b = _request("b", list(range(50, 58)))
    assert mgr.allocate(b) is None                    # needs 4, 1 free: refused, nothing taken
    assert b.slot is None and mgr.num_free_blocks == 1 and mgr.num_free_slots == 3
    mgr.free(a)
    assert mgr.allocate(b) == 0 and len(mgr.table(b)) == 4
    assert mgr.stats.queries == 16 and mgr.stats.hits == 0
