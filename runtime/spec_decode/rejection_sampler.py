"""Verification of proposed tokens against the target (Leviathan et al. 2023; Chen et al. 2023).

Given target logits at the γ+1 positions [last token, x1 … xγ] and the proposal x1 … xγ:
- accepted tokens: the longest prefix of the proposal the target agrees with. Greedy: xi equals the target's
  argmax. Sampling: xi is kept with probability min(1, p(xi) / q(xi)), p the target's and q the proposer's
  distribution (a point mass for n-gram guesses).
- recovered token: at the first rejection, a token drawn from norm(max(0, p − q)) (greedy: the argmax) — what
  makes the output distribution exactly the target's.
- bonus token: when all γ are accepted, one more token sampled from the target's last position for free.
So every verification yields between 1 and γ+1 tokens, distributed exactly as plain decoding would. Penalties
and logit bias apply at each position as plain decoding applies them there: with the guesses before it counted
as seen (it is only judged once they were accepted, so they are the sequence at that point).

Seeded requests verify by coupling instead: the target's token at each position is `seeded_choice` (noise keyed
by seed and position, as plain decoding draws it), and a guess is accepted when it equals that token. The output
is then the very tokens plain seeded decoding gives, whatever γ was; the draft guesses with the same noise, so
it agrees whenever its distribution is close.
"""

from __future__ import annotations

import numpy as np

from ..request import Request
from ..sampler import SampleResult, Sampler, filtered_probs, greedy_token
from .proposer import Proposal


def verify(target_logits: np.ndarray, proposal: Proposal, req: Request, sampler: Sampler) -> tuple[list[SampleResult], int]:
    """target_logits [γ+1, vocab] → (emitted tokens, number of proposed tokens accepted)."""
    gamma = len(proposal.tokens)
    emitted: list[SampleResult] = []
    guesses = proposal.tokens
    if req.params.greedy or req.params.seed is not None:
        start = req.num_tokens
        for i in range(gamma + 1):
            token = greedy_token(target_logits[i], req, guesses[:i]) if req.params.greedy else \
                sampler.draw(filtered_probs(target_logits[i], req, guesses[:i]), req, start + i)
            emitted.append(sampler.result(token, target_logits[i], req))
            if i == gamma or token != proposal.tokens[i]:
                return emitted, i
    rng = sampler.rng(req)
    for i in range(gamma):
        p = filtered_probs(target_logits[i], req, guesses[:i])
        x = proposal.tokens[i]
        qx = proposal.probs[i][x] if proposal.probs is not None else 1.0
        if rng.random() < min(1.0, p[x] / qx):
            emitted.append(sampler.result(x, target_logits[i], req))
            continue
        residual = np.maximum(p - (proposal.probs[i] if proposal.probs is not None else np.eye(1, p.size, x)[0]), 0.0)
        total = residual.sum()
        token = int(rng.choice(p.size, p=residual / total)) if total > 0 else int(rng.choice(p.size, p=p))
        emitted.append(sampler.result(token, target_logits[i], req))
        return emitted, i
    p = filtered_probs(target_logits[gamma], req, guesses)
    emitted.append(sampler.result(int(rng.choice(p.size, p=p)), target_logits[gamma], req))
    return emitted, gamma
