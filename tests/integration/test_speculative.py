"""Speculative decoding is exact: greedy output equals plain greedy, sampled output follows the target's
distribution, and rollback / preemption / abort mid-speculation leak nothing."""

import os
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from artifact.errors import ArtifactError
from runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from runtime.engine import Engine
from runtime.request import Request, SamplingParams
from runtime.sampler import Sampler, seeded_choice
from runtime.spec_decode import rejection_sampler
from runtime.spec_decode.ngram import NgramProposer
from runtime.spec_decode.proposer import Proposal
from runtime.spec_decode.speculator import SpecConfig, expected_tokens

from test_engine import GREEDY, assert_no_leaks, assert_same_greedy_across_attention_kernels as assert_same_greedy, \
    prompts, run_all

CACHE = CacheConfig(kv_budget_bytes=32 << 20)


def spec_engine(target, draft=None, method="draft", adaptive=False, gamma=4, **sched):
    return Engine(target, EngineConfig(SchedulerConfig(**sched), CACHE, SpecConfig(max_gamma=gamma, adaptive=adaptive),
                                       draft=draft if method == "draft" else None, speculation=method))


@pytest.mark.parametrize("draft_name,target_kv", [("qwen2", "fp32"), ("llama", "fp32"), ("qwen2", "int8"), ("qwen2", "fp16")])
def test_greedy_speculation_equals_plain(engine, draft_name, target_kv):
    """Draft = another model (low acceptance: many rejections) or the target itself (everything accepted); an
    int8-KV (fp16-KV) target shares the prefix cache with an fp32-KV draft."""
    target = engine("llama", kv_cache=target_kv)
    items = [(p, GREEDY) for p in prompts(6, seed=21)]
    plain = run_all(Engine(target, EngineConfig(SchedulerConfig(max_num_seqs=6), CACHE)), items)
    eng = spec_engine(target, engine(draft_name), max_num_seqs=6)
    spec = run_all(eng, items, join_steps=[0, 0, 2, 3, 7, 11])
    for a, b in zip(plain, spec):
        assert_same_greedy(a, b)
    s = eng.speculator.stats
    assert s.proposed > 0
    if draft_name == "llama":
        assert s.accepted / s.proposed > 0.95
        assert all(r["usage"].spec_accepted > 0 for r in spec)
    assert_no_leaks(eng)


def test_ngram_speculation_equals_plain(engine):
    target = engine("qwen2")
    rep = prompts(1, seed=4)[0][:12]
    items = [(rep * 5, GREEDY), (prompts(1, seed=5)[0], GREEDY)]
    plain = run_all(Engine(target, EngineConfig(cache=CACHE)), items)
    eng = spec_engine(target, method="ngram")
    for a, b in zip(plain, run_all(eng, items)):
        assert_same_greedy(a, b)
    assert eng.speculator.stats.proposed > 0
    assert_no_leaks(eng)


def test_ngram_lookup():
    ng = NgramProposer(max_n=3, min_n=1)
    assert ng.lookup([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]
    assert ng.lookup([5, 6, 7], 2) == []
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        NgramProposer(max_n=3, min_n=0)


# 1 = 01 00 00 00, 256 = 00 01 00 00, 65536 = 00 00 01 00, 16777216 = 00 00 00 01, 65792 = 00 01 01 00
TOKENS = st.one_of(st.integers(0, 5), st.sampled_from([256, 65536, 16777216, 65792, 2**31 - 1]))


def scan_lookup(ids: list[int], gamma: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup by scanning the whole sequence (what the index replaced): the slow truth."""
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == ids[-n:]:
                return ids[start + n:start + n + gamma]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(TOKENS, min_size=1, max_size=12), min_size=1, max_size=12),
       st.integers(1, 3), st.integers(0, 3), st.integers(1, 6))
def test_ngram_index_grown_step_by_step_equals_a_full_scan(chunks, min_n, extra_n, gamma):
    """The index as a request's tokens arrive in chunks (a prompt, then accepted guesses and single tokens) gives
    at every point the guesses a scan of the whole sequence gives (few symbols: many repeats and ties; and ids
    whose 4-byte forms hold each other's bytes at other offsets, so the byte search meets matches that straddle
    token boundaries and must pass over them)."""
    proposer, ids = NgramProposer(max_n=min_n + extra_n, min_n=min_n), []
    req = Request([], SamplingParams(max_tokens=1), request_id="r")
    for chunk in chunks:
        ids += chunk
        req.prompt_ids = list(ids)
        assert proposer.propose([req], [gamma])[0].tokens == scan_lookup(ids, gamma, min_n, min_n + extra_n)
    proposer.forget(req)
    assert not proposer._index


def test_rejection_sampling_preserves_target_distribution():
    """First emitted token over 20,000 trials is distributed as the target's p, whatever the draft's q."""
    p_logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    q = np.array([0.1, 0.1, 0.6, 0.1, 0.1])
    sampler, req = Sampler(entropy=3), Request([0], SamplingParams(temperature=1.0))
    rng = np.random.default_rng(0)
    counts = np.zeros(5)
    for _ in range(20000):
        x = int(rng.choice(5, p=q))
        emitted, _ = rejection_sampler.verify(np.stack([p_logits, p_logits]), Proposal([x], q[None]), req, sampler)
        counts[emitted[0].token] += 1
    expected = np.exp(p_logits) * 20000
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 18.5, chi2          # p ≈ 0.001 for 4 degrees of freedom


def test_seeded_verification_is_plain_seeded_sampling():
    """Seeded requests verify by coupling: over 20,000 seeds the emitted first token is distributed as p (it is
    seeded_choice from p), and it is exactly the token plain seeded sampling draws at that position."""
    p_logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    q = np.array([0.1, 0.1, 0.6, 0.1, 0.1])
    sampler, counts, accepted = Sampler(), np.zeros(5), 0
    for seed in range(20000):
        req = Request([0], SamplingParams(temperature=1.0, seed=seed))
        guess = seeded_choice(q, seed, req.num_tokens)
        emitted, n = rejection_sampler.verify(np.stack([p_logits, p_logits]), Proposal([guess], q[None]), req, sampler)
        assert emitted[0].token == sampler.sample(p_logits, req).token
        counts[emitted[0].token] += 1
        accepted += n
    expected = np.exp(p_logits) * 20000
    assert ((counts - expected) ** 2 / expected).sum() < 18.5
    assert 0.2 < accepted / 20000 < 0.45           # the coupling accepts when both draws agree (Σ min(p, q) = 0.4)


def test_sampled_speculation_matches_plain_sampling_statistics(engine):
    """End to end with temperature (unseeded, so verification is rejection sampling): the second generated
    token's frequencies agree with plain sampling."""
    target, prompt = engine("llama"), prompts(1, seed=30)[0]
    draws = {"plain": [], "spec": []}
    plain = Engine(target, EngineConfig(SchedulerConfig(max_num_seqs=16), CACHE))
    spec = spec_engine(target, engine("qwen2"), max_num_seqs=16, gamma=3)
    for name, eng in (("plain", plain), ("spec", spec)):
        for seed in range(0, 600, 16):
            outs = eng.generate([prompt] * 16, [SamplingParams(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True)
                                                for _ in range(16)])     # unseeded: rejection sampling
            draws[name] += [o["token_ids"][1] for o in outs]
    # Compare the second token's empirical distributions (it goes through verification) by total variation.
    vocab = max(max(draws["plain"]), max(draws["spec"])) + 1
    a = np.bincount(draws["plain"], minlength=vocab) / len(draws["plain"])
    b = np.bincount(draws["spec"], minlength=vocab) / len(draws["spec"])
    assert 0.5 * np.abs(a - b).sum() < 0.2
    assert spec.speculator.stats.proposed > 0


def test_abort_and_preemption_mid_speculation(engine):
    eng = spec_engine(engine("llama"), engine("qwen2"), max_num_seqs=3, prefill_chunk=16, token_budget=40,
                      max_waiting=256)           # the random walk queues up to ~200 at once
    rng = random.Random(1)
    live = []
    for op in range(600):
        r = rng.random()
        if r < 0.35:
            prompt = [rng.randint(3, 400) for _ in range(rng.randint(1, 40))]
            req = eng.add_request(prompt, SamplingParams(max_tokens=rng.randint(1, 25), ignore_eos=True),
                                  priority=rng.randint(0, 2))
            live.append(req.request_id)
        elif r < 0.55 and live:
            eng.abort(live.pop(rng.randrange(len(live))))
        else:
            eng.step()
    while eng.has_work():
        eng.step()
    assert eng.stats.preemptions > 0 and eng.speculator.stats.proposed > 0
    assert_no_leaks(eng)


def test_mismatched_tokenizer_rejected(checkpoint, engine, tmp_path):
    from compile import synthetic as make_checkpoint
    from compile.build import build
    from compile.config import CompileConfig

    other = make_checkpoint.write_checkpoint("tiny-llama", tmp_path / "ck", tokenizer_vocab=300)
    draft = tmp_path / "draft"
    build(CompileConfig(other, draft, report=False), log=lambda _: None)
    with pytest.raises(ArtifactError, match="tokenizer"):
        spec_engine(engine("llama"), draft)


def test_adaptive_turns_off_when_it_cannot_pay(engine):
    """A draft that is always wrong (acceptance 0 after a few rounds) is switched off."""
    eng = Engine(engine("llama"), EngineConfig(SchedulerConfig(), CACHE, SpecConfig(max_gamma=4, adaptive=True),
                                               draft=engine("qwen2"), speculation="draft"))
    eng.generate([prompts(1, seed=40)[0]], SamplingParams(max_tokens=60, ignore_eos=True))
    s = eng.speculator.stats
    assert s.rounds < 40, "speculation should stop once acceptance is known to be low"
    # the draft runs on the engine thread: no worker of its own spins beside the target's after each call
    assert eng.backend.draft.session.get_session_options().intra_op_num_threads == 1
    assert eng.backend.runner.session.get_session_options().intra_op_num_threads == min(2, os.cpu_count())
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(0.9, 4) > 4


def test_penalties_and_logit_bias_speculate_and_equal_plain_decoding(engine):
    """Penalties and logit bias apply at each verified position with the guesses before it counted as seen, so
    penalized, biased and seeded-sampled requests speculate and still get plain decoding's tokens, beside each
    other and beside plain greedy ones; a bias to one token still forces it."""
    target = engine("llama")
    base = prompts(5, seed=42)
    items = [([7, 8, 9] * 8 + base[0], SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=1.3, logprobs=2)),
             (base[1], SamplingParams(max_tokens=20, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.5,
                                       logprobs=2)),
             (base[2], SamplingParams(max_tokens=12, ignore_eos=True, logit_bias={7: 100.0}, logprobs=2)),
             (base[3] * 2, SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.9, seed=5, repetition_penalty=1.2)),
             (base[4], GREEDY)]
    plain = run_all(Engine(target, EngineConfig(SchedulerConfig(max_num_seqs=5), CACHE)), items)
    assert plain[2]["token_ids"] == [7] * 12
    for draft, method in ((target, "draft"), (engine("qwen2"), "draft"), (None, "ngram")):
        eng = spec_engine(target, draft, method, max_num_seqs=5)
        spec = run_all(eng, items, join_steps=[0, 1, 1, 3, 5])
        for k, (a, b) in enumerate(zip(plain, spec)):
            if items[k][1].temperature == 0:
                assert_same_greedy(a, b)
            else:
                assert a["token_ids"] == b["token_ids"], (method, k)
        if draft is target:             # the draft applies the same penalties: its guesses are the target's choices
            assert all(o["usage"].spec_accepted > 0 for o in spec[:3]), [o["usage"].spec_accepted for o in spec]
        assert_no_leaks(eng)


def test_a_penalty_counts_the_guesses_before_each_position():
    """Target logits whose raw argmax repeats a guess already accepted this round: under a repetition penalty that
    token loses to the runner-up there, so the guess is rejected and the runner-up emitted (judging each position
    on the request's own history alone would accept it)."""
    vocab = 6
    req = Request([1, 2], SamplingParams(max_tokens=8, repetition_penalty=1.3))
    logits = np.zeros((3, vocab), np.float32)
    logits[0, 4] = 5.0                      # position 0: 4 (a guess the target agrees with)
    logits[1, 4], logits[1, 5] = 3.0, 2.5   # position 1: 4 raw, but 4 was just seen: 3.0 / 1.3 < 2.5 → 5
    emitted, accepted = rejection_sampler.verify(logits, Proposal([4, 4]), req, Sampler(0))
    assert [e.token for e in emitted] == [4, 5] and accepted == 1


def test_seeded_sampling_gives_the_same_tokens_with_or_without_speculation(engine):
    """A seeded request draws every token from noise keyed by (seed, position), so speculation — any γ, a poor
    draft, a perfect one, prompt lookup, other requests joining — gives exactly the tokens plain decoding gives."""
    target = engine("llama")
    ps = [p * 3 for p in prompts(6, seed=50)]            # repeats give prompt lookup something to find
    items = [(p, SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=100 + i, ignore_eos=True))
             for i, p in enumerate(ps)]
    plain = [o["token_ids"] for o in run_all(Engine(target, EngineConfig(SchedulerConfig(max_num_seqs=6), CACHE)), items)]
    assert len({tuple(t) for t in plain}) == len(plain)
    for draft, method, gamma in ((engine("qwen2"), "draft", 4), (target, "draft", 2), (None, "ngram", 3)):
        for joins in ([0] * 6, [0, 1, 1, 4, 6, 9]):
            eng = spec_engine(target, draft, method, gamma=gamma, max_num_seqs=6)
            assert [o["token_ids"] for o in run_all(eng, items, join_steps=joins)] == plain, (method, gamma, joins)
            assert eng.speculator.stats.proposed > 0 or method == "ngram"   # sampled text rarely repeats itself
            assert_no_leaks(eng)


def test_the_draft_computes_only_what_it_speculates_on_and_catches_up_exactly(engine):
    """A CPU draft reads no prompt as the target prefills it (the prefix cache keeps those blocks with the
    target's KV alone); it catches up when it first proposes, and a later request hitting those blocks gets the
    draft's KV where the draft has added it. Greedy output equals plain greedy."""
    target = engine("llama")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    first = [(p * 2, params) for p in prompts(3, seed=60)]
    later = [(p + [7, 8, 9], GREEDY) for p, _ in first]
    plain = run_all(Engine(target, EngineConfig(SchedulerConfig(max_num_seqs=3), CACHE)), first + later)
    eng = spec_engine(target, target, max_num_seqs=3)                # fixed γ: every decode step speculates
    reqs = [eng.add_request(p, sp) for p, sp in first]
    outs = {r.request_id: [] for r in reqs}
    while any(r.num_computed < len(r.prompt_ids) for r in reqs):
        for out in eng.step():
            outs[out.request_id] += out.token_ids
        assert [r.num_computed_draft for r in reqs] == [0, 0, 0] and eng.speculator.stats.proposed == 0
    for out in eng.step():        # the first decode step: its schedule caches the prompts' blocks, then it speculates
        outs[out.request_id] += out.token_ids
    assert eng.kv.blocks.num_in_use > 0 and not any(eng.kv.blocks.has_draft)
    assert all(r.num_computed_draft >= len(r.prompt_ids) for r in reqs)
    while eng.has_work():
        for out in eng.step():
            outs[out.request_id] += out.token_ids
    assert [outs[r.request_id] for r in reqs] == [o["token_ids"] for o in plain[:3]]
    assert all(r.spec_accepted > 0 for r in reqs)
    assert any(eng.kv.blocks.has_draft)                            # its KV joined blocks cached without it
    spec = run_all(eng, later)
    for a, b in zip(plain[3:], spec):
        assert_same_greedy(a, b)
        assert b["usage"].cached_tokens > 0 and b["usage"].spec_accepted > 0
    assert_no_leaks(eng)
