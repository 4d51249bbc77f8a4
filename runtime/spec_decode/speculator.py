"""Speculator: decides who speculates and how far (from measured costs and acceptance), then runs
propose → verify → roll back for those sequences.

Cost model (seconds, measured at warm-up and refreshed by every step that runs): t_dec(B) for a batched
plain decode of B sequences, t_ver(S) for verifying S tokens of one sequence, t_draft(B) for one batched
draft step. With acceptance α (per sequence, moving average) a round of γ guesses yields on average
E(α, γ) = (1 − α^(γ+1)) / (1 − α) tokens. Sequences are added to the speculating set, best marginal
gain first, only while doing so raises the step's tokens per second; so speculation switches itself off
where it does not pay (low acceptance, or large batches where a plain decode step is cheap per token).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..model_runner import ModelRunner
from ..request import Request
from ..sampler import SampleResult, Sampler, adjusts_logits
from . import rejection_sampler
from .proposer import Proposer


@dataclass(frozen=True)
class SpecConfig:
    max_gamma: int = 6
    adaptive: bool = True           # False: always speculate max_gamma tokens (for tests and benchmarks)
    prior_acceptance: float = 0.7
    smoothing: float = 0.3          # weight of the latest round in the acceptance average

    def __post_init__(self):
        if not 1 <= self.max_gamma <= 16:
            raise ValueError("max_gamma must be in [1, 16]")


class CostModel:
    """Measured step costs keyed by batch size or token count; linear interpolation between measured keys."""

    def __init__(self):
        self.table: dict[str, dict[int, float]] = {"dec": {}, "ver": {}, "draft": {}, "step": {}}

    def record(self, kind: str, n: int, seconds: float) -> None:
        """Moving average; a sample far above the current estimate (a page fault, a GC pause, another process)
        is clipped, so one outlier cannot flip decisions that would then never re-measure it."""
        old = self.table[kind].get(n)
        self.table[kind][n] = seconds if old is None else 0.8 * old + 0.2 * min(seconds, 1.5 * old)

    def __call__(self, kind: str, n: int) -> float:
        t = self.table[kind]
        if not t:
            return 0.0
        if n in t:
            return t[n]
        keys = sorted(t)
        return float(np.interp(n, keys, [t[k] for k in keys], right=None)) if n <= keys[-1] else t[keys[-1]] * n / keys[-1]


@dataclass
class SpecStats:
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    acceptance: dict[str, float] = field(default_factory=dict)   # request id → moving average


def expected_tokens(alpha: float, gamma: int) -> float:
    alpha = min(alpha, 0.999)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


class Speculator:
    def __init__(self, config: SpecConfig, proposer: Proposer, target: ModelRunner, sampler: Sampler):
        self.config, self.proposer, self.target, self.sampler = config, proposer, target, sampler
        self.cost = CostModel()
        self.stats = SpecStats()

    def eligible(self, req: Request) -> bool:
        """Penalties make each position's distribution depend on the guesses before it, and verification
        compares raw target logits: requests that adjust logits (penalties, logit bias) are not speculated."""
        return not adjusts_logits(req)

    def max_gamma(self, req: Request, capacity: int) -> int:
        left = min(req.params.max_tokens - len(req.output_ids), capacity - req.num_tokens) - 1
        return max(0, min(self.config.max_gamma, left))

    def _candidates(self, decodes: list[Request], capacity: int) -> list[tuple[Request, int]]:
        """(request, largest γ it may take) for the decodes that can speculate at all."""
        cands = [(r, self.max_gamma(r, capacity)) for r in decodes if self.eligible(r)]
        return [(r, g) for r, g in cands if g > 0]

    def _alpha(self, req: Request) -> float:
        """The request's smoothed acceptance rate (the prior until it has speculated)."""
        return self.stats.acceptance.get(req.request_id, self.config.prior_acceptance)

    def plan(self, decodes: list[Request], capacity: int) -> dict[str, int]:
        """γ per request id for the sequences that should speculate this step (others decode plainly)."""
        cands = self._candidates(decodes, capacity)
        if not self.config.adaptive:
            return {r.request_id: g for r, g in cands}
        n = len(decodes)
        draft_per_seq = self.cost("draft", max(1, len(cands))) / max(1, len(cands))
        round_cost = [0.0] + [self.cost("ver", g + 1) + g * draft_per_seq for g in range(1, self.config.max_gamma + 1)]
        options = []
        for r, gmax in cands:
            alpha = self._alpha(r)
            best = max(range(1, gmax + 1), key=lambda g: expected_tokens(alpha, g) / round_cost[g])
            options.append((r, best, expected_tokens(alpha, best), round_cost[best]))
        # Greedy: add the best marginal gains while they raise the step's tokens per second.
        plain_time = self.cost("dec", n)
        marginal = plain_time - self.cost("dec", n - 1) if n > 1 else plain_time
        options.sort(key=lambda o: (o[2] - 1) / max(o[3] - marginal, 1e-9), reverse=True)
        tokens, seconds, chosen = float(n), plain_time, {}
        for r, g, e, cost in options:
            gain, extra = e - 1, cost - marginal
            if gain <= 0.05:          # acceptance known to be ~0: nothing to win
                continue
            if extra > 0 and (tokens + gain) / (seconds + extra) <= tokens / seconds:
                break
            chosen[r.request_id] = g
            tokens, seconds = tokens + gain, seconds + extra
        return chosen

    def plan_packed(self, decodes: list[Request], capacity: int, step_tokens: int) -> dict[str, int]:
        """γ per request id for paged engines, whose verification rides in the step's one packed call: a guess
        costs the step's marginal time per token ('step'(T): measured time of a step computing T tokens).
        Sequences join best acceptance first while the step's expected tokens per second rises."""
        cands = self._candidates(decodes, capacity)
        if not self.config.adaptive:
            return {r.request_id: g for r, g in cands}

        def seconds(tokens: int, spec: dict[str, int]) -> float:
            """The packed step plus the draft's guess steps (one per guess, all speculating sequences batched)."""
            draft = max(spec.values(), default=0) * self.cost("draft", max(1, len(spec)))
            return self.cost("step", tokens) + draft

        if seconds(step_tokens, {}) <= 0:
            return {}
        alpha = {r.request_id: self._alpha(r) for r, _ in cands}
        tokens, chosen = float(len(decodes)), {}
        for r, gmax in sorted(cands, key=lambda c: alpha[c[0].request_id], reverse=True):
            best, rate = 0, tokens / seconds(step_tokens, chosen)
            for g in range(1, gmax + 1):
                gain = expected_tokens(alpha[r.request_id], g) - 1
                trial = (tokens + gain) / seconds(step_tokens + g, {**chosen, r.request_id: g})
                if gain > 0.05 and trial > rate:
                    best, rate = g, trial
            if best:
                chosen[r.request_id] = best
                tokens += expected_tokens(alpha[r.request_id], best) - 1
                step_tokens += best
        return chosen

    def verify(self, req: Request, proposal, logits: np.ndarray) -> tuple[list[SampleResult], int]:
        """Verify `req`'s guesses from the target's logits at its last token and each guess (its own run, or its
        rows of a packed step), roll the proposer back and account; returns (tokens, target KV length)."""
        n = req.num_tokens
        emitted, accepted = rejection_sampler.verify(logits, proposal, req, self.sampler)
        self.proposer.rollback(req, n + accepted)
        self._account(req, len(proposal.tokens), accepted)
        return emitted, n + accepted

    def run(self, reqs: list[Request], gammas: list[int], busy: set[int], pool) -> dict[str, tuple[list[SampleResult], int]]:
        """Propose, verify (one target run per sequence) and roll back; returns id → (tokens, target KV length)."""
        t0 = time.perf_counter()
        proposals = self.proposer.propose(reqs, gammas, busy)
        if self.proposer.name == "draft" and reqs:
            self.cost.record("draft", len(reqs), (time.perf_counter() - t0) / max(1, max(gammas)))
        results = {}
        for req, prop in zip(reqs, proposals):
            t1 = time.perf_counter()
            logits = self.target.prefill(pool, req.slot, [req.last_token] + prop.tokens, req.num_tokens - 1,
                                         all_logits=True)
            self.cost.record("ver", len(prop.tokens) + 1, time.perf_counter() - t1)
            results[req.request_id] = self.verify(req, prop, logits)
        return results

    def _account(self, req: Request, proposed: int, accepted: int) -> None:
        if not proposed:
            return
        s = self.stats
        s.proposed, s.accepted, s.rounds = s.proposed + proposed, s.accepted + accepted, s.rounds + 1
        old = self._alpha(req)
        s.acceptance[req.request_id] = (1 - self.config.smoothing) * old + self.config.smoothing * accepted / proposed
        req.spec_proposed += proposed
        req.spec_accepted += accepted

    def forget(self, req: Request) -> None:
        self.stats.acceptance.pop(req.request_id, None)
