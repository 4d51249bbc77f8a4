"""Semantic cache: answer a repeated or near-duplicate request from an earlier answer, without generating.

Two layers, both keyed by a namespace (tenant, model: one tenant never sees another's answers) and a context key
(everything besides the question that shapes the answer: sampling parameters, constraint, system prompt and
earlier turns, as a hash):

- exact: the same question text → the answer (a dict lookup, no embedding);
- semantic: the embedding proposes, a verifier decides. The question's sentence embedding (runtime.server.embedder)
  is searched in an HNSW index (hnswlib, chosen by `tools/bench_semantic_cache.py index`) of earlier questions;
  of the CANDIDATES nearest, those with the same context key and a cosine ≥ the threshold are candidates. A
  candidate that is a near miss of the question (runtime.server.near_miss: other numbers, code, quotes, negation,
  a swapped direction or slot) is turned down; the VERIFIED most similar of the rest go to the verifier
  (runtime.server.verifier, a pair classifier reading both questions), and the most similar it accepts is the hit.
  Misses cost no verification unless a candidate passed the embedding threshold. Only short questions
  (≤ SEMANTIC_MAX_TOKENS word pieces and SEMANTIC_MAX_CHARS characters) take part: a long text's embedding is dominated by what two texts share (or
  cut at the model's 256 tokens), so long prompts are matched exactly or not at all.

Entries live `ttl_s` and at most `max_entries` are kept (expired entries go first, then the least recently used;
an index label freed by either is reused for the next vector). Thread-safe: the servers call it from worker
threads.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from .embedder import DIM, Embedder
from . import near_miss
from .verifier import Verifier

DEFAULT_THRESHOLD = 0.80      # embedding cosine that makes a candidate (the near-miss rules and verifier decide)
VERIFY_THRESHOLD = 0.2        # the verifier's P(same question) that accepts one (tools/bench_semantic_cache.py)
CANDIDATES = 8                # nearest questions examined for one with the same context key
VERIFIED = 2                  # most candidates the verifier reads for one lookup (the most similar first)
SEMANTIC_MAX_TOKENS = 64      # longer questions are cached and matched exactly only
SEMANTIC_MAX_CHARS = 1024     # so are longer texts (a 100-character "word" is one [UNK] word piece)


@dataclass(frozen=True)
class CacheSettings:
    threshold: float = DEFAULT_THRESHOLD
    verify_threshold: float = VERIFY_THRESHOLD
    ttl_s: float = 600.0
    max_entries: int = 10_000

    def __post_init__(self):
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"semantic cache threshold {self.threshold} is not a cosine similarity in (0, 1]")
        if not 0.0 <= self.verify_threshold <= 1.0:
            raise ValueError(f"semantic cache verify threshold {self.verify_threshold} is not a probability")
        if self.ttl_s <= 0 or self.max_entries < 1:
            raise ValueError("semantic cache ttl and size must be positive")


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str
    completion_tokens: int
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Hit:
    answer: Answer
    kind: str                 # "exact" or "semantic"
    similarity: float
    verifier_score: float | None = None     # the verifier's probability that both questions ask the same

    def describe(self) -> str:
        """The x-quicksilver-cache value of a hit."""
        if self.kind == "exact":
            return "hit; exact"
        return f"hit; semantic; similarity={self.similarity:.3f}; verifier={self.verifier_score:.3f}"

    def usage(self) -> dict:
        """The usage field's `semantic_cache` object."""
        return {"hit": self.kind, "similarity": round(self.similarity, 4),
                "verifier_score": None if self.verifier_score is None else round(self.verifier_score, 4)}


@dataclass
class Query:
    """One request's lookup key; `vector` is filled by the semantic layer and reused when the answer is stored."""
    namespace: tuple[str, str]    # (tenant, model)
    context: str                  # hash of what besides the question shapes the answer
    question: str
    vector: np.ndarray | None = None
    rejected: list[str] = field(default_factory=list)   # why candidates were turned down (near_miss.reason, "verifier")


@dataclass
class _Entry:
    label: int | None             # its vector's label in the namespace's index; None: exact layer only
    namespace: tuple[str, str]
    context: str
    question: str
    answer: Answer
    expires: float


@dataclass
class _Index:
    """One namespace's HNSW index; labels are reused after deletion."""
    index: object
    capacity: int
    free: list[int] = field(default_factory=list)
    next_label: int = 0


class SemanticCache:
    def __init__(self, settings: CacheSettings = CacheSettings(), embedder: Embedder | None = None,
                 verifier: Verifier | None = None, clock=time.monotonic):
        if importlib.util.find_spec("hnswlib") is None:     # at startup, not on the first request
            raise FileNotFoundError("the semantic cache needs the package 'hnswlib': pip install '.[semantic-cache]'")
        self.settings, self.clock = settings, clock
        self.embedder = embedder or Embedder()
        self.verifier = verifier or Verifier()
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()   # (namespace, context, question) → entry, LRU
        self._by_label: dict[tuple, tuple] = {}                     # (namespace, label) → entry key
        self._expiry: deque[tuple[float, tuple, _Entry]] = deque()  # insertion order = expiry order (one TTL)
        self._indexes: dict[tuple[str, str], _Index] = {}
        self._per_model: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, q: Query) -> Hit | None:
        """An answer for this question, or None (a miss). Embeds a short question on a miss of the exact layer."""
        now = self.clock()
        key = (q.namespace, q.context, q.question)
        with self._lock:
            self._expire(now)
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return Hit(entry.answer, "exact", 1.0)
            if q.namespace not in self._indexes:
                return None
        if not self._semantic(q.question):
            return None
        q.vector = self.embedder.embed([q.question])[0]      # outside the lock: ONNX Runtime releases the GIL
        with self._lock:
            idx = self._indexes[q.namespace]
            live = idx.next_label - len(idx.free)
            if live <= 0:
                return None
            labels, distances = idx.index.knn_query(q.vector, k=min(CANDIDATES, live))
            candidates = []
            for label, distance in zip(labels[0], distances[0]):
                found = self._by_label.get((q.namespace, int(label)))
                entry = self._entries.get(found) if found else None
                similarity = 1.0 - float(distance)           # hnswlib's "ip" space: distance = 1 - dot
                if entry is not None and entry.context == q.context and similarity >= self.settings.threshold:
                    candidates.append((similarity, found, entry))
        return self._verified(q, sorted(candidates, key=lambda c: -c[0]))

    def _semantic(self, question: str) -> bool:
        """Whether a question takes part in the semantic layer (short in characters and in word pieces)."""
        return len(question) <= SEMANTIC_MAX_CHARS and self.embedder.count_tokens(question) <= SEMANTIC_MAX_TOKENS

    def _verified(self, q: Query, candidates: list) -> Hit | None:
        """The most similar candidate that is no near miss of the question (runtime.server.near_miss) and that the
        verifier accepts, or None. Verified one at a time, most similar first, outside the lock; at most VERIFIED
        (a hit usually costs one verification). Each turned-down candidate's reason goes in q.rejected."""
        verified = 0
        for similarity, key, entry in candidates:
            why = near_miss.reason(q.question, entry.question)
            if why is not None:
                q.rejected.append(why)
                continue
            if verified == VERIFIED:
                break
            verified += 1
            score = self.verifier.score(q.question, entry.question, enough=self.settings.verify_threshold)
            if score >= self.settings.verify_threshold:
                with self._lock:
                    if self._entries.get(key) is entry:
                        self._entries.move_to_end(key)
                return Hit(entry.answer, "semantic", similarity, score)
            q.rejected.append("verifier")
        return None

    def store(self, q: Query, answer: Answer) -> None:
        """Keep this answer for the question (replacing an equal question's): expired entries go first, then the
        least recently used while the cache is full."""
        vector = q.vector
        if vector is None and self._semantic(q.question):
            vector = self.embedder.embed([q.question])[0]
        now = self.clock()
        key = (q.namespace, q.context, q.question)
        with self._lock:
            if key in self._entries:
                self._drop(key)
            self._expire(now)
            while len(self._entries) >= self.settings.max_entries:
                self._drop(next(iter(self._entries)))
            label = self._add_vector(q.namespace, vector) if vector is not None else None
            entry = _Entry(label, q.namespace, q.context, q.question, answer, now + self.settings.ttl_s)
            self._entries[key] = entry
            self._expiry.append((entry.expires, key, entry))
            self._per_model[q.namespace[1]] += 1
            if label is not None:
                self._by_label[(q.namespace, label)] = key

    def count(self, model: str) -> int:
        """Entries answering for this model (all tenants): the entries gauge."""
        return self._per_model[model]

    def _expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            _, key, entry = self._expiry.popleft()
            if self._entries.get(key) is entry:          # not replaced or evicted since
                self._drop(key)

    def _add_vector(self, namespace, vector: np.ndarray) -> int:
        """Index the vector under a free label (hnswlib un-deletes a deleted label's slot and overwrites its
        vector in place, so labels and slots stay one to one) or a new one."""
        idx = self._indexes.get(namespace) or self._new_index(namespace)
        if idx.free:
            label = idx.free.pop()
        else:
            if idx.next_label >= idx.capacity:
                idx.capacity *= 2
                idx.index.resize_index(idx.capacity)
            label, idx.next_label = idx.next_label, idx.next_label + 1
        idx.index.add_items(vector[None], [label])
        return label

    def _new_index(self, namespace) -> _Index:
        import hnswlib

        capacity = min(1024, self.settings.max_entries)
        index = hnswlib.Index(space="ip", dim=DIM)
        index.init_index(max_elements=capacity, ef_construction=100, M=16)
        index.set_ef(64)
        index.set_num_threads(1)
        self._indexes[namespace] = idx = _Index(index, capacity)
        return idx

    def _drop(self, key) -> None:
        entry = self._entries.pop(key)
        self._per_model[entry.namespace[1]] -= 1
        if entry.label is not None:
            del self._by_label[(entry.namespace, entry.label)]
            idx = self._indexes[entry.namespace]
            idx.index.mark_deleted(entry.label)
            idx.free.append(entry.label)

def query_for(body: dict, chat: bool, params, n: int, tenant: str, model: str) -> Query | None:
    """The cache key of an OpenAI request body, or None when it is not cacheable (see `bypassed`; also a
    token-id prompt, or a chat whose last message is not the user's text). The question is the prompt
    (completions) or the last user message (chat); the earlier messages, tools, response format and sampling
    parameters make the context."""
    asked = body.get("semantic_cache")
    if bypassed(asked, n, params) or body.get("echo") or body.get("tools"):
        return None
    if chat:
        messages = body.get("messages")
        last = messages[-1] if isinstance(messages, list) and messages else None
        if not isinstance(last, dict) or last.get("role") != "user":
            return None
        content = last.get("content")
        if isinstance(content, list):     # content parts: the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str) or not content:
            return None
        # the earlier messages, the last one's other fields (a template may render its `name`), and whether the
        # client set a limit (without one a chat's max_tokens is the rest of the context, not `params`' default)
        limit = "given" if body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None \
            else "rest of context"
        question, context = content, [messages[:-1], {k: v for k, v in last.items() if k != "content"}, limit]
    else:
        prompt = body.get("prompt")
        prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt
        if not isinstance(prompt, str):
            return None
        question, context = prompt, None
    return _query(chat, question, context, params, tenant, model)


def query_for_text(text: str, asked: bool | None, params, tenant: str, model: str) -> Query | None:
    """The cache key of a text prompt (gRPC Generate), or None when it is not cacheable: the same key an HTTP
    completion of that prompt has, so both transports share answers."""
    if bypassed(asked, 1, params) or not text:
        return None
    return _query(False, text, None, params, tenant, model)


def bypassed(asked: bool | None, n: int, params) -> bool:
    """Whether a request must be generated: `semantic_cache` false, n > 1, logprobs, or sampled (temperature > 0)
    unless the request asks for the cache (`semantic_cache` true)."""
    if asked is not None and not isinstance(asked, bool):
        raise ValueError("semantic_cache must be true or false")
    return (asked is False or n != 1 or params.logprobs is not None
            or (params.temperature > 0 and asked is not True))


def _query(chat: bool, question: str, context, params, tenant: str, model: str) -> Query:
    digest = hashlib.sha256(json.dumps([chat, context, repr(params)], sort_keys=True, default=str).encode())
    return Query((tenant, model), digest.hexdigest(), question)
