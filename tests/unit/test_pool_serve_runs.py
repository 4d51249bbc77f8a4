"""tools/pool_serve_runs.py pairs each run's rounds with that run's baseline, never another run's."""

import json
import runpy
from pathlib import Path

import numpy as np
import pytest

POOL = runpy.run_path(str(Path(__file__).resolve().parents[2] / "tools" / "pool_serve_runs.py"))


def _run(path: Path, off: list, spec: list) -> Path:
    """A bench_serve JSON whose rounds hold these conc-1 decode figures (None: a round without the level)."""
    level = lambda x: {} if x is None else {"conc1": {"decode_tps_per_stream": x}}     # noqa: E731
    path.write_text(json.dumps({"rounds": {"spec-off": [level(x) for x in off], "ngram": [level(x) for x in spec]}}))
    return path


def test_each_round_is_divided_by_the_same_round_of_its_own_run(tmp_path):
    # run a: its baseline's first round lacks the level and its second server ran a round more than the baseline;
    # run b is on a 10x faster machine. Pairing by position across the pooled rounds would mix them up.
    a = _run(tmp_path / "a.json", off=[None, 200.0], spec=[90.0, 220.0, 300.0])
    b = _run(tmp_path / "b.json", off=[1000.0, 1000.0], spec=[1000.0, None])
    ratios = POOL["pooled_ratios"]([a, b], "spec-off", "conc1.decode_tps_per_stream")
    assert list(ratios) == ["ngram"]
    np.testing.assert_array_equal(ratios["ngram"], [1.1, 1.0])


def test_the_interval_brackets_the_median_of_resampled_rounds():
    lo, hi = POOL["bootstrap_median"](np.array([0.95, 1.0, 1.05] * 20))
    assert 0.975 <= lo <= 1.0 <= hi <= 1.025          # the median of 60 such rounds is 1.0 but for rare draws
    lo, hi = POOL["bootstrap_median"](np.full(30, 0.97))
    assert lo == hi == 0.97


def test_several_baselines_are_their_geometric_mean_round_by_round(tmp_path):
    # two identical "off" servers read 100 and 400 in round 1 (mean 200) and 90 and 110 in round 2 (mean ~99.5);
    # round 3 lacks the level on one of them, so no baseline there; the baselines get no ratio of their own
    level = lambda x: {} if x is None else {"conc1": {"decode_tps_per_stream": x}}     # noqa: E731
    rounds = {"off": [level(100.0), level(90.0), level(50.0)], "off-b": [level(400.0), level(110.0), level(None)],
              "ngram": [level(220.0), level(99.0), level(50.0)]}
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"rounds": rounds}))
    ratios = POOL["pooled_ratios"]([path], "off,off-b", "conc1.decode_tps_per_stream")
    assert list(ratios) == ["ngram"]
    np.testing.assert_allclose(ratios["ngram"], [220.0 / 200.0, 99.0 / np.sqrt(90.0 * 110.0)], rtol=1e-12)


def test_a_baseline_a_run_lacks_is_named(tmp_path):
    path = _run(tmp_path / "a.json", off=[1.0], spec=[1.0])
    with pytest.raises(SystemExit, match="'off-b'"):
        POOL["pooled_ratios"]([path], "spec-off,off-b", "conc1.decode_tps_per_stream")


def test_runs_are_kept_apart_and_resampled_as_wholes(tmp_path):
    # two runs whose servers sit apart by a run-wide offset (instances): 1.05x in every round of one, 0.95x of the
    # other. Rounds resampled alone give the pooled median a tight interval; runs resampled first cover both.
    a = _run(tmp_path / "a.json", off=[100.0] * 20, spec=[105.0] * 20)
    b = _run(tmp_path / "b.json", off=[100.0] * 20, spec=[95.0] * 20)
    runs = POOL["run_ratios"]([a, b], "spec-off", "conc1.decode_tps_per_stream")
    assert [len(r) for r in runs["ngram"]] == [20, 20]
    np.testing.assert_allclose([r[0] for r in runs["ngram"]], [1.05, 0.95])
    lo, hi = POOL["cluster_bootstrap_median"](runs["ngram"])
    assert lo == pytest.approx(0.95) and hi == pytest.approx(1.05)     # a quarter of draws take one run twice
