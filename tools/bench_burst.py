"""A burst of prompts arriving at once, in process: what scheduling policy does to TTFT and to decode stalls.

Every prompt of the burst is added before the first step (the worst case for a server: nothing decodes yet, every
prompt wants prefill); the engine then steps until all are done. Each policy (token budget, prefill chunk, mixed
step ratio) is its own engine over the same artifact, the policies alternating round by round. Per policy: median
TTFT, ITL p99 and longest gap over all streams' tokens (pooled, as `bench_serve.py` pools them), the number of
gaps over `--stall-ms`, and the burst's wall time; medians over rounds.

Why: ITL p99 over a burst counts how many stalls there were more than how long they were (8 streams × 63 gaps:
p99 misses up to 5 stalls entirely), so two policies can trade a percentile against the longest stall.

    python tools/bench_burst.py engines/smollm2-int8 --policy 4096,256,2 --policy 512,256,2 --json burst.json

`--long-prompt N`: instead of a burst, the streams are decoding when one N-token prompt arrives; per policy, the
other streams' ITL p50 and p99 while it prefills (#49: p99 ≤ 1.5× p50) and its TTFT.

    python tools/bench_burst.py /tmp/q05-int4 --streams 4 --long-prompt 8000 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from runtime.engine import Engine
from runtime.request import SamplingParams

TEXT = Path(__file__).resolve().parents[1] / "compile" / "data" / "heldout_code.txt"


def policy(spec: str) -> tuple:
    """BUDGET,CHUNK[,RATIO][,stall=S][,unpacked]: stall=S is the scheduler's max_burst_stall_s (inf: a burst beside
    decoding streams always whole, as before it); unpacked runs prompt slices in calls of their own beside the
    decodes' (as engines built before packed steps), to compare."""
    fields = spec.split(",")
    unpacked = fields[-1] == "unpacked"
    fields = fields[:-1] if unpacked else fields
    stall = [f for f in fields if f.startswith("stall=")]
    numbers = [f for f in fields if not f.startswith("stall=")]
    if not 2 <= len(numbers) <= 3 or len(stall) > 1:
        raise ValueError(f"a policy is BUDGET,CHUNK[,RATIO][,stall=S][,unpacked], not {spec!r}")
    budget, chunk, ratio = (numbers + ["4"])[:3]
    return ((int(budget), int(chunk), float(ratio)) + ((f"stall={float(stall[0][6:]):g}",) if stall else ())
            + (("unpacked",) if unpacked else ()))


def make_engine(path: str, p: tuple, streams: int) -> Engine:
    stall = next((float(f[6:]) for f in p[3:] if f.startswith("stall=")), SchedulerConfig.max_burst_stall_s)
    engine = Engine(path, EngineConfig(SchedulerConfig(max_num_seqs=max(16, streams), token_budget=p[0],
                                                       prefill_chunk=p[1], max_waiting=256, mixed_step_ratio=p[2],
                                                       max_burst_stall_s=stall),
                                       CacheConfig(enable_prefix_cache=False)))
    if "unpacked" in p:
        engine.backend.pack_steps = False
    return engine


def burst(engine: Engine, prompts: list[str], max_tokens: int, stall_ms: float, tag: str) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"{tag}-{i}")
    times: dict[str, list[float]] = {}
    while engine.has_work():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            times.setdefault(o.request_id, []).append(now)
    gaps = np.concatenate([np.diff(t) for t in times.values()]) * 1e3
    return {"ttft_ms": float(np.median([t[0] - t0 for t in times.values()]) * 1e3),
            "itl_p99_ms": float(np.percentile(gaps, 99)), "itl_max_ms": float(gaps.max()),
            "gaps": int(gaps.size), "stalls": int((gaps > stall_ms).sum()),
            "wall_s": max(t[-1] for t in times.values()) - t0}


def long_prompt(engine: Engine, prompts: list[str], long_ids: list[int], max_tokens: int, tag: str) -> dict:
    """The streams decode a few steps, then the long prompt arrives: the streams' gaps while it prefills (until its
    first token), and its TTFT."""
    params = SamplingParams(max_tokens=min(1024, engine.max_model_len // 2), temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"{tag}-{i}")
    times: dict[str, list[float]] = {}
    while len(times) < len(prompts) or min(len(t) for t in times.values()) < 4:   # all decoding
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            times.setdefault(o.request_id, []).append(now)
    arrival, first = time.perf_counter(), None
    engine.add_request(long_ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                       request_id=f"{tag}-long")
    during: dict[str, list[float]] = {r: [t[-1]] for r, t in times.items()}
    while first is None:
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id == f"{tag}-long":
                first = now
            elif o.request_id in during:
                during[o.request_id].append(now)
    for r in during:
        engine.abort(r)
    while engine.has_work():
        engine.step()
    gaps = np.concatenate([np.diff(t) for t in during.values()]) * 1e3
    return {"long_ttft_s": first - arrival, "itl_p50_ms": float(np.percentile(gaps, 50)),
            "itl_p99_ms": float(np.percentile(gaps, 99)), "itl_max_ms": float(gaps.max()), "gaps": int(gaps.size)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine")
    ap.add_argument("--policy", action="append", type=policy, metavar="BUDGET,CHUNK[,RATIO][,unpacked]",
                    help="token budget, prefill chunk, mixed step ratio (inf: fixed chunks), and `unpacked` for prompt "
                         "slices in calls of their own [default: the engine's defaults, 4096,256,2]")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt-chars", type=int, default=1424, help="~340-445 tokens with the smollm2 tokenizer")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stall-ms", type=float, default=100.0)
    ap.add_argument("--long-prompt", type=int, default=0, metavar="TOKENS",
                    help="streams decode while one prompt of this many tokens arrives (see above)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    policies = args.policy or [(4096, 256, 2.0)]
    text = TEXT.read_text()
    engines = {p: make_engine(args.engine, p, args.streams) for p in policies}
    rows: dict[tuple, list[dict]] = {p: [] for p in policies}
    if args.long_prompt:
        return long_prompt_main(args, engines, text)
    for rnd in range(args.rounds):
        prompts = [f"# round {rnd} stream {i}\n" + text[(i * 7 + rnd) * 997 % (len(text) - args.prompt_chars):]
                   [:args.prompt_chars] for i in range(args.streams)]
        for p, engine in engines.items():
            rows[p].append(burst(engine, prompts, args.max_tokens, args.stall_ms, f"{rnd}"))
    summary = {}
    print(f"{'budget,chunk,ratio':>20} {'TTFT ms':>9} {'ITL p99':>9} {'ITL max':>9} {'stalls':>7} {'wall s':>7}")
    for p, rs in rows.items():
        med = {k: float(np.median([r[k] for r in rs])) for k in ("ttft_ms", "itl_p99_ms", "itl_max_ms", "stalls", "wall_s")}
        summary[",".join(map(str, p))] = {"median": med, "rounds": rs}
        print(f"{','.join(map(str, p)):>20} {med['ttft_ms']:9.0f} {med['itl_p99_ms']:9.0f} {med['itl_max_ms']:9.0f} "
              f"{med['stalls']:7.0f} {med['wall_s']:7.2f}")
    print(f"(medians over {args.rounds} rounds; stalls: gaps over {args.stall_ms:.0f} ms of "
          f"{rows[policies[0]][0]['gaps']})")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "policies": summary},
                                        indent=2))


def long_prompt_main(args, engines: dict, text: str) -> None:
    rows: dict[tuple, list[dict]] = {p: [] for p in engines}
    vocab = next(iter(engines.values())).info.vocab_size
    for rnd in range(args.rounds):
        prompts = [f"# round {rnd} stream {i}\n" + text[(i * 7 + rnd) * 997 % (len(text) - args.prompt_chars):]
                   [:args.prompt_chars] for i in range(args.streams)]
        long_ids = np.random.default_rng(rnd).integers(0, vocab, args.long_prompt).tolist()
        for p, engine in engines.items():
            rows[p].append(long_prompt(engine, prompts, long_ids, args.max_tokens, f"{rnd}"))
    summary = {}
    print(f"{args.streams} streams decoding, one {args.long_prompt}-token prompt arrives; the streams' gaps while it "
          f"prefills (medians over {args.rounds} rounds)")
    print(f"{'budget,chunk,ratio':>20} {'long TTFT s':>12} {'ITL p50':>9} {'ITL p99':>9} {'p99/p50':>8} {'ITL max':>9}")
    for p, rs in rows.items():
        med = {k: float(np.median([r[k] for r in rs])) for k in ("long_ttft_s", "itl_p50_ms", "itl_p99_ms",
                                                                 "itl_max_ms")}
        ratio = float(np.median([r["itl_p99_ms"] / r["itl_p50_ms"] for r in rs]))
        summary[",".join(map(str, p))] = {"median": {**med, "p99_over_p50": ratio}, "rounds": rs}
        print(f"{','.join(map(str, p)):>20} {med['long_ttft_s']:12.2f} {med['itl_p50_ms']:9.1f} "
              f"{med['itl_p99_ms']:9.1f} {ratio:8.2f} {med['itl_max_ms']:9.1f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "policies": summary},
                                        indent=2))


if __name__ == "__main__":
    main()
