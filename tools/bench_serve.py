"""Black-box serving benchmark: any OpenAI-compatible servers, measured the way users measure them — the official
`openai` client streaming /v1/completions — one server at a time, the servers alternating round by round so the
machine's drift hits all alike. Every figure is also given as a ratio to `--baseline` from the same run.

Per concurrency level (distinct prompts of ~`--prompt-tokens` tokens, `--max-tokens` new, greedy, ignore_eos):
TTFT (request sent → first streamed text), per-stream decode tok/s ((tokens − 1) / (last − first text)),
aggregate tok/s (all tokens / wall time of the level), ITL p50/p99/max (gaps between streamed chunks); a stream
whose tokens all decode to no text (a random-weight model's special tokens: no chunk to time) counts towards the
aggregate only, and the level says how many there were (`textless_streams`). Repeated
prefix: a long prompt, then the same prompt with a new last line — cold vs warm TTFT and the `cached_tokens` the
server reports.

    # two running servers
    python tools/bench_serve.py --server qs=http://127.0.0.1:8000/v1 --server llama=http://127.0.0.1:8080/v1 \
        --baseline llama --concurrency 1 8 --rounds 3 --json serve.json --plot serve.png
    # or let it start them: runtime serve ENGINE, and llama-server (tools/peers/llama_server.sh builds it)
    python tools/bench_serve.py --quicksilver ENGINE [--draft DRAFT] --llama-server BIN GGUF --baseline llama
    # speculation vs none, one run: the same engine twice
    python tools/bench_serve.py --quicksilver TARGET --draft DRAFT --variant spec-off="--speculation off" \
        --llama-server BIN GGUF --baseline spec-off --concurrency 1 4 --prompt-tokens 500 --max-tokens 128
    # what this bench can resolve: a second server identical to the baseline (off-b) reads its ratio too
    python tools/bench_serve.py --quicksilver TARGET --draft DRAFT --variant spec-off="--speculation off" \
        --variant off-b="--speculation off" --baseline spec-off --concurrency 1 4 8 --waves 8 \
        --prompt-tokens 500 --max-tokens 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TEXT = Path(__file__).resolve().parents[1] / "compile" / "data" / "heldout_code.txt"
CHARS_PER_TOKEN = 3.2          # held-out Python with the bundled / smollm2-shaped BPE tokenizers


@dataclass
class Stream:
    sent: float
    chunks: list[float] = field(default_factory=list)   # arrival time of each chunk that carried text
    tokens: int = 0
    cached: int | None = None
    done: float = 0.0                                    # when the stream ended

    @property
    def ttft(self) -> float:
        """nan for a stream whose tokens all decoded to no text (a random-weight model's special tokens): a server
        streams no chunk for those, so there is no first text to time."""
        return self.chunks[0] - self.sent if self.chunks else float("nan")

    @property
    def ttft_ms(self) -> float | None:
        """TTFT in ms for a JSON figure: None (left out of medians) where there was no text to time."""
        return self.ttft * 1e3 if self.chunks else None

    @property
    def last(self) -> float:
        return self.chunks[-1] if self.chunks else self.done

    @property
    def decode_tps(self) -> float:
        span = self.chunks[-1] - self.chunks[0]
        return (self.tokens - 1) / span if span > 0 and self.tokens > 1 else float("nan")


def late_streams(spec: str) -> tuple[int, float]:
    n, ms = spec.split(",")
    return int(n), float(ms)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], url: str, log: Path, timeout: float = 600) -> subprocess.Popen:
    """Start a server and wait until its /v1/models answers."""
    import httpx

    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"{cmd[0]} exited with {proc.returncode}; see {log}")
            try:
                if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{cmd[0]} did not come up in {timeout:.0f} s; see {log}")
    except BaseException:           # a timeout, or a SIGTERM while it loads: not left running
        proc.kill()
        proc.wait()
        raise


async def stream_one(client, model: str, prompt: str, max_tokens: int) -> Stream:
    s = Stream(time.perf_counter())
    resp = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
    async for chunk in resp:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            s.chunks.append(now)
        if chunk.usage is not None:
            s.tokens = chunk.usage.completion_tokens
            details = getattr(chunk.usage, "prompt_tokens_details", None)
            s.cached = getattr(details, "cached_tokens", None) if details is not None else None
    s.done = time.perf_counter()
    if not s.tokens:
        s.tokens = len(s.chunks)
    return s


async def level(client, model: str, waves: list[list[str]], max_tokens: int,
                late: tuple[int, float] = (0, 0.0)) -> dict:
    """Each wave's prompts streamed at once, the waves one after another; figures over every stream (aggregate:
    tokens over the waves' summed wall time). Several waves steady a conc-1 figure, one request otherwise.
    `late` (n, ms): a wave's last n streams start ms after the others (prompts arriving while others decode)."""
    streams, wall = [], 0.0

    async def after(delay_s: float, prompt: str) -> Stream:
        await asyncio.sleep(delay_s)
        return await stream_one(client, model, prompt, max_tokens)

    for prompts in waves:
        t0 = time.perf_counter()
        n_late = min(late[0], len(prompts) - 1)
        wave = await asyncio.gather(*[after(late[1] / 1e3 if i >= len(prompts) - n_late else 0.0, p)
                                      for i, p in enumerate(prompts)])
        wall += max(s.last for s in wave) - t0
        streams += wave
    # Streams with no text count towards the aggregate (their tokens were generated) but have no times to give.
    timed = [s for s in streams if s.chunks]
    if not timed:
        raise RuntimeError("the server streamed no text in any stream of this level")
    gaps = np.concatenate([np.diff(s.chunks) for s in timed if len(s.chunks) > 1] or [np.zeros(0)]) * 1e3
    return {"ttft_ms": float(np.median([s.ttft for s in timed]) * 1e3),
            "decode_tps_per_stream": float(np.nanmedian([s.decode_tps for s in timed])),
            "aggregate_tps": sum(s.tokens for s in streams) / wall,
            "itl_p50_ms": float(np.percentile(gaps, 50)) if gaps.size else None,
            "itl_p99_ms": float(np.percentile(gaps, 99)) if gaps.size else None,
            # the longest stall: p99 counts how many stalls there were (under 1 % of the gaps, it misses them all)
            "itl_max_ms": float(gaps.max()) if gaps.size else None,
            "tokens": sum(s.tokens for s in streams), "textless_streams": len(streams) - len(timed)}


async def prefix_case(client, model: str, prompt: str, max_tokens: int, tag: str) -> dict:
    cold = await stream_one(client, model, f"# {tag}\n{prompt}\n# first\n", max_tokens)
    warm = await stream_one(client, model, f"# {tag}\n{prompt}\n# second one\n", max_tokens)
    return {"cold_ttft_ms": cold.ttft_ms, "warm_ttft_ms": warm.ttft_ms, "warm_cached_tokens": warm.cached}


def openai_client(url: str):
    """The `openai` client as a benchmark uses it: no retries, long timeout, a new connection per request. A
    request sent on a pooled connection the server has just closed fails ("Server disconnected without sending a
    response"): servers close idle keep-alive connections (after 5 s: llama-server's cpp-httplib, uvicorn) and
    cpp-httplib also after a few requests on one connection; dropping pooled connections after 1 s idle still
    lost two llama-server rounds in a row on a faster machine. A loopback connect costs ~0.1 ms, alike for all."""
    import httpx
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    http = DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=0))
    return AsyncOpenAI(base_url=url, api_key=os.environ.get("OPENAI_API_KEY", "none"), max_retries=0, timeout=600,
                       http_client=http)


async def measure(name: str, url: str, args, rnd: int) -> dict:
    client = openai_client(url)
    model = (await client.models.list()).data[0].id
    text = TEXT.read_text()
    n_chars = int(args.prompt_tokens * CHARS_PER_TOKEN)
    await stream_one(client, model, text[:200], 4)                                       # warm-up
    if args.fresh_servers:      # a restarted server's first tries (a long-lived one pays them once) go here
        for w in range(2):
            at = (rnd * 31 + w) * 1009 % (len(text) - n_chars)
            await stream_one(client, model, f"# warm-up {rnd} {w}\n" + text[at:at + n_chars], args.max_tokens)
    out = {}
    for c in args.concurrency:
        # distinct prompts per stream, level and round: no server can answer from its prefix cache (the header
        # names the level too: without it a level's first stream repeated the previous level's first prompt)
        waves = [[f"# round {rnd} level {c} wave {w} stream {i}\n"
                  + text[(i * 7 + rnd + 101 * w) * 997 % (len(text) - n_chars):][:n_chars] for i in range(c)]
                 for w in range(args.waves)]
        out[f"conc{c}"] = await level(client, model, waves, args.max_tokens, args.late)
    start = (rnd * 4099) % (len(text) - n_chars)
    out["prefix"] = await prefix_case(client, model, text[start:start + n_chars], args.max_tokens, f"{name} {rnd}")
    await client.close()
    return out


def spec_counters(url: str) -> tuple[float, float, float] | None:
    """(proposed, accepted, verifications) from a Quicksilver server's Prometheus metrics; None for servers that
    do not publish them (llama-server)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    values = {}
    for line in text.splitlines():
        for key in ("quicksilver_spec_proposed_tokens_total", "quicksilver_spec_accepted_tokens_total",
                    "quicksilver_spec_verifications_total"):
            if line.startswith(key + " ") or line.startswith(key + "{"):
                values[key] = values.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return tuple(values.get(k, 0.0) for k in ("quicksilver_spec_proposed_tokens_total",
                                               "quicksilver_spec_accepted_tokens_total",
                                               "quicksilver_spec_verifications_total")) if values else None


def with_acceptance(result: dict, before, after) -> dict:
    """A round's figures plus its speculation: acceptance (accepted ÷ proposed guesses) and tokens per
    verification (1 + accepted ÷ verifications, what one target pass yielded), from the server's counters."""
    if before is None or after is None:
        return result
    proposed, accepted, rounds = (a - b for a, b in zip(after, before))
    result["speculation"] = {"proposed": proposed, "acceptance": accepted / proposed if proposed else None,
                             "tokens_per_verification": 1 + accepted / rounds if rounds else None}
    return result


def round_ratios(rounds: list[dict], base: list[dict], case: str, key: str) -> list[float]:
    """Each round's figure over the same round's of the baseline, leaving out rounds where either lacks it."""
    return [r[case][key] / b[case][key] for r, b in zip(rounds, base)
            if r.get(case, {}).get(key) is not None and b.get(case, {}).get(key)]


def summarize(runs: dict[str, list[dict]], baseline: str | None) -> dict:
    """Median and spread over rounds of every figure, and ratios to the baseline (same round's figures)."""
    summary = {}
    for name, rounds in runs.items():
        summary[name] = {}
        for case in rounds[0]:
            for key in rounds[0][case]:
                values = [r[case][key] for r in rounds if r.get(case, {}).get(key) is not None]
                if not values:
                    continue
                entry = {"median": float(np.median(values)), "min": float(min(values)), "max": float(max(values))}
                if baseline and name != baseline and case != "speculation":
                    ratios = round_ratios(rounds, runs[baseline], case, key)
                    if ratios:
                        entry["ratio"] = float(np.median(ratios))
                        entry["ratio_range"] = [float(min(ratios)), float(max(ratios))]
                summary[name][f"{case}.{key}"] = entry
    return summary


def print_table(summary: dict, baseline: str | None) -> None:
    names = list(summary)
    keys = list(summary[names[0]])
    print(f"{'figure':34s}" + "".join(f"{n:>28s}" for n in names))
    for k in keys:
        row = f"{k:34s}"
        for n in names:
            e = summary[n].get(k)
            if e is None:
                row += f"{'-':>28s}"
                continue
            cell = f"{e['median']:.1f} [{e['min']:.1f}-{e['max']:.1f}]"
            if "ratio" in e:
                cell += f" {e['ratio']:.2f}x"
            row += f"{cell:>28s}"
        print(row)
    if baseline:
        print(f"(median [min-max] over rounds; Nx: ratio to {baseline}, median of per-round ratios)")


def roofline(summary: dict, engine: str, gguf: str | None, context: int) -> dict:
    """Each server's conc-1 decode as a fraction of the machine's bound at this context: read bandwidth ÷ the
    bytes a batch-1 step reads (the engine's weights, or the GGUF file's, and the KV of `context` tokens, sized
    from the Quicksilver engine's manifest: the same model shape)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_decode import kv_bytes_per_token, read_bandwidth_gbs, weight_bytes_per_token

    from artifact import load

    manifest = load(Path(engine), verify=False)
    kv = context * kv_bytes_per_token(manifest)
    weights = {"quicksilver": weight_bytes_per_token(Path(engine), manifest)}
    if gguf:
        weights["llama"] = Path(gguf).stat().st_size
    bandwidth = read_bandwidth_gbs()
    out = {"read_bandwidth_gbs": bandwidth, "context": context, "servers": {}}
    print(f"batch-1 bound at {context} tokens of context, read bandwidth {bandwidth:.1f} GB/s (2 threads):")
    for name, entries in summary.items():
        w = weights.get(name, weights["quicksilver"] if name != "llama" else None)
        decode = entries.get("conc1.decode_tps_per_stream")
        if w is None or decode is None:
            continue
        bound = bandwidth * 1e9 / (w + kv)
        out["servers"][name] = {"bound_tok_s": bound, "decode_tok_s": decode["median"],
                                "pct_of_bound": 100 * decode["median"] / bound}
        print(f"  {name}: conc-1 decode {decode['median']:.1f} tok/s = {100 * decode['median'] / bound:.1f} % of "
              f"{bound:.1f} tok/s ({w / 1e6:.0f} MB weights + {kv / 1e6:.1f} MB KV a step)")
    return out


def plot(summary: dict, path: Path, levels: list[int]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = [("ttft_ms", "TTFT (ms)"), ("decode_tps_per_stream", "decode tok/s per stream"),
               ("aggregate_tps", "aggregate tok/s"), ("itl_p99_ms", "ITL p99 (ms)")]
    fig, axes = plt.subplots(1, len(figures), figsize=(4 * len(figures), 3.2))
    for ax, (key, label) in zip(axes, figures):
        for name, s in summary.items():
            ys = [s[f"conc{c}.{key}"]["median"] for c in levels]
            ax.plot(levels, ys, marker="o", label=name)
        ax.set_xlabel("concurrent streams")
        ax.set_title(label)
        ax.set_xscale("log", base=2)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", action="append", default=[], metavar="NAME=URL", help="a running server's /v1 URL")
    ap.add_argument("--quicksilver", metavar="ENGINE", help="start `runtime serve ENGINE` (defaults, no tuning)")
    ap.add_argument("--draft", metavar="ENGINE", help="with --quicksilver: its draft engine")
    ap.add_argument("--quicksilver-args", default="", help="extra `runtime serve` arguments (quoted)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                    help="with --quicksilver: also start `runtime serve ENGINE ARGS` (no --draft, no "
                         "--quicksilver-args) as server NAME, e.g. spec-off='--speculation off'; every server this "
                         "run starts is fresh, so none is measured on prompts cached by an earlier run")
    ap.add_argument("--llama-server", nargs=2, metavar=("BIN", "GGUF"), help="start llama-server on a GGUF")
    ap.add_argument("--llama-slots", type=int, default=8, help="llama-server -np (parallel slots)")
    ap.add_argument("--llama-slot-context", type=int, default=2048,
                    help="tokens of context per llama-server slot (its -c is slots × this)")
    ap.add_argument("--baseline", default=None, help="server name the ratios are taken against")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-tokens", type=int, default=445)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--waves", type=int, default=1,
                    help="waves of `concurrency` requests per level and round, one after another (conc 1: one "
                         "request is a noisy figure)")
    ap.add_argument("--late", type=late_streams, default=(0, 0.0), metavar="N,MS",
                    help="the last N streams of each wave start MS later: prompts that arrive while the others "
                         "decode, prefilled in slices beside them (a stream's TTFT counts from its own start)")
    ap.add_argument("--fresh-servers", action="store_true",
                    help="restart every server this run started before each round (after the first): a server "
                         "instance's own bias (two identical servers read 0.94x of each other at conc 1 over 24 "
                         "rounds) becomes one more round-to-round difference, which the medians of per-round ratios "
                         "average out; each round then warms every server with two full-length requests first")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("--plot needs matplotlib: pip install '.[bench]'") from None
    servers = dict(s.split("=", 1) for s in args.server)
    procs: dict[str, tuple[subprocess.Popen, list[str], Path]] = {}    # the servers this run started
    # a `kill` of this run stops its servers too (SIGTERM's default ends Python without its `finally`, and the
    # servers kept running: three orphans measured beside the next run)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    try:
        if args.quicksilver:
            port = free_port()
            cmd = ["runtime", "serve", args.quicksilver, "--http-port", str(port), "--grpc-port", "-1"]
            cmd += (["--draft", args.draft] if args.draft else []) + args.quicksilver_args.split()
            servers["quicksilver"] = f"http://127.0.0.1:{port}/v1"
            log = logs / "bench_serve_quicksilver.log"
            procs["quicksilver"] = (start(cmd, servers["quicksilver"], log), cmd, log)
            for name, extra in (v.split("=", 1) for v in args.variant):
                port = free_port()
                cmd = ["runtime", "serve", args.quicksilver, "--http-port", str(port), "--grpc-port", "-1",
                       *extra.split()]
                servers[name] = f"http://127.0.0.1:{port}/v1"
                log = logs / f"bench_serve_{name}.log"
                procs[name] = (start(cmd, servers[name], log), cmd, log)
        if args.llama_server:
            port = free_port()
            binary, gguf = args.llama_server
            cmd = [binary, "-m", gguf, "--port", str(port), "-np", str(args.llama_slots), "-t", str(os.cpu_count()),
                   "-c", str(args.llama_slots * args.llama_slot_context)]
            servers["llama"] = f"http://127.0.0.1:{port}/v1"
            log = logs / "bench_serve_llama.log"
            procs["llama"] = (start(cmd, servers["llama"], log), cmd, log)
        if not servers:
            ap.error("give --server NAME=URL, --quicksilver ENGINE or --llama-server BIN GGUF")

        def restart(name: str, tag: str) -> None:
            """Stop the server this run started under `name` and start it again (same command, port and URL)."""
            proc, cmd, _ = procs[name]
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
            fresh = logs / f"bench_serve_{name}.{tag}.log"   # not log's name grown by a suffix every restart
            procs[name] = (start(cmd, servers[name], fresh), cmd, fresh)

        runs: dict[str, list[dict]] = {name: [] for name in servers}
        for rnd in range(args.rounds):
            order = list(servers) if rnd % 2 == 0 else list(servers)[::-1]
            if args.fresh_servers and rnd > 0:      # in the round's order: none always loads first or last
                for name in order:
                    if name in procs:
                        restart(name, f"round{rnd + 1}")
            for name in order:
                before = spec_counters(servers[name])
                try:
                    runs[name].append(asyncio.run(measure(name, servers[name], args, rnd)))
                except Exception as e:
                    # a server this run started that fails mid-round is restarted and its round measured again,
                    # once (the failures once blamed on llama-server were stale keep-alive connections: see measure)
                    if name not in procs:
                        raise
                    print(f"round {rnd + 1}: {name} failed ({type(e).__name__}); restarted, round measured again",
                          file=sys.stderr)
                    restart(name, f"restart{rnd + 1}")
                    runs[name].append(asyncio.run(measure(name, servers[name], args, rnd)))
                    before = spec_counters(servers[name])    # a restarted server counts from zero
                with_acceptance(runs[name][-1], before, spec_counters(servers[name]))
                print(f"round {rnd + 1}/{args.rounds} {name}: "
                      + ", ".join(f"{c}: ttft {v['ttft_ms']:.0f} ms, {v['decode_tps_per_stream']:.0f} tok/s"
                                  for c, v in runs[name][-1].items() if c.startswith("conc")), file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)      # a second kill must not cut the clean-up short
        for p, _, _ in procs.values():
            p.terminate()
        for p, _, _ in procs.values():
            p.wait(timeout=30)
    summary = summarize(runs, args.baseline)
    print_table(summary, args.baseline)
    bound = None
    if args.quicksilver and 1 in args.concurrency:
        bound = roofline(summary, args.quicksilver, args.llama_server[1] if args.llama_server else None,
                         args.prompt_tokens + args.max_tokens // 2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                                         "servers": servers, "summary": summary, "roofline": bound, "rounds": runs},
                                        indent=2))
    if args.plot:
        plot(summary, args.plot, args.concurrency)


if __name__ == "__main__":
    main()
