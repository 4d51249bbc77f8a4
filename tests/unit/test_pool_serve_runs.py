"""tools/pool_serve_runs.py pairs each run's rounds with that run's baseline, never another run's."""

import json
import runpy
from pathlib import Path

import numpy as np

POOL = runpy.run_path(str(Path(__file__).resolve().parents[2] / "tools" / "pool_serve_runs.py"))


def _run(path: Path, off: list[float], spec: list[float]) -> Path:
    rounds = {"spec-off": [{"conc1": {"decode_tps_per_stream": x}} for x in off],
              "ngram": [{"conc1": {"decode_tps_per_stream": x}} for x in spec]}
    path.write_text(json.dumps({"rounds": rounds}))
    return path


def test_ratios_are_taken_round_by_round_within_each_run(tmp_path):
    # two runs on machines of different speed: pooled rates would mix them, per-round ratios do not
    a = _run(tmp_path / "a.json", off=[100.0, 200.0], spec=[90.0, 220.0])
    b = _run(tmp_path / "b.json", off=[1000.0], spec=[1000.0])
    ratios = POOL["pooled_ratios"]([a, b], "spec-off", "conc1.decode_tps_per_stream")
    assert list(ratios) == ["ngram"]
    np.testing.assert_array_equal(ratios["ngram"], [0.9, 1.1, 1.0])


def test_the_interval_brackets_the_median_within_the_rounds_range():
    lo, hi = POOL["bootstrap_median"](np.array([0.95, 1.0, 1.05] * 20))
    assert 0.95 <= lo <= 1.0 <= hi <= 1.05
    lo, hi = POOL["bootstrap_median"](np.full(30, 0.97))
    assert lo == hi == 0.97
