"""Two builds of our cpu kernels (the `runtime._native` op library) on one engine, or two engines of one checkpoint
(a graph change: `--old-engine`, built before it), or one engine with its weights mapped from its file against read
onto huge pages (`--old-mmap`), interleaved in one process.

For kernel work: keep a copy of the library before a change (`cp .venv/.../runtime/_native*.so /tmp/old.so`),
reinstall (`pip install .`), then compare. For graph work: keep the engine compiled before the change. Both sides
run with the same threads; rounds alternate between them so the machine's drift hits both alike. Per round: a
prompt of `--context` tokens from empty (prefill), a `--chunk`-token prompt chunk after it (a prefix-cache hit's or
a chat turn's uncached tail), and decode steps at batch 1 and `--batch` at that context. Prints medians with the spread of the per-round
new/old ratios, says whether the two builds' logits are bitwise equal, and writes JSON with `--json`.

    python tools/bench_native.py engines/target --old /tmp/old.so --threads 1 --context 1400 --chunk 48
    python tools/bench_native.py /tmp/q05-int4-new --old-engine /tmp/q05-int4 --context 590 --chunk 48
    python tools/bench_native.py /tmp/q05-int4 --old-mmap --context 590 --chunk 48
    python tools/bench_native.py /tmp/q05-int4 --old /tmp/old.so --context 8192 --prefill-once --rounds 16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runtime import cpu_ops  # noqa: E402
from runtime.backends.cpu import runner as model_runner  # noqa: E402


def runner(engine: Path, library: str, threads: int, huge_pages: bool = True) -> model_runner.ModelRunner:
    """A ModelRunner whose session registers `library` as its op library."""
    find_library = cpu_ops.library
    cpu_ops.library = lambda: library
    try:
        return model_runner.ModelRunner(engine, threads=threads, huge_pages=huge_pages)
    finally:
        cpu_ops.library = find_library


def measure(r: model_runner.ModelRunner, pool, ids: list[int], context: int, batch: int, steps: int,
            prefill: bool = True) -> dict:
    """One round: the prompt from empty, the chunk after it and decode steps (only the decode steps, over the KV
    the first round wrote, where `prefill` is false)."""
    if not prefill:
        return decode_steps(r, pool, context, batch, steps, {}, [])
    t = time.perf_counter()
    prefill_logits = np.array(r.prefill(pool, 0, ids[:context], 0))
    out = {"prefill_ms": (time.perf_counter() - t) * 1e3}
    for slot in range(1, batch + 1):                  # the decode rows: slots 1..batch at `context`
        r.prefill(pool, slot, ids[:context], 0)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        chunk_logits = np.array(r.prefill(pool, 0, ids[context:], context))
        times.append(time.perf_counter() - t)
    out["chunk_ms"] = float(np.median(times)) * 1e3
    return decode_steps(r, pool, context, batch, steps, out, [prefill_logits, chunk_logits])


def decode_steps(r: model_runner.ModelRunner, pool, context: int, batch: int, steps: int, out: dict,
                 logits: list) -> dict:
    for b in sorted({1, batch}):
        times = []
        for step in range(steps):
            rows = [(slot, 7, context + step) for slot in range(1, b + 1)]
            t = time.perf_counter()
            decoded = r.decode(pool, rows, set())          # a fresh array: nothing to copy
            times.append(time.perf_counter() - t)
        out[f"decode_b{b}_ms"] = float(np.median(times)) * 1e3
        logits.append(decoded)                            # the last step's
    out["_logits"] = logits
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine", type=Path)
    ap.add_argument("--old", default=None, help="the other build of the op library (a copy of runtime/_native*.so); "
                    "default: this install's")
    ap.add_argument("--old-engine", type=Path, default=None, help="the other engine (default: ENGINE)")
    ap.add_argument("--new", default=None, help="default: this install's library")
    ap.add_argument("--old-mmap", action="store_true", help="the old side maps its weights from the engine's file "
                    "(ONNX Runtime's way) instead of reading them onto huge pages (runtime/backends/cpu/weights.py)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=1400, help="prompt tokens prefilled from empty")
    ap.add_argument("--chunk", type=int, default=48, help="tokens of the chunk computed after them")
    ap.add_argument("--batch", type=int, default=4, help="decode batch besides batch 1")
    ap.add_argument("--steps", type=int, default=10, help="decode steps a round, per batch size")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prefill-once", action="store_true", help="time the prompt and chunk in the first round only, "
                    "then decode steps alone (long contexts: many decode rounds without a long prefill each)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not (args.old or args.old_engine or args.old_mmap):
        ap.error("give --old (another build of the library), --old-engine (another engine) or --old-mmap, or several")
    builds = {"old": args.old or cpu_ops.library(), "new": args.new or cpu_ops.library()}
    engines = {"old": args.old_engine or args.engine, "new": args.engine}
    runners = {name: runner(engines[name], lib, args.threads, huge_pages=not (name == "old" and args.old_mmap))
               for name, lib in builds.items()}
    if args.old_mmap and runners["new"].weights is None:
        sys.exit("--old-mmap: this machine offers no transparent huge pages (or the engine has no weights our ops "
                 "read), so both sides would map the file")
    capacity = args.context + args.chunk + args.steps + 8
    pools = {name: r.new_pool(args.batch + 1, capacity) for name, r in runners.items()}
    ids = [int(t) for t in np.random.default_rng(0).integers(5, 8000, args.context + args.chunk)]
    rounds: dict[str, list[dict]] = {name: [] for name in builds}
    equal = True
    for rnd in range(args.rounds):
        order = list(builds) if rnd % 2 == 0 else list(builds)[::-1]
        prefill = rnd == 0 or not args.prefill_once
        got = {name: measure(runners[name], pools[name], ids, args.context, args.batch, args.steps, prefill)
               for name in order}
        equal &= all(np.array_equal(a, b) for a, b in zip(got["old"].pop("_logits"), got["new"].pop("_logits")))
        for name in builds:
            rounds[name].append(got[name])
    summary = {}
    versus = (f" vs {args.old_engine}" if args.old_engine else "") + (" vs its weights mapped" if args.old_mmap else "")
    print(f"{args.engine}{versus}, {args.threads} thread(s), context {args.context}, chunk {args.chunk}, "
          f"{args.rounds} rounds")
    for key in rounds["old"][0]:
        old = np.array([r[key] for r in rounds["old"] if key in r])
        new = np.array([r[key] for r in rounds["new"] if key in r])
        ratio = new / old
        summary[key] = {"old": float(np.median(old)), "new": float(np.median(new)), "ratio": float(np.median(ratio)),
                        "ratio_range": [float(ratio.min()), float(ratio.max())]}
        print(f"{key:16s} old {np.median(old):8.2f}  new {np.median(new):8.2f}  new/old {np.median(ratio):.3f} "
              f"[{ratio.min():.3f}-{ratio.max():.3f}]")
    print("logits bitwise equal (prefill, chunk and the last decode steps, every round):", equal)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds,
                                         "summary": summary, "bitwise_equal": bool(equal)}, indent=1))


if __name__ == "__main__":
    main()
