"""The proposer interface: given running sequences and how many tokens each may guess, return guesses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..request import Request


@dataclass
class Proposal:
    tokens: list[int]                 # [gamma] guessed continuation
    probs: np.ndarray | None = None   # [gamma, vocab] the distribution each guess was drawn from; None: point mass


class Proposer(Protocol):
    name: str
    step_cost_s: float                # measured cost of one proposal step for one sequence (0 for n-gram)

    def propose(self, reqs: list[Request], gammas: list[int], busy: set[int]) -> list[Proposal]:
        """One proposal per request (gammas[i] tokens, may be fewer if the proposer has nothing)."""
        ...

    def rollback(self, req: Request, num_valid: int) -> None:
        """After verification: only the first `num_valid` tokens of `req` are its true sequence."""
        ...
