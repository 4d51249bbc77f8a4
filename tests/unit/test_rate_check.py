"""Adaptive speculation checks its decisions against measured outcomes: per batch size, decode-only steps with
speculation must deliver at least MARGIN × the tokens per second of plain steps, else speculation stops there; a
short burst every EXPLORE_EVERY steps measures the other side (its first step, cold, is not measured). Its
acceptance estimates count the guesses tried, and estimates that keep speculation off are tried again with the
prior, ever more rarely."""

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.request import Request, SamplingParams
from runtime.spec_decode.speculator import CostModel, RateCheck, SpecConfig, Speculator


def _speculator(**config) -> Speculator:
    return Speculator(SpecConfig(**config), proposer=None, sampler=None, cost=CostModel())


def observe_plain(spec: Speculator, seconds: float, step: float, num_decodes: int = 1) -> None:
    """`seconds` of plain decode-only steps of `step` seconds each, as the engine reports them."""
    for _ in range(round(seconds / step)):
        spec.observe(num_decodes, False, tokens=num_decodes, seconds=step)


def sides(check: RateCheck, n: int, steps: int) -> str:
    return "".join("s" if check.speculate(n) else "p" for _ in range(steps))


def test_speculation_runs_until_measured_losing_and_both_sides_stay_measured():
    check, every, burst = RateCheck(), RateCheck.EXPLORE_EVERY, RateCheck.BURST
    plain_burst = RateCheck.PLAIN_BURST
    assert sides(check, 4, every - 1 + plain_burst) == "s" * (every - 1) + "p" * plain_burst   # explore plain
    check.observe(4, False, tokens=4, seconds=0.04)                   # 100 tok/s plain
    check.observe(4, True, tokens=8, seconds=0.05)                    # first after plain: not measured (cold)
    assert check.pays(4) and check.rate(True, 4) is None
    check.observe(4, True, tokens=8, seconds=0.1)                     # 80 tok/s speculating
    assert not check.pays(4)
    assert sides(check, 4, every - 1 + burst) == "p" * (every - 1) + "s" * burst   # exploring speculation: a burst
    assert check.pays(1) and check.pays(8)                            # other batch sizes keep their own figures
    for _ in range(20):                                               # speculation gets better (new traffic)
        check.observe(4, True, tokens=15, seconds=0.1)
    assert check.pays(4) and sides(check, 4, every)[:every - 1] == "s" * (every - 1)


def test_the_first_step_after_a_switch_of_sides_is_not_measured_either_way():
    """The first plain step after speculating ones pays the target's decode graph coming back into cache (prompt
    lookup at batch 1: 1.24x a steady plain step's time a token); measured, it made plain decoding read slow."""
    check = RateCheck()
    check.observe(1, False, tokens=1, seconds=0.001)                  # steady plain: 1,000 tok/s
    check.observe(1, True, tokens=2, seconds=0.010)                   # first speculating step: cold
    check.observe(1, True, tokens=2, seconds=0.002)                   # 1,000 tok/s speculating
    check.observe(1, False, tokens=1, seconds=0.010)                  # first plain step after: cold
    assert check.rate(True, 1) == 1000 and check.rate(False, 1) == 1000
    check.observe(1, False, tokens=1, seconds=0.002)                  # steady plain again: measured
    assert check.rate(False, 1) < 1000


def test_one_slow_plain_step_does_not_make_losing_speculation_pay():
    """Plain decoding is the reference, measured rarely while speculation runs: a step slowed by something else
    (the first decode after a prompt's prefill, a GC pause, 4x a steady step) counts as PLAIN_CLIP x the average.
    Unclipped, it took plain's rate from 1,000 to 769 tok/s, and lookups losing 1 % "paid" until plain's next
    burst (prompt lookup at batch 1 spent 31 % of its steps speculating; clipped, 5 %)."""
    check = RateCheck()
    for _ in range(20):
        check.observe(1, False, tokens=1, seconds=0.001)              # steady plain: 1,000 tok/s
    check.observe(1, True, tokens=1, seconds=0.001)                   # (cold)
    for _ in range(20):
        check.observe(1, True, tokens=1, seconds=0.00101)             # speculation: 990 tok/s, losing
    check.observe(1, False, tokens=1, seconds=0.001)                  # (cold)
    assert not check.pays(1)
    check.observe(1, False, tokens=1, seconds=0.004)                  # one slow plain step
    w, clip = RateCheck.WEIGHT, RateCheck.PLAIN_CLIP
    assert check.rate(False, 1) == pytest.approx(1 / ((1 - w) * 0.001 + w * clip * 0.001), rel=1e-12)
    assert not check.pays(1)
    once = check.rate(False, 1)
    for _ in range(3):                             # a lasting slow-down is still followed, 2.5 % a step at most
        check.observe(1, False, tokens=1, seconds=0.004)
    assert check.rate(False, 1) == pytest.approx(once / (1 - w + w * clip) ** 3, rel=1e-12)


def test_rates_are_decayed_tokens_over_decayed_seconds_and_ignore_empty_steps():
    check = RateCheck()
    check.observe(2, False, tokens=10, seconds=0.1)
    check.observe(2, False, tokens=20, seconds=0.1)
    w = RateCheck.WEIGHT
    assert check.rate(False, 2) == ((1 - w) * 10 + w * 20) / ((1 - w) * 0.1 + w * 0.1)   # decayed tokens / seconds
    check.observe(2, True, tokens=5, seconds=0.0)
    check.observe(2, True, tokens=0, seconds=0.01)
    assert check.rate(True, 2) is None
    check.observe(2, False, tokens=2, seconds=0.01)                  # back to plain (cold: not measured)
    before = check.rate(False, 2)
    check.observe(2, False, tokens=0, seconds=0.01)                  # a step that yielded nothing
    assert check.rate(False, 2) == before


def test_exploring_a_losing_side_backs_off_and_resets_when_it_pays():
    """Each exploration (BURST speculating steps, the first not measured) that finds speculation still losing
    doubles the plain steps before the next one (up to EXPLORE_MAX); one that finds it paying brings back
    EXPLORE_EVERY."""
    check, every, burst = RateCheck(), RateCheck.EXPLORE_EVERY, RateCheck.BURST
    check.observe(2, False, tokens=2, seconds=0.01)                   # 200 tok/s plain
    check.observe(2, True, tokens=3, seconds=0.03)                    # (cold)
    check.observe(2, True, tokens=3, seconds=0.03)                    # 100 tok/s speculating
    starts, runs, prev = [], [], False
    for i in range(4 * RateCheck.EXPLORE_MAX):
        side = check.speculate(2)
        if side and not prev:
            starts.append(i)
        runs.append(side)
        check.observe(2, side, tokens=3 if side else 2, seconds=0.03 if side else 0.01)
        prev = side
    assert all(runs[s:s + burst] == [True] * burst and not runs[s + burst] for s in starts)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert starts[0] == every - 1
    assert gaps[:6] == [burst - 1 + min(every * 2 ** k, RateCheck.EXPLORE_MAX) for k in range(1, 7)]
    for _ in range(30):                                               # speculation now delivers 300 tok/s
        check.observe(2, True, tokens=9, seconds=0.03)
    assert check.pays(2) and check.interval[2] == every


def test_new_requests_start_from_the_measured_acceptance():
    """Before a request has speculated its acceptance is the engine's recent one (a moving average from the
    configured prior), not the prior itself."""
    spec = _speculator(prior_acceptance=0.7)
    fresh = Request([1, 2, 3], SamplingParams(max_tokens=4), request_id="fresh")
    assert spec._alpha(fresh) == 0.7
    old = Request([1, 2, 3], SamplingParams(max_tokens=4), request_id="old")
    for _ in range(200):
        spec._account(old, proposed=4, accepted=1)      # 1 accepted of 2 tried
    assert abs(spec._alpha(fresh) - 0.5) < 1e-4


def test_acceptance_counts_the_guesses_tried_not_those_after_a_rejection():
    """A round that accepts a of γ tried a + 1 guesses (the ones after the first rejection were never tried):
    rounds accepting 2 of 4 mean α = 2/3 (E(2/3, 4) = 2.6 tokens a round), not 2/4."""
    spec = _speculator(prior_acceptance=0.7)
    req = Request([1, 2, 3], SamplingParams(max_tokens=4), request_id="r")
    for _ in range(300):
        spec._account(req, proposed=4, accepted=2)
    assert abs(spec._alpha(req) - 2 / 3) < 1e-3 and abs(spec.stats.recent - 2 / 3) < 1e-3
    for _ in range(300):
        spec._account(req, proposed=4, accepted=4)      # every guess accepted: nothing was rejected
    assert spec._alpha(req) > 0.999


def test_one_rejected_round_does_not_stop_a_request_the_draft_predicts_well():
    spec = _speculator(prior_acceptance=0.7)
    req = Request([1, 2, 3], SamplingParams(max_tokens=4), request_id="r")
    for _ in range(10):
        spec._account(req, proposed=4, accepted=4)
    spec._account(req, proposed=4, accepted=0)
    assert spec._alpha(req) > 0.8


def test_speculation_measured_useless_is_tried_again_with_the_prior_ever_more_rarely():
    """Acceptance 0 everywhere keeps every plan empty, which alone would never measure anything again (one bad
    round used to stop speculation for good): after EXPLORE_EVERY empty plans one plans with the prior, and each
    such try that does not bring speculation back doubles the wait (a try costs the draft's catch-up)."""
    spec = _speculator(prior_acceptance=0.7)
    old = Request([1, 2, 3], SamplingParams(max_tokens=4), request_id="old")
    for _ in range(400):
        spec._account(old, proposed=4, accepted=0)
    assert spec.stats.recent < 1e-6
    req = Request([1, 2, 3], SamplingParams(max_tokens=10_000), request_id="new")
    cost = lambda guesses: 0.010 + sum(0.001 + 0.002 * g for g in guesses)     # noqa: E731
    every = RateCheck.EXPLORE_EVERY
    plans = [spec.plan([req], capacity=20_000, budget=64, step_cost=cost) for _ in range(16 * every)]
    tried = [i for i, p in enumerate(plans) if p]
    assert all(plans[i] == {"new": plans[tried[0]]["new"]} and plans[i]["new"] >= 1 for i in tried)
    waits = [b - a for a, b in zip(tried, tried[1:])]
    assert tried[0] >= every and len(waits) == 3
    # empty plans between tries: 64, 128, 256 (and the rate check's own plain steps, one in EXPLORE_EVERY)
    assert all(every * 2 ** (k + 1) < w <= every * 2 ** (k + 1) * (1 + 2 / every) for k, w in enumerate(waits))
    for _ in range(6):
        spec._account(req, proposed=4, accepted=4)                             # the try found a good draft:
    assert spec.plan([req], capacity=20_000, budget=64, step_cost=cost)        # it speculates by itself,
    assert spec.explore_after == every                                         # and the wait is back to the start


def test_a_lagging_draft_catches_up_only_where_the_rest_of_the_request_pays_for_it():
    """A request whose draft has not read its 500-token prompt starts speculating only if the expected saving over
    its remaining tokens exceeds the measured catch-up (499 tokens at 40 µs: 20 ms)."""
    spec = _speculator(prior_acceptance=0.8)
    spec.cost.record("catch_up", 1, 40e-6)                 # seconds a token, as propose() measures it
    cost = lambda guesses: 0.0013 + sum(0.0008 + 0.0004 * g for g in guesses)   # noqa: E731  target 1.3 ms a step
    observe_plain(spec, seconds=6.0, step=0.0013)          # enough decoding that a try's catch-up is in budget
    short = Request(list(range(500)), SamplingParams(max_tokens=20), request_id="short")
    long = Request(list(range(500)), SamplingParams(max_tokens=2000), request_id="long")
    assert spec.plan([short], capacity=4096, budget=64, step_cost=cost) == {}
    assert spec.plan([long], capacity=4096, budget=64, step_cost=cost)["long"] >= 1
    short.num_computed_draft = short.num_tokens - 1        # a draft that keeps up pays nothing first
    assert spec.plan([short], capacity=4096, budget=64, step_cost=cost)["short"] >= 1


def test_a_try_waits_until_the_budget_covers_its_catch_up():
    """A try's catch-up is charged ahead: on a fresh engine (no decode time observed, only EXPLORE_ALLOWANCE's
    20 ms) a draft that has read none of a 1,000-token prompt (40 ms at 40 µs a token) is not tried, however good
    the prior; it is once the plain decoding observed covers the rest, at the first step the rate check does not
    keep plain. A short prompt's is tried at once."""
    from runtime.spec_decode.speculator import EXPLORE_ALLOWANCE, EXPLORE_BUDGET

    spec = _speculator(prior_acceptance=0.9)
    spec.cost.record("catch_up", 1, 40e-6)
    cost = lambda guesses: 0.0013 + sum(0.0008 + 0.0004 * g for g in guesses)   # noqa: E731
    assert spec.plan([Request(list(range(20)), SamplingParams(max_tokens=2000), request_id="short")],
                     capacity=4096, budget=64, step_cost=cost)
    spec = _speculator(prior_acceptance=0.9)
    spec.cost.record("catch_up", 1, 40e-6)
    req = Request(list(range(1000)), SamplingParams(max_tokens=2000), request_id="r")
    step = 0.0013
    for steps in range(10_000):                            # 13 s of steps: a plan that never comes fails below
        if spec.plan([req], capacity=4096, budget=64, step_cost=cost):
            break
        spec.observe(1, False, tokens=1, seconds=step)
    assert spec.explore_cost_s == 0
    late = (RateCheck.PLAIN_BURST + 1) * step                # the rate check's own plain steps may come first
    need = 1000 * 40e-6 - EXPLORE_ALLOWANCE
    assert EXPLORE_BUDGET * spec.decode_s >= need > EXPLORE_BUDGET * (spec.decode_s - late)
    assert steps > 3000                                    # ~4 s of 1.3 ms steps


def test_a_try_takes_only_the_sequences_whose_catch_up_the_budget_covers():
    """Of a batch the draft has read nothing of, a try takes the sequences with the fewest tokens to catch up
    while their sum fits the budget left; a sequence the draft keeps up with costs nothing ahead."""
    spec = _speculator(prior_acceptance=0.9)
    spec.cost.record("catch_up", 1, 40e-6)
    cost = lambda guesses: 0.0013 + sum(0.0001 + 0.0001 * g for g in guesses)   # noqa: E731  verified in a batch
    observe_plain(spec, seconds=10.0, step=0.0013, num_decodes=3)      # 50 ms of budget, 70 with the allowance
    reqs = [Request(list(range(n)), SamplingParams(max_tokens=2000), request_id=f"lag{n}") for n in (1000, 300, 600)]
    assert set(spec.plan(reqs, capacity=4096, budget=64, step_cost=cost)) == {"lag300", "lag600"}   # 12 + 24 ms
    reqs[0].num_computed_draft = 999                       # caught up: its guess step is plain work
    assert set(spec.plan(reqs, capacity=4096, budget=64, step_cost=cost)) == {"lag1000", "lag300", "lag600"}


def test_explorations_cost_at_most_the_budget_of_decode_time():
    """A pair that never pays (every guess rejected, each try's catch-up 200 ms: 8 sequences' 500-token prompts)
    still gets tried again, but the tries — with the prior, and the rate check's bursts — are charged their time
    beyond plain decoding's, and none starts while the charges exceed EXPLORE_BUDGET of the decode time observed:
    over a long run the loss to learning stays within the budget (plus the one try that crossed it)."""
    from runtime.spec_decode.speculator import EXPLORE_ALLOWANCE, EXPLORE_BUDGET

    spec = _speculator(prior_acceptance=0.7)
    cost = lambda guesses: 0.010 + sum(0.001 + 0.002 * g for g in guesses)     # noqa: E731
    reqs = [Request([1, 2, 3], SamplingParams(max_tokens=10_000), request_id=f"r{i}") for i in range(2)]
    tries, worst = 0, 0.0
    for _ in range(6_000):
        plan = spec.plan(reqs, capacity=20_000, budget=64, step_cost=cost)
        if plan:
            tries += 1
            spec.catch_up_s = 0.200 if spec._exploring else 0.0
            for r in reqs:
                if r.request_id in plan:
                    spec._account(r, proposed=plan[r.request_id], accepted=0)
            spec.observe(2, True, tokens=2, seconds=0.012 + spec.catch_up_s)
            worst = max(worst, 0.012 + spec.catch_up_s)
        else:
            spec.observe(2, False, tokens=2, seconds=0.010)
    assert tries >= 2, "a pair measured useless is still tried again"
    assert spec.explore_cost_s > 0
    assert spec.explore_cost_s <= EXPLORE_BUDGET * spec.decode_s + EXPLORE_ALLOWANCE + worst


def test_prompt_lookup_plans_only_the_sequences_it_has_a_guess_for():
    """A lookup costs a few dictionary reads, so it runs before the plan: a sequence with no earlier match of its
    last n-gram is not planned at all (its step is plain, not a speculating step that found nothing), and one with
    a match is planned no further than its guess goes and verifies exactly those tokens."""
    from runtime.spec_decode.ngram import NgramProposer

    spec = Speculator(SpecConfig(prior_acceptance=0.9), proposer=NgramProposer(), sampler=None, cost=CostModel())
    cost = lambda guesses: 0.010 + sum(0.001 * (g + 1) for g in guesses)       # noqa: E731  guesses are cheap
    repeats = Request([7, 8, 9, 10, 11, 7, 8, 9], SamplingParams(max_tokens=100), request_id="repeats")
    fresh = Request(list(range(20, 40)), SamplingParams(max_tokens=100), request_id="fresh")
    assert spec.plan([fresh], capacity=1000, budget=64, step_cost=cost) == {}
    assert spec._planned is None and spec._looked_up == {}
    plan = spec.plan([fresh, repeats], capacity=1000, budget=64, step_cost=cost)
    assert set(plan) == {"repeats"} and 1 <= plan["repeats"] <= 5     # "10 11 7 8 9" follows the first "7 8 9"
    proposals = spec.propose([repeats], [plan["repeats"]])
    assert proposals["repeats"].tokens == [10, 11, 7, 8, 9][:plan["repeats"]]


def test_what_a_speculating_step_costs_beyond_its_price_is_learned_per_guess():
    """The cost model prices model calls; a speculating step measured slower than its price (the draft's and the
    rejection sampler's Python, weights coming back into cache) spreads the difference over its guesses, and the
    planner prices each guess that much more: a plan that paid on the model calls alone stops."""
    spec = _speculator(prior_acceptance=0.7)
    cost = lambda guesses: 0.010 + sum(0.001 + 0.002 * g for g in guesses)     # noqa: E731
    req = Request([1, 2, 3], SamplingParams(max_tokens=10_000), request_id="r")
    for _ in range(10):
        spec._account(req, proposed=4, accepted=2)                             # α = 2/3, past the prior
    spec.observe(1, False, tokens=1, seconds=0.010)                            # plain: 100 tok/s, all model
    plan = spec.plan([req], capacity=20_000, budget=64, step_cost=cost)
    assert plan, "on the model calls alone a guess pays"
    plans = []
    for _ in range(300):
        plan = spec.plan([req], capacity=20_000, budget=64, step_cost=cost)
        plans.append(plan.get("r", 0))
        if plan:    # 8 ms a guess unpriced; 3 tokens a step, so the rate check (≥ 140 tok/s vs 100) never objects
            spec.observe(1, True, tokens=3, seconds=cost([plan["r"]]) + 0.008 * plan["r"])
        else:       # the rate check's plain steps, then the planner's own no
            spec.observe(1, False, tokens=1, seconds=0.010)
    assert plans[0] and not any(plans[-100:]), "the learned price stops the plan"
    # it stops once a guess's price exceeds what γ = 1 at α = 2/3 gains over plain: 1.667 / (13 ms + u) < 100/s
    assert 0.0036 < spec.unseen_per_guess <= 0.008
    assert spec.rate_check.pays(1)


class _Unsettled(Speculator):
    """The speculator without its settled plans: every plan runs every check (the slow truth)."""

    def _settle(self, decodes, plans, counts_steps):
        pass


def _state(spec: Speculator) -> tuple:
    check = spec.rate_check
    return (check.sums, check.steps, check.interval, check.burst, check.last_speculated, check.exploring,
            spec.idle_plans, spec.explore_after, spec.decode_s, spec.explore_cost_s, spec.unseen_per_guess,
            spec.stats.rounds, spec.stats.recent_counts, spec.stats.history, spec._empty_plan)


def _side_by_side(phases: list[tuple[int, int, float, float, int]]) -> int:
    """A settling and an unsettled speculator fed the same traffic — phases of (which decodes, steps, a plain step's
    seconds, a speculating step's seconds, guesses accepted a round) — compared after every step; returns the plans
    that were settled."""
    cost = lambda guesses: 0.001 + sum(0.0002 + 0.0001 * g for g in guesses)     # noqa: E731
    reqs = [Request(list(range(40)), SamplingParams(max_tokens=100_000), request_id=f"r{i}") for i in range(3)]
    pools = [[reqs[0]], [reqs[1]], [reqs[0], reqs[1]], [reqs[2], reqs[0]]]
    fast, slow = (cls(SpecConfig(prior_acceptance=0.6), proposer=None, sampler=None, cost=CostModel())
                  for cls in (Speculator, _Unsettled))
    settled = 0
    for which, steps, plain_s, spec_s, accepted in phases:
        decodes = pools[which]
        for _ in range(steps):
            settled += fast._quiet > 0
            plans = [s.plan(decodes, capacity=200_000, budget=64, step_cost=cost) for s in (fast, slow)]
            assert plans[0] == plans[1]
            for spec in (fast, slow):
                for r in decodes:
                    if r.request_id in plans[0]:
                        spec._account(r, proposed=plans[0][r.request_id], accepted=min(accepted, plans[0][r.request_id]))
                tokens = len(decodes) + (accepted if plans[0] else 0)
                spec.catch_up_s = 0.0
                spec.observe(len(decodes), bool(plans[0]), tokens, spec_s if plans[0] else plain_s)
            assert _state(fast) == _state(slow)
    return settled


SLOWING = [(0, 400, 0.0010, 0.0016, 0), (0, 300, 0.0030, 0.0016, 0)]    # plain slows until speculation pays
SWITCHING = [(0, 300, 0.0010, 0.0040, 0), (1, 50, 0.0010, 0.0040, 0), (0, 300, 0.0010, 0.0040, 0)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3),                      # which decodes
                          st.integers(1, 700),                    # steps of this phase
                          st.sampled_from([0.0010, 0.0012, 0.0030]),   # a plain step's seconds
                          st.sampled_from([0.0011, 0.0016, 0.0040]),   # a speculating step's seconds
                          st.integers(0, 4)),                     # guesses accepted in a round
                min_size=1, max_size=8))
@example(SLOWING)
@example(SWITCHING)
def test_settled_plans_answer_and_count_exactly_as_checking_every_step(phases):
    """While the rate check keeps plain decoding (or the same decodes' plan was empty), the speculator settles the
    next plans at once and skips its checks: decisions, rates, counters and budgets stay those of checking every
    step, whatever the traffic — other decodes, plain decoding slowing until speculation pays, rounds accepted
    or not."""
    _side_by_side(phases)


def test_settled_plans_were_exercised():
    """The comparisons above are not vacuous: on these traffics most plans are settled."""
    assert _side_by_side(SLOWING) > 400 and _side_by_side(SWITCHING) > 400
