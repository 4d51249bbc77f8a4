"""Pool the rounds of several bench_serve runs: per-round ratios to a baseline server, their median, quartiles and a
bootstrap interval of the median.

One run's servers are one set of processes, and separate instances of the same engine differ by ~1-3 % by
themselves (memory placement); at conc 1 this machine's rounds swing ±20-30 %. A 0.98x verdict needs more rounds
than one run gives and more than one set of servers, so run bench_serve several times (each starts fresh servers)
and pool them here:

    python tools/pool_serve_runs.py --baseline spec-off --metric conc1.decode_tps_per_stream RUN1.json RUN2.json

Identical servers still read apart (a second `--speculation off` server beside the baseline read 0.935x of it at
conc 1 over 24 rounds), so runs may carry several such servers and take their geometric mean, round by round, as
the baseline: `--baseline spec-off,off-b`.

Because a run's servers stay apart by the same few per cent in every round, a run's rounds are not independent
draws: besides the pooled median, each run's own median is printed, and the interval is also taken resampling runs
first, then rounds within each (a cluster bootstrap): with few runs that interval is the honest one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import round_ratios  # noqa: E402


def pooled_ratios(paths: list[Path], baseline: str, metric: str) -> dict[str, np.ndarray]:
    """Server name → its per-round ratios to `baseline` on `metric` ("conc8.aggregate_tps"), over every run given
    (each must have the baseline): a round is divided by the same round of its own run's baseline, and rounds
    where either lacks the figure are left out. `baseline` may name several servers ("off,off-b"): a round's
    baseline is then the geometric mean of theirs (a round where one lacks the figure has none)."""
    return {name: np.concatenate(runs) for name, runs in run_ratios(paths, baseline, metric).items()}


def run_ratios(paths: list[Path], baseline: str, metric: str) -> dict[str, list[np.ndarray]]:
    """pooled_ratios' ratios kept apart by run: server name → one array per run that has any."""
    level, figure = metric.split(".", 1)
    bases = baseline.split(",")
    ratios: dict[str, list[np.ndarray]] = {}
    for path in paths:
        rounds = json.loads(path.read_text())["rounds"]
        missing = [b for b in bases if b not in rounds]
        if missing:
            raise SystemExit(f"{path}: no server named {missing[0]!r} (it has {', '.join(rounds)})")
        base = [{level: {figure: mean_figure([rounds[b][i] for b in bases], level, figure)}}
                for i in range(min(len(rounds[b]) for b in bases))]
        for name, runs in rounds.items():
            r = [] if name in bases else round_ratios(runs, base, level, figure)
            if r:
                ratios.setdefault(name, []).append(np.array(r))
    return ratios


def mean_figure(rounds: list[dict], level: str, figure: str) -> float | None:
    """The geometric mean of these servers' figure in one round; None if any lacks it."""
    values = [r.get(level, {}).get(figure) for r in rounds]
    if any(not v for v in values):
        return None
    return float(np.prod(values) ** (1 / len(values)))     # x ** 1.0 is x: one baseline's ratios are as before


def bootstrap_median(x: np.ndarray, draws: int = 5000, seed: int = 0) -> tuple[float, float]:
    """The 5th and 95th percentiles of the median of resampled rounds."""
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(x, size=(draws, len(x))), axis=1)
    return float(np.percentile(medians, 5)), float(np.percentile(medians, 95))


def cluster_bootstrap_median(runs: list[np.ndarray], draws: int = 5000, seed: int = 0) -> tuple[float, float]:
    """bootstrap_median resampling runs with replacement, then each drawn run's rounds: the 5th and 95th
    percentiles of the pooled median, with the spread between runs (server instances) in it."""
    rng = np.random.default_rng(seed)
    medians = np.empty(draws)
    for i in range(draws):
        picked = [runs[j] for j in rng.integers(len(runs), size=len(runs))]
        medians[i] = np.median(np.concatenate([rng.choice(r, size=len(r)) for r in picked]))
    return float(np.percentile(medians, 5)), float(np.percentile(medians, 95))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, nargs="+", help="bench_serve --json outputs")
    ap.add_argument("--baseline", required=True, help="the server the ratios are taken against, or several "
                    "(comma-separated): their geometric mean, round by round")
    ap.add_argument("--metric", action="append", help="LEVEL.FIGURE, e.g. conc1.decode_tps_per_stream (repeatable; "
                    "default: conc1 decode, conc4 and conc8 aggregate)")
    ap.add_argument("--json", type=Path, help="also write the pooled figures here")
    args = ap.parse_args()
    metrics = args.metric or ["conc1.decode_tps_per_stream", "conc4.aggregate_tps", "conc8.aggregate_tps"]
    out: dict[str, dict] = {"runs": [str(p) for p in args.runs], "baseline": args.baseline, "pooled": {}}
    for metric in metrics:
        for name, runs in run_ratios(args.runs, args.baseline, metric).items():
            x = np.concatenate(runs)
            lo, hi = bootstrap_median(x)
            clo, chi = cluster_bootstrap_median(runs)
            q1, q3 = np.percentile(x, [25, 75])
            per_run = [float(np.median(r)) for r in runs]
            out["pooled"].setdefault(metric, {})[name] = {
                "rounds": len(x), "median": float(np.median(x)), "quartiles": [float(q1), float(q3)],
                "median_90pct_interval": [lo, hi], "runs": len(runs), "run_medians": per_run,
                "median_90pct_interval_by_run": [clo, chi]}
            print(f"{metric:30s} {name:12s} {len(x):4d} rounds  {np.median(x):.3f}x [{q1:.3f}-{q3:.3f}]  "
                  f"median's 90 % interval {lo:.3f}-{hi:.3f}; {len(runs)} runs, {clo:.3f}-{chi:.3f} resampling "
                  f"runs; run medians {' '.join(f'{m:.3f}' for m in per_run)}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
