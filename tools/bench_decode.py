"""Decode benchmark for one or more engines: TTFT (512-token prompt), decode tokens/s at batch 1 and 8,
peak memory, and the batch-1 roofline of this machine: read bandwidth ÷ the bytes a step must read (the weights,
and the KV cache of the context so far), printed beside every batch-1 figure as the fraction of that bound.
`--contexts 2048,8192` adds batch-1 decode at those context lengths (KV reads grow with them).

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


def read_bandwidth_gbs(threads: int = 2, mib: int = 512, repeats: int = 5) -> float:
    """Read bandwidth with `threads` numpy reductions in parallel (numpy releases the GIL), best of repeats."""
    data = np.ones(mib * 2**20 // 8, np.float64)
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


def decode_at(runner, pool, context: int, steps: int, vocab: int) -> float:
    """Median seconds of a batch-1 decode step at `context` tokens (prefilled in chunks of 512)."""
    from runtime.backends.cpu.slots import SlotRange

    ids = np.random.default_rng(1).integers(0, vocab, context)
    for start in range(0, context, 512):
        chunk = ids[start:start + 512]
        logits = runner.execute(chunk[None].astype(np.int64), np.array([start + len(chunk) - 1], np.int32),
                                np.array([len(chunk) - 1]), pool, SlotRange(0, 1))
    token, times = int(logits.argmax()), []
    for i in range(steps):
        t = time.perf_counter()
        logits = runner.execute(np.array([[token]], np.int64), np.array([context + i], np.int32), np.array([0]),
                                pool, SlotRange(0, 1))
        token = int(logits.argmax())
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def measure(engine: Path, prompt_len: int, decode_steps: int, threads: int | None, spin: bool,
            prompt_file: Path | None = None, contexts: tuple[int, ...] = ()) -> dict:
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
    pool = runner.new_pool(8, capacity=prompt_len + decode_steps + 8)

    ttft = []
    for _ in range(5):
        t = time.perf_counter()
        logits = runner.execute(prompt, np.array([prompt_len - 1], np.int32), np.array([prompt_len - 1]), pool, SlotRange(0, 1))
        int(logits.argmax())
        ttft.append(time.perf_counter() - t)

    result = {"engine": str(engine), "precision": runner.manifest["precision"]["weights"], "load_s": round(load_s, 3),
              "ttft_ms": round(1e3 * float(np.median(ttft)), 2)}
    # decode right after the prompt (context prompt_len … prompt_len + decode_steps), every row the same prompt
    for s in range(1, 8):
        pool_copy(pool, 0, s, prompt_len)
    for batch in (1, 8):
        tokens = np.full((batch, 1), int(logits.argmax()), np.int64)
        steps = []
        for i in range(decode_steps):
            t = time.perf_counter()
            logits = runner.execute(tokens, np.full(batch, prompt_len + i, np.int32), np.arange(batch), pool, SlotRange(0, batch))
            tokens = logits.argmax(-1).astype(np.int64)[:, None]
            steps.append(time.perf_counter() - t)
        result[f"decode_b{batch}_tok_s"] = round(batch / float(np.median(steps)), 1)
    result["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    result["weight_bytes_per_token"] = weight_bytes_per_token(engine, runner.manifest)
    result["kv_bytes_per_context_token"] = kv_bytes_per_token(runner.manifest)
    result["decode_b1_context"] = prompt_len + decode_steps // 2
    for context in contexts:
        long_pool = runner.new_pool(1, capacity=context + decode_steps + 8)
        result[f"decode_b1_ctx{context}_tok_s"] = round(1 / decode_at(runner, long_pool, context, decode_steps,
                                                                      runner.vocab_size), 1)
        del long_pool
    return result


def bound_tok_s(row: dict, bandwidth_gbs: float, context: int) -> float:
    """Batch-1 tokens/s if a step cost only reading its bytes (weights + the KV of `context` tokens)."""
    return bandwidth_gbs * 1e9 / (row["weight_bytes_per_token"] + context * row["kv_bytes_per_context_token"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engines", nargs="+", type=Path)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--spin", action="store_true", help="let ONNX Runtime threads spin between ops")
    ap.add_argument("--prompt-file", type=Path, default=None, help='JSON {"ids": [...]} (e.g. the peers\' prompt_512.json)')
    ap.add_argument("--contexts", default="", help="batch-1 decode also at these context lengths (comma-separated)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.single:
        contexts = tuple(int(c) for c in args.contexts.split(",") if c)
        print(json.dumps(measure(args.engines[0], args.prompt_len, args.decode_steps, args.threads, args.spin,
                                 args.prompt_file, contexts)))
        return
    bandwidth = read_bandwidth_gbs()
    rows = []
    for engine in args.engines:
        cmd = [sys.executable, __file__, str(engine), "--single", "--prompt-len", str(args.prompt_len),
               "--decode-steps", str(args.decode_steps)] + (["--threads", str(args.threads)] if args.threads else []) \
            + (["--spin"] if args.spin else []) + (["--prompt-file", str(args.prompt_file)] if args.prompt_file else []) \
            + (["--contexts", args.contexts] if args.contexts else [])
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{engine}: {out.stderr.strip().splitlines()[-1]}")
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["roofline_b1_tok_s"] = round(bound_tok_s(row, bandwidth, row["decode_b1_context"]), 1)
        row["roofline_pct"] = round(100 * row["decode_b1_tok_s"] / row["roofline_b1_tok_s"], 1)
        for key in [k for k in row if k.startswith("decode_b1_ctx")]:
            context = int(key[len("decode_b1_ctx"):-len("_tok_s")])
            row[key.replace("_tok_s", "_pct_of_bound")] = round(100 * row[key] / bound_tok_s(row, bandwidth, context), 1)
        rows.append(row)
    print(f"read bandwidth {bandwidth:.1f} GB/s (2 threads); prompt {args.prompt_len} tokens; medians")
    header = f"{'engine':<32} {'prec':<5} {'TTFT ms':>8} {'b1 tok/s':>9} {'b8 tok/s':>9} {'roofline':>9} {'% roof':>7} {'MB/tok':>7} {'peak MiB':>9}"
    print(header)
    for r in rows:
        print(f"{Path(r['engine']).name:<32} {r['precision']:<5} {r['ttft_ms']:>8.1f} {r['decode_b1_tok_s']:>9.1f} "
              f"{r['decode_b8_tok_s']:>9.1f} {r['roofline_b1_tok_s']:>9.1f} {r['roofline_pct']:>7.1f} "
              f"{r['weight_bytes_per_token'] / 1e6:>7.1f} {r['peak_rss_mib']:>9.0f}")
        for key in [k for k in r if k.startswith("decode_b1_ctx") and k.endswith("_tok_s")]:
            context = key[len("decode_b1_ctx"):-len("_tok_s")]
            print(f"  batch 1 at {context} tokens of context: {r[key]:.1f} tok/s, "
                  f"{r[key.replace('_tok_s', '_pct_of_bound')]:.1f} % of the bound (weights + KV)")
    if args.json:
        args.json.write_text(json.dumps({"read_bandwidth_gbs": bandwidth, "prompt_len": args.prompt_len, "engines": rows}, indent=2))


if __name__ == "__main__":
    main()
