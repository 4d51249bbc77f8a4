"""Speculator: decides who speculates and how far (from measured costs and acceptance), asks the proposer for
guesses, and verifies them against the target's logits (rolling the proposer back).

The cost model, the acceptance estimate, the check against measured rates and exploration: docs/design.md,
"Speculation".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..config import SpecConfig
from ..request import Request
from ..sampler import SampleResult, Sampler
from . import rejection_sampler
from .proposer import Proposal, Proposer


class CostModel:
    """Measured step costs keyed by batch size or token count; linear interpolation between measured keys."""

    def __init__(self):
        # "catch_up": seconds a token of a draft's catch-up costs (key 1), recorded by the speculator
        self.table: dict[str, dict[int, float]] = {"dec": {}, "ver": {}, "draft": {}, "step": {}, "catch_up": {}}

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


RECENT_WEIGHT = 0.05     # of the latest round in the engine-wide acceptance new requests start from


@dataclass
class SpecStats:
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    recent_counts: tuple[float, float] = (0.0, 0.0)   # engine-wide decayed (accepted, tried) guesses
    history: dict[str, tuple[float, float]] = field(default_factory=dict)   # request id → decayed (accepted, tried)

    @property
    def recent(self) -> float:
        """The engine-wide α: decayed accepted over decayed tried guesses (the counts start at the prior)."""
        accepted, tried = self.recent_counts
        return accepted / tried


def decayed(counts: tuple[float, float], keep: float, accepted: int, tried: int) -> tuple[float, float]:
    """(accepted, tried) counts with the old ones weighted by `keep`: recent rounds count most."""
    return keep * counts[0] + accepted, keep * counts[1] + tried


def expected_tokens(alpha: float, gamma: int) -> float:
    alpha = min(alpha, 0.999)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


class RateCheck:
    """Measured tokens per second of decode-only steps, with and without speculation, per batch size (moving
    averages): whether speculation is delivering, and when to look at the other side.

    Looking costs little one way (a plain step among speculating ones) and a lot the other: a speculating step
    verifies its sequences in a call of their own (one each where the engine cannot batch them), and after many
    plain ones the draft first catches up on every token it missed (left out of the measured rate, see
    Speculator.observe, but paid). So while speculation keeps
    losing at a batch size, the steps between its explorations double (EXPLORE_EVERY up to EXPLORE_MAX), and
    return to EXPLORE_EVERY once it pays. The first step after a switch of sides is not measured, either way: the
    first speculating one pays the draft's weights and KV coming back into cache and its catch-up tail (a single
    exploring step measured that way lost where steady speculation won: 433 vs 773 tok/s on the bundled pair at
    batch 1), and the first plain one the target's decode graph coming back (prompt lookup at batch 1: 1.24x the
    time a token of steady plain steps took, so plain decoding measured only there read slow and speculation that
    lost ~10 % "paid"). So an exploration of speculation runs BURST steps, one of plain decoding PLAIN_BURST, and
    the verdict is taken after the last. Plain decoding is the reference and, while speculation runs, measured on
    one step in EXPLORE_EVERY: a plain step slower than PLAIN_CLIP x plain's average (the first decode after a
    prefill, a GC pause) counts as that much. Unclipped, one such step made lookups that lost "pay" until the next
    plain burst, and prompt lookup at batch 1 spent 31 % of its steps speculating (5 % clipped). Speculation's own
    slow steps are not clipped: they err towards plain decoding."""

    EXPLORE_EVERY = 32
    EXPLORE_MAX = 1024
    BURST = 4
    PLAIN_BURST = 2
    WEIGHT = 0.1
    MARGIN = 1.02
    PLAIN_CLIP = 1.25

    def __init__(self):
        # side → batch size → decayed (tokens, seconds): a rate is their ratio, not an average of per-step rates
        # (a speculating step yields 1 to γ+1 tokens, and the mean of such ratios swung 2x from step to step)
        self.sums: dict[bool, dict[int, tuple[float, float]]] = {True: {}, False: {}}
        self.steps: dict[int, int] = {}
        self.interval: dict[int, int] = {}     # batch size → steps between explorations of the losing side
        self.burst: dict[int, tuple[bool, int]] = {}   # batch size → (side, steps left) of an exploration
        self.last_speculated = False
        self.exploring = False                 # the last speculate() was an exploration of losing speculation

    def observe(self, num_decodes: int, speculated: bool, tokens: int, seconds: float) -> None:
        cold, self.last_speculated = speculated != self.last_speculated, speculated
        if seconds <= 0 or tokens <= 0 or cold:
            return
        sums = self.sums[speculated]
        old = sums.get(num_decodes)
        if old is not None and not speculated:      # the reference: one slow step must not make speculation "pay"
            seconds = min(seconds, self.PLAIN_CLIP * old[1] * tokens / old[0])
        w = self.WEIGHT
        sums[num_decodes] = (tokens, seconds) if old is None else ((1 - w) * old[0] + w * tokens,
                                                                     (1 - w) * old[1] + w * seconds)
        if speculated and old is not None and not self.burst.get(num_decodes, (False, 0))[1]:   # a verdict: next interval
            interval = self.interval.get(num_decodes, self.EXPLORE_EVERY)
            self.interval[num_decodes] = (self.EXPLORE_EVERY if self.pays(num_decodes)
                                          else min(2 * interval, self.EXPLORE_MAX))

    def pays(self, num_decodes: int) -> bool:
        """Speculation has not been measured delivering less than MARGIN × plain decoding's rate at this batch size.
        The margin is on plain's side: a tie (lookups that find nothing, a draft that breaks even) goes to plain
        decoding, which pays no first cold step after a switch; at 0.98 speculation that lost up to 2 % kept
        running (prompt lookup on code it could not copy: 0.96x of speculation off)."""
        spec, plain = self.rate(True, num_decodes), self.rate(False, num_decodes)
        return spec is None or plain is None or spec >= self.MARGIN * plain

    def plain_ahead(self, num_decodes: int) -> int:
        """The calls of speculate(num_decodes) after this one that answer plain decoding whatever they are told,
        as long as speculation does not come to pay: the steps to the next exploration of losing speculation
        (none during a burst, or while speculation pays)."""
        if self.burst.get(num_decodes, (False, 0))[1] or self.pays(num_decodes):
            return 0
        return max(0, self.interval.get(num_decodes, self.EXPLORE_EVERY) - self.steps.get(num_decodes, 0) - 1)

    def rate(self, speculated: bool, num_decodes: int) -> float | None:
        """Measured tokens per second of decode-only steps of this side and batch size; None before any."""
        sums = self.sums[speculated].get(num_decodes)
        return sums[0] / sums[1] if sums else None

    def speculate(self, num_decodes: int, may_explore: bool = True) -> bool:
        """This step's side: the one that pays, except PLAIN_BURST steps in EXPLORE_EVERY (plain, while speculation
        pays) or BURST steps in the backed-off interval (speculation, while it loses: `exploring`), which measure
        the other. An exploration of losing speculation that is due waits while `may_explore` is false."""
        side, left = self.burst.get(num_decodes, (False, 0))
        if left:
            self.burst[num_decodes] = (side, left - 1)
            self.exploring = side
            return side
        self.exploring = False
        n = self.steps[num_decodes] = self.steps.get(num_decodes, 0) + 1
        pays = self.pays(num_decodes)
        if n >= (self.EXPLORE_EVERY if pays else self.interval.get(num_decodes, self.EXPLORE_EVERY)):
            if not pays and not may_explore:
                return False
            self.steps[num_decodes] = 0           # steps are counted from the last exploration
            self.burst[num_decodes] = (not pays, (self.PLAIN_BURST if pays else self.BURST) - 1)
            self.exploring = not pays
            return not pays
        return pays


EXPLORE_BUDGET = 0.005  # explorations may cost at most this share of the decode time observed,
EXPLORE_ALLOWANCE = 0.020   # and these seconds more: a fresh engine's first try (a 500-token prompt's catch-up)
UNSEEN_WEIGHT = 0.1     # of the latest speculating step in the cost per guess the cost model does not see
WARM_ROUNDS = 8         # verifications before the engine's acceptance is its own, not the prior's


class Speculator:
    """Exploration is what keeps speculation from losing for good on one bad estimate, and what makes it lose
    where it cannot pay: a try plans with the prior acceptance and pays the draft's catch-up over every token it
    missed (a 500-token prompt: ~20 ms, a tenth of a 128-token answer at the bundled pair's speed). So tries
    (the planner's with the prior, the first WARM_ROUNDS on it, the rate check's bursts) are charged what they
    cost beyond plain decoding, and one starts only while those charges stay within EXPLORE_BUDGET of the decode
    time observed (plus EXPLORE_ALLOWANCE, so that a fresh engine may try at all): whatever the pair and traffic,
    learning costs at most that. The part of a try's cost known beforehand, the draft's catch-up (the tokens it
    missed × its measured cost a token), is charged ahead: a try takes only the sequences whose catch-up the budget
    still covers (fewest missed tokens first), so a fresh engine does not start with a whole batch's prompts to
    catch up on — at batch 8 with 500-token prompts ~170 ms, the budget of ~30 s of decoding."""

    def __init__(self, config: SpecConfig, proposer: Proposer, sampler: Sampler, cost: CostModel,
                 price: Callable[[int], Callable[[Sequence[int]], float]] | None = None):
        """`cost`: the backend's measured step costs; the proposer's timed steps are recorded there as "draft".
        `price`: the backend's step_cost, what plan() prices a step of so many decodes with unless told."""
        self.config, self.proposer, self.sampler, self.cost, self.price = config, proposer, sampler, cost, price
        self.stats = SpecStats(recent_counts=(config.prior_acceptance * config.prior_tokens, config.prior_tokens))
        self.rate_check = RateCheck()
        self.idle_plans = 0            # plans in a row that chose no one (while someone could speculate)
        self.explore_after = RateCheck.EXPLORE_EVERY   # idle plans before one plans with the prior
        self._empty_plan: tuple | None = None    # (decodes, rounds) of the last plan, if it chose no one
        self.catch_up_s = 0.0          # of this step's proposal: the draft computing tokens it had not seen
        self.decode_s = 0.0            # seconds of the decode-only steps observed
        self.explore_cost_s = 0.0      # what exploring steps cost beyond plain decoding's rate, catch-up included
        self._exploring = False        # the last plan was an exploration (prior or rate-check burst), not a choice
        self._looked_up: dict[str, Proposal] = {}    # a free proposer's guesses, taken while planning this step
        self.unseen_per_guess = 0.0    # seconds a guess costs that the cost model does not price (see observe)
        self._planned: tuple[float, int] | None = None   # the last plan's priced seconds and guesses, if it chose
        self._looked = False           # this step's plan ran a lookup (see observe)
        # Plans known to choose no one (see _settle): how many are left, for which decodes (and rounds), and whether
        # each counts a step of the rate check (else an idle plan).
        self._quiet, self._quiet_decodes, self._quiet_rounds, self._quiet_counts_steps = 0, [], 0, False

    def observe(self, num_decodes: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A decode-only step's outcome (adaptive speculation checks its decisions against these). A speculating
        step's catch-up is left out: it is the draft's share of prompts (and of tokens decoded while it sat out),
        paid once per token, not a cost of every step that speculates. An exploring step is charged its time
        beyond plain decoding's for the same tokens (its catch-up alone before plain steps are measured).

        The cost model prices the model calls; a speculating step also pays what it cannot see: the draft's and the
        rejection sampler's Python per guess, each model's weights coming back into cache after the other's ran.
        On the bundled pair that was 0.6 ms of a 2.3 ms step, and a plan priced at 1.06x of plain delivered
        0.78x. So each speculating step's time beyond its price (catch-up aside) is spread over its guesses,
        and the planner prices every guess that much more (UNSEEN_WEIGHT: a moving average).

        A step whose lookup found nothing is plain but for the lookup: the rate check counts it on speculation's
        side, so lookups that cost more than their guesses save turn themselves off."""
        self.decode_s += seconds
        if self._quiet:                # a plain step of a settled plan: only the reference moves
            self.rate_check.observe(num_decodes, False, tokens, seconds)
            if (self._quiet_counts_steps and num_decodes == len(self._quiet_decodes)
                    and self.rate_check.pays(num_decodes)):
                self._quiet = 0        # plain decoding slowed down until speculation pays
            return
        planned, self._planned = self._planned, None
        speculated, self._looked = speculated or self._looked, False
        if speculated and planned is not None:
            priced, guesses = planned
            unseen = min(max(seconds - self.catch_up_s - priced, -priced), priced) / guesses
            self.unseen_per_guess += UNSEEN_WEIGHT * (unseen - self.unseen_per_guess)
        if speculated and self._exploring:
            plain = self.rate_check.rate(False, num_decodes)
            self.explore_cost_s += max(0.0, seconds - tokens / plain) if plain else self.catch_up_s
        self.rate_check.observe(num_decodes, speculated, tokens, seconds - self.catch_up_s if speculated else seconds)

    def may_explore(self) -> bool:
        """Whether explorations so far have cost within their budget (EXPLORE_BUDGET of the decode time observed,
        and EXPLORE_ALLOWANCE)."""
        return self.explore_cost_s <= self._explore_budget()

    def _explore_budget(self) -> float:
        return EXPLORE_BUDGET * self.decode_s + EXPLORE_ALLOWANCE

    def _affordable(self, cands: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """The candidates of an exploring plan whose draft catch-up, priced ahead at the measured cost a token, the
        exploration budget still covers: fewest missed tokens first, as long as the sum fits (the draft's own
        proposal step takes a lag of one or two tokens, priced nothing). Prompt lookup records no catch-up cost,
        so its tries are not cut."""
        per_token = self.cost("catch_up", 1)
        if not per_token:
            return cands
        left = self._explore_budget() - self.explore_cost_s
        kept = []
        for lag, r, g in sorted(((r.num_tokens - r.num_computed_draft, r, g) for r, g in cands), key=lambda c: c[0]):
            left -= lag * per_token if lag > 2 else 0.0
            if left < 0:
                break
            kept.append((r, g))
        return kept

    def max_gamma(self, req: Request, capacity: int) -> int:
        left = min(req.params.max_tokens - len(req.output_ids), capacity - req.num_tokens) - 1
        return max(0, min(self.config.max_gamma, left))

    def _alpha(self, req: Request) -> float:
        """The request's acceptance: its own guesses (recent rounds weigh most) and `prior_tokens` guesses at the
        rate of this engine's recent rounds. A new request starts at the engine's rate (of a workload the draft
        predicts badly, not at an optimistic constant); one rejected round does not stop a request that the
        draft predicts well (guesses are accepted in runs and fail in bursts)."""
        accepted, tried = self.stats.history.get(req.request_id, (0.0, 0.0))
        k = self.config.prior_tokens
        return (accepted + k * self.stats.recent) / (tried + k)

    def plan(self, decodes: list[Request], capacity: int, budget: int,
             step_cost: Callable[[Sequence[int]], float] | None = None) -> dict[str, int]:
        """γ per request id for the decodes that should speculate this step, at most `budget` guesses in all
        (the scheduler's token budget left after the decodes); `step_cost(guesses)` prices the step (default:
        `price`'s, made only once the cheap exits are past)."""
        if self._quiet:
            if decodes == self._quiet_decodes and self.stats.rounds == self._quiet_rounds:
                self._quiet -= 1
                if self._quiet_counts_steps:
                    self.rate_check.steps[len(decodes)] += 1
                else:
                    self.idle_plans += 1
                return {}
            self._quiet = 0
        self._exploring, self._looked_up, self._planned, self._looked = False, {}, None, False
        if not self.config.adaptive:
            return self._every_guess(decodes, capacity, budget)
        # first the checks that end most steps, so that a plain step pays little more than this call
        rounds, explore_due = self.stats.rounds, self.idle_plans >= self.explore_after
        if self._empty_plan == (decodes, rounds) and not (explore_due and self.may_explore()):
            self.idle_plans += 1      # the same requests, no round since their plan was empty: it would be again
            if not explore_due:
                self._settle(decodes, self.explore_after - self.idle_plans, counts_steps=False)
            return {}
        may_explore = self.may_explore()
        if not may_explore and rounds < WARM_ROUNDS:
            return {}                 # the estimates are still mostly the prior, and tries are over budget
        if not (decodes and self.rate_check.speculate(len(decodes), may_explore)):
            if decodes:
                self._settle(decodes, self.rate_check.plain_ahead(len(decodes)), counts_steps=True)
            return {}
        explore = explore_due and may_explore
        cands = self._candidates(decodes, capacity)
        if not cands:                 # no one may guess, or a lookup found nothing: no plan to remember
            return {}
        burst = self.rate_check.exploring
        unmeasured = rounds < WARM_ROUNDS         # the estimates are still mostly the prior
        if explore or burst or unmeasured:        # a try: only what the budget covers of its catch-up
            cands = self._affordable(cands)
            if not cands:
                return {}
        choice = self._choose(cands, len(decodes), budget, step_cost or self.price(len(decodes)),
                              self.config.prior_acceptance if explore else 0.0)
        if choice is None:            # nothing measured yet: no basis for a decision
            return {}
        chosen, self._planned = choice
        self.idle_plans = 0 if chosen or explore else self.idle_plans + 1
        if explore:                   # reset once the estimates choose speculation by themselves
            self.explore_after = min(2 * self.explore_after, RateCheck.EXPLORE_MAX)
        elif chosen:
            self.explore_after = RateCheck.EXPLORE_EVERY
        self._empty_plan = None if chosen else (list(decodes), rounds)   # a copy: preemption edits plan lists
        self._exploring = bool(chosen) and (explore or burst or unmeasured)
        return chosen

    def _settle(self, decodes: list[Request], plans: int, counts_steps: bool) -> None:
        """The next `plans` plans for these same decodes choose no one, as this one did: they skip the checks and
        only count what those would have counted (a step of the rate check, or an idle plan), and their steps'
        observations only move plain decoding's rate. Why: the checks and their bookkeeping, cheap as they are,
        ran on every plain step with the caches cold after the model's call; at batch 1 on the bundled pair
        that was ~1 % of a 0.9 ms step. Exact: what could change the answer ends the count — other decodes or a
        round verified (plan), or plain decoding slowing until speculation's measured rate pays (observe; a step
        of the rate check consults that) — and tries' budget only grows meanwhile."""
        if plans > 0:
            self._quiet, self._quiet_decodes, self._quiet_rounds = plans, list(decodes), self.stats.rounds
            self._quiet_counts_steps = counts_steps

    def _every_guess(self, decodes: list[Request], capacity: int, budget: int) -> dict[str, int]:
        """Not adaptive: everyone guesses as far as they may, within the budget."""
        chosen: dict[str, int] = {}
        for r, g in self._candidates(decodes, capacity):
            g = min(g, budget - sum(chosen.values()))
            if g > 0:
                chosen[r.request_id] = g
        return chosen

    def _choose(self, cands: list[tuple[Request, int]], num_decodes: int, budget: int,
                step_cost: Callable[[Sequence[int]], float], floor: float
                ) -> tuple[dict[str, int], tuple[float, int] | None] | None:
        """Who guesses how far (acceptance at least `floor`), and the plan's priced seconds and guesses (None if
        no one); None where nothing is measured yet."""
        base = step_cost([])
        if base <= 0:
            return None
        # What a step costs beyond its model calls (scheduling, sampling, delivery), from plain steps' measured rate:
        # a step that speculates pays it once for several tokens.
        plain = self.rate_check.rate(False, num_decodes)
        overhead = max(0.0, num_decodes / plain - base) if plain else 0.0
        unseen = max(0.0, self.unseen_per_guess)
        chosen: dict[str, int] = {}
        tokens, guesses, rate = float(num_decodes), [], num_decodes / (base + overhead)
        for r, gmax in sorted(cands, key=lambda c: self._alpha(c[0]), reverse=True):
            alpha, best = max(floor, self._alpha(r)), 0
            before = rate
            for g in range(1, min(gmax, budget - sum(guesses)) + 1):
                gain = expected_tokens(alpha, g) - 1
                trial = (tokens + gain) / (step_cost(guesses + [g]) + overhead + unseen * (sum(guesses) + g))
                if gain > 0.05 and trial > rate:
                    best, rate = g, trial
            if not best:              # those after it guess worse at the same price: none of them joins either
                break
            gain = expected_tokens(alpha, best) - 1
            if not self._worth_catching_up(r, tokens / before, (tokens + gain) / rate, gain):
                rate = before
                continue
            chosen[r.request_id] = best
            guesses.append(best)
            tokens += gain
        return chosen, ((step_cost(guesses) + overhead, sum(guesses)) if chosen else None)

    def _candidates(self, decodes: list[Request], capacity: int) -> list[tuple[Request, int]]:
        """(request, most guesses) for those that may guess. A free proposer's guesses are taken now (prompt
        lookup: a few dictionary reads), so that only sequences that have one are planned, each as far as its
        guess goes: planning γ first and finding no guess (most steps of most text) counted plain steps as
        speculating ones. A model's guesses come after the plan (propose)."""
        cands = [(r, g) for r in decodes if (g := self.max_gamma(r, capacity)) > 0]
        if not self.proposer or not self.proposer.free or not cands:
            return cands
        found = self.proposer.propose([r for r, _ in cands], [g for _, g in cands])
        self._looked = True
        self._looked_up = {r.request_id: p for (r, _), p in zip(cands, found) if p.tokens}
        return [(r, len(p.tokens)) for (r, _), p in zip(cands, found) if p.tokens]

    def _worth_catching_up(self, req: Request, plain_step: float, spec_step: float, gain: float) -> bool:
        """A draft that lags a sequence by more than a step's worth (its prompt, tokens decoded while it sat out)
        first computes them, once: worth it only if speculating saves more over the request's remaining tokens
        (one a step at `plain_step` seconds, or 1 + `gain` a step at `spec_step`) than that costs."""
        lag, per_token = req.num_tokens - req.num_computed_draft, self.cost("catch_up", 1)
        if lag <= 2 or not per_token:             # nothing to catch up, or not measured yet
            return True
        remaining = req.params.max_tokens - len(req.output_ids)
        saving = remaining * plain_step - remaining / (1 + gain) * spec_step
        return saving > (lag - 1) * per_token

    def propose(self, reqs: list[Request], gammas: list[int]) -> dict[str, Proposal]:
        """Guesses per request id; a draft model's batched guess steps are timed for the planner."""
        if not reqs:
            return {}
        if self.proposer.free:        # looked up while planning: the first γ of each guess
            return {r.request_id: Proposal(self._looked_up[r.request_id].tokens[:g]) for r, g in zip(reqs, gammas)}
        behind = sum(r.num_tokens - r.num_computed_draft for r in reqs)
        t0 = time.perf_counter()
        self.proposer.catch_up(reqs)          # outside the timed guess steps
        self.catch_up_s = time.perf_counter() - t0
        caught = behind - sum(r.num_tokens - r.num_computed_draft for r in reqs)
        if caught > 8:
            self.cost.record("catch_up", 1, self.catch_up_s / caught)
        t0 = time.perf_counter()
        proposals = self.proposer.propose(reqs, gammas)
        if self.proposer.name == "draft":
            self.cost.record("draft", len(reqs), (time.perf_counter() - t0) / max(1, max(gammas)))
        return {r.request_id: p for r, p in zip(reqs, proposals)}

    def verify(self, req: Request, proposal: Proposal, logits: np.ndarray) -> tuple[list[SampleResult], int]:
        """Verify `req`'s guesses from the target's logits at its last token and each guess, roll the proposer
        back and account; returns (tokens, target KV length)."""
        n = req.num_tokens
        emitted, accepted = rejection_sampler.verify(logits, proposal, req, self.sampler)
        self.proposer.rollback(req, n + accepted)
        self._account(req, len(proposal.tokens), accepted)
        return emitted, n + accepted

    def _account(self, req: Request, proposed: int, accepted: int) -> None:
        if not proposed:
            return
        s = self.stats
        s.proposed, s.accepted, s.rounds = s.proposed + proposed, s.accepted + accepted, s.rounds + 1
        tried = accepted + (accepted < proposed)
        s.recent_counts = decayed(s.recent_counts, 1 - RECENT_WEIGHT, accepted, tried)
        s.history[req.request_id] = decayed(s.history.get(req.request_id, (0.0, 0.0)), self.config.memory, accepted,
                                            tried)
        req.spec_proposed += proposed
        req.spec_accepted += accepted

    def forget(self, req: Request) -> None:
        self.stats.history.pop(req.request_id, None)
        self.proposer.forget(req)
