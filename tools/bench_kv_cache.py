"""Engine A/B: two engines of one checkpoint in one process, interleaved — e.g. --kv-cache fp32 vs int8, or a
build before and after a graph change (--batch-invariant vs --no-batch-invariant).

For each context length: prefill time of one sequence, and decode step time at batch 1 and 8 right after
it, alternating the engines round by round so background load hits both alike (this machine is noisy:
separate runs minutes apart disagree by more than the effect). Pools are made resident up front. Medians over rounds.

    python tools/bench_kv_cache.py engines/smol-kvfp32 engines/smol-kvint8 --contexts 512 3072 --json kv.json
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
    ap.add_argument("engines", nargs=2, type=Path)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 3072])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12, help="decode steps per round and batch size")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    runners = {str(e): ModelRunner(e, threads=args.threads) for e in args.engines}
    rows = []
    for ctx in args.contexts:
        prompt = np.random.default_rng(ctx).integers(100, min(r.vocab_size for r in runners.values()) - 100, ctx).tolist()
        pools, times = {}, {}
        for name, r in runners.items():
            pools[name] = r.new_pool(8, ctx + args.steps + 1)
            for slot in range(8):
                pools[name].ensure(slot, ctx + args.steps + 1)
            for slot in range(8):
                r.prefill(pools[name], slot, prompt, 0)
        for _ in range(args.rounds):
            for name, r in runners.items():
                t = times.setdefault(name, {"prefill": [], 1: [], 8: []})
                t0 = time.perf_counter()
                r.prefill(pools[name], 0, prompt, 0)
                t["prefill"].append(time.perf_counter() - t0)
                for batch in (1, 8):
                    steps = []
                    for i in range(args.steps):
                        t0 = time.perf_counter()
                        r.decode(pools[name], [(s, 5, ctx + i) for s in range(batch)], set())
                        steps.append(time.perf_counter() - t0)
                    t[batch].append(float(np.median(steps[2:])))
        for name, r in runners.items():
            t = times[name]
            row = {"engine": name, "kv_cache": r.kv_layout.dtype, "context": ctx,
                   "kv_bytes_per_token": r.kv_layout.token_bytes,
                   "prefill_ms": round(1e3 * float(np.median(t["prefill"])), 1),
                   "decode_b1_ms": round(1e3 * float(np.median(t[1])), 2),
                   "decode_b8_ms": round(1e3 * float(np.median(t[8])), 2)}
            rows.append(row)
            print(f"context {ctx:>5}  {Path(name).name:<28} KV {row['kv_cache']:<8} {row['kv_bytes_per_token']:>6} B/token  "
                  f"prefill {row['prefill_ms']:>8} ms  decode b1 {row['decode_b1_ms']:>6} ms  b8 {row['decode_b8_ms']:>7} ms",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
