"""Logits → next tokens: greedy, temperature, top-k, top-p, min-p, penalties, logit bias, per-request seeds,
logprobs.

Each row is processed with its own parameters; greedy rows skip all the work but argmax. Log-probabilities
are those of the model's distribution (before temperature and filters), as OpenAI reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .request import Request


@dataclass
class SampleResult:
    token: int
    logprob: float | None = None                 # of the chosen token
    top_logprobs: list[tuple[int, float]] | None = None


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    if m == -np.inf:        # a row a grammar closed entirely (past its end, along speculative guesses): no choice
        return x.copy()
    return x - (m + np.log(np.exp(x - m).sum()))


def adjusts_logits(req: Request) -> bool:
    """Whether the request's penalties or logit bias change its logits (else greedy is a plain argmax)."""
    p = req.params
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty or p.frequency_penalty or p.logit_bias)


def _with_ids(seen: np.ndarray, ids: Sequence[int]) -> np.ndarray:
    """`seen` (sorted, distinct) with `ids` added: inserted one by one where they are few, else a merge."""
    if len(ids) > 8:
        return np.union1d(seen, np.asarray(ids, np.int64))
    for t in ids:
        i = int(np.searchsorted(seen, t))
        if i == len(seen) or seen[i] != t:
            seen = np.insert(seen, i, t)
    return seen


def seen_ids(req: Request, ahead: Sequence[int] = ()) -> np.ndarray:
    """The distinct ids of the request's sequence and `ahead` (sorted), kept on the request as its tokens arrive:
    a repetition penalty re-derived them from the whole sequence every token (~100 µs at 600 tokens, a tenth of
    a bundled-target decode step). A request's tokens only ever grow."""
    n = req.num_tokens
    if req.seen is None:
        req.seen, req.seen_upto = np.unique(np.asarray(req.tokens(0, n), np.int64)), n
    elif req.seen_upto < n:
        req.seen, req.seen_upto = _with_ids(req.seen, req.tokens(req.seen_upto, n)), n
    return _with_ids(req.seen, ahead) if len(ahead) else req.seen


def adjust_logits(logits: np.ndarray, req: Request, ahead: Sequence[int] = ()) -> np.ndarray:
    """Penalties for tokens already seen, then the logit bias (in place on a float64 copy the caller owns).
    `ahead`: tokens after the request's own that count as seen (speculative guesses before this position: a
    guess is only judged once every guess before it was accepted, so they are the sequence there)."""
    p = req.params
    if p.repetition_penalty != 1.0:
        seen = seen_ids(req, ahead)
        vals = logits[seen]
        logits[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and (req.output_ids or ahead):
        ids, counts = np.unique(np.asarray(req.output_ids + list(ahead)), return_counts=True)
        logits[ids] -= p.presence_penalty + p.frequency_penalty * counts
    if p.logit_bias:
        ids, bias = zip(*p.logit_bias)
        np.add.at(logits, np.asarray(ids, np.int64), bias)
    return logits


def greedy_token(logits: np.ndarray, req: Request, ahead: Sequence[int] = ()) -> int:
    """The greedy choice: the argmax, after the request's penalties and logit bias where it has any."""
    if not adjusts_logits(req):
        return int(logits.argmax())
    return int(adjust_logits(logits.astype(np.float64), req, ahead).argmax())


def filtered_probs(logits: np.ndarray, req: Request, ahead: Sequence[int] = ()) -> np.ndarray:
    """The distribution sampling draws from: penalties, temperature, then top-k, top-p and min-p filters
    (`ahead`: as adjust_logits)."""
    p = req.params
    x = adjust_logits(logits.astype(np.float64, copy=True), req, ahead) / p.temperature
    if 0 < p.top_k < x.size:
        kth = np.partition(x, -p.top_k)[-p.top_k]
        x[x < kth] = -np.inf
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        drop = order[np.searchsorted(cum, p.top_p, side="left") + 1:]    # keep the smallest set reaching top_p
        probs[drop] = 0.0
    if p.min_p > 0.0:
        probs[probs < p.min_p * probs.max()] = 0.0
    return probs / probs.sum()


def seeded_choice(probs: np.ndarray, seed: int, position: int) -> int:
    """A draw from `probs` that depends only on (seed, position): the Gumbel-max trick with noise keyed by the
    request's seed and the token's index in the sequence. Plain decoding, a draft's guess and the target's check
    of that guess at the same position all use the same noise, so a seeded request gives the same tokens
    whatever speculation does (how many guesses, accepted or not) — and each token is still an exact sample."""
    noise = np.random.default_rng(np.random.SeedSequence([seed, position])).gumbel(size=probs.size)
    with np.errstate(divide="ignore"):
        return int(np.argmax(np.log(probs) + noise))


class Sampler:
    def __init__(self, entropy: int | None = None):
        """`entropy` seeds the draws of unseeded requests (tests); None: fresh from the OS."""
        self._rngs: dict[str, np.random.Generator] = {}
        self._entropy = np.random.SeedSequence(entropy)

    def rng(self, req: Request) -> np.random.Generator:
        """The generator of an unseeded request (seeded ones draw by position: `seeded_choice`)."""
        if req.request_id not in self._rngs:
            self._rngs[req.request_id] = np.random.default_rng(self._entropy.spawn(1)[0])
        return self._rngs[req.request_id]

    def forget(self, req: Request) -> None:
        self._rngs.pop(req.request_id, None)

    def draw(self, probs: np.ndarray, req: Request, position: int) -> int:
        """A sample from `probs` for the token at `position`: by (seed, position) for seeded requests, else from
        the request's own generator. Plain decoding, draft guesses and seeded verification all draw here."""
        if req.params.seed is not None:
            return seeded_choice(probs, req.params.seed, position)
        return int(self.rng(req).choice(probs.size, p=probs))

    def sample(self, logits: np.ndarray, req: Request) -> SampleResult:
        """logits [vocab] float32 for one request → its next token."""
        p = req.params
        if p.greedy:
            token = greedy_token(logits, req)
        else:
            token = self.draw(filtered_probs(logits, req), req, req.num_tokens)
        return self.result(token, logits, req)

    def result(self, token: int, logits: np.ndarray, req: Request) -> SampleResult:
        """The chosen token with the log-probabilities the request asked for."""
        p = req.params
        if p.logprobs is None:
            return SampleResult(token)
        lp = log_softmax(logits.astype(np.float64))
        top = []
        if p.logprobs:
            idx = np.argpartition(-lp, p.logprobs)[:p.logprobs]
            idx = idx[np.argsort(-lp[idx])]
            top = [(int(i), float(lp[i])) for i in idx if np.isfinite(lp[i])]   # a grammar's −inf: not a choice
        return SampleResult(token, float(lp[token]), top)
