"""Speculative decoding benchmark: decode tokens/s with and without speculation at batch 1, 4 and 16, greedy and
temperature 0.7, on code-completion prompts from held-out code; acceptance, chosen γ, and greedy identity.
Also prompt lookup (n-gram) on an "edit this code" workload. Prints a table, writes JSON.

First it measures what speculation could give at best on this machine (`ceiling`): a target step's time as a
function of the tokens it computes, T(k), and a draft step's, d, and from them the speedup bound per γ.

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
from runtime.backends.cpu.runner import ModelRunner
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


def measure(engine: Engine, prompts: list[str], params: SamplingParams, batch: int | None = None) -> dict:
    """`prompts` in groups of `batch` run together (all at once by default); per-stream tokens/s × batch from the
    median request's TPOT, acceptance over all of them."""
    batch = batch or len(prompts)
    t0 = time.monotonic()
    results = [r for i in range(0, len(prompts), batch)
               for r in engine.generate(prompts[i:i + batch], [params] * len(prompts[i:i + batch]))]
    wall = time.monotonic() - t0
    tpots = [r["usage"].tpot_s for r in results if r["usage"].tpot_s]
    return {"tok_s": batch / float(np.median(tpots)), "wall_s": wall,
            "tokens": [r["token_ids"] for r in results],
            "proposed": sum(r["usage"].spec_proposed for r in results),
            "accepted": sum(r["usage"].spec_accepted for r in results)}


def ceiling(target: Path, draft: Path, context: int, max_gamma: int, rounds: int = 7, calls: int = 50) -> dict:
    """The most speculation can give here. A round of γ guesses yields at most γ + 1 tokens and costs γ draft steps
    and one target step over γ + 1 tokens; plain decoding costs one single-token step a token. So with per-guess
    acceptance α a round yields E(α, γ) = (1 − α^(γ+1)) / (1 − α) tokens, and the speedup is at most
    E(α, γ) · T(1) / (T(γ+1) + γ · d) — the engine's own work per step left out, which only lowers it. Where T(k)
    grows nearly as fast as k (a model whose weights stay in the CPU's cache is compute-bound, not
    bandwidth-bound), no draft, however good, makes speculation pay much. Medians of `rounds` interleaved rounds
    of `calls` calls each, at `context` tokens of context."""
    t, d = ModelRunner(target), ModelRunner(draft)
    tp, dp = t.new_pool(1, context + max_gamma + 2), d.new_pool(1, context + 2)
    ids = np.random.default_rng(0).integers(3, min(t.vocab_size, d.vocab_size), context).tolist()
    t.prefill(tp, 0, ids, 0)
    d.prefill(dp, 0, ids, 0)
    steps = {k: (lambda k=k: t.prefill(tp, 0, ids[:k], context, all_logits=True)) for k in range(1, max_gamma + 2)}
    steps[0] = lambda: d.decode(dp, [(0, ids[0], context)], set())          # key 0: a draft step
    samples: dict[int, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for k, step in steps.items():
            step()
            t0 = time.perf_counter()
            for _ in range(calls):
                step()
            samples[k].append((time.perf_counter() - t0) / calls)
    cost = {k: float(np.median(v)) for k, v in samples.items()}
    alphas = (1.0, 0.9, 0.8, 0.7, 0.6)
    bound = {g: {a: round(expected(a, g) * cost[1] / (cost[g + 1] + g * cost[0]), 2) for a in alphas}
             for g in range(1, max_gamma + 1)}
    print(f"target step over k tokens at {context} of context (ms): "
          + ", ".join(f"T({k}) {cost[k] * 1e3:.3f}" for k in range(1, max_gamma + 2)) + f"; draft step {cost[0] * 1e3:.3f}")
    print("speedup bound at acceptance α per guess: " + "; ".join(
        f"γ={g} " + " ".join(f"{a}:{b}" for a, b in bound[g].items()) for g in bound))
    return {"context": context, "target_step_ms": {k: round(cost[k] * 1e3, 4) for k in range(1, max_gamma + 2)},
            "draft_step_ms": round(cost[0] * 1e3, 4), "bound": {g: {str(a): b for a, b in v.items()} for g, v in bound.items()}}


def expected(alpha: float, gamma: int) -> float:
    """Tokens a round of γ guesses yields on average at per-guess acceptance α (the last one is the target's)."""
    return float(gamma + 1) if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path("engines/target"))
    ap.add_argument("--draft", type=Path, default=Path("engines/draft"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-gamma", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per batch size (a batch of 1 runs them in turn)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--ceiling-context", type=int, default=500, help="context of the step-cost measurement")
    args = ap.parse_args()
    bound = ceiling(args.target, args.draft, args.ceiling_context, args.max_gamma)
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
    rows, prompts = [], code_prompts(max(max(args.batches), args.prompts))
    for temperature in (0.0, 0.7):
        for batch in args.batches:
            params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=7 if temperature else None,
                                    ignore_eos=True)
            batch_prompts = prompts[:max(batch, args.prompts // batch * batch)]    # whole batches, ~--prompts
            base = measure(engines["plain"], batch_prompts, params, batch)
            for name in ("draft", "draft-fixed4"):
                eng = engines[name]
                rounds0 = eng.speculator.stats.rounds
                r = measure(eng, batch_prompts, params, batch)
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
        args.json.write_text(json.dumps({"target": str(args.target), "draft": str(args.draft), "ceiling": bound, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
