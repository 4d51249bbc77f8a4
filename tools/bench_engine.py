"""Engine benchmark (in-process, no server): single-stream TTFT/TPOT, concurrency scaling, prefix-cache TTFT,
and short-request TTFT under long-prompt load. Medians and p50/p95/p99; prints a table and writes JSON.

    python tools/bench_engine.py engines/smollm2-int8 --json bench_engine.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from runtime.config import CacheConfig, EngineConfig, OrtConfig, SchedulerConfig
from runtime.engine import Engine
from runtime.request import SamplingParams


def pct(values, q) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def run(engine: Engine, arrivals: list[tuple[float, list[int], SamplingParams]]) -> tuple[list, float]:
    """Submit each (offset_s, prompt, params) at its time, step until all finish; returns (usages, wall seconds)."""
    arrivals = sorted(arrivals, key=lambda a: a[0])
    usages, t0, i = {}, time.monotonic(), 0
    while i < len(arrivals) or engine.has_work():
        now = time.monotonic() - t0
        while i < len(arrivals) and arrivals[i][0] <= now:
            req = engine.add_request(arrivals[i][1], arrivals[i][2])
            usages[req.request_id] = (i, None)
            i += 1
        if not engine.has_work():
            time.sleep(max(0.0, min(0.01, arrivals[i][0] - now)))
            continue
        for out in engine.step():
            if out.finished:
                usages[out.request_id] = (usages[out.request_id][0], out.usage)
    ordered = sorted(usages.values(), key=lambda v: v[0])
    return [u for _, u in ordered], time.monotonic() - t0


def summary(usages, wall: float) -> dict:
    ttft = [u.ttft_s for u in usages]
    tpot = [u.tpot_s for u in usages if u.tpot_s]
    tokens = sum(u.completion_tokens for u in usages)
    return {"requests": len(usages), "ttft_ms": {q: round(1e3 * pct(ttft, q), 1) for q in (50, 95, 99)},
            "tpot_ms": {q: round(1e3 * pct(tpot, q), 2) for q in (50, 95, 99)},
            "output_tok_s": round(tokens / wall, 1), "wall_s": round(wall, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=4608)
    ap.add_argument("--kv-budget-gib", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    cache = lambda prefix=True: CacheConfig(max_model_len=args.max_model_len, enable_prefix_cache=prefix,  # noqa: E731
                                            kv_budget_bytes=int(args.kv_budget_gib * 2**30))
    engine = Engine(args.engine, EngineConfig(SchedulerConfig(max_num_seqs=16, max_waiting=1024), cache(), ort=OrtConfig(threads=args.threads)))
    vocab = engine.runner.vocab_size
    toks = lambda n: rng.integers(100, vocab - 100, int(n)).tolist()  # noqa: E731
    greedy = lambda n: SamplingParams(max_tokens=int(n), ignore_eos=True)  # noqa: E731
    results = {"engine": str(args.engine), "precision": engine.runner.manifest["precision"]["weights"]}

    # 1. single stream: 512-token prompt, 128 new tokens (fresh prompts: no prefix-cache help), median of 3
    single = [run(engine, [(0, toks(512), greedy(128))])[0][0] for _ in range(3)]
    results["single"] = {"ttft_ms": round(1e3 * float(np.median([u.ttft_s for u in single])), 1),
                         "tpot_ms": round(1e3 * float(np.median([u.tpot_s for u in single])), 2)}
    results["single"]["decode_tok_s"] = round(1e3 / results["single"]["tpot_ms"], 1)

    # 2. concurrency: N requests at once, 64-token prompts, 128 new tokens: aggregate decode throughput
    for n in (8, 16):
        usages, _ = run(engine, [(0, toks(64), greedy(128)) for _ in range(n)])
        tpot = float(np.median([u.tpot_s for u in usages]))
        results[f"concurrent_{n}"] = {"tpot_ms": round(1e3 * tpot, 2), "decode_tok_s": round(n / tpot, 1)}

    # 3. 16 concurrent, log-normal prompt (median 256) and output (median 96) lengths
    prompts = np.clip(rng.lognormal(np.log(256), 0.6, 16), 16, 2048)
    outs = np.clip(rng.lognormal(np.log(96), 0.5, 16), 8, 512)
    usages, wall = run(engine, [(0, toks(p), greedy(o)) for p, o in zip(prompts, outs)])
    results["lognormal_16"] = summary(usages, wall)

    # 4. shared 1,024-token system prompt + 32 new tokens: TTFT with the prefix cache on and off
    system = toks(1024)
    for label, prefix in (("prefix_cache_on", True), ("prefix_cache_off", False)):
        eng = engine if prefix else Engine(args.engine, EngineConfig(SchedulerConfig(max_num_seqs=16), cache(False),
                                                                     ort=OrtConfig(threads=args.threads)))
        run(eng, [(0, system + toks(32), greedy(1))])                       # warms the cache (when on)
        ttfts = [run(eng, [(0, system + toks(32), greedy(8))])[0][0].ttft_s for _ in range(5)]
        results[label] = {"ttft_ms": round(1e3 * float(np.median(ttfts)), 1)}
        if not prefix:
            del eng
    results["prefix_ttft_ratio"] = round(results["prefix_cache_on"]["ttft_ms"] / results["prefix_cache_off"]["ttft_ms"], 3)

    # 5. short requests while 10 % carry 4k-token prompts (Poisson arrivals, 2 req/s, 40 requests), with the
    #    time-bounded long-prompt chunk (the default) and with fixed chunks, on the same arrivals
    short_alone = [run(engine, [(0, toks(64), greedy(16))])[0][0].ttft_s for _ in range(3)]
    t, arrivals, kinds = 0.0, [], []
    for i in range(40):
        t += rng.exponential(0.5)
        long = i % 10 == 5
        arrivals.append((t, toks(4096 if long else 64), greedy(16)))
        kinds.append(long)
    for label, ratio in (("mixed_4k", SchedulerConfig.mixed_step_ratio), ("mixed_4k_fixed_chunks", float("inf"))):
        eng = Engine(args.engine, EngineConfig(SchedulerConfig(max_num_seqs=16, mixed_step_ratio=ratio), cache(False),
                                               ort=OrtConfig(threads=args.threads)))
        usages, wall = run(eng, arrivals)
        del eng
        short = [u for u, k in zip(usages, kinds) if not k]
        results[label] = {"short_ttft_unloaded_ms": round(1e3 * float(np.median(short_alone)), 1),
                          "short_ttft_p50_ms": round(1e3 * pct([u.ttft_s for u in short], 50), 1),
                          "short_ttft_p99_ms": round(1e3 * pct([u.ttft_s for u in short], 99), 1),
                          "short_tpot_p50_ms": round(1e3 * pct([u.tpot_s for u in short if u.tpot_s], 50), 1),
                          "long_ttft_p50_ms": round(1e3 * pct([u.ttft_s for u, k in zip(usages, kinds) if k], 50), 1)}
    s = results
    print(f"engine {s['engine']} ({s['precision']})")
    print(f"  single stream, 512-token prompt: TTFT {s['single']['ttft_ms']} ms, TPOT {s['single']['tpot_ms']} ms "
          f"({s['single']['decode_tok_s']} tok/s)")
    for n in (8, 16):
        c = s[f"concurrent_{n}"]
        print(f"  {n} concurrent: {c['decode_tok_s']} tok/s aggregate, TPOT {c['tpot_ms']} ms "
              f"({c['decode_tok_s'] / s['single']['decode_tok_s']:.2f}x single-stream throughput)")
    ln = s["lognormal_16"]
    print(f"  16 log-normal requests: TTFT p50/p95/p99 {ln['ttft_ms'][50]}/{ln['ttft_ms'][95]}/{ln['ttft_ms'][99]} ms, "
          f"TPOT p50/p95/p99 {ln['tpot_ms'][50]}/{ln['tpot_ms'][95]}/{ln['tpot_ms'][99]} ms, {ln['output_tok_s']} tok/s")
    print(f"  1,024 shared + 32 new: TTFT {s['prefix_cache_on']['ttft_ms']} ms cached vs "
          f"{s['prefix_cache_off']['ttft_ms']} ms cold ({s['prefix_ttft_ratio']}x)")
    for label, name in (("mixed_4k", "time-bounded chunks"), ("mixed_4k_fixed_chunks", "fixed chunks")):
        m = s[label]
        print(f"  short requests with 10 % 4k prompts, {name}: TTFT p50 {m['short_ttft_p50_ms']} ms, p99 "
              f"{m['short_ttft_p99_ms']} ms (unloaded {m['short_ttft_unloaded_ms']} ms), TPOT p50 {m['short_tpot_p50_ms']} ms; "
              f"4k TTFT p50 {m['long_ttft_p50_ms']} ms")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
