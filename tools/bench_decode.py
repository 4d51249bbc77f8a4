"""Decode benchmark for one or more engines: TTFT (512-token prompt), decode tokens/s at batch 1 and 8,
peak memory, and the batch-1 roofline of this machine: read bandwidth ÷ the bytes a step must read (the weights,
and the KV cache of the context so far), printed beside every batch-1 figure as the fraction of that bound.
`--contexts 2048,8192` adds batch-1 decode at those context lengths (KV reads grow with them).

This machine's bandwidth swings 25–37 GB/s minutes apart (and read 55–60 GB/s for seconds at a time), so a fraction
of the bound taken from one bandwidth figure and a decode figure measured elsewhere swung 51–77 % between runs. The
fraction is therefore taken in rounds inside the decoding process: each round decodes between two bandwidth
readings, and its bound is their mean; the table gives the median fraction of the steady rounds (readings within 15 %
of each other), their range, and how many rounds were steady. Threads spin between ops as `runtime serve` does
(--no-spin: sleep).

Each engine runs in its own subprocess so peak RSS is its own; engines are measured one after another
in one invocation so their ratios are comparable. Medians over repeats.

    python tools/bench_decode.py engines/target-fp32 engines/target-int8 engines/target-int4 --json out.json
    python tools/bench_decode.py /tmp/q05-int4 --contexts 2048,8192
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx


def read_bandwidth_gbs(threads: int = 2, mib: int = 512, repeats: int = 5, data: np.ndarray | None = None) -> float:
    """Read bandwidth with `threads` numpy reductions in parallel (numpy releases the GIL), best of repeats."""
    data = np.ones(mib * 2**20 // 8, np.float64) if data is None else data
    parts = np.array_split(data, threads)
    best = 0.0
    for _ in range(repeats):
        workers = [threading.Thread(target=np.add.reduce, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, data.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def pool_copy(pool, src: int, dst: int, rows: int) -> None:
    """Give slot `dst` the first `rows` KV rows of slot `src` (same prompt, no second prefill)."""
    for arrays in (pool.keys, pool.values):
        for a in arrays:
            a[dst, :, :rows] = a[src, :, :rows]


def weight_bytes_per_token(engine: Path, manifest: dict) -> int:
    """Bytes of weights a batch-1 decode step reads (as resident at run time: fp8 is folded to fp32)."""
    model = onnx.load(str(engine / manifest["graph"]["file"]), load_external_data=False)
    tied = manifest["model"]["tie_word_embeddings"]
    total = 0
    for t in model.graph.initializer:
        gather_only = t.name in ("model.embed_tokens.weight_int8", "model.embed_tokens.row_scale") or (
            not tied and t.name.startswith("model.embed_tokens."))
        if gather_only or t.name in ("cos_cache", "sin_cache"):
            continue
        n = int(np.prod(t.dims)) if t.dims else 1
        itemsize = 4 if t.data_type == onnx.TensorProto.FLOAT8E4M3FN else onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        total += n * itemsize
    return total


def kv_bytes_per_token(manifest: dict) -> int:
    """KV cache bytes one token of context adds, which every later decode step reads (K and V, every layer)."""
    kv = manifest["kv_cache"]
    itemsize = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "int8": 1, "fp8": 1}[kv["dtype"]]
    return 2 * kv["num_layers"] * kv["num_kv_heads"] * kv["head_dim"] * itemsize


def decode_steps_s(runner, pool, first: int, position: int, steps: int) -> tuple[list[float], int]:
    """Seconds of `steps` batch-1 decode steps from `position` (slot 0), greedy from token `first`; the last token.
    Each step is the serving engine's batch-1 call (ModelRunner.decode_one)."""
    token, times = first, []
    for i in range(steps):
        t = time.perf_counter()
        logits = runner.decode_one(pool, 0, token, position + i)
        token = int(logits.argmax())
        times.append(time.perf_counter() - t)
    return times, token


STEADY = 0.15       # a round counts when its bandwidth readings before and after it differ by at most this


def roofline_rounds(runner, pool, first: int, position: int, steps: int, rounds: int, step_bytes: int,
                    bandwidth_data: np.ndarray) -> dict:
    """Batch-1 decode in `rounds` rounds, each between two readings of this machine's bandwidth: the median step's
    tok/s and the fraction of the bound (the readings' mean ÷ `step_bytes`) per round. The fraction's median and
    range are over the steady rounds (readings within STEADY of each other; all rounds where none was): on a shared
    host the bandwidth jumped 33 → 55 GB/s and back between a reading and the decode after it, and such a round's
    fraction (55–109 % for one engine in one run) says nothing about the decode."""
    def reading() -> float:
        time.sleep(0.01)                  # ONNX Runtime's threads stop spinning 2 ms after a run
        return read_bandwidth_gbs(repeats=3, data=bandwidth_data)

    rates, fractions, bandwidths, steady = [], [], [], []
    after = reading()
    for r in range(rounds):
        before = after                    # a round's first reading is the last round's second
        times, first = decode_steps_s(runner, pool, first, position + r * steps, steps)
        after = reading()
        bandwidth = (before + after) / 2
        rate = 1 / float(np.median(times))
        rates.append(rate)
        bandwidths.append(bandwidth)
        fractions.append(rate / (bandwidth * 1e9 / step_bytes))
        steady.append(abs(before - after) <= STEADY * bandwidth)
    keep = steady if any(steady) else [True] * rounds
    kept = [f for f, k in zip(fractions, keep) if k]
    return {"tok_s": round(float(np.median(rates)), 1),
            "bandwidth_gbs": round(float(np.median([b for b, k in zip(bandwidths, keep) if k])), 1),
            "pct_of_bound": round(100 * float(np.median(kept)), 1),
            "pct_of_bound_range": [round(100 * min(kept), 1), round(100 * max(kept), 1)],
            "steady_rounds": sum(steady), "rounds_pct_of_bound": [round(100 * f, 1) for f in fractions]}


def prefill(runner, pool, ids: np.ndarray) -> int:
    """Prefill `ids` into slot 0 in chunks of 512; the greedy next token."""
    from runtime.backends.cpu.slots import SlotRange

    for start in range(0, len(ids), 512):
        chunk = ids[start:start + 512]
        logits = runner.execute(chunk[None].astype(np.int64), np.array([start + len(chunk) - 1], np.int32),
                                np.array([len(chunk) - 1]), pool, SlotRange(0, 1))
    return int(logits.argmax())


def measure(engine: Path, prompt_len: int, decode_steps: int, threads: int | None, spin: bool,
            prompt_file: Path | None = None, contexts: tuple[int, ...] = (), rounds: int = 5,
            kv_huge_pages: bool = False) -> dict:
    from runtime.backends.cpu.slots import SlotRange
    from runtime.backends.cpu.runner import ModelRunner

    t0 = time.perf_counter()
    runner = ModelRunner(engine, threads=threads, spin=spin)
    load_s = time.perf_counter() - t0
    if prompt_file is not None:   # the peers' prompt (shared/peers: prompt_512.json), for side-by-side runs
        ids = json.loads(prompt_file.read_text())["ids"][:prompt_len]
    else:
        ids = np.random.default_rng(0).integers(0, runner.vocab_size, prompt_len).tolist()
    prompt = np.asarray([ids], np.int64)
    # slots as the server's: the model's whole context each, rows made resident ahead of the writes (long
    # sequences' on huge pages with --kv-huge-pages, slots.py)
    pool = runner.new_pool(8, huge_pages=kv_huge_pages)
    for slot in range(8):
        pool.ensure(slot, prompt_len + rounds * decode_steps + 8)

    ttft = []
    for _ in range(5):
        t = time.perf_counter()
        logits = runner.execute(prompt, np.array([prompt_len - 1], np.int32), np.array([prompt_len - 1]), pool, SlotRange(0, 1))
        int(logits.argmax())
        ttft.append(time.perf_counter() - t)

    result = {"engine": str(engine), "precision": runner.manifest["precision"]["weights"], "load_s": round(load_s, 3),
              "ttft_ms": round(1e3 * float(np.median(ttft)), 2)}
    first = int(logits.argmax())
    # batch 8 right after the prompt (context prompt_len … prompt_len + decode_steps), every row the same prompt
    for s in range(1, 8):
        pool_copy(pool, 0, s, prompt_len)
    tokens = np.full((8, 1), first, np.int64)
    steps = []
    for i in range(decode_steps):
        t = time.perf_counter()
        logits = runner.execute(tokens, np.full(8, prompt_len + i, np.int32), np.arange(8), pool, SlotRange(0, 8))
        tokens = logits.argmax(-1).astype(np.int64)[:, None]
        steps.append(time.perf_counter() - t)
    result["decode_b8_tok_s"] = round(8 / float(np.median(steps)), 1)
    result["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)   # before the rounds' buffer
    weights, per_token = weight_bytes_per_token(engine, runner.manifest), kv_bytes_per_token(runner.manifest)
    result["weight_bytes_per_token"], result["kv_bytes_per_context_token"] = weights, per_token
    # batch 1 right after the prompt, in rounds with the bandwidth (slot 0's rows past the prompt are rewritten)
    context = prompt_len + rounds * decode_steps // 2
    result["decode_b1_context"] = context
    bandwidth_data = np.ones(512 * 2**20 // 8, np.float64)
    b1 = roofline_rounds(runner, pool, first, prompt_len, decode_steps, rounds, weights + context * per_token,
                         bandwidth_data)
    result["decode_b1_tok_s"], result["read_bandwidth_gbs"] = b1["tok_s"], b1["bandwidth_gbs"]
    result["roofline_b1_tok_s"] = round(b1["bandwidth_gbs"] * 1e9 / (weights + context * per_token), 1)
    result["roofline_pct"], result["roofline_pct_range"] = b1["pct_of_bound"], b1["pct_of_bound_range"]
    result["roofline_steady_rounds"], result["roofline_rounds_pct"] = b1["steady_rounds"], b1["rounds_pct_of_bound"]
    for context in contexts:
        long_pool = runner.new_pool(1, huge_pages=kv_huge_pages)
        long_pool.ensure(0, context + rounds * decode_steps + 8)
        ids = np.random.default_rng(1).integers(0, runner.vocab_size, context)
        at = roofline_rounds(runner, long_pool, prefill(runner, long_pool, ids), context, decode_steps, rounds,
                             weights + (context + rounds * decode_steps // 2) * per_token, bandwidth_data)
        result[f"decode_b1_ctx{context}_tok_s"] = at["tok_s"]
        result[f"decode_b1_ctx{context}_pct_of_bound"] = at["pct_of_bound"]
        result[f"decode_b1_ctx{context}_pct_range"] = at["pct_of_bound_range"]
        result[f"decode_b1_ctx{context}_steady_rounds"] = at["steady_rounds"]
        result[f"decode_b1_ctx{context}_kv_huge_mib"] = round(long_pool.huge_bytes / 2**20)
        del long_pool
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engines", nargs="+", type=Path)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-spin", dest="spin", action="store_false",
                    help="ONNX Runtime threads sleep between ops (runtime serve --no-spin); default: they spin")
    ap.add_argument("--rounds", type=int, default=5, help="batch-1 rounds, each after a bandwidth reading")
    ap.add_argument("--prompt-file", type=Path, default=None, help='JSON {"ids": [...]} (e.g. the peers\' prompt_512.json)')
    ap.add_argument("--contexts", default="", help="batch-1 decode also at these context lengths (comma-separated)")
    ap.add_argument("--kv-huge-pages", action="store_true",
                    help="long sequences' KV on transparent huge pages (runtime serve --kv-huge-pages)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.single:
        contexts = tuple(int(c) for c in args.contexts.split(",") if c)
        print(json.dumps(measure(args.engines[0], args.prompt_len, args.decode_steps, args.threads, args.spin,
                                 args.prompt_file, contexts, args.rounds, args.kv_huge_pages)))
        return
    rows = []
    for engine in args.engines:
        cmd = [sys.executable, __file__, str(engine), "--single", "--prompt-len", str(args.prompt_len),
               "--decode-steps", str(args.decode_steps)] + (["--threads", str(args.threads)] if args.threads else []) \
            + ([] if args.spin else ["--no-spin"]) + ["--rounds", str(args.rounds)] + (["--prompt-file", str(args.prompt_file)] if args.prompt_file else []) \
            + (["--contexts", args.contexts] if args.contexts else []) + (["--kv-huge-pages"] if args.kv_huge_pages else [])
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{engine}: {out.stderr.strip().splitlines()[-1]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"prompt {args.prompt_len} tokens; medians; batch 1 in {args.rounds} rounds, each between two read-bandwidth "
          f"readings (2 threads): % of the bound is the median steady round's, [their range], steady/all rounds")
    header = (f"{'engine':<24} {'prec':<5} {'TTFT ms':>8} {'b1 tok/s':>9} {'b8 tok/s':>9} {'GB/s':>5} {'roofline':>9} "
              f"{'% roof':>7} {'[range]':>12} {'steady':>6} {'MB/tok':>7} {'peak MiB':>9}")
    print(header)
    for r in rows:
        lo, hi = r["roofline_pct_range"]
        steady = f"{r['roofline_steady_rounds']}/{args.rounds}"
        print(f"{Path(r['engine']).name:<24} {r['precision']:<5} {r['ttft_ms']:>8.1f} {r['decode_b1_tok_s']:>9.1f} "
              f"{r['decode_b8_tok_s']:>9.1f} {r['read_bandwidth_gbs']:>5.1f} {r['roofline_b1_tok_s']:>9.1f} "
              f"{r['roofline_pct']:>7.1f} {f'[{lo:.0f}–{hi:.0f}]':>12} {steady:>6} "
              f"{r['weight_bytes_per_token'] / 1e6:>7.1f} "
              f"{r['peak_rss_mib']:>9.0f}")
        for key in [k for k in r if k.startswith("decode_b1_ctx") and k.endswith("_tok_s")]:
            context = key[len("decode_b1_ctx"):-len("_tok_s")]
            lo, hi = r[key.replace("_tok_s", "_pct_range")]
            steady = r[key.replace("_tok_s", "_steady_rounds")]
            print(f"  batch 1 at {context} tokens of context: {r[key]:.1f} tok/s, "
                  f"{r[key.replace('_tok_s', '_pct_of_bound')]:.1f} % [{lo:.0f}–{hi:.0f}] of the bound (weights + KV), "
                  f"{steady}/{args.rounds} rounds steady, KV on huge pages "
                  f"{r[key.replace('_tok_s', '_kv_huge_mib')]} MiB")
    if args.json:
        args.json.write_text(json.dumps({"prompt_len": args.prompt_len, "rounds": args.rounds, "engines": rows}, indent=2))


if __name__ == "__main__":
    main()
