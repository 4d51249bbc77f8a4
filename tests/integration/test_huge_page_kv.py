"""Long sequences' KV on transparent huge pages (runtime/backends/cpu/slots.py) computes exactly what it computes on
4 KiB pages: the same logits, bit for bit, for a prompt past `huge_from` and for decode steps of a batch whose other
slot is short, in a pool whose rows per head are padded to whole huge pages."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.backends.cpu.runner import ModelRunner
from runtime.backends.cpu.slots import SlotRange
from runtime.kv.memory import HUGE_PAGE, huge_pages_offered


def steps(runner: ModelRunner, pool, prompt: list[int]) -> list[np.ndarray]:
    """Slot 0 prefills `prompt` in chunks of 512, slot 1 a 100-token prompt; then four batch-2 decode steps."""
    out = []
    for slot, ids in ((0, prompt), (1, prompt[:100])):
        pool.ensure(slot, len(ids) + 8)
        for start in range(0, len(ids), 512):
            chunk = ids[start:start + 512]
            out.append(runner.execute(np.asarray([chunk], np.int64), np.array([start + len(chunk) - 1], np.int32),
                                      np.arange(len(chunk)), pool, SlotRange(slot, 1)).copy())
    tokens, pos = np.array([[5], [9]], np.int64), np.array([len(prompt), 100], np.int32)
    for _ in range(4):
        logits = runner.execute(tokens, pos, np.arange(2), pool, SlotRange(0, 2))
        out.append(logits.copy())
        tokens, pos = logits.argmax(-1).astype(np.int64)[:, None], pos + 1
    return out


@pytest.mark.skipif(not huge_pages_offered(), reason="this kernel offers no transparent huge pages")
def test_long_sequence_kv_on_huge_pages_gives_the_same_bits(engine):
    path = engine("llama-hd128")
    prompt = np.random.default_rng(0).integers(3, 512, 1300).tolist()
    got = {}
    for huge in (True, False):
        runner = ModelRunner(path)
        pool = runner.new_pool(2, capacity=6000, huge_pages=huge)     # not whole huge pages: rows padded to 8,192
        if huge:
            assert (pool.huge_rows, pool.huge_from, pool.rows) == (4096, 512, 8192)
        else:
            assert (pool.huge_rows, pool.rows) == (0, 6000)
        got[huge] = steps(runner, pool, prompt)
        # slot 0's first page of rows in each layer's K and V; slot 1 (100 tokens) on 4 KiB pages
        assert pool.huge_bytes == (2 * runner.num_layers * HUGE_PAGE if huge else 0)
    assert len(got[True]) == len(got[False]) == 8
    for a, b in zip(got[True], got[False], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(not huge_pages_offered(), reason="this kernel offers no transparent huge pages")
def test_engine_with_kv_huge_pages_serves_the_same_tokens_and_counts_what_it_holds(engine):
    """serve --kv-huge-pages: a batch of long prompts (on huge pages) and a short one (granules) decodes the same
    tokens and log-probabilities as without, every step's resident memory is what the budget counts, and all of it
    goes back at the end."""
    from runtime.config import CacheConfig, EngineConfig, SchedulerConfig
    from runtime.engine import Engine
    from runtime.request import SamplingParams

    rng = np.random.default_rng(1)
    batch = [rng.integers(3, 512, n).tolist() for n in (1300, 40, 700)]
    params = SamplingParams(max_tokens=12, logprobs=2, ignore_eos=True)
    out = {}
    for huge in (True, False):
        cache = CacheConfig(max_model_len=6000, enable_prefix_cache=False, kv_huge_pages=huge)
        eng = Engine(engine("llama-hd128"), EngineConfig(SchedulerConfig(max_num_seqs=4, prefill_chunk=512), cache))
        assert eng.kv.slots.huge_rows == (4096 if huge else 0)
        seen, steps, logprobs = [], eng.step, {}

        def watched():
            result = steps()
            pools = eng.kv.pools
            assert sum(p.resident_bytes for p in pools) == eng.kv.resident_tokens * pools[0].token_bytes
            seen.append(pools[0].huge_bytes)
            for o in result:
                logprobs.setdefault(o.request_id, []).extend(o.logprobs or [])
            return result

        eng.step = watched
        done = eng.generate(batch, params)
        out[huge] = [r["token_ids"] for r in done] + list(logprobs.values())     # in the order they first streamed
        assert all(len(r["token_ids"]) == 12 for r in done) and sum(map(len, logprobs.values())) == 36
        # the 1,300- and 700-token prompts' (past huge_from, 512): a huge page of K and V a layer each
        assert max(seen) == (4 * eng.runner.num_layers * HUGE_PAGE if huge else 0)
        assert eng.kv.resident_tokens == 0 and eng.kv.slots.huge_bytes == 0
    assert out[True] == out[False]
