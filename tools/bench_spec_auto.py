"""What adaptive speculation costs or gives where it cannot pay: the bundled pair in process, one request at a time
(conc 1), plain decoding vs a draft vs prompt lookup, each adaptive, on held-out code with the sampling the bundled
target's generation_config gives (repetition penalty 1.3). Each round runs 4 prompts, each on every engine in turn
(engine order rotating); a round's figure is decode tokens ÷ decode seconds; ratios to plain per round, medians and
quartiles. Also what speculation did: guesses proposed and accepted, and what its tries were charged.

Each engine with speculation also runs every prompt with its speculation switched off ("draft/off", "ngram/off"),
and its ratio to that is the headline: the same ONNX Runtime sessions and memory on both sides. Separate engine
instances differ by themselves (identical plain engines in one process read 0.99-1.01x of each other, and
a whole run's ratios moved 0.96-0.99x between runs).

With `--concurrency N` each prompt becomes N prompts generated together (continuous batching, as N clients at
once), each run with a prefix of its own so that no run finds another's prompt in the prefix cache; the figure is
still decode tokens ÷ decode seconds per stream.

    python tools/bench_spec_auto.py --rounds 16 --json tools/results/spec_auto_in_process_epyc.json
    python tools/bench_spec_auto.py --concurrency 8 --rounds 12
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.request import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "compile" / "data" / "heldout_code.txt"


@contextmanager
def speculation_off(engine: Engine):
    """The engine as `--speculation off` runs it: no planner hook, no speculator to observe steps."""
    hook, speculator = engine.scheduler.plan_speculation, engine.speculator
    engine.scheduler.plan_speculation, engine.speculator = None, None
    try:
        yield engine
    finally:
        engine.scheduler.plan_speculation, engine.speculator = hook, speculator


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=ROOT / "engines" / "target")
    ap.add_argument("--draft", type=Path, default=ROOT / "engines" / "draft")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=1, help="prompts generated together")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    text = TEXT.read_text()
    engines = {"off": Engine(args.target, EngineConfig()),
               "draft": Engine(args.target, EngineConfig(draft=args.draft, speculation="draft")),
               "ngram": Engine(args.target, EngineConfig(speculation="ngram"))}
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, repetition_penalty=1.3)
    runs = [(name, engine, False) for name, engine in engines.items()]
    runs += [(f"{name}/off", engines[name], True) for name in ("draft", "ngram")]
    rates: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for rnd in range(args.rounds):
        tokens, seconds = dict.fromkeys(rates, 0.0), dict.fromkeys(rates, 0.0)
        for i in range(4):          # each prompt on every engine in turn: the machine's drift hits all alike
            k = (4 * rnd + i) % len(runs)
            for name, engine, off in runs[k:] + runs[:k]:
                mark = f" {name}" if args.concurrency > 1 else ""       # a cold prompt for every run
                prompts = [f"# {rnd} {i}{mark}{f' {c}' if c else ''}\n" +
                           text[((i + 4 * c) * 7 + rnd * 13) * 997 % (len(text) - 1600):][:1600]
                           for c in range(args.concurrency)]
                with speculation_off(engine) if off else nullcontext():
                    outs = engine.generate(prompts, [params] * len(prompts))
                for usage in (o["usage"] for o in outs):
                    tokens[name] += usage.completion_tokens - 1
                    seconds[name] += (usage.completion_tokens - 1) * usage.tpot_s
        for name in rates:
            rates[name].append(tokens[name] / seconds[name])
    out = {"rounds": args.rounds, "concurrency": args.concurrency, "rates": rates, "engines": {}}

    def ratio(name: str, base: str) -> dict:
        r = np.array(rates[name]) / np.array(rates[base])
        return {"ratio": float(np.median(r)),
                "ratio_quartiles": [float(np.percentile(r, 25)), float(np.percentile(r, 75))]}

    for name in rates:
        entry = {"tok_s": float(np.median(rates[name])), "vs_off_engine": ratio(name, "off")}
        engine = engines[name.split("/")[0]]
        if name in ("draft", "ngram"):
            s = engine.speculator
            entry.update(vs_own_off=ratio(name, f"{name}/off"), proposed=s.stats.proposed, accepted=s.stats.accepted,
                         explore_cost_s=s.explore_cost_s, decode_s=s.decode_s)
        out["engines"][name] = entry
        line = f"{name:9s} {entry['tok_s']:7.1f} tok/s  {fmt(entry['vs_off_engine'])} of the plain engine"
        if "vs_own_off" in entry:
            line += (f", {fmt(entry['vs_own_off'])} of itself with speculation off; proposed {entry['proposed']}, "
                     f"accepted {entry['accepted']}, tries charged {entry['explore_cost_s']:.3f} s of "
                     f"{entry['decode_s']:.2f} s decoding")
        print(line)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


def fmt(r: dict) -> str:
    return f"{r['ratio']:.3f}x [{r['ratio_quartiles'][0]:.3f}-{r['ratio_quartiles'][1]:.3f}]"


if __name__ == "__main__":
    main()
