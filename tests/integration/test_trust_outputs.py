"""Answers that are right or say they are not (#45): a constraint the grammar engine cannot build is a 400 /
INVALID_ARGUMENT every time (never an empty "stop" served as success), sampling options left out take the model's
generation_config.json on every transport, and streamed log-probabilities have one entry per token."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from runtime.client import Client

from server_harness import ServerThread

EXPLODING_SCHEMA = {"type": "string", "pattern": "^b{1000000}$"}


@pytest.fixture(scope="module")
def server(bundled):
    s = ServerThread(bundled["target"])
    yield s
    s.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_the_grammar_engine_cannot_build_is_a_400_every_time(server, stream):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": EXPLODING_SCHEMA}}}
    for _ in range(3):            # the first, and again once anything could have been cached
        r = httpx.post(f"{server.http_url}/v1/chat/completions", timeout=60, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert "cannot be built" in error["message"] and "<state>" not in error["message"]
        assert len(error["message"]) < 400


def test_a_regex_the_grammar_engine_cannot_build_is_invalid_argument_over_grpc(server):
    client = Client(server.grpc_target)
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as e:
            list(client.generate("x = ", max_tokens=8, constraint={"regex": "a{1000000}"}))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "cannot be built" in e.value.details() and len(e.value.details()) < 400


def test_a_buildable_constraint_still_constrains(server):
    r = httpx.post(f"{server.http_url}/v1/completions", timeout=60,
                   json={"prompt": "x = ", "max_tokens": 8, "temperature": 0, "response_format": {
                       "type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": ["yes", "no"]}}}})
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["choices"][0]["text"]) in ("yes", "no")


def test_a_grammar_failing_mid_generation_ends_its_request_with_an_error(bundled):
    """The grammar engine giving up after some tokens (its lexer budget runs out: injected here, since a grammar
    that passes the build-time probes and fails later is not reproducible on demand) ends that request with
    finish "error" and the reason; the others in the same steps finish normally; the compiled grammar is
    forgotten; no KV is left behind."""
    from runtime.config import CacheConfig, EngineConfig, SchedulerConfig
    from runtime.constraints import Constraint, GrammarFailed, Matcher
    from runtime.engine import Engine
    from runtime.request import SamplingParams

    from test_engine import assert_no_leaks

    eng = Engine(bundled["target"], EngineConfig(SchedulerConfig(max_num_seqs=4), CacheConfig(kv_budget_bytes=64 << 20)))
    constraint = Constraint("regex", "[a-z ]{1,40}")
    doomed = eng.add_request("x = ", SamplingParams(max_tokens=30, constraint=constraint))
    fine = eng.add_request("y = ", SamplingParams(max_tokens=30, constraint=constraint))
    plain = eng.add_request("def f(x):", SamplingParams(max_tokens=12, ignore_eos=True))
    matcher, calls = eng._matchers[doomed.request_id], [0]
    original = Matcher._allowed

    def fails_third(out):
        calls[0] += 1
        if calls[0] == 3:
            raise GrammarFailed("the constraint could not be followed: lexer error: too many expressions constructed")
        original(matcher, out)

    matcher._allowed = fails_third
    outs = {}
    while eng.has_work():
        for out in eng.step():
            outs.setdefault(out.request_id, []).append(out)
    last = {rid: o[-1] for rid, o in outs.items()}
    assert last[doomed.request_id].finish_reason == "error"
    assert "lexer error" in last[doomed.request_id].error
    assert sum(len(o.token_ids) for o in outs[doomed.request_id]) == 2
    assert last[fine.request_id].finish_reason in ("stop", "length") and last[fine.request_id].error is None
    assert last[plain.request_id].finish_reason == "length"
    assert constraint not in eng.grammars._compiled
    assert_no_leaks(eng)


def bundled_default_output(bundled, prompt: str, max_tokens: int) -> str:
    """The in-process engine with the model's generation_config.json options spelled out (greedy, repetition
    penalty 1.3 for the bundled target)."""
    from runtime.config import CacheConfig, EngineConfig, SchedulerConfig
    from runtime.engine import Engine
    from runtime.request import SamplingParams, generation_defaults

    defaults = generation_defaults(bundled["target"])
    assert defaults["temperature"] == 0.0 and defaults["repetition_penalty"] == 1.3
    eng = Engine(bundled["target"], EngineConfig(SchedulerConfig(max_num_seqs=1), CacheConfig(kv_budget_bytes=64 << 20)))
    return eng.generate([prompt], SamplingParams(max_tokens=max_tokens, **defaults))[0]["text"]


def test_http_requests_that_leave_sampling_out_take_the_models_defaults(server, bundled):
    """README's own request: the same text every time, the model's greedy-with-penalty text (was: temperature 1.0,
    different random text each run)."""
    want = bundled_default_output(bundled, "def add(a, b):", 32)
    texts = {httpx.post(f"{server.http_url}/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 32},
                        timeout=60).json()["choices"][0]["text"] for _ in range(3)}
    assert texts == {want}
    chat = {"messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 24}
    replies = {httpx.post(f"{server.http_url}/v1/chat/completions", json=chat, timeout=60).json()
               ["choices"][0]["message"]["content"] for _ in range(3)}
    assert len(replies) == 1
    # an option the caller gives wins over the model's
    r = httpx.post(f"{server.http_url}/v1/completions", timeout=60,
                   json={"prompt": "def add(a, b):", "max_tokens": 32, "repetition_penalty": 1.0})
    assert r.json()["choices"][0]["text"] != want


def test_grpc_requests_that_leave_sampling_out_take_the_models_defaults(server, bundled):
    want = bundled_default_output(bundled, "def add(a, b):", 32)
    client = Client(server.grpc_target)
    got = "".join(r.text for r in client.generate("def add(a, b):", max_tokens=32))
    assert got == want


def test_options_left_out_fall_back_to_openai_defaults_where_the_model_has_none():
    from runtime.request import SamplingParams
    from runtime.server.http_server import sampling_from_json

    params, _ = sampling_from_json({"prompt": "x"}, chat=False)
    assert params.resolve({}).temperature == 1.0                       # OpenAI's default
    assert params.resolve({"temperature": 0.0}).temperature == 0.0     # the model's
    given, _ = sampling_from_json({"prompt": "x", "temperature": 0.7}, chat=False)
    assert given.resolve({"temperature": 0.0}).temperature == 0.7      # the caller's
    assert SamplingParams(temperature=0.5).resolve({"temperature": 0.0}).temperature == 0.5   # nothing left out


def test_runtime_generate_takes_the_models_defaults_too(bundled):
    import subprocess
    import sys
    from pathlib import Path

    want = bundled_default_output(bundled, "def add(a, b):", 32)
    r = subprocess.run([sys.executable, "-c", "from runtime.cli import main; main()", "generate", str(bundled["target"]),
                        "--max-tokens", "32", "def add(a, b):"], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr
    assert r.stdout == "def add(a, b):" + want + "\n"


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_logprobs_have_one_entry_per_token(server, chat):
    """Tokens biased to bytes that end inside a UTF-8 character (their text comes out with a later token) still
    get their log-probability entries as they are generated: streamed, as many as the whole response gives, and
    completions' text_offset filled and within the text."""
    body = {"max_tokens": 9, "temperature": 0, "logit_bias": {"143": 100, "235": 100}}
    if chat:
        body |= {"messages": [{"role": "user", "content": "x = "}], "logprobs": True, "top_logprobs": 1}
        path = "/v1/chat/completions"
    else:
        body |= {"prompt": "x = ", "logprobs": 1}
        path = "/v1/completions"
    whole = httpx.post(f"{server.http_url}{path}", json=body, timeout=60).json()
    streamed, text = [], ""
    with httpx.stream("POST", f"{server.http_url}{path}", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                lp = choice.get("logprobs")
                if lp:
                    streamed.append(lp)
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    if chat:
        want = whole["choices"][0]["logprobs"]["content"]
        got = [entry for lp in streamed for entry in lp["content"]]
        assert len(want) == whole["usage"]["completion_tokens"] == 9
        assert [(e["token"], e["logprob"]) for e in got] == [(e["token"], e["logprob"]) for e in want]
        return
    want = whole["choices"][0]["logprobs"]
    assert len(want["tokens"]) == whole["usage"]["completion_tokens"] == 9
    assert [t for lp in streamed for t in lp["tokens"]] == want["tokens"]
    assert [v for lp in streamed for v in lp["token_logprobs"]] == want["token_logprobs"]
    offsets = [o for lp in streamed for o in lp["text_offset"]]
    assert offsets == want["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] <= len(text) == len(whole["choices"][0]["text"])


def test_text_offsets_do_not_move_when_a_stop_string_holds_text(server):
    """A stop string that might begin where the text stands holds that text back until it cannot; the offsets
    counted only reported text, so the tokens after a held one got offsets too early (0, 0, 5 … for 0, 2, 5 …)."""
    body = {"prompt": "x = ", "max_tokens": 8, "temperature": 0, "logprobs": 0}
    plain = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert len(plain["text"]) >= 3
    stop = plain["text"][:3] + "\u2603never"                         # matches the text's start, then never
    held = httpx.post(f"{server.http_url}/v1/completions", json={**body, "stop": [stop]}, timeout=60).json()
    held = held["choices"][0]
    assert held["text"] == plain["text"]
    assert held["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]
    offsets = plain["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] < len(plain["text"])
