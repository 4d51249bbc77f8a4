"""Replica routing benchmark: `runtime serve --replicas N` with prefix-aware vs round-robin routing, on a chat
workload where the prefix is what matters — many users, a system prompt every user shares (`--system-chars`)
followed by each user's own long context (`--context-chars`: a document, earlier sessions), each user's
conversation growing turn by turn (a user's next turn is its whole history plus a short new message), Poisson
arrivals (each user thinks for an exponential time before the next turn), greedy, streamed through the `openai`
client. With `--serve-args "--kv-budget-mib M"` the replicas' prefix caches can be made to hold only part of the
users' contexts, the regime where routing decides the hit rate (round robin needs every context on every replica).

Per routing policy: prefix-cache hit rate (cached prompt tokens / prompt tokens, as the server reports them), the
prompt tokens a request's replica computed (p50: what a hit's TTFT is made of, beside the fixed cost), TTFT
p50/p99 at the client, aggregate tok/s, and the engines' own TTFT p50 (from the front's receipt of a request to its
first token on the replica, as the front logs each request: what routing changes, without the client, the HTTP
response and Serve's hop back, which every request pays alike). The policies run one after another,
alternating over rounds, each in a fresh server (no cache carried over), on the same seeded workload.

    python tools/bench_replicas.py ENGINE --replicas 2 --threads 1 --users 16 --turns 6 --rate 2 --rounds 2 \\
        --json tools/results/replicas_prefix_vs_rr.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import TEXT, free_port, openai_client, start  # noqa: E402

POLICIES = ("prefix", "round-robin")
FIGURES = ("hit_rate", "uncached_p50", "ttft_p50_ms", "ttft_p99_ms", "aggregate_tps", "engine_ttft_p50_ms")
ENGINE_TTFT = re.compile(r" prompt=\d+ cached=\d+ .*ttft_ms=([\d.]+)")     # the front's line for a finished request


def workload(users: int, turns: int, system_chars: int, context_chars: int, seed: int) -> list[list[str]]:
    """Each user's messages: the first carries the shared system prompt and the user's own context (held-out code,
    from a user-specific offset), each later one a short question about another snippet."""
    text = TEXT.read_text()
    rng = np.random.default_rng(seed)
    system = "You are a careful Python reviewer. House rules follow.\n" + text[:system_chars]
    out = []
    for u in range(users):
        start = int(rng.integers(system_chars, len(text) - context_chars))
        context = f"\n# user {u} shares this code:\n" + text[start:start + context_chars] if context_chars else ""
        questions = [f"\n# user {u}, question {t}: what does this do?\n" + text[int(s):int(s) + 90]
                     for t, s in enumerate(rng.integers(0, len(text) - 100, turns))]
        questions[0] = system + context + questions[0]
        out.append(questions)
    return out


async def user(client, messages: list[str], think_s: float, max_tokens: int, rng, out: list):
    history = ""
    for message in messages:
        await asyncio.sleep(rng.exponential(think_s))
        history += message
        sent = time.perf_counter()
        first, answer, usage = None, [], None
        resp = await client.completions.create(model="m", prompt=history, max_tokens=max_tokens, temperature=0,
                                               stream=True, stream_options={"include_usage": True})
        async for chunk in resp:
            if chunk.choices and chunk.choices[0].text:
                first = first or time.perf_counter()
                answer.append(chunk.choices[0].text)
            if chunk.usage is not None:
                usage = chunk.usage
        history += "".join(answer)
        out.append({"ttft_s": first - sent, "prompt": usage.prompt_tokens, "completion": usage.completion_tokens,
                    "cached": usage.prompt_tokens_details.cached_tokens, "done": time.perf_counter()})


async def run_workload(url: str, args, seed: int) -> dict:
    client = openai_client(url)
    messages = workload(args.users, args.turns, args.system_chars, args.context_chars, seed)
    think = args.users / args.rate            # each user's mean think time: the whole fleet arrives at `rate`/s
    out: list[dict] = []
    t0 = time.perf_counter()
    await asyncio.gather(*[user(client, m, think, args.max_tokens, np.random.default_rng(seed * 1000 + u), out)
                           for u, m in enumerate(messages)])
    wall = max(r["done"] for r in out) - t0
    await client.close()
    ttft = np.array([r["ttft_s"] for r in out]) * 1e3
    return {"requests": len(out), "hit_rate": sum(r["cached"] for r in out) / sum(r["prompt"] for r in out),
            "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "aggregate_tps": sum(r["completion"] for r in out) / wall,
            "uncached_p50": float(np.median([r["prompt"] - r["cached"] for r in out])),
            "prompt_tokens_mean": float(np.mean([r["prompt"] for r in out]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine", type=Path)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads per replica")
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-chars", type=int, default=1600, help="shared system prompt (~3.2 characters a token)")
    ap.add_argument("--context-chars", type=int, default=0, help="each user's own context after the system prompt")
    ap.add_argument("--rate", type=float, default=2.0, help="mean requests per second over all users (Poisson)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--serve-args", default="", help="extra `runtime serve` arguments (quoted)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    results: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for rnd in range(args.rounds):
        for policy in POLICIES if rnd % 2 == 0 else POLICIES[::-1]:
            port = free_port()
            cmd = ["runtime", "serve", str(args.engine), "--replicas", str(args.replicas), "--threads",
                   str(args.threads), "--replica-routing", policy, "--http-port", str(port), "--grpc-port", "-1",
                   "--served-model-name", "m", *args.serve_args.split()]
            url = f"http://127.0.0.1:{port}/v1"
            log = Path(f"/tmp/bench_replicas_{policy}.log")
            proc = start(cmd, url, log)
            try:
                r = asyncio.run(run_workload(url, args, seed=rnd))
            finally:
                proc.terminate()
                proc.wait(60)
            engine_ttft = [float(ms) for ms in ENGINE_TTFT.findall(log.read_text())]
            r["engine_ttft_p50_ms"] = float(np.median(engine_ttft)) if engine_ttft else float("nan")
            results[policy].append(r)
            print(f"round {rnd} {policy:12s} " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                                         for k, v in r.items()), flush=True)
    summary = {}
    for policy, rounds in results.items():
        summary[policy] = {k: {"median": float(np.median([r[k] for r in rounds])),
                               "min": float(min(r[k] for r in rounds)), "max": float(max(r[k] for r in rounds))}
                           for k in rounds[0]}
    for k in FIGURES:
        ratios = [p[k] / b[k] for p, b in zip(results["prefix"], results["round-robin"]) if b[k]]
        summary.setdefault("prefix_over_round_robin", {})[k] = {"median": float(np.median(ratios)),
                                                               "min": float(min(ratios)), "max": float(max(ratios))}
    print(f"{'figure':22s}{'prefix':>26s}{'round-robin':>26s}{'prefix / rr':>22s}")
    for k in FIGURES:
        cells = [f"{summary[p][k]['median']:.3f} [{summary[p][k]['min']:.3f}-{summary[p][k]['max']:.3f}]" for p in POLICIES]
        r = summary["prefix_over_round_robin"][k]
        print(f"{k:22s}{cells[0]:>26s}{cells[1]:>26s}{r['median']:>12.2f} [{r['min']:.2f}-{r['max']:.2f}]")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rounds": results,
                                         "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
