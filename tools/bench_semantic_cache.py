"""Semantic cache measurements (figures printed and written as JSON).

    python tools/bench_semantic_cache.py accuracy           # precision/recall on labelled pairs, tune and held-out
    python tools/bench_semantic_cache.py index              # hnswlib vs faiss at 100k entries: build, query p50/p99, recall
    python tools/bench_semantic_cache.py lookup             # SemanticCache.lookup at 100k entries: miss, verified hit
    python tools/bench_semantic_cache.py serve ENGINE       # TTFT at the API: generated vs exact hit vs semantic hit

`accuracy` reads tools/data/semantic_pairs.jsonl: 405 question pairs written by hand, labelled same question or
not, 214 of them near misses (direction, word, number, negation, entity, unit and code swaps, most sharing all but
one word with their partner). The "tune" split chose the thresholds; the "heldout" split (148 pairs) was written
before any verifier was run and is only ever reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PAIRS = ROOT / "tools" / "data" / "semantic_pairs.jsonl"
RESULTS = ROOT / "tools" / "results"


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q))


def _pairs(split: str | None = None) -> list[dict]:
    rows = [json.loads(line) for line in PAIRS.read_text().splitlines() if line.strip()]
    return [r for r in rows if split is None or r["split"] == split]


def _scores(rows: list[dict]):
    """(embedding cosine, near-miss reason, verifier P(same)) per pair."""
    from runtime.server import near_miss
    from runtime.server.embedder import Embedder
    from runtime.server.verifier import Verifier

    e, v = Embedder(), Verifier()
    sims = (e.embed([r["a"] for r in rows]) * e.embed([r["b"] for r in rows])).sum(1)
    reasons = [near_miss.reason(r["a"], r["b"]) for r in rows]
    verified = np.array([v.score(r["a"], r["b"]) for r in rows])
    return sims, reasons, verified


def _rates(hit: np.ndarray, same: np.ndarray) -> dict:
    tp, fp = int((hit & same).sum()), int((hit & ~same).sum())
    return {"precision": tp / (tp + fp) if tp + fp else 1.0, "recall": tp / int(same.sum()), "false_hits": fp,
            "hits": tp + fp}


def accuracy(args) -> dict:
    """Precision and recall of a semantic hit, per split: the embedding alone at the old threshold (0.91), the
    embedding with the near-miss rules, and the whole check (rules + verifier, the default); per near-miss kind,
    how many the default lets through; on the tune split, the verifier threshold sweep that chose the default."""
    from runtime.server.semantic_cache import DEFAULT_THRESHOLD, VERIFY_THRESHOLD

    out = {"pairs": str(PAIRS.relative_to(ROOT)), "threshold": DEFAULT_THRESHOLD,
           "verify_threshold": VERIFY_THRESHOLD, "splits": {}}
    for split in ("tune", "heldout"):
        rows = _pairs(split)
        sims, reasons, verified = _scores(rows)
        same = np.array([r["same"] for r in rows])
        rules = np.array([x is None for x in reasons])
        candidate = sims >= DEFAULT_THRESHOLD
        variants = {"embedding >= 0.91 (before)": _rates(sims >= 0.91, same),
                    f"embedding >= {DEFAULT_THRESHOLD} + rules": _rates(candidate & rules, same),
                    f"embedding >= {DEFAULT_THRESHOLD} + rules + verifier (default)":
                        _rates(candidate & rules & (verified >= VERIFY_THRESHOLD), same)}
        default = candidate & rules & (verified >= VERIFY_THRESHOLD)
        kinds = {}
        for kind in sorted({r["kind"] for r in rows if not r["same"]}):
            idx = [i for i, r in enumerate(rows) if r["kind"] == kind]
            kinds[kind] = {"pairs": len(idx), "served": int(default[idx].sum()),
                           "served_before": int((sims[idx] >= 0.91).sum())}
        sweep = None
        if split == "tune":
            sweep = {f"{t:.2f}": _rates(candidate & rules & (verified >= t), same)
                     for t in (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)}
        out["splits"][split] = {"pairs": len(rows), "same": int(same.sum()), "near_misses": int((~same).sum()),
                                "variants": variants, "near_miss_kinds": kinds, "verify_sweep": sweep}
        print(f"{split}: {len(rows)} pairs ({int(same.sum())} same question, {int((~same).sum())} near misses)")
        for name, r in variants.items():
            print(f"  {name:52s} precision {r['precision']:.3f}  recall {r['recall']:.3f}  "
                  f"false hits {r['false_hits']}")
        print("  near misses served (default / before): " +
              ", ".join(f"{k} {v['served']}/{v['served_before']} of {v['pairs']}" for k, v in kinds.items()))
        if sweep:
            print("  verifier threshold sweep: " + ", ".join(f"{t}: {r['precision']:.3f}/{r['recall']:.3f}"
                                                           for t, r in sweep.items()))
    return out


def _vectors(n: int, dim: int = 384, seed: int = 0) -> np.ndarray:
    """Clustered unit vectors (questions come in topics): 1000 centres, each point a noisy copy of one."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((1000, dim)).astype(np.float32)
    v = centres[rng.integers(0, 1000, n)] + 0.8 * rng.standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def index(args) -> dict:
    import faiss
    import hnswlib

    n, dim = args.entries, 384
    data = _vectors(n)
    # What a cache lookup that should hit looks like: a near-duplicate (cosine ~0.95) of one stored question.
    rng = np.random.default_rng(1)
    sources = rng.integers(0, n, args.queries)
    queries = data[sources] + 0.33 * rng.standard_normal((args.queries, dim)).astype(np.float32) / np.sqrt(dim)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    exact = np.argmax(queries @ data.T, axis=1)
    out = {}

    def hnsw():
        idx = hnswlib.Index(space="ip", dim=dim)
        idx.init_index(max_elements=n, ef_construction=100, M=16, allow_replace_deleted=True)
        idx.set_num_threads(1)
        idx.add_items(data, np.arange(n))
        idx.set_ef(64)
        return idx, lambda q: idx.knn_query(q, k=8)[0][0]

    def faiss_hnsw():
        idx = faiss.IndexHNSWFlat(dim, 16, faiss.METRIC_INNER_PRODUCT)
        idx.hnsw.efConstruction = 100
        idx.add(data)
        idx.hnsw.efSearch = 64
        return idx, lambda q: idx.search(q, 8)[1][0]

    def faiss_flat():
        idx = faiss.IndexIDMap(faiss.IndexFlatIP(dim))
        idx.add_with_ids(data, np.arange(n))
        return idx, lambda q: idx.search(q, 8)[1][0]

    faiss.omp_set_num_threads(1)
    for name, make, deletes in (("hnswlib HNSW (M=16, ef=64)", hnsw, "mark_deleted + slot reuse"),
                                ("faiss IndexHNSWFlat (M=16, ef=64)", faiss_hnsw, "none (rebuild)"),
                                ("faiss IndexFlatIP (exact)", faiss_flat, "remove_ids, O(n) each")):
        t0 = time.perf_counter()
        _, search = make()
        build = time.perf_counter() - t0
        times, found = [], []
        for q in queries:
            t0 = time.perf_counter()
            labels = search(q[None])
            times.append(time.perf_counter() - t0)
            found.append(labels[0])
        recall = float(np.mean(np.array(found) == exact))     # the stored near-duplicate found first
        out[name] = {"build_s": build, "query_p50_ms": 1e3 * pct(times, 50), "query_p99_ms": 1e3 * pct(times, 99),
                     "recall_at_1": recall, "deletion": deletes}
        print(f"{name:36s} build {build:6.1f} s  query p50 {1e3 * pct(times, 50):.3f} ms  "
              f"p99 {1e3 * pct(times, 99):.3f} ms  recall@1 {recall:.3f}  delete: {deletes}")
    print(f"queries: near-duplicates of stored entries, cosine median {np.median((queries * data[sources]).sum(1)):.3f}")
    return {"entries": n, "queries": args.queries, "dim": dim, "libraries": out}


def lookup(args) -> dict:
    """The whole lookup at `entries` entries on one thread: a miss (exact layer, embedding, HNSW; no candidate
    passes the threshold) and a verified hit (the same, then the near-miss rules and the verifier), each question
    looked up once per round."""
    from runtime.server.embedder import DIM
    from runtime.server.semantic_cache import Answer, CacheSettings, Query, SemanticCache

    cache = SemanticCache(CacheSettings(max_entries=args.entries + 1000, ttl_s=1e9))
    ns, answer = ("default", "m"), Answer("x", "stop", 1)
    t0 = time.perf_counter()
    vectors = _vectors(args.entries)
    for i, v in enumerate(vectors):          # stored with precomputed vectors: embedding 100k texts takes minutes
        cache.store(Query(ns, "ctx", f"question {i}", v), answer)
    same = [r for r in _pairs("tune") if r["same"]]
    for r in same:                           # the real questions whose paraphrases are asked below
        cache.store(Query(ns, "ctx", r["a"]), Answer(r["a"], "stop", 1))
    fill = time.perf_counter() - t0
    assert DIM == vectors.shape[1]
    unrelated = [f"{w} question about the {t} of a {o}" for w in ("A", "Another", "One more")
                 for t in ("history", "colour", "price", "weight") for o in ("boat", "cloud", "violin", "lamp")]
    times = {"miss": [], "verified hit": []}
    for _ in range(args.rounds):
        for q in unrelated:
            t0 = time.perf_counter()
            hit = cache.lookup(Query(ns, "ctx", q))
            times["miss"].append(time.perf_counter() - t0)
            assert hit is None or hit.kind == "semantic"
        for r in same:
            q = Query(ns, "ctx", r["b"])
            t0 = time.perf_counter()
            hit = cache.lookup(q)
            dt = time.perf_counter() - t0
            if hit is not None and hit.kind == "semantic":
                times["verified hit"].append(dt)
    res = {"entries": len(cache), "fill_s": fill, "rounds": args.rounds}
    for kind, ts in times.items():
        res[kind] = {"lookups": len(ts), "p50_ms": 1e3 * pct(ts, 50), "p99_ms": 1e3 * pct(ts, 99)}
        print(f"{len(cache):,} entries: {kind:12s} p50 {res[kind]['p50_ms']:.2f} ms  p99 {res[kind]['p99_ms']:.2f} ms"
              f"  ({len(ts)} lookups)")
    return res


def serve(args) -> dict:
    """runtime serve --semantic-cache; the openai client streams: a new question (generated), the same again
    (exact hit), a paraphrase (semantic hit); TTFT of each, rounds alternating over distinct questions."""
    import httpx
    from openai import OpenAI

    firsts = {}
    for p in _pairs("tune"):        # one pair per question: a question asked twice is a hit the first time
        if p["same"]:
            firsts.setdefault(p["a"], p)
    pairs = list(firsts.values())[:args.rounds]
    exe = Path(sys.executable).parent / "runtime"
    port = 18431
    proc = subprocess.Popen([str(exe), "serve", str(args.engine), "--grpc-port", "-1", "--http-port", str(port),
                             "--semantic-cache", "--speculation", "off"], stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        client = OpenAI(base_url=f"{url}/v1", api_key="none")

        def ttft(question: str) -> tuple[float, float, str]:
            t0 = time.perf_counter()
            raw = client.chat.completions.with_raw_response.create(
                model="", messages=[{"role": "user", "content": question}], max_tokens=args.max_tokens,
                temperature=0, stream=True)
            first = None
            for chunk in raw.parse():
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - t0
            total = time.perf_counter() - t0
            return first if first is not None else total, total, raw.headers.get("x-quicksilver-cache", "")

        ttft("warm up the server")
        out = {"generated": [], "exact": [], "semantic": [], "semantic_missed": 0}
        e2e = {"generated": [], "exact": [], "semantic": []}
        for p in pairs:
            t, total, how = ttft(p["a"])
            assert how.startswith("miss"), how
            out["generated"].append(t)
            e2e["generated"].append(total)
            t, total, how = ttft(p["a"])
            assert how.startswith("hit; exact"), how
            out["exact"].append(t)
            e2e["exact"].append(total)
            t, total, how = ttft(p["b"])
            if how.startswith("hit; semantic"):
                out["semantic"].append(t)
                e2e["semantic"].append(total)
            else:
                out["semantic_missed"] += 1
        res = {k: (1e3 * statistics.median(v) if isinstance(v, list) and v else v) for k, v in out.items()}
        res.update({f"{k}_p90_ms": 1e3 * pct(v, 90) for k, v in out.items() if isinstance(v, list) and v})
        print(f"{len(pairs)} questions, max_tokens {args.max_tokens}: TTFT median generated {res['generated']:.1f} ms, "
              f"exact hit {res['exact']:.1f} ms, semantic hit {res['semantic']:.1f} ms "
              f"({len(out['semantic'])} paraphrases hit, {out['semantic_missed']} missed); whole response median "
              + ", ".join(f"{k} {1e3 * statistics.median(v):.1f} ms" for k, v in e2e.items() if v))
        return {"engine": str(args.engine), "max_tokens": args.max_tokens, "ttft_ms_median": res,
                "e2e_ms_median": {k: 1e3 * statistics.median(v) for k, v in e2e.items() if v},
                "samples_ms": {k: [1e3 * x for x in v] for k, v in out.items() if isinstance(v, list)}}
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["accuracy", "index", "lookup", "serve"])
    ap.add_argument("engine", nargs="?", type=Path, help="serve: the engine to serve")
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=30, help="serve: distinct questions; lookup: passes over them")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = {"index": index, "accuracy": accuracy, "lookup": lookup, "serve": serve}[args.what](args)
    path = args.json or RESULTS / f"semantic_cache_{args.what}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
