"""ONNX Runtime thread spinning policies, interleaved in one process: decode step time at batch 1 and 8, and the
CPU the process burns when steps are 5 ms apart (what spinning costs a machine that is not saturated).

  off   threads sleep between ops (`--no-spin`)
  spin  threads spin between ops and for 2 ms after a run (the default: runtime.backends.cpu.runner.SPIN_US)
  ort   ONNX Runtime's own spinning (~40 ms after every run)
  stop  spin between ops, stop when a run returns (session.force_spinning_stop)

    python tools/bench_spin.py ENGINE --context 400 --rounds 7 --json spin.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import runtime.backends.cpu.runner as mr

POLICIES = {
    "off": {"session.intra_op.allow_spinning": "0"},
    "spin": {"session.intra_op.allow_spinning": "1", "session.intra_op.spin_duration_us": str(mr.SPIN_US)},
    "ort": {"session.intra_op.allow_spinning": "1"},
    "stop": {"session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "1"},
}


def runner(engine: Path, entries: dict[str, str]) -> mr.ModelRunner:
    original = mr.session_options

    def options(threads, config=None, spin=True):
        so = original(threads, config, False)
        for key, value in entries.items():
            so.add_session_config_entry(key, value)
        return so

    mr.session_options = options
    try:
        return mr.ModelRunner(engine)
    finally:
        mr.session_options = original


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine", type=Path)
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    runners = {name: runner(args.engine, entries) for name, entries in POLICIES.items()}
    ctx, pools = args.context, {}
    for name, r in runners.items():
        pools[name] = r.new_pool(8, ctx + args.rounds + 1)
        for s in range(8):
            pools[name].ensure(s, ctx + args.rounds + 1)
            r.prefill(pools[name], s, list(range(100, 100 + ctx)), 0)
    res = {n: {"b1_ms": [], "b8_ms": [], "cores_busy_5ms_gaps": []} for n in runners}
    for rnd in range(args.rounds):
        for name, r in runners.items():
            for b in (1, 8):
                rows = [(s, 5, ctx + rnd) for s in range(b)]
                t0 = time.perf_counter()
                for _ in range(10):
                    r.decode(pools[name], rows, set())
                res[name][f"b{b}_ms"].append((time.perf_counter() - t0) / 10 * 1e3)
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(10):
                r.decode(pools[name], [(0, 5, ctx)], set())
                time.sleep(0.005)
            res[name]["cores_busy_5ms_gaps"].append((time.process_time() - c0) / (time.perf_counter() - w0))
    summary = {n: {k: float(np.median(v)) for k, v in d.items()} for n, d in res.items()}
    for n, d in summary.items():
        print(f"{n:5s} b=1 {d['b1_ms']:6.2f} ms  b=8 {d['b8_ms']:6.2f} ms  cores busy with 5 ms gaps "
              f"{d['cores_busy_5ms_gaps']:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"engine": str(args.engine), "summary": summary, "rounds": res}, indent=2))


if __name__ == "__main__":
    main()
