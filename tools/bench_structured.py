"""Constrained decoding cost: grammar libraries compared on our tokenizer, and the engine's constrained TPOT.

    python tools/bench_structured.py libs ENGINE_DIR            # llguidance vs outlines-core (vs xgrammar if installed)
    python tools/bench_structured.py engine ENGINE_DIR          # mask cost per token at batch 1 and 16, TPOT vs plain

`libs`: for each schema, compile time (first matcher) and the per-token mask time along a valid instance's tokens,
median of several runs; outlines-core's vocabulary is our tokenizer's decoded tokens (its index is built from the
schema's regex over them, up front). `engine`: the same requests with and without a JSON-schema constraint,
alternating, on one engine; the engine's own clock for grammar work (`EngineStats.grammar_s`) over its step time.
Prints a table and writes JSON (tools/results/structured_*.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMAS = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                               "ok": {"type": "boolean"}},
              "required": ["name", "age", "ok"], "additionalProperties": False},
             {"name": "Ada Lovelace", "age": 36, "ok": True}),
    "nested": ({"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999999},
                                                  "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                           "maxItems": 5}},
                 "required": ["id", "tags"], "additionalProperties": False},
        "items": {"type": "array", "maxItems": 4, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer", "minimum": 1,
                                                                                "maximum": 99}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["user", "items"], "additionalProperties": False},
        {"user": {"id": 4242, "tags": ["a", "bb", "ccc"]}, "items": [{"sku": "ABC-1234", "qty": 2},
                                                                      {"sku": "XYZ-0001", "qty": 10}]}),
    "enum_heavy": ({"type": "object", "properties": {f"f{i}": {"enum": [f"value_{j}" for j in range(20)]}
                                                     for i in range(6)},
                    "required": [f"f{i}" for i in range(6)], "additionalProperties": False},
                   {f"f{i}": f"value_{i * 3}" for i in range(6)}),
}


def instance_tokens(tok, instance) -> list[int]:
    return tok.encode(json.dumps(instance, separators=(", ", ": "))).ids


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab: int, eos: int):
        from llguidance import LLMatcher, LLTokenizer
        self.LLMatcher, self.vocab = LLMatcher, vocab
        self.tok = LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)

    def compile(self, schema):
        from runtime.constraints import JSON_STYLE
        m = self.LLMatcher(self.tok, self.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE), log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def walk(self, m, tokens) -> list[float]:
        words = np.empty((self.vocab + 31) // 32, np.int32)
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            times.append(time.perf_counter() - t0)
            assert m.consume_token(t), m.get_error()
        return times


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer_json: str, vocab: int, eos: int):
        from tokenizers import Tokenizer
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema
        tok = Tokenizer.from_str(tokenizer_json)
        mapping: dict[str, list[int]] = {}
        for i in range(tok.get_vocab_size()):
            if i != eos:
                mapping.setdefault(tok.decode([i]), []).append(i)
        self.Guide, self.Index, self.regex, self.vocab_size = Guide, Index, build_regex_from_schema, vocab
        self.vocab = Vocabulary(eos, mapping)

    def compile(self, schema):
        return self.Guide(self.Index(self.regex(json.dumps(schema), r"[ ]?"), self.vocab))

    def walk(self, guide, tokens) -> list[float]:
        mask = np.zeros((self.vocab_size + 31) // 32, np.int32)
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            guide.write_mask_into(mask.ctypes.data, mask.size, 4)
            times.append(time.perf_counter() - t0)
            guide.advance(t)
        return times


def bench_libs(engine_dir: Path, repeats: int) -> dict:
    from tokenizers import Tokenizer
    tokenizer_json = (engine_dir / "tokenizer.json").read_text()
    tok = Tokenizer.from_str(tokenizer_json)
    manifest = json.loads((engine_dir / "manifest.json").read_text())
    vocab, eos = manifest["model"]["vocab_size"], manifest["tokenizer"]["eos_token_ids"][0]
    libs = []
    for cls in (Llguidance, OutlinesCore):
        t0 = time.perf_counter()
        try:
            libs.append((cls(tokenizer_json, vocab, eos), time.perf_counter() - t0))
        except ImportError as e:
            print(f"{cls.name}: not installed ({e})")
    results = {}
    for schema_name, (schema, instance) in SCHEMAS.items():
        tokens = instance_tokens(tok, instance)
        for lib, setup_s in libs:
            compile_s, per_token = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                try:
                    m = lib.compile(schema)
                except Exception as e:   # noqa: BLE001 - a library that cannot compile a schema is a result
                    compile_s = None
                    print(f"{lib.name} {schema_name}: cannot compile: {str(e)[:120]}")
                    break
                compile_s.append(time.perf_counter() - t0)
                per_token += lib.walk(m, tokens)
            row = {"setup_s": setup_s, "tokens": len(tokens)}
            if compile_s:
                row.update(compile_ms=1e3 * statistics.median(compile_s),
                           mask_us_p50=1e6 * float(np.percentile(per_token, 50)),
                           mask_us_p99=1e6 * float(np.percentile(per_token, 99)))
            results.setdefault(schema_name, {})[lib.name] = row
            print(f"{schema_name:11} {lib.name:14} " + (
                f"compile {row['compile_ms']:8.1f} ms  mask p50 {row['mask_us_p50']:7.1f} us  "
                f"p99 {row['mask_us_p99']:8.1f} us  ({len(tokens)} tokens)" if compile_s else "cannot compile"))
    return results


def bench_engine(engine_dir: Path, rounds: int, batches: list[int]) -> dict:
    from runtime.config import CacheConfig, EngineConfig, SchedulerConfig
    from runtime.constraints import Constraint
    from runtime.engine import Engine
    from runtime.request import SamplingParams

    schema = {"type": "object", "properties": {
        "lines": {"type": "array", "minItems": 12, "maxItems": 12, "items": {"type": "string", "minLength": 6,
                                                                             "maxLength": 6}}},
              "required": ["lines"], "additionalProperties": False}
    prompts = ["def fibonacci(n):\n", "class Stack:\n", "import os\n", "config = "]
    results = {}
    for batch in batches:
        eng = Engine(engine_dir, EngineConfig(SchedulerConfig(max_num_seqs=max(batch, 4)),
                                              CacheConfig(kv_budget_bytes=512 << 20, enable_prefix_cache=False)))
        constrained = SamplingParams(max_tokens=400, constraint=Constraint.json_schema(schema))
        eng.generate(["warm"], constrained)
        rows = {"plain": [], "constrained": [], "grammar_share": []}
        plain_tokens = 1
        for _ in range(rounds):
            for kind in ("constrained", "plain"):
                ps = [prompts[i % len(prompts)] for i in range(batch)]
                if kind == "constrained":
                    params = constrained
                    eng.stats.grammar_s = 0.0
                else:                                   # as many tokens as the constrained run made
                    params = SamplingParams(max_tokens=plain_tokens, ignore_eos=True)
                t0 = time.perf_counter()
                outs = eng.generate(ps, params)
                wall = time.perf_counter() - t0
                n = [len(o["token_ids"]) for o in outs]
                tpot = statistics.median(o["usage"].tpot_s for o in outs if o["usage"].tpot_s)
                rows[kind].append(tpot)
                if kind == "constrained":
                    for o in outs:
                        json.loads(o["text"])
                    plain_tokens = max(n)
                    rows["grammar_share"].append(eng.stats.grammar_s / wall)
                    rows.setdefault("grammar_us_per_token", []).append(1e6 * eng.stats.grammar_s / sum(n))
        summary = {"batch": batch, "tpot_ms_plain": 1e3 * statistics.median(rows["plain"]),
                   "tpot_ms_constrained": 1e3 * statistics.median(rows["constrained"]),
                   "ratio_per_round": [c / p for c, p in zip(rows["constrained"], rows["plain"])],
                   "grammar_share_of_wall": statistics.median(rows["grammar_share"]),
                   "grammar_us_per_token": statistics.median(rows["grammar_us_per_token"])}
        results[f"b{batch}"] = summary
        r = summary["ratio_per_round"]
        print(f"batch {batch:2}: TPOT plain {summary['tpot_ms_plain']:.2f} ms, constrained "
              f"{summary['tpot_ms_constrained']:.2f} ms (ratio median {statistics.median(r):.2f}, "
              f"{min(r):.2f}-{max(r):.2f}); grammar work {summary['grammar_us_per_token']:.0f} us/token = "
              f"{100 * summary['grammar_share_of_wall']:.1f} % of the run")
        del eng
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["libs", "engine"])
    ap.add_argument("engine", type=Path, help="an engine directory (its tokenizer; `engine` runs it)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    result = bench_libs(args.engine, args.repeats) if args.what == "libs" else bench_engine(args.engine, args.rounds,
                                                                                           args.batches)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"structured_{args.what}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
