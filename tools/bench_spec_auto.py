"""What adaptive speculation costs or gives where it cannot pay: the bundled pair in process, one request at a time
(conc 1), plain decoding vs a draft vs prompt lookup, each adaptive, on held-out code with the sampling the bundled
target's generation_config gives (repetition penalty 1.3). Each round runs 4 prompts, each on every engine in turn
(engine order rotating); a round's figure is decode tokens ÷ decode seconds; ratios to plain per round, medians and
quartiles. Also what speculation did: guesses proposed and accepted, and what its tries were charged.

    python tools/bench_spec_auto.py --rounds 16 --json tools/results/spec_auto_in_process_epyc.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.request import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "compile" / "data" / "heldout_code.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=ROOT / "engines" / "target")
    ap.add_argument("--draft", type=Path, default=ROOT / "engines" / "draft")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    text = TEXT.read_text()
    engines = {"off": Engine(args.target, EngineConfig()),
               "draft": Engine(args.target, EngineConfig(draft=args.draft, speculation="draft")),
               "ngram": Engine(args.target, EngineConfig(speculation="ngram"))}
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, repetition_penalty=1.3)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for rnd in range(args.rounds):
        tokens, seconds = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0.0)
        for i in range(4):          # each prompt on every engine in turn: the machine's drift hits all alike
            prompt = f"# {rnd} {i}\n" + text[(i * 7 + rnd * 13) * 997 % (len(text) - 1600):][:1600]
            order = list(engines.items())
            k = (4 * rnd + i) % len(order)
            for name, engine in order[k:] + order[:k]:
                usage = engine.generate([prompt], [params])[0]["usage"]
                tokens[name] += usage.completion_tokens - 1
                seconds[name] += (usage.completion_tokens - 1) * usage.tpot_s
        for name in engines:
            rates[name].append(tokens[name] / seconds[name])
    out = {"rounds": args.rounds, "rates": rates, "engines": {}}
    for name, engine in engines.items():
        ratios = np.array(rates[name]) / np.array(rates["off"])
        entry = {"tok_s": float(np.median(rates[name])), "ratio": float(np.median(ratios)),
                 "ratio_quartiles": [float(np.percentile(ratios, 25)), float(np.percentile(ratios, 75))]}
        if engine.speculator is not None:
            s = engine.speculator
            entry.update(proposed=s.stats.proposed, accepted=s.stats.accepted, explore_cost_s=s.explore_cost_s,
                         decode_s=s.decode_s)
        out["engines"][name] = entry
        extra = (f"; proposed {entry['proposed']}, accepted {entry['accepted']}, tries charged "
                 f"{entry['explore_cost_s']:.3f} s of {entry['decode_s']:.2f} s decoding") if "proposed" in entry else ""
        print(f"{name:6s} {entry['tok_s']:7.1f} tok/s  {entry['ratio']:.3f}x of off "
              f"[{entry['ratio_quartiles'][0]:.3f}-{entry['ratio_quartiles'][1]:.3f}]{extra}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
