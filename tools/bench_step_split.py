"""Where a batch-1 decode step's time goes: the engine's whole step against the part inside ONNX Runtime's run, so
the rest (scheduling, binding inputs, sampling, detokenizing: the engine's Python) shows as its own figure. On a
small model that rest is a large share of a step; on a large one the run dominates.

    python tools/bench_step_split.py engines/target --requests 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.request import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "compile" / "data" / "heldout_code.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine", type=Path)
    ap.add_argument("--requests", type=int, default=8, help="requests run one after another")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    engine = Engine(args.engine, EngineConfig())
    inside = [0.0]
    run = ort.InferenceSession.run_with_iobinding

    def timed_run(session, binding, *rest, **kw):
        t = time.perf_counter()
        try:
            return run(session, binding, *rest, **kw)
        finally:
            inside[0] += time.perf_counter() - t

    ort.InferenceSession.run_with_iobinding = timed_run
    text, params = TEXT.read_text(), SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    engine.generate(["# warm-up\n" + text[:1600]], [params])
    steps, runs = [], []
    for i in range(args.requests):
        req = engine.add_request(f"# {i}\n" + text[(i + 3) * 3000:][:1600], params)
        engine.step()                                   # the prompt: not a decode step
        while not req.finished:
            inside[0] = 0.0
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
            runs.append(inside[0])
    step, inside_run = np.array(steps) * 1e6, np.array(runs) * 1e6
    rest = step - inside_run
    out = {"engine": str(args.engine), "steps": len(steps), "step_us": float(np.median(step)),
           "onnxruntime_us": float(np.median(inside_run)), "outside_us": float(np.median(rest)),
           "outside_quartiles_us": [float(np.percentile(rest, 25)), float(np.percentile(rest, 75))],
           "outside_share": float(np.median(rest / step))}
    print(f"{args.engine}: {out['steps']} batch-1 decode steps, medians: step {out['step_us']:.0f} us, inside ONNX "
          f"Runtime {out['onnxruntime_us']:.0f} us, outside {out['outside_us']:.0f} us "
          f"[{out['outside_quartiles_us'][0]:.0f}-{out['outside_quartiles_us'][1]:.0f}] "
          f"({100 * out['outside_share']:.1f} % of the step)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
