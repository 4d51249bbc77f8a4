"""Hypothesis fuzz of OpenAI request bodies against a real HTTP server: whatever the types, ranges, unicode or
sizes, the answer is a 200 with choices or a 4xx with an OpenAI error body — never a 5xx, never a hang."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_harness import ServerThread

CASES = {"run": 0, "ok": 0, "refused": 0}

scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.integers(-3, 40) | \
    st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8),
                                                                                                inner, max_size=4),
                           max_leaves=12)
small_ints = st.integers(-2, 12)
texts = st.text(max_size=200) | st.text(st.characters(codec="utf-8"), max_size=20) | st.just("\ud800") | \
    st.builds(lambda c, n: c * n, st.characters(), st.integers(0, 3000))
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bot"]) | json_values,
                                           "content": texts | json_values}), max_size=4) | json_values
FIELDS = {
    "model": st.sampled_from(["llama-fp32", "gpt-7"]) | json_values,
    "prompt": texts | st.lists(st.integers(-5, 600), max_size=40) | st.lists(texts, max_size=2) | json_values,
    "max_tokens": small_ints | json_values, "max_completion_tokens": small_ints | json_values,
    "temperature": st.floats(-1, 3) | json_values, "top_p": st.floats(-0.5, 1.5) | json_values,
    "top_k": small_ints | json_values, "min_p": st.floats(-0.5, 1.5) | json_values,
    "presence_penalty": st.floats(-3, 3) | json_values, "frequency_penalty": st.floats(-3, 3) | json_values,
    "repetition_penalty": st.floats(-1, 3) | json_values, "seed": st.integers(-2**64, 2**64) | json_values,
    "n": st.integers(-1, 4) | json_values, "best_of": st.integers(-1, 4) | json_values,
    "stop": texts | st.lists(texts, max_size=6) | json_values, "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | json_values}) | json_values,
    "echo": st.booleans() | json_values, "logprobs": st.booleans() | small_ints | json_values,
    "top_logprobs": small_ints | json_values, "logit_bias": st.dictionaries(
        st.integers(-5, 10**6).map(str) | st.text(max_size=5), st.floats(-200, 200) | json_values, max_size=4) | json_values,
    "ignore_eos": st.booleans() | json_values, "priority": st.integers(-200, 200) | json_values,
    "timeout": st.floats(-1, 30) | json_values, "response_format": json_values, "suffix": json_values,
    "tools": json_values, "user": texts, "unknown_field": json_values, "messages": messages,
}
bodies = st.fixed_dictionaries({}, optional=FIELDS)


@pytest.fixture(scope="module")
def server(engine):
    s = ServerThread(engine("llama"), max_tokens_limit=8)      # bounded work per case
    yield s
    s.stop()
    print(f"\nHTTP fuzz: {CASES['run']} cases ({CASES['ok']} answered 200, {CASES['refused']} refused with 4xx)")


def check(response: httpx.Response, lines: list[str] | None, timeout=None) -> None:
    """`timeout`: the body's own deadline — a request that asked for a few milliseconds may get its 504."""
    if response.status_code == 504 and isinstance(timeout, (int, float)) and not isinstance(timeout, bool) \
            and 0 < timeout < 1:
        assert response.json()["error"]["code"] == "deadline_exceeded"
        return
    assert response.status_code < 500, (response.status_code, response.text)
    if response.status_code == 200:
        CASES["ok"] += 1
        if lines is not None:               # a stream: events, then [DONE]
            assert lines[-1] == "data: [DONE]"
            for line in lines[:-1]:         # chunks; the only error a valid stream may end with is its deadline
                event = json.loads(line[6:])
                assert "choices" in event or event["error"]["code"] == "deadline_exceeded", event
        else:
            assert response.json()["choices"]
        return
    CASES["refused"] += 1
    assert 400 <= response.status_code < 500
    error = response.json()["error"]
    assert isinstance(error["message"], str) and isinstance(error["type"], str) and isinstance(error["code"], str)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=bodies | json_values, chat=st.booleans(), raw=st.booleans())
def test_openai_bodies_fuzz(server, body, chat, raw):
    """raw: send the body as json.dumps would (NaN and Infinity included); else as strict JSON where possible."""
    if chat and isinstance(body, dict) and "messages" not in body:
        body = {**body, "messages": [{"role": "user", "content": "hi"}]}
    url = f"{server.http_url}/v1/{'chat/completions' if chat else 'completions'}"
    content = json.dumps(body, allow_nan=raw).encode("utf-8", "surrogatepass") if raw or _finite(body) else b"{"
    CASES["run"] += 1
    with httpx.Client(timeout=30) as h, h.stream("POST", url, content=content,
                                                 headers={"Content-Type": "application/json"}) as r:
        if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
            check(r, [line for line in r.iter_lines() if line])
        else:
            r.read()
            check(r, None, body.get("timeout") if isinstance(body, dict) else None)


def _finite(value) -> bool:
    try:
        json.dumps(value, allow_nan=False)
        return True
    except ValueError:
        return False
