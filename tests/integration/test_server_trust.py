"""Issue #45 on real servers (127.0.0.1): one credential per request, read once for auth, tenant, priority floor and
metrics on both transports (item 1); requests that can never succeed are 400s, not retryable 429s (item 7); nesting
is bounded (item 8); error messages stay under 1 KB (item 9); "auto" is listed, and the startup log says what is on
(item 13)."""

import json
import logging
import threading

import grpc
import httpx
import pytest

from runtime.client import Client
from runtime.server.tenants import Tenant

from server_harness import ServerThread

PROMPT = "def main(argv):\n    return"
ALPHA = Tenant("alpha", "key-alpha-0001", requests_per_minute=2)
BETA = Tenant("beta", "key-beta-00001", tokens_per_minute=100)
GAMMA = Tenant("gamma", "key-gamma-0001", priority_floor=-5)
DELTA = Tenant("delta", "key-delta-0001")
VIP = "vip-key-000001"
MAX_ERROR_BYTES = 1024


@pytest.fixture(scope="module")
def tenanted(engine):
    s = ServerThread(engine("llama"), tenants=(ALPHA, BETA, GAMMA, DELTA))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def open_server(engine):
    """No key required (max_waiting 8, max_num_seqs 4: the harness's); one priority key."""
    s = ServerThread(engine("llama"), priority_keys=((VIP, -10),))
    yield s
    s.stop()


def post(server, headers=(), path="/v1/completions", **body):
    return httpx.post(f"{server.http_url}{path}", headers=list(headers), timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 2, **body})


def grpc_error(server, metadata=(), **kwargs) -> grpc.RpcError:
    with Client(server.grpc_target, metadata=tuple(metadata)) as c:
        with pytest.raises(grpc.RpcError) as err:
            list(c.generate(kwargs.pop("prompt", PROMPT), **{"max_tokens": 2, **kwargs}))
    return err.value


def bearer(key: str, scheme: str = "Bearer") -> tuple[str, str]:
    return ("Authorization", f"{scheme} {key}")


# --- item 1: one credential, read once, for everything ---------------------------------------------------------

def test_two_authorization_headers_cannot_escape_a_tenants_limits(tenanted):
    for order in ((bearer("garbage"), bearer(ALPHA.key)), (bearer(ALPHA.key), bearer("garbage")),
                  (bearer(ALPHA.key), bearer(ALPHA.key))):
        for _ in range(5):                       # was: ten 200s, counted as tenant "default"
            r = post(tenanted, order)
            assert r.status_code == 401 and "more than one" in r.json()["error"]["message"]
    # nothing was charged: alpha's two requests a minute are all still there, then its limit holds
    assert [post(tenanted, [bearer(ALPHA.key)]).status_code for _ in range(3)] == [200, 200, 429]
    assert tenanted.metric("quicksilver_tenant_requests_total", tenant="alpha", outcome="admitted") == 2
    assert tenanted.metric("quicksilver_tenant_requests_total", tenant="default") == 0


def test_two_authorization_metadata_entries_are_refused(tenanted, open_server):
    for server in (tenanted, open_server):
        err = grpc_error(server, [("authorization", "Bearer garbage"), ("authorization", f"Bearer {DELTA.key}")])
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "more than one" in err.details()
    two = [bearer("garbage"), bearer(VIP)]     # an open server: the floor must not come from one and auth the other
    assert post(open_server, two, priority=-10).status_code == 401
    assert post(open_server, [bearer(VIP)], priority=-10).status_code == 200
    assert post(open_server, [("Authorization", "Basic dXNlcjpwdw==")]).status_code == 200   # not bearer: none
    assert post(open_server, [("Authorization", "Basic dXNlcjpwdw==")], priority=-10).status_code == 400


def test_bearer_scheme_is_case_insensitive(tenanted):
    for scheme in ("bearer", "BEARER", "Bearer"):
        assert post(tenanted, [bearer(DELTA.key, scheme)]).status_code == 200
        with Client(tenanted.grpc_target, metadata=(("authorization", f"{scheme} {DELTA.key}"),)) as c:
            assert list(c.generate(PROMPT, max_tokens=2))
    assert tenanted.metric("quicksilver_tenant_requests_total", tenant="delta", outcome="admitted") == 6
    # the tenant's priority floor comes from the same (lower-case) credential
    assert post(tenanted, [bearer(GAMMA.key, "bearer")], priority=-5).status_code == 200
    assert post(tenanted, [bearer(GAMMA.key, "bearer")], priority=-6).status_code == 400


# --- item 7: a request that can never succeed is a 400 naming the limit ------------------------------------------

def test_more_choices_than_the_queue_holds_is_a_400(open_server):
    r = post(open_server, n=16)
    assert r.status_code == 400 and "max-waiting" in r.json()["error"]["message"]
    assert "Retry-After" not in r.headers
    ok = post(open_server, n=8)                   # as many as the queue holds: served on an idle server
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 8


def test_a_request_larger_than_the_tenants_token_bucket_is_a_400(tenanted):
    r = post(tenanted, [bearer(BETA.key)], max_tokens=200)
    assert r.status_code == 400 and "Retry-After" not in r.headers
    assert "tokens_per_minute" in r.json()["error"]["message"]
    with Client(tenanted.grpc_target, BETA.key) as c:
        with pytest.raises(grpc.RpcError) as err:
            list(c.generate(PROMPT, max_tokens=200))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tokens_per_minute" in err.value.details()
    assert post(tenanted, [bearer(BETA.key)], max_tokens=4).status_code == 200      # nothing was charged


# --- item 8: nesting is bounded -----------------------------------------------------------------------------------

def nested(depth: int, leaf="0") -> str:
    return "[" * depth + leaf + "]" * depth


def deep_schema(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_deeply_nested_bodies_are_400(open_server):
    url = f"{open_server.http_url}/v1/completions"
    for depth in (100, 5_000, 300_000):          # was: 500 RecursionError from ~1,000 deep
        body = '{"prompt": "x", "max_tokens": 1, "user": ' + nested(depth) + "}"
        r = httpx.post(url, content=body, timeout=60)
        assert r.status_code == 400 and "nested" in r.json()["error"]["message"], (depth, r.text[:200])
    body = {"prompt": "x", "max_tokens": 1, "user": json.loads(nested(63))}       # the body's object + 63 = 64
    assert httpx.post(url, json=body, timeout=60).status_code == 200
    schema = {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep_schema(400)}}
    r = httpx.post(url, json={"prompt": "x", "max_tokens": 1, "response_format": schema}, timeout=60)
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
    pattern = {"type": "string", "pattern": "(" * 2000 + "a" + ")" * 2000}     # the regex nests, not the JSON
    r = httpx.post(url, json={"prompt": "x", "max_tokens": 1, "response_format": {
        "type": "json_schema", "json_schema": {"name": "deep", "schema": pattern}}}, timeout=60)
    assert r.status_code == 400, r.text[:300]


def test_schemas_are_checked_off_the_event_loop_and_sized_first(open_server, monkeypatch):
    """The meta-schema check takes seconds on a large schema (a 1 MB anyOf: 4.5 s on the event loop, every stream
    stalled that long): it runs in a worker thread, after a size check that refuses what no constraint accepts."""
    from runtime import constraints
    threads = []
    checked = constraints.check_schema

    def recording(schema):
        threads.append(threading.current_thread())
        return checked(schema)
    monkeypatch.setattr("runtime.server.structured.check_schema", recording)
    url = f"{open_server.http_url}/v1/chat/completions"
    small = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": small}}
    for extra in ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": small}}},
                  {"tools": [tool], "tool_choice": "auto"}):
        r = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra},
                       timeout=60)
        assert r.status_code == 200, r.text[:300]
    assert len(threads) == 2 and open_server.thread not in threads
    huge = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "string", "maxLength": i}}}
                      for i in range(6_000)]}                                # ~340,000 characters
    r = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": huge}}}, timeout=60)
    assert r.status_code == 400 and "limited to 256,000 characters" in r.json()["error"]["message"]


def test_deeply_nested_grpc_schema_is_invalid_argument(open_server):
    deepest = '{"not":' * 20_000 + "{}" + "}" * 20_000                # 180 KB, under the 256,000-character cap
    for schema in (json.dumps(deep_schema(400)), deepest):       # was: UNKNOWN (RecursionError)
        err = grpc_error(open_server, constraint={"json_schema": schema})
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "nested" in err.details(), err.details()[:200]
    shallow = json.dumps(deep_schema(10))
    with Client(open_server.grpc_target) as c:
        assert list(c.generate(PROMPT, max_tokens=2, constraint={"json_schema": shallow}))


# --- item 9: error messages stay under 1 KB ------------------------------------------------------------------------

def test_error_messages_stay_under_a_kilobyte(open_server):
    err = grpc_error(open_server, model="m" * 20_000)        # was: RESOURCE_EXHAUSTED (the details overflow metadata)
    assert err.code() == grpc.StatusCode.NOT_FOUND and "unknown model" in err.details()
    assert len(err.details().encode()) <= MAX_ERROR_BYTES and err.details().endswith("…")
    err = grpc_error(open_server, model="é" * 5_000)          # multi-byte text is cut on a character boundary
    assert err.code() == grpc.StatusCode.NOT_FOUND and len(err.details().encode()) <= MAX_ERROR_BYTES
    for body in ({"model": "m" * 200_000}, {"priority": "p" * 200_000}):
        r = post(open_server, **body)
        message = r.json()["error"]["message"]
        assert r.status_code == (404 if "model" in body else 400)
        assert len(message.encode()) <= MAX_ERROR_BYTES and message.endswith("…")
    assert post(open_server, model="gpt-7").json()["error"]["message"].startswith("unknown model 'gpt-7'")


# --- item 13: "auto" is listed; the startup log says what is on ----------------------------------------------------

def test_auto_is_listed_and_served_on_a_one_model_server(open_server):
    models = httpx.get(f"{open_server.http_url}/v1/models").json()["data"]
    ids = [m["id"] for m in models]
    assert ids == [open_server.server.bridge.model_name, "auto"]
    assert models[1]["routes_to"] == [ids[0]]
    r = post(open_server, model="auto")
    assert r.status_code == 200 and r.json()["model"] == ids[0]


def test_startup_log_names_features_and_slots(engine, caplog):
    with caplog.at_level(logging.INFO, logger="quicksilver.server"):
        s = ServerThread(engine("llama"), tenants=(ALPHA, BETA))
        s.stop()
    text = "\n".join(r.getMessage() for r in caplog.records)
    features = next(line for line in text.splitlines() if line.startswith("features:"))
    assert "tenants (2)" in features and "semantic cache" not in features and "tracing" not in features
    assert "4 running sequences" in text and "8 queued" in text
