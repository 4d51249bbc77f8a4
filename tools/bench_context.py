"""Decode step time vs context length and batch size, for several engines interleaved in one process.

What the attention op costs per step: every engine decodes the same batches at the same contexts, the engines
alternating round by round so the machine's drift hits all alike; medians and quartiles of the step times.

    python tools/bench_context.py engines/smollm2-int8-ort engines/smollm2-int8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from runtime.backends.cpu.runner import ModelRunner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engines", nargs="+")
    ap.add_argument("--contexts", type=int, nargs="+", default=[16, 512, 1024])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps per engine per round")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    capacity = max(args.contexts) + args.rounds * (args.steps + 2) + 8
    runners = {e: ModelRunner(e) for e in args.engines}
    pools = {e: r.new_pool(max(args.batches), capacity) for e, r in runners.items()}
    rng = np.random.default_rng(0)
    results = []
    for ctx in args.contexts:
        for batch in args.batches:
            times: dict[str, list[float]] = {e: [] for e in runners}
            prompts = [rng.integers(5, 1000, ctx).tolist() for _ in range(batch)]
            for e, r in runners.items():
                for slot, prompt in enumerate(prompts):
                    r.prefill(pools[e], slot, prompt, 0)
            for rnd in range(args.rounds):
                for e, r in (runners.items() if rnd % 2 == 0 else reversed(runners.items())):
                    for step in range(args.steps + 2):      # two untimed steps wake the threads
                        pos = ctx + rnd * (args.steps + 2) + step
                        t0 = time.perf_counter()
                        r.decode(pools[e], [(slot, 7, pos) for slot in range(batch)], set())
                        if step >= 2:
                            times[e].append(time.perf_counter() - t0)
            row = {"context": ctx, "batch": batch}
            for e, ts in times.items():
                row[e] = {"median_ms": float(np.median(ts) * 1e3), "p25_ms": float(np.percentile(ts, 25) * 1e3),
                          "p75_ms": float(np.percentile(ts, 75) * 1e3)}
            results.append(row)
            print(f"context {ctx:5d} batch {batch:2d}: " + " | ".join(
                f"{Path(e).name} {v['median_ms']:.2f} ms [{v['p25_ms']:.2f}-{v['p75_ms']:.2f}]"
                for e, v in row.items() if isinstance(v, dict)), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=2))


if __name__ == "__main__":
    main()
