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
