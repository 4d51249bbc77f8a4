"""The repetition penalty's seen tokens, kept on the request as its tokens arrive (the fast path), equal the
distinct ids of the whole sequence and the guesses ahead (the slow truth), however the tokens arrive."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.request import Request, SamplingParams
from runtime.sampler import adjust_logits, seen_ids


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=30), st.lists(st.lists(st.integers(0, 40), max_size=12),
       max_size=10), st.lists(st.lists(st.integers(0, 40), max_size=6), min_size=1, max_size=10))
def test_seen_ids_kept_as_tokens_arrive_equal_a_full_recount(prompt, outputs, aheads):
    req = Request(list(prompt), SamplingParams(max_tokens=100, repetition_penalty=1.3))
    for chunk, ahead in zip(outputs + [[]] * len(aheads), aheads):
        req.output_ids += chunk
        want = np.unique(np.asarray(req.all_ids + ahead, np.int64))
        assert np.array_equal(seen_ids(req, ahead), want)
        assert np.array_equal(seen_ids(req), np.unique(np.asarray(req.all_ids, np.int64)))   # ahead never kept
        logits = np.random.default_rng(len(req.all_ids)).standard_normal(41)
        slow = logits.copy()
        slow[want] = np.where(slow[want] > 0, slow[want] / 1.3, slow[want] * 1.3)
        assert np.array_equal(adjust_logits(logits.copy(), req, ahead), slow)
