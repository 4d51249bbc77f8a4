"""Semantic cache measurements (figures printed and written as JSON).

    python tools/bench_semantic_cache.py threshold          # precision/recall per threshold on labelled pairs
    python tools/bench_semantic_cache.py index              # hnswlib vs faiss at 100k entries: build, query p50/p99, recall
    python tools/bench_semantic_cache.py lookup             # SemanticCache.lookup at 100k entries (embed + search)
    python tools/bench_semantic_cache.py serve ENGINE       # TTFT at the API: generated vs exact hit vs semantic hit

`threshold` reads tools/data/paraphrase_pairs.jsonl: question pairs written by hand and labelled paraphrase or
not, most negatives sharing all but one word with their partner (capital of France / of Spain), the pairs a
semantic cache must not confuse.
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
PAIRS = ROOT / "tools" / "data" / "paraphrase_pairs.jsonl"
RESULTS = ROOT / "tools" / "results"


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q))


def threshold(args) -> dict:
    from runtime.server.embedder import Embedder
    from runtime.server.semantic_cache import DEFAULT_THRESHOLD

    pairs = [json.loads(line) for line in PAIRS.read_text().splitlines() if line.strip()]
    e = Embedder()
    a, b = e.embed([p["a"] for p in pairs]), e.embed([p["b"] for p in pairs])
    sims = (a * b).sum(1)
    labels = np.array([p["paraphrase"] for p in pairs])
    rows = []
    for t in np.round(np.arange(0.70, 0.99, 0.01), 2):
        hit = sims >= t
        tp, fp = int((hit & labels).sum()), int((hit & ~labels).sum())
        rows.append({"threshold": float(t), "precision": tp / (tp + fp) if tp + fp else 1.0,
                     "recall": tp / int(labels.sum()), "false_hits": fp})
    print(f"{len(pairs)} pairs ({int(labels.sum())} paraphrases); cosine of paraphrases median "
          f"{np.median(sims[labels]):.3f}, of non-paraphrases median {np.median(sims[~labels]):.3f}, "
          f"max {sims[~labels].max():.3f}")
    print("threshold  precision  recall  false hits")
    for r in rows:
        mark = "  <- default" if abs(r["threshold"] - DEFAULT_THRESHOLD) < 1e-9 else ""
        print(f"  {r['threshold']:.2f}      {r['precision']:.3f}    {r['recall']:.3f}   {r['false_hits']}{mark}")
    worst = sorted(((float(s), p["a"], p["b"]) for s, p, lab in zip(sims, pairs, labels) if not lab), reverse=True)[:5]
    print("closest non-paraphrases:", *[f"  {s:.3f}  {x!r} / {y!r}" for s, x, y in worst], sep="\n")
    return {"pairs": len(pairs), "default": DEFAULT_THRESHOLD, "rows": rows,
            "closest_non_paraphrases": worst}


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
    """The whole lookup a request pays on a semantic-cache miss at `entries` entries: exact layer, embedding, HNSW."""
    from runtime.server.embedder import DIM
    from runtime.server.semantic_cache import Answer, CacheSettings, Query, SemanticCache

    cache = SemanticCache(CacheSettings(max_entries=args.entries + 1, ttl_s=1e9))
    ns, answer = ("default", "m"), Answer("x", "stop", 1)
    t0 = time.perf_counter()
    vectors = _vectors(args.entries)
    for i, v in enumerate(vectors):          # stored with precomputed vectors: embedding 100k texts takes minutes
        cache.store(Query(ns, "ctx", f"question {i}", v), answer)
    fill = time.perf_counter() - t0
    assert len(cache) == args.entries and DIM == vectors.shape[1]
    questions = [line for line in (json.loads(s)["a"] for s in PAIRS.read_text().splitlines())][:args.queries]
    embed_t, total_t = [], []
    for q in questions * max(1, args.queries // len(questions)):
        t0 = time.perf_counter()
        cache.embedder.embed([q])
        embed_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        cache.lookup(Query(ns, "ctx", q))
        total_t.append(time.perf_counter() - t0)
    search = [t - e for t, e in zip(total_t, embed_t)]
    res = {"entries": args.entries, "fill_s": fill, "lookups": len(total_t),
           "lookup_p50_ms": 1e3 * pct(total_t, 50), "lookup_p99_ms": 1e3 * pct(total_t, 99),
           "embed_p50_ms": 1e3 * pct(embed_t, 50), "embed_p99_ms": 1e3 * pct(embed_t, 99),
           "search_p99_ms_est": 1e3 * pct(search, 99)}
    print(f"{args.entries:,} entries (filled in {fill:.1f} s); lookup p50 {res['lookup_p50_ms']:.2f} ms, "
          f"p99 {res['lookup_p99_ms']:.2f} ms; of which embedding p50 {res['embed_p50_ms']:.2f} / p99 "
          f"{res['embed_p99_ms']:.2f} ms, search (lookup - embed) p99 ≈ {res['search_p99_ms_est']:.2f} ms")
    return res


def serve(args) -> dict:
    """runtime serve --semantic-cache; the openai client streams: a new question (generated), the same again
    (exact hit), a paraphrase (semantic hit); TTFT of each, rounds alternating over distinct questions."""
    import httpx
    from openai import OpenAI

    pairs = [json.loads(s) for s in PAIRS.read_text().splitlines() if s.strip()]
    firsts = {}
    for p in pairs:                 # one pair per question: a question asked twice is a hit the first time
        if p["paraphrase"]:
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
    ap.add_argument("what", choices=["threshold", "index", "lookup", "serve"])
    ap.add_argument("engine", nargs="?", type=Path, help="serve: the engine to serve")
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=30, help="serve: distinct questions")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = {"index": index, "threshold": threshold, "lookup": lookup, "serve": serve}[args.what](args)
    path = args.json or RESULTS / f"semantic_cache_{args.what}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
