"""Property-based (Hypothesis): random interleavings of submit / abort / step on the real engine with the bundled
target. After every run (and the idle work a server does between requests), every slot, block and request is free,
and every request that finished on its own gave, token for token and log-probability for log-probability, what it
gives alone on a fresh engine. The engine copies one block into the prefix cache a step, so copies left over from
one step to the next, and a finished request's from its retained slot, meet every other action."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compile.build import build
from compile.config import CompileConfig
from runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from runtime.engine import Engine
from runtime.request import SamplingParams

MODELS = Path(__file__).resolve().parents[2] / "models"
CACHE = CacheConfig(kv_budget_bytes=48 << 20)

# A pool of prompts that share prefixes (so prefix-cache hits happen) with assorted lengths and tails.
_rng = np.random.default_rng(7)
_BASE = _rng.integers(3, 8000, 140).tolist()
PROMPTS = [_BASE[:n] + _rng.integers(3, 8000, int(t)).tolist() for n, t in
           [(0, 3), (0, 40), (33, 5), (64, 2), (80, 30), (140, 1), (140, 12), (17, 70), (0, 2), (100, 0)]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    out = tmp_path_factory.mktemp("interleavings") / "target-int8"
    build(CompileConfig(MODELS / "target", out, "int8", report=False), log=lambda _: None)
    return out


@pytest.fixture(scope="module")
def engines(target):
    """(engine under test, reference engine without a prefix cache, solo results cache)."""
    busy = Engine(target, EngineConfig(SchedulerConfig(max_num_seqs=6, token_budget=64, prefill_chunk=32), CACHE))
    busy.kv._flush_blocks = 1
    solo = Engine(target, EngineConfig(cache=CacheConfig(kv_budget_bytes=48 << 20, enable_prefix_cache=False)))
    return busy, solo, {}


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=1)


def alone(solo: Engine, cache: dict, k: int, max_tokens: int) -> tuple[list[int], list[dict]]:
    if (k, max_tokens) not in cache:
        req = solo.add_request(PROMPTS[k], params(max_tokens))
        tokens, logprobs = [], []
        while solo.has_work():
            for out in solo.step():
                tokens += out.token_ids
                logprobs += out.logprobs or []
        assert req.finish_reason == "length"
        cache[k, max_tokens] = tokens, logprobs
    return cache[k, max_tokens]


ACTIONS = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.integers(0, len(PROMPTS) - 1), st.integers(1, 12)),
    st.tuples(st.just("abort"), st.integers(0, 15)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("idle"), st.integers(1, 3)),
), min_size=1, max_size=25)

CASES_RUN = []


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(actions=ACTIONS)
def test_random_interleavings_leak_nothing_and_match_solo_runs(engines, actions):
    eng, solo, cache = engines
    submitted, results = [], {}

    def collect(outputs):
        for out in outputs:
            tokens, logprobs, _ = results.setdefault(out.request_id, ([], [], []))
            tokens += out.token_ids
            logprobs += out.logprobs or []
            if out.finished:
                results[out.request_id][2].append(out.finish_reason)

    for action in actions:
        if action[0] == "submit":
            req = eng.add_request(PROMPTS[action[1]], params(action[2]))
            submitted.append((req.request_id, action[1], action[2]))
        elif action[0] == "abort" and submitted:
            rid = submitted[action[1] % len(submitted)][0]
            out = eng.abort(rid)
            collect([out] if out else [])
        elif action[0] == "idle" and not eng.has_work():      # as the server: only while nothing runs
            for _ in range(action[1]):
                eng.idle()
        elif action[0] == "step":
            for _ in range(action[1]):
                collect(eng.step())
    while eng.has_work():
        collect(eng.step())
    while eng.idle():
        pass
    # Nothing held: no request, every slot free, no block referenced.
    assert not eng.requests and eng.kv.num_free_slots == eng.kv.slots.num_slots
    assert eng.kv.blocks.num_in_use == 0 and all(r == 0 for r in eng.kv.blocks.ref)
    for rid, k, max_tokens in submitted:
        tokens, logprobs, reasons = results.get(rid, ([], [], ["abort"]))
        assert len(reasons) == 1 and reasons[0] in ("length", "abort")
        if reasons[0] == "length":
            assert (tokens, logprobs) == alone(solo, cache, k, max_tokens)
        else:                                  # aborted: what it got so far is a prefix of its solo run
            want = alone(solo, cache, k, max_tokens)[0]
            assert tokens == want[:len(tokens)]
    CASES_RUN.append(len(actions))


def test_report_how_many_cases_ran():
    """Runs after the property test (file order): it must have exercised its examples."""
    print(f"\ninterleavings: {len(CASES_RUN)} cases, {sum(CASES_RUN)} actions")
    assert len(CASES_RUN) >= 100
