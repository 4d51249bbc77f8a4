"""Draft-model proposer for paged (cuda) engines.

The draft keeps its KV in its own caches under the target's block tables (same block ids: the target's
reservation covers both), tracking progress in `req.num_computed_draft`. Each guess step is one packed call
over every speculating sequence — the first step also carries whatever prompt or accepted tokens the draft
has not seen yet. Rejected guesses need no undo: the next round writes from the shorter length.
"""

from __future__ import annotations

import numpy as np

from .kv import PagedKVManager, build_paged_batch
from .runner import PagedModelRunner
from ...request import Request
from ...sampler import Sampler
from ...spec_decode.proposer import choose
from ...spec_decode.proposer import Proposal


class PagedDraftProposer:
    name = "draft"
    free = False

    def __init__(self, runner: PagedModelRunner, kv: PagedKVManager, sampler: Sampler):
        self.runner, self.kv, self.sampler = runner, kv, sampler

    def feed(self, reqs: list[Request], feeds: list[list[int]]) -> np.ndarray:
        """One packed draft call: feeds[i] continues reqs[i] after its num_computed_draft; returns the logits of
        each sequence's last fed token (the engine feeds prompt chunks through it too)."""
        batch = build_paged_batch([(self.kv.table(r), r.num_computed_draft, len(f)) for r, f in zip(reqs, feeds)],
                                  self.kv.block_size, self.runner.max_blocks_per_seq)
        logits = self.runner.step(np.asarray([t for f in feeds for t in f], np.int64), batch,
                                  np.cumsum([len(f) for f in feeds]) - 1)
        for r, f in zip(reqs, feeds):
            r.num_computed_draft += len(f)
        return logits

    def catch_up(self, reqs: list[Request]) -> None:
        pass                        # its first guess step is one packed call that carries whatever it has not seen

    def propose(self, reqs: list[Request], gammas: list[int]) -> list[Proposal]:
        tokens: list[list[int]] = [[] for _ in reqs]
        probs: list[list[np.ndarray]] = [[] for _ in reqs]
        feeds = [r.tokens(r.num_computed_draft, r.num_tokens) for r in reqs]
        for k in range(max(gammas, default=0)):
            active = [i for i, g in enumerate(gammas) if g > k]
            logits = self.feed([reqs[i] for i in active], [feeds[i] for i in active])
            for i, row in zip(active, logits):
                t, q = choose(row, reqs[i], self.sampler, reqs[i].num_tokens + k)
                tokens[i].append(t)
                probs[i].append(q)
                feeds[i] = [t]
        return [Proposal(t, None if r.params.greedy else np.stack(p)) for t, p, r in zip(tokens, probs, reqs)]

    def rollback(self, req: Request, num_valid: int) -> None:
        req.num_computed_draft = min(req.num_computed_draft, num_valid)

    def forget(self, req: Request) -> None:
        pass                        # its KV lives in the request's slot, given back with it
