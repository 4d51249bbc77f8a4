"""Load generator for a running `runtime serve` (loopback only): open-loop Poisson arrivals at given rates, or
closed-loop concurrency; log-normal prompt/output lengths; optional shared prefix; gRPC or HTTP (SSE).
Reports p50/p95/p99 TTFT, TPOT, ITL, E2E, throughput and errors per load level, as a table, JSON and a PNG plot.

    python tools/loadgen.py --url grpc://127.0.0.1:50051 --rates 1 2 4 8 --requests 60 --json lg.json --plot lg.png
    python tools/loadgen.py --url http://127.0.0.1:8000 --concurrency 8 --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class Result:
    ok: bool
    code: str = "OK"
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    tokens: int = 0


async def grpc_call(stub, pb, prompt: list[int], max_tokens: int, timeout: float) -> Result:
    import grpc

    req = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
    req.token_ids.ids.extend(prompt)
    t0 = time.perf_counter()
    res, last = Result(True), None
    try:
        async for msg in stub.Generate(req, timeout=timeout):
            now = time.perf_counter()
            if msg.token_ids:
                if res.ttft is None:
                    res.ttft = now - t0
                elif last is not None:
                    res.itl.append(now - last)
                last = now
                res.tokens += len(msg.token_ids)
    except grpc.aio.AioRpcError as e:
        return Result(False, e.code().name)
    res.e2e = time.perf_counter() - t0
    return res


async def http_call(client, url: str, prompt: list[int], max_tokens: int, timeout: float) -> Result:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    res, last = Result(True), None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                await r.aread()
                return Result(False, f"HTTP {r.status_code}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                if res.ttft is None:
                    res.ttft = now - t0
                elif last is not None:
                    res.itl.append(now - last)
                last = now
                res.tokens += 1
    except Exception as e:  # noqa: BLE001 - any transport failure is an error of this request
        return Result(False, type(e).__name__)
    res.e2e = time.perf_counter() - t0
    return res


def workload(n: int, vocab: int, prompt_median: int, output_median: int, shared: int, rng) -> list[tuple[list[int], int]]:
    prefix = rng.integers(100, vocab - 100, shared).tolist()
    prompts = np.clip(rng.lognormal(np.log(prompt_median), 0.5, n), 4, 4 * prompt_median).astype(int)
    outputs = np.clip(rng.lognormal(np.log(output_median), 0.5, n), 1, 4 * output_median).astype(int)
    return [(prefix + rng.integers(100, vocab - 100, p).tolist(), int(o)) for p, o in zip(prompts, outputs)]


def summarize(label, results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.code] = errors.get(r.code, 0) + 1
    q = lambda xs: {p: round(1e3 * float(np.percentile(xs, p)), 2) if xs else None for p in (50, 95, 99)}  # noqa: E731
    tpot = [(r.e2e - r.ttft) / (r.tokens - 1) for r in ok if r.tokens > 1 and r.ttft is not None]
    return {"load": label, "requests": len(results), "ok": len(ok), "errors": errors,
            "ttft_ms": q([r.ttft for r in ok if r.ttft is not None]), "tpot_ms": q(tpot),
            "itl_ms": q([x for r in ok for x in r.itl]), "e2e_ms": q([r.e2e for r in ok]),
            "throughput_tok_s": round(sum(r.tokens for r in ok) / wall, 1), "wall_s": round(wall, 2)}


async def run_level(call, items, rate: float | None, concurrency: int | None, duration: float, rng) -> tuple[list, float]:
    t0 = time.perf_counter()
    if rate is not None:        # open loop: arrivals do not wait for completions
        tasks = []
        for prompt, out in items:
            tasks.append(asyncio.create_task(call(prompt, out)))
            await asyncio.sleep(rng.exponential(1.0 / rate))
            if time.perf_counter() - t0 > duration:
                break
        return list(await asyncio.gather(*tasks)), time.perf_counter() - t0
    queue = list(items)
    results: list[Result] = []

    async def worker():
        while queue and time.perf_counter() - t0 < duration:
            prompt, out = queue.pop()
            results.append(await call(prompt, out))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - t0


async def main_async(args) -> list[dict]:
    url = urlparse(args.url)
    if url.hostname not in LOOPBACK:
        raise SystemExit("loadgen only targets loopback servers")
    if args.seed is None:       # fresh prompts per run: a rerun against a warm server must not hit its prefix cache
        args.seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed {args.seed} (--seed {args.seed} repeats this workload)", flush=True)
    rng = np.random.default_rng(args.seed)
    if url.scheme == "grpc":
        import grpc

        from runtime.server.proto import quicksilver_pb2 as pb
        from runtime.server.proto import quicksilver_pb2_grpc as pb_grpc

        channel = grpc.aio.insecure_channel(url.netloc)
        stub = pb_grpc.GenerationStub(channel)
        vocab = (await stub.ModelInfo(pb.ModelInfoRequest())).vocab_size
        call = lambda p, o: grpc_call(stub, pb, p, o, args.timeout)  # noqa: E731
    else:
        import httpx

        client = httpx.AsyncClient(limits=httpx.Limits(max_connections=512))
        base = f"{url.scheme}://{url.netloc}"
        vocab = (await client.get(f"{base}/v1/models")).json()["data"][0].get("vocab_size", 8000)
        call = lambda p, o: http_call(client, base, p, o, args.timeout)  # noqa: E731
    levels = [("rate", r) for r in args.rates] if args.rates else [("concurrency", c) for c in args.concurrency]
    out = []
    for kind, value in levels:
        items = workload(args.requests, vocab, args.prompt_median, args.output_median, args.shared_prefix, rng)
        results, wall = await run_level(call, items, value if kind == "rate" else None,
                                        value if kind == "concurrency" else None, args.duration, rng)
        row = summarize(f"{kind}={value}", results, wall)
        row[kind], row["seed"] = value, args.seed
        out.append(row)
        print(f"{row['load']:<16} ok {row['ok']:>4}/{row['requests']:<4} TTFT p50/p95/p99 {row['ttft_ms'][50]}/"
              f"{row['ttft_ms'][95]}/{row['ttft_ms'][99]} ms  TPOT p50/p99 {row['tpot_ms'][50]}/{row['tpot_ms'][99]} ms  "
              f"ITL p99 {row['itl_ms'][99]} ms  {row['throughput_tok_s']} tok/s  errors {row['errors'] or '-'}", flush=True)
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r.get("rate", r.get("concurrency")) for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for p in (50, 99):
            ax.plot(xs, [r[key][p] for r in rows], marker="o", label=f"p{p}")
        ax.set_xlabel("offered load (req/s)" if "rate" in rows[0] else "concurrency")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def missing_extras(args: argparse.Namespace) -> list[str]:
    """Optional modules this run needs that are not installed (the `bench` extra has them)."""
    from importlib.util import find_spec

    needed = (["matplotlib (for --plot)"] if args.plot else []) + \
        (["httpx (for http:// URLs)"] if args.url.startswith("http") else [])
    return [what for what in needed if find_spec(what.split()[0]) is None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="grpc://127.0.0.1:50051", help="grpc://HOST:PORT or http://HOST:PORT")
    ap.add_argument("--rates", type=float, nargs="*", default=None, help="open-loop Poisson arrival rates (req/s)")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[4], help="closed-loop client counts")
    ap.add_argument("--requests", type=int, default=50, help="requests per load level (upper bound)")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds per load level (upper bound)")
    ap.add_argument("--prompt-median", type=int, default=128)
    ap.add_argument("--output-median", type=int, default=64)
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens shared by every prompt")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=None, help="workload seed [default: a fresh one, printed]")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    missing = missing_extras(args)
    if missing:           # before the workload, not after it
        ap.error(f"{' and '.join(missing)} not installed: pip install '.[bench]'")
    rows = asyncio.run(main_async(args))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
