"""Prompt lookup (n-gram) proposer: guess that the text continues as it did after the last occurrence of its
most recent n-gram. Free to run; pays off when the output copies its context (code edits, RAG, repetition)."""

from __future__ import annotations

from ..request import Request
from .proposer import Proposal


class NgramProposer:
    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 2):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, reqs: list[Request], gammas: list[int]) -> list[Proposal]:
        return [Proposal(self.lookup(r.all_ids, g)) for r, g in zip(reqs, gammas)]

    def lookup(self, ids: list[int], gamma: int) -> list[int]:
        """The `gamma` tokens after the latest earlier match of the longest suffix n-gram (n ≥ min_n)."""
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            tail = ids[-n:]
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start:start + n] == tail:
                    follow = ids[start + n:start + n + gamma]
                    if follow:
                        return follow
        return []

    def catch_up(self, reqs: list[Request]) -> None:
        pass                        # nothing computed: it looks at the tokens themselves

    def feed(self, reqs: list[Request], tokens: list[list[int]]) -> None:
        pass                        # looks at the tokens themselves when proposing

    def rollback(self, req: Request, num_valid: int) -> None:
        pass
