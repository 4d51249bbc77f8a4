"""A semantic hit means the same question: every near-miss kind is turned down (by the near-miss rules or the
verifier, each checked on its own), paraphrases still hit, the verifier's score is reported, and gRPC answers from
the cache with HTTP's bypass rules. The cache before the verifier served each of these near misses (an embedding
reads them as near-identical); they run at a low embedding threshold so that every one reaches the checks."""

import asyncio

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.server import near_miss
from runtime.server.embedder import Embedder
from runtime.server.proto import quicksilver_pb2 as pb
from runtime.server.proto import quicksilver_pb2_grpc as pb_grpc
from runtime.server.semantic_cache import Answer, CacheSettings, Query, SemanticCache
from runtime.server.verifier import Verifier

from server_harness import ServerThread

NEAR_MISSES = [   # (kind, stored question, asked question, the rule that turns it down)
    ("direction", "How do I convert Celsius to Fahrenheit?", "How do I convert Fahrenheit to Celsius?", "direction"),
    ("direction", "Is Python faster than Java?", "Is Java faster than Python?", "direction"),
    ("direction", "How do I convert a list to a string?", "How do I convert a string to a list?", "direction"),
    ("word", "How do I sort a list in ascending order?", "How do I sort a list in descending order?",
     "substitution"),
    ("number", "Give me 3 ideas for a birthday party", "Give me 10 ideas for a birthday party", "literals"),
    ("number", "Write a 100-word story about a dragon", "Write a 500-word story about a dragon", "literals"),
    ("negation", "Is coffee good for your health?", "Is coffee not good for your health?", "negation"),
    ("negation", "Which animals can swim?", "Which animals cannot swim?", "negation"),
    ("entity", "What is the capital of France?", "What is the capital of Spain?", "substitution"),
    ("entity", "How do I reverse a list in Python?", "How do I reverse a list in JavaScript?", "substitution"),
    ("unit", "What is the distance to the Moon in miles?", "What is the distance to the Moon in kilometers?",
     "substitution"),
    ("unit", "How many megabytes are in a gigabyte?", "How many kilobytes are in a gigabyte?", "substitution"),
    ("code", 'What does "git reset --hard" do?', 'What does "git reset --soft" do?', "literals"),
    ("code", "What does `a[1:]` do in Python?", "What does `a[:1]` do in Python?", "literals"),
    ("quote", "How many uppercase letters are in 'Hello World'?", "How many uppercase letters are in 'hello world'?",
     "literals"),
    ("operator", "What is 12 / 4?", "What is 12 - 4?", "literals"),
    ("operator", "Is 5 ≥ 3?", "Is 5 ≤ 3?", "literals"),
    ("operator", "What is minus five squared?", "What is five squared?", "literals"),
    ("direction", "How do I convert Celsius to Fahrenheit?", "How do I get Celsius from Fahrenheit?", "direction"),
    ("negation", "Give me a vegetarian recipe", "Give me a non-vegetarian recipe", "negation"),
    ("qualifier", "Summarize the plot of Hamlet", "Summarize the plot of Hamlet in Spanish", "qualifier"),
    ("qualifier", "List the planets in order", "List the planets in reverse order", "qualifier"),
    ("case", "What is Polish?", "What is polish?", "case"),
    ("accent", "What is a pâte?", "What is a pate?", "substitution"),
    ("layout", "for i in range(3):\n    x = i\n    print(i)\nHow many lines does this print?",
     "for i in range(3):\n    x = i\nprint(i)\nHow many lines does this print?", "layout"),
]
PARAPHRASES = [("How do I reverse a list in Python?", "Reverse a Python list"),
               ("Who wrote Romeo and Juliet?", "Who is the author of Romeo and Juliet?"),
               ("What are the first 10 prime numbers?", "What are the first ten prime numbers?")]


@pytest.fixture(scope="module")
def models():
    return Embedder(), Verifier()


def ask(question):
    return Query(("default", "m"), "ctx", question)


@pytest.mark.parametrize("kind,stored,asked,rule", NEAR_MISSES, ids=[f"{k}-{i}" for i, (k, *_) in
                                                                     enumerate(NEAR_MISSES)])
def test_each_near_miss_kind_is_turned_down(models, kind, stored, asked, rule):
    cache = SemanticCache(CacheSettings(threshold=0.5), *models)
    cache.store(ask(stored), Answer("the stored question's answer", "stop", 5))
    q = ask(asked)
    assert cache.lookup(q) is None
    assert q.rejected == [rule]
    assert near_miss.reason(asked, stored) == rule          # either way round


def test_the_verifier_turns_down_what_the_rules_let_through(models):
    embedder, verifier = models
    stored, asked = "How do I show hidden files on a Mac?", "How do I hide files on a Mac?"
    assert near_miss.reason(stored, asked) is None
    cache = SemanticCache(CacheSettings(threshold=0.5), embedder, verifier)
    cache.store(ask(stored), Answer("defaults write …", "stop", 5))
    q = ask(asked)
    assert cache.lookup(q) is None and q.rejected == ["verifier"]
    assert verifier.score(asked, stored) < 0.05 and verifier.score(stored, asked) < 0.05


@pytest.mark.parametrize("stored,asked", PARAPHRASES)
def test_paraphrases_still_hit_with_the_verifiers_score(models, stored, asked):
    cache = SemanticCache(CacheSettings(), *models)
    answer = Answer("an answer", "stop", 3, (5, 6, 7))
    cache.store(ask(stored), answer)
    hit = cache.lookup(ask(asked))
    assert hit is not None and hit.kind == "semantic" and hit.answer == answer
    assert hit.similarity >= 0.8 and hit.verifier_score >= 0.2
    assert hit.describe() == (f"hit; semantic; similarity={hit.similarity:.3f}; "
                              f"verifier={hit.verifier_score:.3f}")


def test_the_first_order_that_accepts_decides_as_both_would(models):
    """score(enough=t) reads the second order only when the first is under t: the same side of t as reading both."""
    verifier = models[1]
    for stored, asked in PARAPHRASES + [(s, a) for _, s, a, _ in NEAR_MISSES]:
        both = verifier.score(asked, stored)
        for t in (0.05, 0.2, 0.5, 0.9):
            assert (verifier.score(asked, stored, enough=t) >= t) == (both >= t), (asked, stored, t)


def test_the_most_similar_accepted_candidate_wins(models):
    cache = SemanticCache(CacheSettings(threshold=0.5), *models)
    cache.store(ask("How do I reverse a list in JavaScript?"), Answer("js", "stop", 1))
    cache.store(ask("How do I reverse a list in Python?"), Answer("py", "stop", 1))
    q = ask("Reverse a Python list")
    assert cache.lookup(q).answer.text == "py"


def test_unpadded_verification_matches_the_graph_as_exported(models):
    """The verifier drops the export's fixed 256-token padding (a tenth of the cost): its decisions stay those of
    the padded graph, its probabilities within 0.15 (the int8 graph quantizes activations per tensor, so padding
    moves them; the threshold was chosen on the unpadded scores, which are what runs)."""
    import numpy as np
    import onnxruntime as ort

    from runtime.server.embedder import packaged_file
    from runtime.server.semantic_cache import VERIFY_THRESHOLD
    from runtime.server.verifier import JUDGE, _readout

    verifier = models[1]
    padded = ort.InferenceSession(str(packaged_file(*JUDGE.model)), providers=["CPUExecutionProvider"])
    for a, b in PARAPHRASES + [(s, q) for _, s, q, _ in NEAR_MISSES[:4]]:
        enc = verifier.tokenizer.encode(a, b)
        n = len(enc.ids)
        feed = {k: np.zeros((1, 256), np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}
        feed["input_ids"][0, :n], feed["attention_mask"][0, :n], feed["token_type_ids"][0, :n] = \
            enc.ids, 1, enc.type_ids
        before = _readout(padded.run(None, feed)[0], JUDGE.same_class)[0]
        now = _readout(verifier._logits([(a, b)]), JUDGE.same_class)[0]
        assert abs(before - now) <= 0.15 and (before >= VERIFY_THRESHOLD) == (now >= VERIFY_THRESHOLD), (a, b)


words = st.sampled_from("how do i sort list reverse file python java the a to from in of convert".split())


@settings(max_examples=300, deadline=None)
@given(st.lists(words, min_size=1, max_size=12), st.integers(0, 999), st.integers(0, 999))
def test_near_miss_rules_are_symmetric_and_numbers_always_count(ws, m, n):
    text = " ".join(ws)
    assert near_miss.reason(text, text) is None
    a, b = f"{text} {m}", f"{text} {n}"
    assert (near_miss.reason(a, b) is None) == (m == n) == (near_miss.reason(b, a) is None)
    other = " ".join(reversed(ws))
    assert (near_miss.reason(text, other) is None) == (near_miss.reason(other, text) is None)


# -- gRPC serves from the cache, with HTTP's bypass rules -------------------------------------------------------

@pytest.fixture(scope="module")
def server(engine):
    s = ServerThread(engine("llama"), semantic_cache=CacheSettings(ttl_s=600, max_entries=100))
    yield s
    s.stop()


def generate(server, text=None, ids=None, **sampling):
    """(responses, initial metadata) of one Generate call."""
    semantic = sampling.pop("semantic_cache", None)

    async def call():
        async with grpc.aio.insecure_channel(server.grpc_target) as ch:
            req = pb.GenerateRequest(sampling=pb.SamplingParams(**{"max_tokens": 8, "temperature": 0, **sampling}))
            if text is not None:
                req.text = text
            else:
                req.token_ids.ids.extend(ids)
            if semantic is not None:
                req.semantic_cache = semantic
            stream = pb_grpc.GenerationStub(ch).Generate(req)
            out = [m async for m in stream]
            return out, dict(await stream.initial_metadata())
    return asyncio.run(call())


def test_grpc_answers_from_the_cache_and_bypasses_like_http(server):
    first, meta = generate(server, "How do I reverse a list in Python?")
    assert meta["x-quicksilver-cache"] == "miss" and not first[-1].HasField("cache")
    text = "".join(m.text for m in first)
    ids = [t for m in first for t in m.token_ids]
    again, meta = generate(server, "How do I reverse a list in Python?")
    assert meta["x-quicksilver-cache"] == "hit; exact" and len(again) == 1
    assert again[0].text == text and list(again[0].token_ids) == ids
    assert again[0].cache.kind == "exact" and not again[0].cache.HasField("verifier_score")
    assert again[0].finish_reason == first[-1].finish_reason
    near, meta = generate(server, "Reverse a Python list")
    how = meta["x-quicksilver-cache"]
    assert how.startswith("hit; semantic; similarity=0.96") and how.endswith("; verifier=1.000"), how
    assert near[0].text == text and near[0].cache.kind == "semantic" and near[0].cache.verifier_score > 0.9
    for other in ("How do I reverse a list in Python 3?", "How do I reverse a list in Python 2?"):   # cosine 0.98
        swapped, meta = generate(server, other)
        assert meta["x-quicksilver-cache"] == "miss" and not swapped[-1].HasField("cache")
    for kwargs, why in (({"temperature": 0.8}, "sampled"), ({"semantic_cache": False}, "asked not to"),
                        ({"logprobs": 1}, "logprobs")):
        out, meta = generate(server, "How do I reverse a list in Python?", **kwargs)
        assert meta["x-quicksilver-cache"] == "bypass" and not out[-1].HasField("cache"), why
    out, meta = generate(server, ids=[1, 2, 3])
    assert meta["x-quicksilver-cache"] == "bypass"                            # token ids: no text
    assert server.metric("quicksilver_semantic_cache_candidates_total", result="verified") == 1
    # "… Python 3?" against the stored question, "… Python 2?" against it and "… Python 3?" (stored as a miss)
    assert server.metric("quicksilver_semantic_cache_candidates_total", result="literals") == 3


def test_serve_options_build_the_cache_settings():
    from runtime.cli import _cache_settings
    from runtime.server.semantic_cache import DEFAULT_THRESHOLD, VERIFY_THRESHOLD

    assert _cache_settings(True, None, None, 30.0, 7) == CacheSettings(
        threshold=DEFAULT_THRESHOLD, verify_threshold=VERIFY_THRESHOLD, ttl_s=30.0, max_entries=7)
    assert _cache_settings(True, 0.9, 0.6, 600.0, 10) == CacheSettings(0.9, 0.6, 600.0, 10)
    assert _cache_settings(False, None, None, 600.0, 10) is None
    with pytest.raises(SystemExit):
        _cache_settings(False, None, 0.5, 600.0, 10)            # a threshold without the cache is a mistake


@pytest.mark.parametrize("a,b,rule", [
    ("Why doesn’t my code compile", "Why does my code compile", "negation"),           # a curly apostrophe
    ("Why haven't my changes been saved to disk yet", "Why have my changes been saved to disk yet", "negation"),
    ("How to convert Celsius to Fahrenheit", "Convert Fahrenheit to Celsius", "direction"),   # not the first "to"
])
def test_near_miss_rules_read_every_spelling_and_marker(a, b, rule):
    assert near_miss.reason(a, b) == rule and near_miss.reason(b, a) == rule


@pytest.mark.parametrize("a,b", [
    ("what is the capital of france", "What is the capital of France?"),      # a text in one case says nothing
    ("Convert Celsius to Fahrenheit", "Convert from Celsius to Fahrenheit"),  # the same direction, spelt out
    ("How do I restart nginx?", "Restart the nginx server"),                   # added words that only spell it out
    ("How do I make a shallow copy of a list?", "How to shallow-copy a list"),  # a hyphen in a word is no minus
])
def test_near_miss_rules_let_paraphrases_through(a, b):
    assert near_miss.reason(a, b) is None and near_miss.reason(b, a) is None


def test_long_texts_stay_out_of_the_semantic_layer(models):
    """A text over SEMANTIC_MAX_CHARS is matched exactly only, however few word pieces it has (a long run of
    characters is one [UNK]): two different ones are not candidates for each other, and no rule scans them."""
    from runtime.server.semantic_cache import SEMANTIC_MAX_CHARS

    cache = SemanticCache(CacheSettings(threshold=0.5), *models)
    first, second = "x" * (SEMANTIC_MAX_CHARS + 1), "y" * (SEMANTIC_MAX_CHARS + 1)
    assert models[0].count_tokens(first) <= 4
    cache.store(ask(first), Answer("a", "stop", 1))
    assert cache.lookup(ask(first)).kind == "exact"
    q = ask(second)
    assert cache.lookup(q) is None and q.rejected == [] and q.vector is None


def test_a_hit_counts_against_the_callers_tenant_limits(engine):
    from runtime.server.tenants import Tenant

    carol = Tenant("carol", "key-carol-0001", requests_per_minute=2)
    s = ServerThread(engine("llama"), semantic_cache=CacheSettings(), tenants=(carol,))
    try:
        import httpx

        def ask_http():
            return httpx.post(f"{s.http_url}/v1/completions", headers={"Authorization": f"Bearer {carol.key}"},
                              json={"prompt": "Who wrote Hamlet?", "max_tokens": 4, "temperature": 0}, timeout=60)
        assert ask_http().headers["x-quicksilver-cache"] == "miss"
        assert ask_http().headers["x-quicksilver-cache"] == "hit; exact"
        third = ask_http()                     # would be a hit: refused like a generated request
        assert third.status_code == 429 and "requests_per_minute" in third.json()["error"]["message"]
        assert s.metric("quicksilver_tenant_requests_total", tenant="carol", outcome="admitted") == 2
        assert s.metric("quicksilver_tenant_requests_total", tenant="carol", outcome="rate_limited") == 1
    finally:
        s.stop()


def test_a_grpc_hit_checks_the_request_id_as_a_generated_request_would(server):
    generate(server, "What is the tallest mountain?")                   # stored
    with pytest.raises(grpc.RpcError) as e:
        async def call():
            async with grpc.aio.insecure_channel(server.grpc_target) as ch:
                req = pb.GenerateRequest(text="What is the tallest mountain?", request_id="r" * 300,
                                         sampling=pb.SamplingParams(max_tokens=8, temperature=0))
                return [m async for m in pb_grpc.GenerationStub(ch).Generate(req)]
        asyncio.run(call())
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.value.details()
