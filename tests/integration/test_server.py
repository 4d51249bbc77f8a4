"""Real servers on 127.0.0.1: gRPC and HTTP behave like the in-process engine, fail cleanly on bad input,
cancel, shed, honour deadlines, authenticate, speak TLS, report metrics and shut down gracefully."""

import asyncio
import concurrent.futures
import json
import math
import random
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from runtime.client import Client
from runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from runtime.engine import Engine
from runtime.request import SamplingParams
from runtime.spec_decode.speculator import SpecConfig

from server_harness import ServerThread

PROMPT = "def main(argv):\n    return"


@pytest.fixture(scope="module")
def server(engine):
    s = ServerThread(engine("llama"))
    yield s
    s.stop()


def test_grpc_stream_equals_engine(server, engine):
    want = Engine(engine("llama"), EngineConfig(cache=CacheConfig(kv_budget_bytes=32 << 20))).generate(
        [PROMPT], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    with Client(server.grpc_target) as c:
        msgs = list(c.generate(PROMPT, max_tokens=20, ignore_eos=True, temperature=0.0))
        assert c.tokenize("def x") == server.server.engine.tokenizer.encode("def x").ids
        info = c.model_info()
    assert [t for m in msgs for t in m.token_ids] == want["token_ids"]
    assert "".join(m.text for m in msgs) == want["text"]
    assert all(not m.finish_reason for m in msgs[:-1]) and msgs[-1].finish_reason == "length"
    assert msgs[-1].usage.completion_tokens == 20 and msgs[-1].usage.ttft_ms > 0
    assert info.model == "llama-fp32" and info.max_model_len == 512


def test_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True) if c.choices)
    assert done.choices[0].text == streamed and done.usage.completion_tokens == 12
    ids = list(range(400, 440))                 # 40 tokens no other test sends: the first request's slot is retained,
    first, again = (client.completions.create(model=model, prompt=ids, max_tokens=2) for _ in range(2))
    # so the repeat starts after all but the last two tokens (always computed), not after 2 whole 16-token blocks
    assert (first.usage.prompt_tokens_details.cached_tokens, again.usage.prompt_tokens_details.cached_tokens) == (0, 38)
    greedy = dict(temperature=0, extra_body={"ignore_eos": True})     # OpenAI's default samples at T=1: may stop early
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          **greedy)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5, stream=True, stream_options={"include_usage": True},
                                                 **greedy))
    assert chunks[-1].usage.completion_tokens == 5


BAD_GRPC = [
    (dict(prompt=""), "empty"), (dict(prompt="x" * 3000), "context"), (dict(prompt=[1, 2, 10**9]), "token ids"),
    (dict(temperature=-1.0), "temperature"), (dict(temperature=math.nan), "NaN"), (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-5), "max_tokens"), (dict(max_tokens=100000), "context"),
    (dict(stop=["s"] * 40), "stop"), (dict(stop=["x" * 1000]), "stop"), (dict(model="gpt-7"), "unknown model"),
    (dict(logit_bias={5: 500.0}), "logit_bias"), (dict(logit_bias={10**9: 1.0}), "logit_bias"),
]


@pytest.mark.parametrize("kwargs,needle", BAD_GRPC)
def test_grpc_bad_input(server, kwargs, needle):
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt", PROMPT)
    model = kwargs.pop("model", "")
    with Client(server.grpc_target) as c:
        with pytest.raises(grpc.RpcError) as err:
            list(c.generate(prompt, model=model, **kwargs))
        unknown = model != ""                     # a model the server does not serve: NOT_FOUND, as vLLM's 404
        want = grpc.StatusCode.NOT_FOUND if unknown else grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.code() == want and needle in err.value.details()
        assert len(list(c.generate(PROMPT, max_tokens=2))) >= 1          # still serving


def test_client_stop_string(server):
    """Client.generate(stop="ab") is one stop string, not the stops "a" and "b"."""
    with Client(server.grpc_target) as c:
        text = "".join(m.text for m in c.generate(PROMPT, max_tokens=40, temperature=0.0, ignore_eos=True))
        # A two-character stop whose second character occurs earlier: one-character stops would cut sooner.
        stop = next(text[i:i + 2] for i in range(1, len(text) - 1)
                    if text[i + 1] in text[:i] and text[i:i + 2] not in text[:i + 1])
        stopped = list(c.generate(PROMPT, max_tokens=40, temperature=0.0, ignore_eos=True, stop=stop))
    assert "".join(m.text for m in stopped) == text[:text.index(stop)] and stopped[-1].finish_reason == "stop"


def test_grpc_invalid_utf8(server):
    channel = grpc.insecure_channel(server.grpc_target)
    raw = channel.unary_stream("/quicksilver.v1.Generation/Generate", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as err:
        list(raw(b"\x12\x03\xff\xfe\xfd"))               # field `text` holding invalid UTF-8
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in err.value.details()
    channel.close()


BAD_HTTP = [
    (b"{not json", "not valid JSON"), (json.dumps({"prompt": ""}), "empty"),
    (json.dumps({"prompt": PROMPT, "temperature": -1}), "temperature"),
    (json.dumps({"prompt": PROMPT, "top_p": 0}), "top_p"), (json.dumps({"prompt": PROMPT, "max_tokens": 0}), "max_tokens"),
    (json.dumps({"prompt": PROMPT, "model": "gpt-7"}), "unknown model"),
    (json.dumps({"prompt": [1, 2, 10**9]}), "token ids"), (json.dumps({"prompt": PROMPT, "n": 17}), "n must be"),
    (json.dumps({"prompt": PROMPT, "n": 0}), "n must be"), (json.dumps({"prompt": PROMPT, "n": 2, "best_of": 3}), "best_of"),
    (json.dumps({"prompt": PROMPT, "max_tokens": 10**6}), "context"),
    (json.dumps({"prompt": PROMPT, "stop": ["x"] * 30}), "stop"),
    (b'{"prompt": "\xff\xfe"}', "not valid JSON"),
    (json.dumps({"prompt": PROMPT, "temperature": "hot"}), "temperature"),
    (json.dumps({"prompt": PROMPT, "best_of": 2}), "best_of"),
    (json.dumps({"prompt": PROMPT, "logit_bias": {"5": 500}}), "logit_bias"),
    (json.dumps({"prompt": PROMPT, "logit_bias": {"five": 1}}), "logit_bias"),
    (json.dumps({"prompt": PROMPT, "logit_bias": {"999999": 1}}), "logit_bias"),
    (json.dumps({"prompt": PROMPT, "logit_bias": [5]}), "logit_bias"),
    (json.dumps({"prompt": PROMPT, "echo": True, "logprobs": 1}), "echo"),
    (json.dumps({"prompt": PROMPT, "suffix": "end"}), "suffix"),
    (json.dumps({"prompt": PROMPT, "response_format": {"type": "xml"}}), "response_format"),
    (json.dumps({"prompt": PROMPT, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}}),
     "not a valid JSON Schema"),
    (json.dumps({"prompt": PROMPT, "response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "string", "pattern": "(?<=a)b"}}}}), "does not compile"),
    (json.dumps({"prompt": PROMPT, "tools": [{"type": "function", "function": {"name": "f"}}]}), "chat feature"),
    (json.dumps({"prompt": "\ud800"}), "lone UTF-16 surrogate"),
    (json.dumps({"prompt": PROMPT, "stop": ["\udfff"]}), "lone UTF-16 surrogate"),
    (json.dumps({"prompt": PROMPT, "stream": "yes"}), "stream must be true or false"),
    (json.dumps({"prompt": PROMPT, "echo": 1}), "echo must be true or false"),
    (json.dumps({"prompt": PROMPT, "ignore_eos": "false"}), "ignore_eos must be true or false"),
    (json.dumps({"prompt": PROMPT, "stream": True, "stream_options": {"include_usage": "yes"}}),
     "include_usage must be true or false"),
    # each of these was a 500: an integer past Python's 4,300 digits, one too large for a float, a NaN timeout
    (b'{"prompt": "x", "max_tokens": 2, "user": ' + b"9" * 4301 + b"}", "not valid JSON"),
    (json.dumps({"prompt": PROMPT, "temperature": 10**400}), "temperature"),
    (json.dumps({"prompt": PROMPT, "timeout": float("nan")}), "timeout"),
    (json.dumps({"prompt": PROMPT, "timeout": True}), "timeout"),
]


@pytest.mark.parametrize("body,needle", BAD_HTTP)
def test_http_bad_input(server, body, needle):
    r = httpx.post(f"{server.http_url}/v1/completions", content=body)
    want = (404, "not_found_error") if needle == "unknown model" else (400, "invalid_request_error")
    assert (r.status_code, r.json()["error"]["type"]) == want and needle in r.json()["error"]["message"]
    chat = httpx.post(f"{server.http_url}/v1/chat/completions", json={"messages": "nope"})
    assert chat.status_code == 400
    assert httpx.post(f"{server.http_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_http_errors_are_openai_json(server):
    """Every error is OpenAI's shape with a string code: unknown paths, wrong methods, bad input alike."""
    cases = [(httpx.get(f"{server.http_url}/v1/nothing"), 404, "not_found", "GET /v1/nothing: Not Found"),
             (httpx.get(f"{server.http_url}/v1/completions"), 405, "method_not_allowed",
              "GET /v1/completions: Method Not Allowed"),
             (httpx.post(f"{server.http_url}/v1/completions", json={"prompt": PROMPT, "stream": "yes"}), 400,
              "invalid_argument", "stream must be true or false")]
    for r, status, code, message in cases:
        assert (r.status_code, r.headers["content-type"]) == (status, "application/json")
        assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "code": code}}
    assert cases[1][0].headers["allow"] == "POST"
    chat = httpx.post(f"{server.http_url}/v1/chat/completions",
                      content=json.dumps({"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2}))
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "invalid_argument"


def test_logit_bias_and_echo(server):
    """logit_bias bans or forces tokens (HTTP and gRPC alike); echo puts the prompt before the completion."""
    url = f"{server.http_url}/v1/completions"
    base = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 0, "ignore_eos": True}
    tok = server.server.engine.tokenizer
    with Client(server.grpc_target) as c:
        plain = [t for m in c.generate(PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True) for t in m.token_ids]
        banned = [t for m in c.generate(PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True,
                                         logit_bias={plain[0]: -100.0}) for t in m.token_ids]
        msgs = list(c.generate(PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias={42: 100.0}))
    assert banned[0] != plain[0] and [t for m in msgs for t in m.token_ids] == [42] * 6
    banned_http = httpx.post(url, json={**base, "logit_bias": {str(plain[0]): -100}}).json()
    assert banned_http["choices"][0]["logprobs"]["tokens"] == [tok.decode([t]) for t in banned]
    forced = httpx.post(url, json={**base, "logit_bias": {"42": 100}}).json()
    assert forced["choices"][0]["logprobs"]["tokens"] == [tok.decode([42])] * 6
    whole = httpx.post(url, json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "echo": True}).json()
    alone = httpx.post(url, json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0}).json()
    assert whole["choices"][0]["text"] == PROMPT + alone["choices"][0]["text"]
    with httpx.stream("POST", url, json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "echo": True,
                                         "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["text"] == PROMPT
    assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]


def test_logprobs_carry_token_text(server):
    """OpenAI logprobs name tokens by their text (special tokens too), not by their ids as strings; chat adds each
    token's UTF-8 bytes, which rebuild the text even where a token holds part of a character (this random model
    emits such tokens)."""
    tok = server.server.engine.tokenizer
    with Client(server.grpc_target) as c:
        lps = [lp for m in c.generate(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
               for lp in m.logprobs]
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    done = httpx.post(f"{server.http_url}/v1/completions", json=body).json()["choices"][0]["logprobs"]
    text = lambda ids: tok.decode(ids, skip_special_tokens=False)                     # noqa: E731
    assert done["tokens"] == [text([lp.token_id]) for lp in lps]
    assert done["token_logprobs"] == pytest.approx([lp.logprob for lp in lps], abs=1e-6)
    assert done["top_logprobs"] == [pytest.approx({text([t.token_id]): t.logprob for t in lp.top}, abs=1e-6)
                                    for lp in lps]
    chat_body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0,
                 "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
    choice = httpx.post(f"{server.http_url}/v1/chat/completions", json=chat_body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    with Client(server.grpc_target) as c:
        prompt_ids = c.tokenize("user: " + PROMPT + "\nassistant:")
        chat_ids = [t for m in c.generate(prompt_ids, max_tokens=8, temperature=0.0, ignore_eos=True)
                    for t in m.token_ids]
    assert [e["token"] for e in content] == [text([t]) for t in chat_ids]
    assert b"".join(bytes(e["bytes"]) for e in content).decode(errors="replace") == text(chat_ids)
    assert all(bytes(top["bytes"]).decode(errors="replace") == top["token"] for e in content
               for top in e["top_logprobs"])
    assert [e["top_logprobs"][0]["token"] for e in content] == [e["token"] for e in content]     # greedy: the top one


def test_n_choices(server):
    """n choices: choice i is the request alone with seed + i; streamed chunks carry their index; the prompt is
    counted once and completions summed; hanging up mid-stream aborts every choice."""
    url = f"{server.http_url}/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3, "ignore_eos": True}
    whole = httpx.post(url, json=body).json()
    texts = [c["text"] for c in whole["choices"]]
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2] and len(set(texts)) > 1
    assert whole["usage"]["completion_tokens"] == 24 and whole["usage"]["prompt_tokens"] < 24
    for i, text in enumerate(texts):
        assert httpx.post(url, json={**body, "n": 1, "seed": 7 + i}).json()["choices"][0]["text"] == text
    with httpx.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = ["".join(e["choices"][0]["text"] for e in events if e["choices"] and e["choices"][0]["index"] == i)
                for i in range(3)]
    assert streamed == texts and events[-1]["usage"]["completion_tokens"] == 24
    hits = server.metric("quicksilver_prefix_cache_hits_tokens_total")
    httpx.post(url, json={**body, "prompt": list(range(200, 300))})           # 100 tokens: 6 full blocks
    assert server.metric("quicksilver_prefix_cache_hits_tokens_total") - hits >= 2 * 96    # choices 1, 2 reuse them
    chat = httpx.post(f"{server.http_url}/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2}).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    top = 2**63 - 1                                          # the largest seed: choice 1's wraps to 0, not a 400
    wrapped = httpx.post(url, json={**body, "n": 2, "seed": top}).json()["choices"]
    assert wrapped[1]["text"] == httpx.post(url, json={**body, "n": 1, "seed": 0}).json()["choices"][0]["text"]
    with httpx.stream("POST", url, json={**body, "n": 4, "max_tokens": 400, "stream": True}) as r:
        next(r.iter_lines())                                 # one event, then the client hangs up
    assert wait_until(lambda: server.metric("quicksilver_requests_running") == 0
                      and server.metric("quicksilver_kv_cache_usage_percent") == 0)


def test_chat_default_max_tokens_is_the_rest_of_the_context(server):
    """Without max_tokens a chat reply may fill the context, as OpenAI's (was: cut at 64 tokens)."""
    r = httpx.post(f"{server.http_url}/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}).json()
    u = r["usage"]
    assert r["choices"][0]["finish_reason"] == "length" and u["total_tokens"] == 512
    assert u["completion_tokens"] == 512 - u["prompt_tokens"] > 64


def test_refusals_count_as_errors_not_aborts(server):
    """Every refused request counts once in quicksilver_request_errors (refused by the transport, the bridge or the
    engine) and none counts as a finished abort."""
    def counts():
        return ({code: server.metric("quicksilver_request_errors_total", code=code)
                 for code in ("invalid_argument", "not_found", "method_not_allowed")},
                server.metric("quicksilver_requests_finished_total", finish_reason="abort"))

    errors, aborts = counts()
    url = f"{server.http_url}/v1/completions"
    assert httpx.post(url, json={"prompt": "x " * 600}).status_code == 400                  # engine: context
    assert httpx.post(url, json={"prompt": [1, 10**9]}).status_code == 400                  # engine: token id
    assert httpx.post(url, json={"prompt": PROMPT, "temperature": -1}).status_code == 400   # transport
    assert httpx.post(f"{server.http_url}/v1/nothing").status_code == 404
    assert httpx.get(url).status_code == 405
    with Client(server.grpc_target) as c:
        for kwargs in (dict(prompt="x " * 600), dict(prompt=PROMPT, temperature=-1.0)):
            with pytest.raises(grpc.RpcError):
                list(c.generate(**kwargs))
    after, aborts_after = counts()
    assert {k: after[k] - errors[k] for k in after} == {"invalid_argument": 5, "not_found": 1, "method_not_allowed": 1}
    assert aborts_after == aborts


def test_model_info_names_the_draft_without_its_path(engine):
    s = ServerThread(engine("llama"), EngineConfig(SchedulerConfig(max_num_seqs=2), CacheConfig(kv_budget_bytes=32 << 20),
                                                   draft=engine("llama"), speculation="draft"))
    try:
        with Client(s.grpc_target) as c:
            info = c.model_info()
        assert (info.draft_model, info.speculation) == ("llama-fp32", "draft")
    finally:
        s.stop()


def test_oversized_body(server):
    body = b'{"prompt": "' + b"x" * (2 << 20) + b'"}'
    r = httpx.post(f"{server.http_url}/v1/completions", content=body)
    assert r.status_code == 413
    # chunked, no length declared: met while it is read, still a 413 (the handler's InvalidRequest made it a 400)
    chunked = httpx.post(f"{server.http_url}/v1/completions", content=iter([body[:1 << 20], body[1 << 20:]]))
    assert chunked.status_code == 413 and "exceeds the limit" in chunked.json()["error"]["message"]


def wait_until(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_a_client_gone_before_its_choices_open_aborts_them_all(engine):
    """One slot, eight choices: each waits for the one before it. A client that hangs up while they queue aborts
    the ones still to come (finished with 'abort'), where the server ran all eight to their length for nobody.
    (The tiny model runs a choice's 480 tokens in ~0.15 s, so the first few may finish before the hang-up is seen.)"""
    s = ServerThread(engine("llama"), EngineConfig(SchedulerConfig(max_num_seqs=1, max_waiting=8),
                                                   CacheConfig(kv_budget_bytes=32 << 20)))
    finished = "quicksilver_requests_finished_total"
    try:
        lengths, aborts = (s.metric(finished, finish_reason=r) for r in ("length", "abort"))
        body = {"prompt": PROMPT, "max_tokens": 480, "temperature": 0.8, "seed": 3, "n": 8, "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{s.http_url}/v1/completions", json=body, timeout=0.1)      # then the client is gone
        assert wait_until(lambda: s.metric("quicksilver_requests_running") == 0
                          and s.metric("quicksilver_requests_waiting") == 0
                          and s.metric("quicksilver_kv_cache_usage_percent") == 0, timeout=30)
        ran = s.metric(finished, finish_reason="length") - lengths
        aborted = s.metric(finished, finish_reason="abort") - aborts
        assert ran + aborted == 8 and aborted >= 2, (ran, aborted)
    finally:
        s.stop()


def test_cancellation_frees_kv(server):
    with Client(server.grpc_target) as c:
        stream = c.generate(PROMPT, max_tokens=480, ignore_eos=True)
        next(stream)
        stream.close()                                       # client cancels
    assert wait_until(lambda: server.metric("quicksilver_requests_running") == 0
                      and server.metric("quicksilver_kv_cache_usage_percent") == 0)
    with httpx.stream("POST", f"{server.http_url}/v1/completions",
                      json={"prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "stream": True}) as r:
        next(r.iter_lines())                                 # HTTP client reads one event and hangs up
    assert wait_until(lambda: server.metric("quicksilver_requests_running") == 0
                      and server.metric("quicksilver_kv_cache_usage_percent") == 0)
    assert server.metric("quicksilver_requests_finished_total", finish_reason="abort") >= 2


def test_shedding_is_fast(engine):
    s = ServerThread(engine("llama"), EngineConfig(SchedulerConfig(max_num_seqs=1, max_waiting=1),
                                                   CacheConfig(kv_budget_bytes=32 << 20)))
    try:
        def one(_):
            t0 = time.monotonic()
            try:
                with Client(s.grpc_target) as c:
                    list(c.generate(PROMPT, max_tokens=300, ignore_eos=True))
                return "ok", time.monotonic() - t0, None
            except grpc.RpcError as e:
                return e.code().name, time.monotonic() - t0, dict(e.trailing_metadata() or ())
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(8)))
        shed = [r for r in results if r[0] == "RESOURCE_EXHAUSTED"]
        assert shed and all(r[1] < 1.0 for r in shed) and all("retry-after-ms" in r[2] for r in shed)
        assert any(r[0] == "ok" for r in results)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: httpx.post(f"{s.http_url}/v1/completions", timeout=30, json={
                "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True}), range(8)))
        limited = [r for r in codes if r.status_code == 429]
        assert limited and all("Retry-After" in r.headers for r in limited)
    finally:
        s.stop()


def test_deadlines(engine):
    s = ServerThread(engine("llama"), EngineConfig(SchedulerConfig(max_num_seqs=1), CacheConfig(kv_budget_bytes=32 << 20)))
    try:
        def expired_grpc():
            try:
                list(c.generate(PROMPT, max_tokens=50, timeout=0.1))   # waits behind the long one, then expires
            except grpc.RpcError as e:
                return e.code()

        with Client(s.grpc_target) as c, concurrent.futures.ThreadPoolExecutor(5) as pool:
            # three long ones queued first, one at a time (a single one took ~100 ms on a fast machine: a request
            # behind it could finish inside its 0.1 s)
            longs = [pool.submit(lambda: list(c.generate(PROMPT, max_tokens=480, ignore_eos=True))) for _ in range(3)]
            time.sleep(0.03)
            code = pool.submit(expired_grpc)
            http = pool.submit(lambda: httpx.post(f"{s.http_url}/v1/completions",
                                                  json={"prompt": PROMPT, "max_tokens": 50, "timeout": 0.1}))
            assert code.result() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert http.result().status_code == 504
            assert [len(f.result()) for f in longs] == [480] * 3
        assert wait_until(lambda: s.metric("quicksilver_requests_running") == 0 and not s.server.engine.requests)
        assert s.metric("quicksilver_request_errors_total", code="deadline_exceeded") >= 1
    finally:
        s.stop()


def test_auth(engine):
    s = ServerThread(engine("llama"), api_key="s3cret")
    try:
        with Client(s.grpc_target) as c:
            with pytest.raises(grpc.RpcError) as err:
                list(c.generate(PROMPT, max_tokens=2))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(s.grpc_target, api_key="wrong") as c, pytest.raises(grpc.RpcError):
            list(c.generate(PROMPT, max_tokens=2))
        with Client(s.grpc_target, api_key="s3cret") as c:
            assert list(c.generate(PROMPT, max_tokens=2))
        url = f"{s.http_url}/v1/completions"
        assert httpx.post(url, json={"prompt": PROMPT}).status_code == 401
        assert httpx.post(url, json={"prompt": PROMPT}, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert httpx.post(url, json={"prompt": PROMPT, "max_tokens": 2},
                          headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(f"{s.http_url}/health").status_code == 200
    finally:
        s.stop()


def self_signed(tmp: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import datetime
    import ipaddress

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .sign(key, hashes.SHA256()))
    (tmp / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))
    return tmp / "cert.pem", tmp / "key.pem"


def test_tls(engine, tmp_path):
    pytest.importorskip("cryptography")
    cert, key = self_signed(tmp_path)
    s = ServerThread(engine("llama"), tls_cert=cert, tls_key=key)
    try:
        with Client(s.grpc_target, tls_ca=cert) as c:
            assert list(c.generate(PROMPT, max_tokens=3))
        r = httpx.post(f"{s.http_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3},
                       verify=ssl.create_default_context(cafile=str(cert)))
        assert r.status_code == 200
    finally:
        s.stop()


def test_concurrent_clients_and_metrics(server):
    before = server.metric("quicksilver_generation_tokens_total")
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        def one(i):
            with Client(server.grpc_target) as c:
                return sum(len(m.token_ids) for m in c.generate(PROMPT + " " * i, max_tokens=10, ignore_eos=True))
        assert list(pool.map(one, range(12))) == [10] * 12
    # Counters are refreshed after each engine step, right after its outputs are delivered.
    assert wait_until(lambda: server.metric("quicksilver_generation_tokens_total") >= before + 120)
    assert server.metric("quicksilver_time_to_first_token_seconds_count", prompt_tokens="0-128") >= 12
    assert server.metric("quicksilver_prefix_cache_queries_tokens_total") > 0


def test_every_request_received_is_released_whatever_its_end(server):
    """The count of requests being received (which an idle engine waits for, async_engine.Arrivals) returns to
    zero after served, refused, malformed, cancelled and concurrent requests on both transports: a leaked count
    would delay every request that reaches an idle engine."""
    arrivals = server.server.frontend.arrivals
    url = f"{server.http_url}/v1/completions"
    rest = threading.Event()

    def slow_body():                                         # headers and half a body, then the rest
        yield b'{"prompt": "def f():", '
        rest.wait(30)
        yield b'"max_tokens": 3}'
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sent = pool.submit(httpx.post, url, content=slow_body(), headers={"content-type": "application/json"})
        assert wait_until(lambda: arrivals.pending == 1)    # counted while its body is still on the way
        rest.set()
        assert sent.result().status_code == 200
    assert httpx.post(url, json={"prompt": PROMPT, "max_tokens": 3}).status_code == 200
    assert httpx.post(url, content=b"{not json").status_code == 400
    assert httpx.post(url, json={"prompt": PROMPT, "model": "gpt-7"}).status_code == 404
    assert httpx.post(url, json={"prompt": "", "max_tokens": 3}).status_code == 400
    with httpx.stream("POST", url, json={"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
        next(r.iter_lines())                                 # hangs up after one event
    with Client(server.grpc_target) as c:
        assert len(list(c.generate(PROMPT, max_tokens=3))) >= 1
        with pytest.raises(grpc.RpcError):
            list(c.generate("", max_tokens=3))
        stream = c.generate(PROMPT, max_tokens=400, ignore_eos=True)
        next(stream)
        stream.close()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        codes = list(pool.map(lambda i: httpx.post(url, json={"prompt": PROMPT + " " * i, "max_tokens": 4}).status_code,
                              range(12)))
    assert codes == [200] * 12
    assert wait_until(lambda: arrivals.pending == 0), arrivals.pending
    assert wait_until(lambda: server.metric("quicksilver_requests_running") == 0)


def test_graceful_shutdown(engine):
    exe = Path(sys.executable).parent / "runtime"
    proc = subprocess.Popen([str(exe), "serve", str(engine("llama")), "--grpc-port", "0", "--http-port", "-1",
                             "--grace", "10"], stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for line in proc.stderr:
            if "serving" in line:
                port = int(line.split("grpc=")[1].split()[0])
                break
        with Client(f"127.0.0.1:{port}") as c:
            stream = c.generate(PROMPT, max_tokens=480, ignore_eos=True)
            next(stream)
            proc.send_signal(signal.SIGTERM)
            rest = list(stream)                       # the in-flight request finishes
        assert rest[-1].finish_reason == "length"
        assert proc.wait(20) == 0
    finally:
        proc.kill()


def test_generated_proto_in_sync(tmp_path):
    """In a child process: grpc_tools carries its own native protobuf, and loading it beside another native
    protobuf user (onnxruntime-extensions, later in the session) corrupts the test process's heap."""
    pytest.importorskip("grpc_tools")
    subprocess.run([sys.executable, "-m", "runtime.server.proto.generate", str(tmp_path)], check=True)
    here = Path(__file__).resolve().parents[2] / "runtime" / "server" / "proto"
    for name in ("quicksilver_pb2.py", "quicksilver_pb2_grpc.py"):
        assert (tmp_path / "runtime/server/proto" / name).read_text() == (here / name).read_text(), \
            f"{name} is stale: run python -m runtime.server.proto.generate"


def serve_cli(*args, timeout=60) -> subprocess.CompletedProcess:
    """`runtime serve ARGS` that is expected to refuse at start; a server that starts anyway is killed."""
    exe = Path(sys.executable).parent / "runtime"
    try:
        return subprocess.run([str(exe), "serve", *map(str, args)], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"runtime serve {' '.join(map(str, args))} started instead of refusing: {e.stderr}")


def test_serve_refuses_taken_port_or_bad_address(server, engine, tmp_path):
    """A second server on a port in use, a port out of range, a host that is not one, a TLS key for another
    certificate: each fails at start with one line naming it, not a shared port, a traceback or "Failed to bind"."""
    pytest.importorskip("cryptography")
    grpc_port, http_port = server.server.grpc_port, server.server.http_port
    cert, _ = self_signed(tmp_path)
    (tmp_path / "other").mkdir()
    _, other_key = self_signed(tmp_path / "other")
    cases = [
        (["--grpc-port", grpc_port, "--http-port", -1],
         f"error: cannot listen for gRPC on 127.0.0.1:{grpc_port}: Address already in use"),
        (["--grpc-port", -1, "--http-port", http_port],
         f"error: cannot listen for HTTP on 127.0.0.1:{http_port}: Address already in use"),
        (["--grpc-port", 70000], "Error: Invalid value for '--grpc-port': 70000 is not in the range -1<=x<=65535."),
        (["--host", "999.1.1.1", "--grpc-port", 0, "--http-port", 0],
         "error: --host 999.1.1.1: not an address of this machine ("),
        (["--tls-cert", cert, "--tls-key", other_key, "--grpc-port", 0, "--http-port", 0],
         f"error: TLS key {other_key} does not match certificate {cert}"),
    ]
    for args, message in cases:
        result = serve_cli(engine("llama"), *args)
        lines = result.stderr.strip().splitlines()
        if message.startswith("Error: Invalid value"):      # click's usage error: usage and a hint come first
            lines = lines[3:]
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(message), (args, result.stderr)


class InjectedFailure:
    """Makes the server's model run raise for requests whose prompt holds `sentinel`: at their prefill, or at their
    first decode (after the first token went out). The engine fails only the requests of the failed step."""

    def __init__(self, server, sentinel: int, at: str):
        self.runner, self.sentinel, self.at, self.slots = server.server.engine.runner, sentinel, at, set()
        prefill, decode = self.runner.prefill, self.runner.decode

        def failing_prefill(pool, slot, tokens, start, *args, **kwargs):
            if self.sentinel in tokens:
                if self.at == "prefill":
                    raise RuntimeError("injected failure")
                self.slots.add(slot)
            return prefill(pool, slot, tokens, start, *args, **kwargs)

        def failing_decode(pool, rows, *args, **kwargs):
            if self.slots & {slot for slot, _, _ in rows}:
                self.slots.clear()
                raise RuntimeError("injected failure")
            return decode(pool, rows, *args, **kwargs)

        self.runner.prefill, self.runner.decode = failing_prefill, failing_decode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        del self.runner.prefill, self.runner.decode          # the class's methods again


def test_failed_step_is_an_error_not_a_success(server):
    """A request whose engine step failed gets HTTP 500 / an SSE error event / gRPC INTERNAL with the engine's reason,
    counts in quicksilver_request_errors{code="internal"}, and the server keeps serving others exactly."""
    reason = "internal error: RuntimeError: injected failure"
    sentinel = server.server.engine.runner.vocab_size - 1
    bad = [sentinel, 5, 6, 7, 8]
    url = f"{server.http_url}/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    want = httpx.post(url, json=body).json()["choices"][0]["text"]
    errors = server.metric("quicksilver_request_errors_total", code="internal")
    with InjectedFailure(server, sentinel, "prefill"):
        r = httpx.post(url, json={**body, "prompt": bad})
        assert r.status_code == 500
        assert r.json() == {"error": {"message": reason, "type": "internal_error", "code": "internal"}}
        with Client(server.grpc_target) as c, pytest.raises(grpc.RpcError) as err:
            list(c.generate(bad, max_tokens=6))
        assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INTERNAL, reason)
        assert httpx.post(url, json=body).json()["choices"][0]["text"] == want          # others run normally
    with InjectedFailure(server, sentinel, "decode"):
        with httpx.stream("POST", url, json={**body, "prompt": bad, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert r.status_code == 200
        assert lines[-2:] == ['data: {"error":{"message":"' + reason + '","type":"internal_error","code":"internal"}}',
                              "data: [DONE]"]
        with Client(server.grpc_target) as c:
            got = []
            with pytest.raises(grpc.RpcError) as err:
                for m in c.generate(bad, max_tokens=6, ignore_eos=True):
                    got.append(m)
        assert len(got) == 1 and len(got[0].token_ids) == 1 and not got[0].finish_reason
        assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INTERNAL, reason)
        r = httpx.post(url, json={**body, "prompt": bad})
        assert r.status_code == 500 and r.json()["error"]["message"] == reason
        assert httpx.post(url, json=body).json()["choices"][0]["text"] == want
    assert server.metric("quicksilver_request_errors_total", code="internal") - errors == 5
    assert wait_until(lambda: not server.server.engine.requests
                      and server.metric("quicksilver_kv_cache_usage_percent") == 0)


def test_priority_range_and_per_key_floor(engine):
    """Priorities are integers in [-100, 100]; a caller may not ask for one more urgent (lower) than its floor:
    --priority-floor for everyone, a --priority-key token's own floor for its holders (which also authenticate)."""
    s = ServerThread(engine("llama"), api_key="s3cret", priority_floor=0, priority_keys=(("ops", -50),))
    floor = lambda p, f: f"priority {p} is more urgent than this caller may ask for (lowest allowed: {f})"  # noqa: E731
    span = "priority must be an integer in [-100, 100], not "
    try:
        cases = [("s3cret", -1, floor(-1, 0)), ("s3cret", 101, span + "101"), ("ops", -51, floor(-51, -50)),
                 ("ops", -101, span + "-101"), ("s3cret", 0, None), ("ops", -50, None), ("s3cret", 100, None)]
        for key, priority, refusal in cases:
            with Client(s.grpc_target, api_key=key) as c:
                if refusal is None:
                    assert len([t for m in c.generate(PROMPT, max_tokens=2, ignore_eos=True, priority=priority)
                                for t in m.token_ids]) == 2
                    continue
                with pytest.raises(grpc.RpcError) as err:
                    list(c.generate(PROMPT, max_tokens=2, priority=priority))
                assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, refusal)
        url = f"{s.http_url}/v1/completions"
        for key, priority, refusal in cases + [("ops", "high", span + "'high'"), ("ops", 1.5, span + "1.5"),
                                               ("ops", True, span + "True")]:
            r = httpx.post(url, headers={"Authorization": f"Bearer {key}"},
                           json={"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True, "priority": priority})
            if refusal is None:
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
            else:
                assert (r.status_code, r.json()["error"]["message"]) == (400, refusal)
        assert httpx.post(url, headers={"Authorization": "Bearer nope"}, json={"prompt": PROMPT}).status_code == 401
    finally:
        s.stop()


def test_request_ids_are_tags_not_engine_ids(server):
    """A gRPC request_id is the client's tag, echoed back: two clients using the same one both run (was: "already
    in use" for the second); without one, responses carry the server's unguessable id."""
    tag = "my-request"
    with Client(server.grpc_target) as a, Client(server.grpc_target) as b:
        first = a.generate(PROMPT, max_tokens=30, ignore_eos=True, request_id=tag)
        head = next(first)                                   # admitted and running under the engine's own id
        second = list(b.generate(PROMPT, max_tokens=3, ignore_eos=True, request_id=tag))
        rest = list(first)
        untagged = list(a.generate(PROMPT, max_tokens=2, ignore_eos=True))
    assert {m.request_id for m in [head, *rest, *second]} == {tag}
    assert sum(len(m.token_ids) for m in [head, *rest]) == 30 and sum(len(m.token_ids) for m in second) == 3
    assert len({m.request_id for m in untagged}) == 1 and re.fullmatch(r"req-[0-9a-f]{24}", untagged[0].request_id)
    with Client(server.grpc_target) as c, pytest.raises(grpc.RpcError) as err:
        list(c.generate(PROMPT, max_tokens=2, request_id="x" * 257))
    assert err.value.details() == "request_id is 257 characters; at most 256"
    forged = "x)\nINFO quicksilver.server.requests: req-0000 (admin) prompt=1 finish=stop"   # a line in the log
    for tag in (forged, "a\rb", "tab\there", "line\u2028sep"):
        with Client(server.grpc_target) as c, pytest.raises(grpc.RpcError) as err:
            list(c.generate(PROMPT, max_tokens=2, request_id=tag))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "printable" in err.value.details(), tag
    with Client(server.grpc_target) as c:                   # ids as clients make them still run
        assert list(c.generate(PROMPT, max_tokens=1, request_id="3f2b9c1e-7a4d-4e2b-9c1e-7a4d4e2b9c1e éè"))


def random_words(seed: int, n: int) -> str:
    """Text of new words (the tokenizer caches words it has seen, so each call needs its own)."""
    r = random.Random(seed)
    return " ".join("".join(r.choice("abcdefghijklmnopqrstuvwxyzé") for _ in range(r.randint(3, 12))) for _ in range(n))


def test_tokenization_does_not_block_the_event_loop(server):
    """gRPC Tokenize and a long chat prompt's tokenization run off the event loop: while the tokenizer is held
    inside a long text (gated on an event), /health answers; only then is the tokenizer let go. (Event-based: were
    the work on the loop, /health could not answer until the gate opened, and the check below would time out.)"""
    bridge = server.server.bridge
    original, entered, release = bridge.prompts.encode, threading.Event(), threading.Event()

    def gated(text, max_chars=None):
        if max_chars is None:                    # the whole-text path, which the bridge runs on a worker thread
            entered.set()
            release.wait(30)
        return original(text, max_chars=max_chars) if max_chars is not None else original(text)

    def while_tokenizing(action):
        entered.clear(), release.clear()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(action)
            assert entered.wait(30), "the long text never reached the tokenizer"
            assert httpx.get(f"{server.http_url}/health", timeout=5).status_code == 200   # the loop is free
            release.set()
            return fut.result(60)

    bridge.prompts.encode = gated
    try:
        text = random_words(1, 20_000)
        with Client(server.grpc_target) as c:
            assert while_tokenizing(lambda: c.tokenize(text)) == server.server.engine.tokenizer.encode(text).ids
        chat = {"messages": [{"role": "user", "content": random_words(2, 80_000)}]}    # no max_tokens: counted here
        r = while_tokenizing(lambda: httpx.post(f"{server.http_url}/v1/chat/completions", json=chat, timeout=60))
        assert r.status_code == 400 and "exceeds the context length" in r.json()["error"]["message"]
    finally:
        bridge.prompts.encode = original


def test_itl_is_per_token_after_the_first(server):
    """The ITL histogram gets one sample per token after the first message (whose wait is the TTFT)."""
    count = server.metric("quicksilver_inter_token_latency_seconds_count")
    with Client(server.grpc_target) as c:
        msgs = list(c.generate(PROMPT, max_tokens=10, ignore_eos=True))
    assert [len(m.token_ids) for m in msgs] == [1] * 10
    assert server.metric("quicksilver_inter_token_latency_seconds_count") - count == 9


def test_ttft_counts_from_the_transport_receiving_the_request(server, monkeypatch):
    """HTTP TTFT starts when the request's headers arrive: the body, sent only once the server reads it, is in it.
    The server stamps the arrival before its first read, so TTFT ≥ (body sent − first read) on any machine."""
    from runtime.server import http_server

    reading, times = threading.Event(), {}
    guard = http_server._Guard.__call__

    async def watched(self, scope, receive, send):
        async def first_read():
            if not reading.is_set():
                times["read"] = time.monotonic()
                reading.set()
            return await receive()
        return await guard(self, scope, first_read if scope.get("path") == "/v1/completions" else receive, send)

    def body():
        assert reading.wait(30)
        time.sleep(0.3)                 # a slow client: the gap TTFT must hold (counted from the body, it would not)
        times["sent"] = time.monotonic()
        yield json.dumps({"prompt": PROMPT, "max_tokens": 1}).encode()

    monkeypatch.setattr(http_server._Guard, "__call__", watched)
    count = server.metric("quicksilver_time_to_first_token_seconds_count")
    total = server.metric("quicksilver_time_to_first_token_seconds_sum")
    t0 = time.monotonic()
    r = httpx.post(f"{server.http_url}/v1/completions", content=body(), headers={"Content-Type": "application/json"})
    waited = time.monotonic() - t0
    assert r.status_code == 200
    assert wait_until(lambda: server.metric("quicksilver_time_to_first_token_seconds_count") == count + 1)
    ttft = server.metric("quicksilver_time_to_first_token_seconds_sum") - total
    assert times["sent"] - times["read"] <= ttft <= waited, (times, ttft, waited)


def test_draft_speculation_metrics(engine, server):
    """A server with a draft model: greedy output equals the plain server's; the speculation counters move by
    exactly what the request's usage reports; ITL still counts one sample per token after the first message.
    (The draft is the target itself, which the adaptive controller rightly declines: γ is fixed here.)"""
    s = ServerThread(engine("llama"), EngineConfig(SchedulerConfig(max_num_seqs=2), CacheConfig(kv_budget_bytes=32 << 20),
                                                   SpecConfig(max_gamma=4, adaptive=False),
                                                   draft=engine("llama"), speculation="draft"))
    try:
        names = ("quicksilver_spec_proposed_tokens_total", "quicksilver_spec_accepted_tokens_total",
                 "quicksilver_inter_token_latency_seconds_count")
        before = [s.metric(n) for n in names]
        body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{s.http_url}/v1/completions", json=body) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        spec = events[-1]["usage"]["completion_tokens_details"]
        proposed, accepted = spec["speculative_proposed_tokens"], spec["speculative_accepted_tokens"]
        plain = httpx.post(f"{server.http_url}/v1/completions", json={**body, "stream": False}).json()
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == plain["choices"][0]["text"]
        assert 0 < accepted <= proposed
        assert wait_until(lambda: [s.metric(n) - b for n, b in zip(names, before)] == [proposed, accepted, 39]), \
            ([s.metric(n) - b for n, b in zip(names, before)], proposed, accepted)
    finally:
        s.stop()


def test_stop_does_not_block_the_event_loop(engine):
    """Server.stop aborts through the engine's inbox and joins the engine thread off the event loop: while a step
    is held (gated on an event), the loop keeps turning and stop waits; once the step is let go, stop completes.
    (Were the join on the loop, the loop could not turn until the gate's 10 s fallback, and stop would be done by
    the time the loop turned again.)"""
    s = ServerThread(engine("llama"), grace_s=0.0)
    runner, decode = s.server.engine.runner, s.server.engine.runner.decode
    entered, release = threading.Event(), threading.Event()

    def held_decode(*args, **kwargs):
        entered.set()
        release.wait(10)
        return decode(*args, **kwargs)

    async def stop_while_held() -> tuple[bool, int]:
        stop = asyncio.create_task(s.server.stop())
        turns = 0
        for _ in range(20):                      # the loop turns while stop waits for the held step
            await asyncio.sleep(0.005)
            turns += 1
        waiting = not stop.done()
        release.set()
        await asyncio.wait_for(stop, 30)
        return waiting, turns

    with Client(s.grpc_target) as c:
        stream = c.generate(PROMPT, max_tokens=400, ignore_eos=True)
        next(stream)
        runner.decode = held_decode
        assert entered.wait(10), "no step entered the held decode"
        waiting, turns = s._run(stop_while_held())
    s.close_loop()
    assert waiting and turns == 20            # stop waited for the step, and the loop turned meanwhile
    assert not s.server.aengine._thread.is_alive()


class SlowSteps:
    """Makes every decode step of a server take at least `seconds` (the engine thread sleeps, the loop is free)."""

    def __init__(self, server, seconds: float):
        self.runner, decode = server.server.engine.runner, server.server.engine.runner.decode

        def slow(*args, **kwargs):
            time.sleep(seconds)
            return decode(*args, **kwargs)
        self.runner.decode = slow

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        del self.runner.decode


def test_sse_timeout_event(server):
    """A stream that outlives its timeout ends with an OpenAI error event and [DONE], counts as deadline_exceeded,
    and its request is aborted."""
    errors = server.metric("quicksilver_request_errors_total", code="deadline_exceeded")
    with SlowSteps(server, 0.05), httpx.stream("POST", f"{server.http_url}/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True, "timeout": 0.5}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and 2 < len(lines) < 20
    assert lines[-2:] == ['data: {"error":{"message":"request timed out and was aborted","type":"timeout_error",'
                          '"code":"deadline_exceeded"}}', "data: [DONE]"]
    assert server.metric("quicksilver_request_errors_total", code="deadline_exceeded") - errors == 1
    assert wait_until(lambda: not server.server.engine.requests)


def test_non_streaming_disconnect_aborts(server):
    """A non-streaming client that hangs up gets its request aborted (the server answers 499 to nobody)."""
    aborts = server.metric("quicksilver_requests_finished_total", finish_reason="abort")
    with SlowSteps(server, 0.05):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.http_url}/v1/completions", timeout=0.5,
                       json={"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True})
        assert wait_until(lambda: not server.server.engine.requests, timeout=2.0)
    assert server.metric("quicksilver_requests_finished_total", finish_reason="abort") - aborts == 1
    assert wait_until(lambda: server.metric("quicksilver_kv_cache_usage_percent") == 0)


def test_draining_refuses_new_requests(engine):
    """While a stopping server drains, in-flight requests finish and new ones get 503 (and /health says so)."""
    s = ServerThread(engine("llama"), grace_s=20.0)
    try:
        with SlowSteps(s, 0.02), Client(s.grpc_target) as c:
            stream = c.generate(PROMPT, max_tokens=60, ignore_eos=True)
            first = next(stream)
            stopping = asyncio.run_coroutine_threadsafe(s.server.stop(), s.loop)
            assert wait_until(lambda: s.server.bridge.draining)
            r = httpx.post(f"{s.http_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert (r.status_code, r.json()) == (503, {"error": {"message": "the server is shutting down",
                                                                 "type": "unavailable_error", "code": "unavailable"}})
            health = httpx.get(f"{s.http_url}/health")
            assert (health.status_code, health.json()) == (503, {"status": "draining"})
            rest = list(stream)
        assert sum(len(m.token_ids) for m in [first, *rest]) == 60 and rest[-1].finish_reason == "length"
        stopping.result(30)
    finally:
        s.close_loop()


def test_http_connections_send_small_writes_at_once():
    """Accepted HTTP connections have TCP_NODELAY (inherited from the listening socket): without it a streamed
    chunk written right after the response headers waited for the client's delayed ACK, ~40 ms, on every request
    (measured at the API: warm-prefix TTFT 65-76 ms with, 27-33 ms without)."""
    import socket

    from runtime.server.app import listen_socket

    listener = listen_socket("127.0.0.1", 0, "HTTP")
    try:
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        accepted.close()
        client.close()
    finally:
        listener.close()
