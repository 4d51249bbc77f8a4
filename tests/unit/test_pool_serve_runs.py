"""tools/pool_serve_runs.py pairs each run's rounds with that run's baseline, never another run's."""

import json
import runpy
from pathlib import Path

import numpy as np

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
