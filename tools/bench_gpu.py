"""End to end on a GPU: the cuda backend (our forward + plugins/cuda + CUDA graphs) against the CPU engine and
transformers, in one run (tools/gpu_check.sh calls it on a lent machine; each part is timed in process, then the
decode is measured again at the API through `runtime serve` and the openai client).

    python tools/bench_gpu.py --out /tmp/qs-gpu/gpu_serving.json [--work /tmp/qs-bench] [--skip-api]

Parts (each one's failure is recorded and the rest still run):
  parity      greedy tokens of the cuda engine (GPU) vs the CPU engine (ONNX Runtime, fp32) of the same checkpoint;
              where they part, the CPU engine's top-2 log-probability gap there (a near-tie or not)
  ttft        445-token prompt, fresh each time (no prefix hit), median of 10
  decode      batch 1, 256 new tokens: tok/s from the token times (after the first)
  aggregate   8 and 32 concurrent requests (445-token prompts, 128 new tokens each): tokens / wall time
  spec        bundled pair as cuda engines: plain, prompt lookup (an edit-style request), draft; tok/s at batch 1
  hf          transformers on the same GPU and checkpoint: eager generate, batch 1 (and --hf-static: static cache)
  api         runtime serve + openai client: conc-1 decode tok/s and TTFT, beside in-process
Weights are random (tools/make_checkpoint.py's smollm2-135m shape) except the bundled pair's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compile.build import build  # noqa: E402
from compile.config import CompileConfig  # noqa: E402
from runtime.config import CacheConfig, CudaConfig, EngineConfig, SchedulerConfig  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.request import SamplingParams  # noqa: E402
from runtime.spec_decode.speculator import SpecConfig  # noqa: E402

PROMPT_TOKENS = 445
RESULTS: dict = {}
DEVICE = "cuda"
OUT_PATH: Path | None = None


def log(*a) -> None:
    print(*a, flush=True)


def part(name: str):
    def wrap(fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                RESULTS[name] = fn(*a, **k)
            except Exception as e:                      # record and go on: device time is scarce
                traceback.print_exc()
                RESULTS[name] = {"error": f"{type(e).__name__}: {e}"}
            RESULTS.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
            log(f"[{name}] {json.dumps(RESULTS[name])[:600]}")
            if OUT_PATH is not None:                    # after every part: a run cut short keeps what it measured
                OUT_PATH.write_text(json.dumps(RESULTS, indent=2) + "\n")
            return RESULTS[name]
        return run
    return wrap


def engine(path: Path, *, seqs: int = 32, device: str | None = None, prefix: bool = False, **kw) -> Engine:
    return Engine(path, EngineConfig(SchedulerConfig(max_num_seqs=seqs, max_waiting=1024),
                                     CacheConfig(enable_prefix_cache=prefix, max_model_len=kw.pop("max_model_len", 2048)),
                                     cuda=CudaConfig(device=device), **kw))


def prompts(n: int, vocab: int, length: int = PROMPT_TOKENS, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab - 1, length).tolist() for _ in range(n)]


def drive(eng: Engine, items: list[tuple[list[int], SamplingParams]]) -> dict:
    """Submit all at once, step to the end; per request: token times (monotonic), tokens, logprobs."""
    t0 = time.perf_counter()
    reqs = {eng.add_request(p, sp).request_id: i for i, (p, sp) in enumerate(items)}
    times = {i: [] for i in reqs.values()}
    tokens = {i: [] for i in reqs.values()}
    logprobs = {i: [] for i in reqs.values()}
    while eng.has_work():
        for out in eng.step():
            i = reqs[out.request_id]
            now = time.perf_counter()
            times[i] += [now] * len(out.token_ids)
            tokens[i] += out.token_ids
            logprobs[i] += out.logprobs or []
    return {"start": t0, "end": time.perf_counter(), "times": times, "tokens": tokens, "logprobs": logprobs}


@part("parity")
def parity(cuda_dir: Path, cpu_dir: Path, vocab: int) -> dict:
    items = [(p, SamplingParams(max_tokens=48, ignore_eos=True, logprobs=2)) for p in
             prompts(3, vocab, 64, seed=1) + prompts(1, vocab, PROMPT_TOKENS, seed=2)]
    gpu = drive(engine(cuda_dir, device=DEVICE), items)
    cpu = drive(engine(cpu_dir, seqs=4), items)
    rows = []
    for i in range(len(items)):
        a, b = cpu["tokens"][i], gpu["tokens"][i]
        part_at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        row = {"tokens": len(a), "equal": part_at is None}
        if part_at is not None:
            top = cpu["logprobs"][i][part_at]["top"]
            row.update(parts_at=part_at, cpu_top2_gap=round(top[0][1] - top[1][1], 5))
        common = part_at if part_at is not None else len(a)
        diffs = [abs(cpu["logprobs"][i][k]["top"][0][1] - gpu["logprobs"][i][k]["top"][0][1]) for k in range(common)]
        row["max_logprob_diff_before_parting"] = round(max(diffs, default=0.0), 5)
        rows.append(row)
    return {"prompts": rows, "all_equal": all(r["equal"] for r in rows)}


@part("ttft")
def ttft(eng: Engine, vocab: int) -> dict:
    ms = []
    for i, p in enumerate(prompts(12, vocab, seed=10)):
        r = drive(eng, [(p, SamplingParams(max_tokens=1, ignore_eos=True))])
        if i >= 2:
            ms.append(1e3 * (r["times"][0][0] - r["start"]))
    return {"prompt_tokens": PROMPT_TOKENS, "median_ms": round(statistics.median(ms), 2),
            "min_ms": round(min(ms), 2), "max_ms": round(max(ms), 2), "n": len(ms)}


@part("decode")
def decode(eng: Engine, vocab: int, new: int = 256) -> dict:
    rates = []
    for p in prompts(3, vocab, seed=20):
        r = drive(eng, [(p, SamplingParams(max_tokens=new, ignore_eos=True))])
        t = r["times"][0]
        rates.append((len(t) - 1) / (t[-1] - t[0]))
    return {"new_tokens": new, "tok_s": [round(x, 1) for x in rates], "median_tok_s": round(statistics.median(rates), 1),
            "step_ms": round(1e3 / statistics.median(rates), 3)}


@part("profile")
def profile(eng: Engine, vocab: int) -> dict:
    """Where a batch-1 decode step goes: graph replay on the device (events), runner.step (host copies, replay,
    logits to host), engine.step (scheduler, sampler, detokenizer on top); and the top kernels of an eager step."""
    import torch
    from dataclasses import replace

    from runtime.backends.paged.kv import build_paged_batch

    runner = eng.runner
    out = {}
    for n in (1, 8, 32):
        batch = build_paged_batch([([0, 1, 2, 3], 40, 1)] * n, eng.kv.block_size, runner.max_blocks_per_seq)
        batch = replace(batch, slot_mapping=np.full(n, -1, np.int64))
        ids = np.ones(n, np.int64)
        runner.step(ids, batch, np.arange(n))
        entry = runner._graphs.get(runner._bucket(n))
        if entry is not None:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ms = []
            for _ in range(30):
                a.record()
                entry[0].replay()
                b.record()
                b.synchronize()
                ms.append(a.elapsed_time(b))
            out[f"replay_ms_b{n}"] = round(statistics.median(ms), 4)
        t = []
        for _ in range(30):
            t0 = time.perf_counter()
            runner.step(ids, batch, np.arange(n))
            t.append(time.perf_counter() - t0)
        out[f"runner_step_ms_b{n}"] = round(1e3 * statistics.median(t), 4)
    # an eager 1-token step under the profiler: which kernels a decode step is made of
    batch = build_paged_batch([([0, 1, 2, 3], 40, 1)], eng.kv.block_size, runner.max_blocks_per_seq)
    batch = replace(batch, slot_mapping=np.full(1, -1, np.int64))
    with torch.inference_mode():
        d_ids, meta, rows = runner._upload(np.ones(1, np.int64), batch, np.arange(1), batch.max_seq_len)
        runner.model(d_ids, meta, rows, runner.caches)
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile as prof

        with prof(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
            runner.model(d_ids, meta, rows, runner.caches)
            torch.cuda.synchronize()
    events = [e for e in p.key_averages() if e.device_type.name == "CUDA"]
    events.sort(key=lambda e: -e.device_time_total)
    out["kernels"] = [(e.key[:60], e.count, round(e.device_time_total / max(e.count, 1), 2)) for e in events[:14]]
    out["kernel_count"] = sum(e.count for e in events)
    out["kernel_us_total"] = round(sum(e.device_time_total for e in events), 1)
    return out


@part("aggregate")
def aggregate(eng: Engine, vocab: int) -> dict:
    out = {}
    for n in (8, 32):
        walls = []
        for rep in range(2):
            r = drive(eng, [(p, SamplingParams(max_tokens=128, ignore_eos=True)) for p in prompts(n, vocab, seed=30 + rep)])
            walls.append(sum(len(t) for t in r["tokens"].values()) / (r["end"] - r["start"]))
        out[f"conc{n}_tok_s"] = round(max(walls), 1)
        out[f"conc{n}_runs"] = [round(w, 1) for w in walls]
    return out


EDIT_PROMPT = '''def moving_average(values, window):
    """Return the moving averages of `values` over `window` items."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            averages.append(total / window)
    return averages


# The same function, with `values` renamed to `samples`:
def moving_average(samples, window):
'''


@part("spec")
def spec(target: Path, draft: Path) -> dict:
    sp = SamplingParams(max_tokens=160, ignore_eos=True)
    out = {}
    variants = {"plain": {}, "ngram": dict(speculation="ngram", spec=SpecConfig(max_gamma=8)),
                "draft": dict(speculation="draft", draft=draft, spec=SpecConfig(max_gamma=4))}
    for name, kw in variants.items():
        eng = engine(target, seqs=4, device=DEVICE, max_model_len=1024, **kw)
        rates, texts = [], None
        for _ in range(3):
            r = drive(eng, [(EDIT_PROMPT, sp)])
            t = r["times"][0]
            rates.append((len(t) - 1) / (t[-1] - t[0]))
            texts = r["tokens"][0]
        st = eng.speculator.stats if eng.speculator else None
        out[name] = {"tok_s": round(statistics.median(rates), 1), "runs": [round(x, 1) for x in rates],
                     "tokens": texts[:16]}
        if st is not None:
            out[name].update(proposed=st.proposed, accepted=st.accepted)
        del eng
    out["same_tokens"] = out["ngram"]["tokens"] == out["plain"]["tokens"] == out["draft"]["tokens"]
    for name in ("ngram", "draft"):
        out[f"{name}_vs_plain"] = round(out[name]["tok_s"] / out["plain"]["tok_s"], 3)
    return out


@part("hf")
def hf(checkpoint: Path, vocab: int, static: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    gpu = DEVICE == "cuda"
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float16 if gpu else torch.float32)
    model = model.to(DEVICE).eval()
    ids = torch.tensor(prompts(1, vocab, seed=40), device=DEVICE)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    out = {}
    modes = [("eager", {})] + ([("static_cache", dict(cache_implementation="static"))] if static else [])
    for name, kw in modes:
        rates = []
        for rep in range(3 if name == "eager" else 2):
            sync()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False, min_new_tokens=1, **kw)
            sync()
            t1 = time.perf_counter()
            model.generate(ids, max_new_tokens=129, do_sample=False, min_new_tokens=129, **kw)
            sync()
            t2 = time.perf_counter()
            rates.append(128 / ((t2 - t1) - (t1 - t0)))
        out[name] = {"tok_s": round(max(rates), 1), "runs": [round(r, 1) for r in rates]}
    return out


try:
    from openai import OpenAI
except ImportError:         # the lent GPU machine: 64 MiB carried, the openai client's wheels do not fit beside grpcio
    OpenAI = None


def openai_stream(port: int):
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    model = client.models.list().data[0].id

    def stream(prompt):
        for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=256, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].text:
                yield chunk
    return stream


def sse_stream(port: int):
    """The same request as openai_stream, read as server-sent events with httpx: one item per token. A random
    model's tokens often decode to no text, which the server then holds back, so the request asks for each
    token's log-probability (`logprobs: 0`), which makes every token an event, text or not. One client for all
    requests, as the openai client keeps: a fresh httpx client per request adds ~25 ms to each TTFT."""
    import httpx

    client = httpx.Client(timeout=60)

    def stream(prompt):
        body = {"prompt": prompt, "max_tokens": 256, "temperature": 0, "stream": True, "ignore_eos": True,
                "logprobs": 0, "stream_options": {"include_usage": True}}
        with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        stream.tokens = event["usage"]["completion_tokens"]
                    elif event.get("choices"):
                        yield event
    return stream


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@part("api")
def api(cuda_dir: Path, vocab: int, in_process_tok_s: float | None, in_process_ttft_ms: float | None) -> dict:
    import httpx

    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", "from runtime.cli import main; main()", "serve", str(cuda_dir),
                             "--device", DEVICE, "--http-port", str(port), "--grpc-port", "-1", "--no-prefix-cache",
                             "--max-num-seqs", "32", "--max-model-len", "2048"], env=env)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"runtime serve exited with {proc.returncode}")
            time.sleep(0.5)
        stream = openai_stream(port) if OpenAI is not None else sse_stream(port)
        rates, ttfts = [], []
        for i, p in enumerate(prompts(5, vocab, seed=50)):
            t0 = time.perf_counter()
            times = [time.perf_counter() for _ in stream(p)]
            tokens = getattr(stream, "tokens", len(times))
            if len(times) < 2:
                raise RuntimeError(f"the server streamed {len(times)} event(s) for {tokens} tokens")
            if i == 0:
                continue                          # warm-up
            ttfts.append(1e3 * (times[0] - t0))
            rates.append((tokens - 1) / (times[-1] - times[0]))
        out = {"client": "openai" if OpenAI is not None else "httpx (SSE)",
               "decode_tok_s": round(statistics.median(rates), 1), "ttft_ms": round(statistics.median(ttfts), 2),
               "chunks_note": "tok/s: completion tokens over the time from the first streamed event to the last"
                              + ("" if OpenAI is not None else "; httpx asks for logprobs: 0, one event a token")}
        if in_process_tok_s:
            out["decode_vs_in_process"] = round(out["decode_tok_s"] / in_process_tok_s, 3)
        if in_process_ttft_ms:
            out["ttft_vs_in_process"] = round(out["ttft_ms"] / in_process_ttft_ms, 3)
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/qs-bench"))
    ap.add_argument("--skip-api", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the whole script (use a tiny --preset)")
    ap.add_argument("--preset", default="smollm2-135m", help="tools/make_checkpoint.py preset for the random model")
    ap.add_argument("--only", default=None, help="run only these parts (comma-separated names)")
    ap.add_argument("--hf-static", action="store_true", help="also transformers' static cache (compiles 40-80 s)")
    args = ap.parse_args()
    import torch

    global DEVICE, OUT_PATH
    DEVICE, OUT_PATH = args.device, args.out
    args.out.parent.mkdir(parents=True, exist_ok=True)

    from compile import synthetic as make_checkpoint

    RESULTS["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    RESULTS["torch"] = torch.__version__
    w = args.work
    t0 = time.perf_counter()
    ckpt = w / args.preset
    if not (ckpt / "config.json").is_file():
        make_checkpoint.write_checkpoint(args.preset, ckpt, tokenizer_vocab=4096)
    dirs = {}
    for name, model, precision, target in (("cuda", ckpt, "fp16", "cuda"), ("cpu", ckpt, "fp32", "cpu"),
                                           ("bundled_target", ROOT / "models" / "target", "fp16", "cuda"),
                                           ("bundled_draft", ROOT / "models" / "draft", "fp16", "cuda")):
        dirs[name] = w / f"engine-{name}"
        if not (dirs[name] / "manifest.json").is_file():
            build(CompileConfig(model, dirs[name], precision, target=target, report=False), log=lambda _: None)
    RESULTS["setup_s"] = round(time.perf_counter() - t0, 1)
    log(f"checkpoint and engines ready in {RESULTS['setup_s']} s")
    vocab = make_checkpoint.PRESETS[args.preset]["vocab"]

    only = set(args.only.split(",")) if args.only else None
    wanted = lambda name: only is None or name in only     # noqa: E731
    if only is None or only & {"ttft", "decode", "profile", "aggregate"}:
        t0 = time.perf_counter()
        eng = engine(dirs["cuda"], device=DEVICE)
        RESULTS["engine_start_s"] = round(time.perf_counter() - t0, 2)
        RESULTS["backend"] = eng.runner.backend_name
        for name, fn in (("ttft", ttft), ("decode", decode), ("profile", profile), ("aggregate", aggregate)):
            if wanted(name):
                fn(eng, vocab)
        del eng
        # PyTorch's caching allocator keeps what it frees, and on the H100 `runtime serve` below found the GPU full
        # without both calls. With --device cpu a cuda-backend engine is freed when dropped (no cycle: checked
        # after every part); whether CUDA graph capture adds one on a GPU is not checked, so collect anyway.
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if wanted("parity"):
        parity(dirs["cuda"], dirs["cpu"], vocab)
    if wanted("spec"):
        spec(dirs["bundled_target"], dirs["bundled_draft"])
    if not args.skip_hf and wanted("hf"):
        hf(ckpt, vocab, args.hf_static)
    if not args.skip_api and wanted("api"):
        api(dirs["cuda"], vocab, RESULTS.get("decode", {}).get("median_tok_s"), RESULTS.get("ttft", {}).get("median_ms"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(RESULTS, indent=2) + "\n")
    log(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
