"""Draft-model proposer: a small model with the target's tokenizer guesses γ tokens autoregressively.

The draft has its own KV slots (same slot index as the target's, owned and reserved by the KVCacheManager) and tracks
how many tokens of each sequence it has computed in `req.num_computed_draft`. It reads no prompt as the
target computes it: before proposing it catches up on the tokens it has not seen (`catch_up`: a sequence's
prompt, or whatever it decoded while speculation was off, as one chunk; then, in `propose`, one batched step
for the usual single token, a chunk of two where a sequence is two behind), so it computes only what
speculation uses. Then it takes γ-1 more batched single-token steps. Rejected guesses need no
undo: the next round starts writing at the shorter length.
"""

from __future__ import annotations

import numpy as np

from .kv import KVCacheManager
from .runner import ModelRunner
from ...request import Request
from ...sampler import Sampler
from ...spec_decode.proposer import Proposal, choose


class DraftModelProposer:
    name = "draft"
    free = False

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, sampler: Sampler):
        self.runner, self.kv, self.pool, self.sampler = runner, kv, kv.pools[1], sampler

    def feed(self, reqs: list[Request], tokens: list[list[int]]) -> None:
        for req, toks in zip(reqs, tokens):
            self.runner.prefill(self.pool, req.slot, toks, req.num_computed_draft)
            req.num_computed_draft += len(toks)

    def catch_up(self, reqs: list[Request]) -> None:
        """Sequences more than two tokens behind (a prompt it skipped, tokens decoded while speculation was off)
        compute all but their last token as one chunk each; propose then takes the rest in its first step (a
        chunk of two, or the batched single token)."""
        behind = [r for r in reqs if r.num_tokens - r.num_computed_draft > 2]
        self.feed(behind, [r.tokens(r.num_computed_draft, r.num_tokens - 1) for r in behind])

    def _catch_up_to(self, req: Request, upto: int) -> np.ndarray:
        """Feed tokens [num_computed_draft, upto) as one chunk; returns the last position's logits."""
        start = req.num_computed_draft
        logits = self.runner.prefill(self.pool, req.slot, req.tokens(start, upto), start)
        req.num_computed_draft = upto
        return logits[0]

    def propose(self, reqs: list[Request], gammas: list[int]) -> list[Proposal]:
        fence = self.kv.decode_fence({r.slot for r in reqs}, pool=1)    # what batches of guesses must not span
        tokens: list[list[int]] = [[] for _ in reqs]
        probs: list[list[np.ndarray]] = [[] for _ in reqs]
        # First guess: sequences behind by several tokens catch up in a chunk, the rest in one batch.
        single = [i for i, r in enumerate(reqs) if r.num_tokens - r.num_computed_draft == 1]
        for i, r in enumerate(reqs):
            if i not in single:
                t, q = choose(self._catch_up_to(r, r.num_tokens), r, self.sampler, r.num_tokens, tokens[i])
                tokens[i].append(t)
                probs[i].append(q)
        if single:
            rows = [(reqs[i].slot, reqs[i].last_token, reqs[i].num_tokens - 1) for i in single]
            for i, row in zip(single, self.runner.decode(self.pool, rows, *fence)):
                reqs[i].num_computed_draft = reqs[i].num_tokens
                t, q = choose(row, reqs[i], self.sampler, reqs[i].num_tokens, tokens[i])
                tokens[i].append(t)
                probs[i].append(q)
        # Further guesses, all sequences that still want more in one batch per step.
        for k in range(1, max(gammas, default=0)):
            active = [i for i, g in enumerate(gammas) if g > k]
            if not active:
                break
            rows = [(reqs[i].slot, tokens[i][-1], reqs[i].num_tokens + k - 1) for i in active]
            for i, row in zip(active, self.runner.decode(self.pool, rows, *fence)):
                reqs[i].num_computed_draft += 1
                t, q = choose(row, reqs[i], self.sampler, reqs[i].num_tokens + k, tokens[i])
                tokens[i].append(t)
                probs[i].append(q)
        return [Proposal(t, None if r.params.greedy else np.stack(p)) for t, p, r in zip(tokens, probs, reqs)]

    def rollback(self, req: Request, num_valid: int) -> None:
        req.num_computed_draft = min(req.num_computed_draft, num_valid)

    def forget(self, req: Request) -> None:
        pass                        # its KV lives in the request's slot, given back with it
