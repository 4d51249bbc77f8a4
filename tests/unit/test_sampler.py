"""Sampler math against the softmax: distributions, filters, penalties, logprobs."""

import numpy as np
import pytest

from runtime.detokenizer import StopStringFilter
from runtime.request import InvalidRequest, Request, SamplingParams
from runtime.sampler import Sampler, filtered_probs, log_softmax

LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], np.float32)


def req(**kw):
    return Request([0, 3], SamplingParams(**kw))


def test_sampling_distribution_matches_softmax():
    """Chi-square test of 20,000 draws at temperature 0.7 against softmax(logits / 0.7): an unseeded request's
    successive draws, and seeded requests' draws over 20,000 seeds (one draw per (seed, position))."""
    sampler, r = Sampler(entropy=0), req(temperature=0.7)
    p = np.exp(LOGITS / 0.7 - (LOGITS / 0.7).max())
    p /= p.sum()
    expected = p * 20000
    mask = expected > 5
    for tokens in ([sampler.sample(LOGITS, r).token for _ in range(20000)],
                   [sampler.sample(LOGITS, req(temperature=0.7, seed=s)).token for s in range(20000)]):
        counts = np.bincount(tokens, minlength=6)
        chi2 = (((counts - expected) ** 2)[mask] / expected[mask]).sum()
        assert chi2 < 20.5, chi2            # p ≈ 0.001 for 5 degrees of freedom


def test_seeded_draws_depend_on_seed_and_position_only():
    """Same seed and position → same token, in any sampler, after any other draws; the position changes it."""
    a, b = Sampler(), Sampler()
    r = req(temperature=1.0, seed=7)
    first = a.sample(LOGITS, r).token
    assert all(a.sample(LOGITS, r).token == first for _ in range(20)) and b.sample(LOGITS, r).token == first
    draws = set()
    for n in range(1, 40):
        r.output_ids = [0] * n                    # later positions of the same request
        draws.add(a.sample(LOGITS, r).token)
    assert len(draws) > 1


def test_filters():
    assert np.count_nonzero(filtered_probs(LOGITS, req(temperature=1.0, top_k=2))) == 2
    p = filtered_probs(LOGITS, req(temperature=1.0, top_p=0.5))
    assert np.count_nonzero(p) == 1                        # the top token alone has ≥ 0.5
    p = filtered_probs(LOGITS, req(temperature=1.0, min_p=0.2))
    full = np.exp(LOGITS) / np.exp(LOGITS).sum()
    assert set(np.flatnonzero(p)) == set(np.flatnonzero(full >= 0.2 * full.max()))
    assert np.isclose(p.sum(), 1.0)


def test_penalties_and_greedy():
    s = Sampler()
    assert s.sample(LOGITS, req()).token == 0
    # token 0 appears in the prompt: a strong repetition penalty moves greedy to token 1
    assert s.sample(LOGITS, req(repetition_penalty=5.0)).token == 1
    r = req(frequency_penalty=2.0)
    r.output_ids = [0, 0]
    assert s.sample(LOGITS, r).token == 1


def test_logit_bias():
    s = Sampler()
    assert s.sample(LOGITS, req(logit_bias={0: -100})).token == 1            # the argmax banned
    assert s.sample(LOGITS, req(logit_bias={5: 100})).token == 5             # the least likely forced
    r = req(temperature=1.0, seed=3, logit_bias={0: -100, 1: -100})
    assert {s.sample(LOGITS, r).token for _ in range(300)} <= {2, 3, 4, 5}
    p = filtered_probs(LOGITS, req(temperature=1.0, logit_bias={(3): 2.0}))
    want = np.exp(LOGITS + np.eye(6)[3] * 2.0)
    assert np.allclose(p, want / want.sum())
    # Log-probabilities stay those of the model, as OpenAI reports them.
    out = s.sample(LOGITS, req(logit_bias={5: 100}, logprobs=0))
    assert np.isclose(out.logprob, log_softmax(LOGITS.astype(np.float64))[5])


@pytest.mark.parametrize("bias", [{1: 101.0}, {-1: 1.0}, {True: 1.0}, {1: "x"}, dict(enumerate([0.0] * 301)), [1, 2]])
def test_invalid_logit_bias(bias):
    with pytest.raises(InvalidRequest, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_logprobs_are_model_logprobs():
    out = Sampler().sample(LOGITS, req(temperature=0.5, seed=1, logprobs=3))
    lp = log_softmax(LOGITS.astype(np.float64))
    assert np.isclose(out.logprob, lp[out.token])
    assert [t for t, _ in out.top_logprobs] == [0, 1, 2]


@pytest.mark.parametrize("pieces,stop,want_text,want_hit", [
    (["hel", "lo wor", "ld"], "o w", "hell", True),
    (["abc", "de"], "xyz", "abcde", False),
    (["a", "b", "c"], "bc", "a", True),
    (["END", "x"], "END", "", True),
])
def test_stop_string_filter(pieces, stop, want_text, want_hit):
    f, text, hit = StopStringFilter((stop,)), "", False
    for piece in pieces:
        out, hit = f.feed(piece)
        text += out
        if hit:
            break
    if not hit:
        text += f.flush()
    assert (text, hit) == (want_text, want_hit)
