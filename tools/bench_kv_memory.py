"""KV memory that follows the tokens: what it buys and what it costs. Four measurements, each printed and written
to JSON; `--code DIR` runs them on another checkout of Quicksilver (e.g. a `git worktree` of an older commit), so
before/after comes from the same tool. Without ENGINE, the bundled target is built once (int8 weights) under
--build-dir.

  capacity   sequences of `--prompt` tokens (+ `--max-tokens`) admitted at once in a `--budget-mib` KV budget
             (max_num_seqs raised to `--requests`): one schedule() over `--requests` waiting requests.
  tpot       TPOT of `--concurrency` concurrent requests (median over requests, per round); run it for two code
             versions interleaved with `--ab`.
  rss        process RSS (RssAnon) idle after warm-up, at the peak of a burst of `--concurrency` requests, and
             after the burst; with the prefix cache's resident blocks listed apart (they stay: cached data).
  costs      SlotPool alone, in the engine's KV layout: one `ensure` that is already resident (the per-step fast
             path), one that populates a granule in every layer (K and V, every kv head), one `release`.

    python tools/bench_kv_memory.py capacity ENGINE --budget-mib 1024 --prompt 512 --max-tokens 64
    python tools/bench_kv_memory.py tpot ENGINE --ab /tmp/old-checkout --rounds 5 --json out.json
    python tools/bench_kv_memory.py rss ENGINE --draft DRAFT
    python tools/bench_kv_memory.py costs --json tools/results/kv_memory_costs.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def use_code(code: str | None) -> None:
    """Import Quicksilver from `code` instead of the installed (editable) package."""
    if not code:
        return
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()
                        and "editable" not in getattr(f, "__name__", "").lower()]
    sys.path.insert(0, str(Path(code).resolve()))
    for name in [m for m in sys.modules if m == "runtime" or m.startswith(("runtime.", "compile."))]:
        del sys.modules[name]


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def engine(args, **sched):
    from runtime.config import CacheConfig, EngineConfig, SchedulerConfig
    from runtime.engine import Engine

    cache = CacheConfig(kv_budget_bytes=args.budget_mib << 20, max_model_len=args.max_model_len)
    spec = dict(draft=Path(args.draft), speculation="draft") if args.draft else {}
    return Engine(args.engine, EngineConfig(SchedulerConfig(**sched), cache, **spec))


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab - 100, length).tolist() for _ in range(n)]


def capacity(args) -> dict:
    from runtime.request import SamplingParams

    eng = engine(args, max_num_seqs=args.requests, token_budget=max(512, args.requests + 1))
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for p in prompts(args.requests, args.prompt, eng.runner.vocab_size):
        eng.add_request(p, params)
    eng.scheduler.schedule()
    return {"admitted": len(eng.scheduler.running), "requests": args.requests}


def tpot(args) -> dict:
    from runtime.request import SamplingParams

    eng = engine(args, max_num_seqs=max(16, args.concurrency))
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    out = eng.generate(prompts(args.concurrency, args.prompt, eng.runner.vocab_size, seed=1), params)
    t = [r["usage"].tpot_s * 1e3 for r in out]
    return {"tpot_ms_median": float(np.median(t)), "tpot_ms_p90": float(np.percentile(t, 90))}


def rss(args) -> dict:
    from runtime.request import SamplingParams

    eng = engine(args, max_num_seqs=max(16, args.concurrency))
    idle = rss_mib()
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for p in prompts(args.concurrency, args.prompt, eng.runner.vocab_size, seed=2):
        eng.add_request(p, params)
    peak = idle
    while eng.has_work():
        eng.step()
        peak = max(peak, rss_mib())
    after = rss_mib()
    blocks = eng.kv.blocks
    cached = getattr(blocks, "_populated", blocks.num_blocks) * sum(a[0].nbytes for a in blocks.keys + blocks.values) / 2**20
    return {"idle_mib": idle, "peak_mib": peak, "after_mib": after, "prefix_cache_resident_mib": cached,
            "slot_tokens_resident_after": getattr(eng.kv, "resident_tokens", None)}


def costs(args) -> dict:
    from artifact import read_manifest
    from runtime.backends.cpu.slots import SlotPool

    kv = read_manifest(Path(args.engine))["kv_cache"]
    capacity = args.max_model_len or read_manifest(Path(args.engine))["model"]["max_seq_len"]
    slots = args.concurrency
    pool = SlotPool(kv["num_layers"], slots, kv["num_kv_heads"], capacity, kv["head_dim"], kv["dtype"])
    g = pool.granule

    def timed(fn, reps: int = 1) -> float:
        t0 = time.perf_counter_ns()
        for _ in range(reps):
            fn()
        return (time.perf_counter_ns() - t0) / reps / 1e3

    first, grow, rel, rel_long, fast = [], [], [], [], []
    for _ in range(args.rounds):
        for slot in range(slots):
            first.append(timed(lambda: pool.ensure(slot, 1)))             # the slot's first granule
            grow.append(timed(lambda: pool.ensure(slot, g + 1)))          # a decoding sequence crossing into the next
            fast.append(timed(lambda: pool.ensure(slot, g), 1000))        # already resident
        for slot in range(slots):
            rel.append(timed(lambda: pool.release(slot)))                 # two granules resident
        for slot in range(slots):
            pool.ensure(slot, args.prompt)
            rel_long.append(timed(lambda: pool.release(slot)))            # a prompt's worth resident
    us = lambda xs: round(float(np.median(xs)), 3)
    layout = {k: kv[k] for k in ("dtype", "num_layers", "num_kv_heads", "head_dim")} | {"capacity": capacity}
    return {"layout": layout, "granule_tokens": g, "granule_bytes": g * pool.token_bytes,
            "calls_per_populate": 2 * pool.num_layers * pool.kv_heads, "calls_per_release": 2 * pool.num_layers,
            "ensure_fast_path_us": us(fast), "ensure_first_granule_us": us(first), "ensure_next_granule_us": us(grow),
            "release_2_granules_us": us(rel), f"release_{args.prompt}_tokens_us": us(rel_long),
            "populated_mib_per_s": round(g * pool.token_bytes / 2**20 / (us(grow) * 1e-6), 1)}


def bundled_engine(build_dir: Path) -> str:
    """The bundled target built with int8 weights (once: reused while its manifest is there)."""
    out = build_dir / "target-int8"
    if not (out / "manifest.json").exists():
        model = Path(__file__).resolve().parent.parent / "models" / "target"
        cmd = [sys.executable, "-c", "from compile.cli import main; main()", "build", "--model", str(model),
               "--out", str(out), "--precision", "int8", "--overwrite"]
        subprocess.run(cmd, check=True, stdout=sys.stderr)
    return str(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["capacity", "tpot", "rss", "costs"])
    ap.add_argument("engine", nargs="?", default=None, help="engine folder (default: the bundled target, built)")
    ap.add_argument("--build-dir", type=Path, default=Path("/tmp/qs-bench-kv-memory"))
    ap.add_argument("--draft", default=None)
    ap.add_argument("--code", default=None, help="a Quicksilver checkout to import instead of the installed one")
    ap.add_argument("--ab", default=None, help="tpot: also run this checkout, interleaved round by round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-mib", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.engine is None:
        args.engine = bundled_engine(args.build_dir)
    if args.ab:          # parent: alternate child runs of the two versions, so load drifts hit both alike
        me = [sys.executable, __file__, args.what, args.engine, *sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in
              vars(args).items() if k in ("draft", "budget_mib", "max_model_len", "prompt", "max_tokens", "concurrency")
              and v is not None), [])]
        runs = {"this": [], "ab": []}
        for _ in range(args.rounds):
            for name, code in (("this", None), ("ab", args.ab)):
                cmd = me + (["--code", code] if code else [])
                runs[name].append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
        result = {name: {k: float(np.median([r[k] for r in rs])) for k in rs[0]} | {"rounds": rs}
                  for name, rs in runs.items()}
        key = next(iter(runs["this"][0]))
        ratio = result["this"][key] / result["ab"][key]
        spread = [a[key] / b[key] for a, b in zip(runs["this"], runs["ab"])]
        result["ratio_this_over_ab"] = {"median": ratio, "min": min(spread), "max": max(spread)}
        print(f"{key}: this {result['this'][key]:.2f}  {args.ab} {result['ab'][key]:.2f}  ratio {ratio:.3f} "
              f"(per round {min(spread):.3f}..{max(spread):.3f}, {args.rounds} rounds)")
    else:
        use_code(args.code)
        t0 = time.perf_counter()
        result = {"capacity": capacity, "tpot": tpot, "rss": rss, "costs": costs}[args.what](args)
        result["seconds"] = time.perf_counter() - t0
        print(json.dumps(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args), "result": result, "pid": os.getpid()}, indent=2, default=str))


if __name__ == "__main__":
    main()
