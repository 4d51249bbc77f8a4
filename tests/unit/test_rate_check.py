"""Adaptive speculation checks its decisions against measured outcomes: per batch size, decode-only steps with
speculation must deliver at least the tokens per second of plain steps, else speculation stops there; one step in
EXPLORE_EVERY measures the other side."""

from runtime.spec_decode.speculator import RateCheck


def sides(check: RateCheck, n: int, steps: int) -> str:
    return "".join("s" if check.speculate(n) else "p" for _ in range(steps))


def test_speculation_runs_until_measured_losing_and_both_sides_stay_measured():
    check, every = RateCheck(), RateCheck.EXPLORE_EVERY
    assert sides(check, 4, every) == "s" * (every - 1) + "p"          # nothing measured: speculate, explore plain
    check.observe(4, True, tokens=8, seconds=0.1)                     # 80 tok/s speculating
    check.observe(4, False, tokens=4, seconds=0.04)                   # 100 tok/s plain
    assert not check.pays(4)
    assert sides(check, 4, every) == "p" * (every - 1) + "s"          # plain, exploring speculation
    assert check.pays(1) and check.pays(8)                            # other batch sizes keep their own figures
    for _ in range(20):                                               # speculation gets better (new traffic)
        check.observe(4, True, tokens=15, seconds=0.1)
    assert check.pays(4) and sides(check, 4, every)[:every - 1] == "s" * (every - 1)


def test_rates_are_moving_averages_and_ignore_empty_steps():
    check = RateCheck()
    check.observe(2, False, tokens=10, seconds=0.1)
    check.observe(2, False, tokens=20, seconds=0.1)
    assert check.rates[False][2] == (1 - RateCheck.WEIGHT) * 100 + RateCheck.WEIGHT * 200
    check.observe(2, True, tokens=5, seconds=0.0)
    assert 2 not in check.rates[True]


def test_exploring_a_losing_side_backs_off_and_resets_when_it_pays():
    """Each exploration that finds speculation still losing doubles the plain steps before the next one (up to
    EXPLORE_MAX); one that finds it paying brings back EXPLORE_EVERY."""
    check, every = RateCheck(), RateCheck.EXPLORE_EVERY
    check.observe(2, False, tokens=2, seconds=0.01)                   # 200 tok/s plain
    check.observe(2, True, tokens=3, seconds=0.03)                    # 100 tok/s speculating
    gaps = []
    for _ in range(7):
        run = sides(check, 2, 4 * RateCheck.EXPLORE_MAX)
        gaps.append(run.index("s") + 1)
        check.observe(2, True, tokens=3, seconds=0.03)                # the exploration lost again
        check.steps[2] = 0                                            # sides() ran on past it: count anew
    assert gaps == [min(every * 2 ** k, RateCheck.EXPLORE_MAX) for k in range(7)]
    for _ in range(30):                                               # speculation now delivers 300 tok/s
        check.observe(2, True, tokens=9, seconds=0.03)
    assert check.pays(2) and check.interval[2] == every


def test_new_requests_start_from_the_measured_acceptance():
    """Before a request has speculated its acceptance is the engine's recent one, not the configured prior."""
    from runtime.request import Request, SamplingParams
    from runtime.spec_decode.speculator import SpecConfig, Speculator

    spec = Speculator(SpecConfig(prior_acceptance=0.7), proposer=None, sampler=None, cost=None)
    fresh = Request([1, 2, 3], SamplingParams(max_tokens=4), request_id="fresh")
    assert spec._alpha(fresh) == 0.7
    old = Request([1, 2, 3], SamplingParams(max_tokens=4), request_id="old")
    for _ in range(200):
        spec._account(old, proposed=4, accepted=1)
    assert abs(spec._alpha(fresh) - 0.25) < 1e-6
