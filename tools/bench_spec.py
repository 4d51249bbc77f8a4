"""Speculative decoding benchmark: decode tokens/s with and without speculation at batch 1, 4 and 16, greedy and
temperature 0.7, on code-completion prompts from held-out code; acceptance, chosen γ, and greedy identity.
Also prompt lookup (n-gram) on an "edit this code" workload. Prints a table, writes JSON.

    python tools/bench_spec.py --target engines/target --draft engines/draft --json bench_spec.json
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
from runtime.spec_decode.speculator import SpecConfig

HELDOUT = Path(__file__).resolve().parents[1] / "compile" / "data" / "heldout_code.txt"


def code_prompts(n: int, chars: int = 400) -> list[str]:
    """Prompts cut from held-out code at line starts: the text before a function body, as an editor sends it."""
    text = HELDOUT.read_text()
    starts = [i for i in range(len(text)) if text.startswith("\n    def ", i) or text.startswith("\ndef ", i)]
    prompts = []
    for s in starts[:: max(1, len(starts) // n)][:n]:
        end = text.index("\n", s + 5) + 1
        prompts.append(text[max(0, end - chars):end])
    return prompts


def edit_prompts(n: int) -> list[str]:
    """'Rewrite' prompts: the answer mostly copies the code in the prompt (where prompt lookup shines)."""
    text = HELDOUT.read_text()
    blocks = [b for b in text.split("\n\n") if 200 < len(b) < 700][:n]
    return [f"# Original:\n{b}\n\n# Same code, reformatted:\n{b.splitlines()[0]}\n" for b in blocks]


def measure(engine: Engine, prompts: list[str], params: SamplingParams) -> dict:
    t0 = time.monotonic()
    results = engine.generate(prompts, [params] * len(prompts))
    wall = time.monotonic() - t0
    tpots = [r["usage"].tpot_s for r in results if r["usage"].tpot_s]
    return {"tok_s": len(prompts) / float(np.median(tpots)), "wall_s": wall,
            "tokens": [r["token_ids"] for r in results],
            "proposed": sum(r["usage"].spec_proposed for r in results),
            "accepted": sum(r["usage"].spec_accepted for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path("engines/target"))
    ap.add_argument("--draft", type=Path, default=Path("engines/draft"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-gamma", type=int, default=6)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    cache = CacheConfig(kv_budget_bytes=2 << 30, enable_prefix_cache=False)
    sched = SchedulerConfig(max_num_seqs=max(args.batches))
    engines = {
        "plain": Engine(args.target, EngineConfig(sched, cache)),
        "draft": Engine(args.target, EngineConfig(sched, cache, SpecConfig(max_gamma=args.max_gamma), draft=args.draft,
                                                  speculation="draft")),
        "draft-fixed4": Engine(args.target, EngineConfig(sched, cache, SpecConfig(max_gamma=4, adaptive=False),
                                                         draft=args.draft, speculation="draft")),
        "ngram": Engine(args.target, EngineConfig(sched, cache, SpecConfig(max_gamma=args.max_gamma), speculation="ngram")),
    }
    rows, prompts = [], code_prompts(max(args.batches) * 2)
    for temperature in (0.0, 0.7):
        for batch in args.batches:
            params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=7 if temperature else None,
                                    ignore_eos=True)
            batch_prompts = prompts[:batch]
            base = measure(engines["plain"], batch_prompts, params)
            for name in ("draft", "draft-fixed4"):
                eng = engines[name]
                rounds0 = eng.speculator.stats.rounds
                r = measure(eng, batch_prompts, params)
                rounds = eng.speculator.stats.rounds - rounds0
                rows.append({"mode": name, "temperature": temperature, "batch": batch,
                             "plain_tok_s": round(base["tok_s"], 1), "spec_tok_s": round(r["tok_s"], 1),
                             "speedup": round(r["tok_s"] / base["tok_s"], 2),
                             "acceptance": round(r["accepted"] / r["proposed"], 3) if r["proposed"] else None,
                             "mean_gamma": round(r["proposed"] / rounds, 2) if rounds else 0.0,
                             "greedy_identical": (r["tokens"] == base["tokens"]) if temperature == 0 else None})
    edits = edit_prompts(4)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for batch in (1, 4):
        base = measure(engines["plain"], edits[:batch], params)
        r = measure(engines["ngram"], edits[:batch], params)
        rows.append({"mode": "ngram-edit", "temperature": 0.0, "batch": batch, "plain_tok_s": round(base["tok_s"], 1),
                     "spec_tok_s": round(r["tok_s"], 1), "speedup": round(r["tok_s"] / base["tok_s"], 2),
                     "acceptance": round(r["accepted"] / r["proposed"], 3) if r["proposed"] else None,
                     "mean_gamma": None, "greedy_identical": r["tokens"] == base["tokens"]})
    print(f"{'mode':<13} {'temp':>4} {'batch':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} "
          f"{'accept':>6} {'mean γ':>6} {'identical':>9}")
    for r in rows:
        print(f"{r['mode']:<13} {r['temperature']:>4} {r['batch']:>5} {r['plain_tok_s']:>11} {r['spec_tok_s']:>10} "
              f"{r['speedup']:>7} {str(r['acceptance']):>6} {str(r['mean_gamma']):>6} {str(r['greedy_identical']):>9}")
    if args.json:
        args.json.write_text(json.dumps({"target": str(args.target), "draft": str(args.draft), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
