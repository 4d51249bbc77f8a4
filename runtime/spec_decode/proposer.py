"""The proposer interface: given running sequences and how many tokens each may guess, return guesses."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from ..request import Request
from ..sampler import Sampler, filtered_probs, greedy_token


@dataclass
class Proposal:
    tokens: list[int]                 # [gamma] guessed continuation
    probs: np.ndarray | None = None   # [gamma, vocab] the distribution each guess was drawn from; None: point mass


@runtime_checkable
class Proposer(Protocol):
    name: str                         # "draft" (a model: its steps are timed for the planner) or "ngram"
    free: bool                        # guessing costs a lookup, not a model step: the speculator asks before it
                                      # plans, and plans only the sequences that have a guess

    def propose(self, reqs: list[Request], gammas: list[int]) -> list[Proposal]:
        """One proposal per request (gammas[i] tokens, may be fewer if the proposer has nothing)."""
        ...

    def catch_up(self, reqs: list[Request]) -> None:
        """Before proposing: compute what the proposer has not seen of these sequences, but for what its first
        guess step takes anyway (the speculator times the guess steps without this)."""
        ...

    def feed(self, reqs: list[Request], tokens: list[list[int]]) -> None:
        """Compute tokens[i], which continue reqs[i] after its num_computed_draft: tokens a draft has not seen
        (its catch-up before proposing; a paged engine's prompt chunks as the target computes them)."""
        ...

    def rollback(self, req: Request, num_valid: int) -> None:
        """After verification: only the first `num_valid` tokens of `req` are its true sequence."""
        ...

    def forget(self, req: Request) -> None:
        """`req` has finished: drop what the proposer keeps for it."""
        ...


def choose(logits: np.ndarray, req: Request, sampler: Sampler, position: int,
           guesses: Sequence[int] = ()) -> tuple[int, np.ndarray | None]:
    """A draft guess for the token at `position`, after this round's `guesses` before it: the argmax (greedy), or
    a sample with the distribution it came from (for verification), both under the request's penalties as the
    target's check applies them there; seeded requests draw with the noise the target's check will use."""
    if req.params.greedy:
        return greedy_token(logits, req, guesses), None
    q = filtered_probs(logits, req, guesses)
    return sampler.draw(q, req, position), q
