"""Several models behind one real server: requests name a model and get exactly that engine's output; "auto" is
routed by the declared policy and falls back to the smaller model when the larger is saturated, saying so; the
policy is validated; and (Hypothesis) the router never picks a saturated model while its fallback chain has room."""

import contextlib
import json
import threading
import time

import grpc
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import OpenAI

from runtime.client import Client
from runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from runtime.engine import Engine
from runtime.request import InvalidRequest, SamplingParams
from runtime.server.router import Route, RoutePolicy, Router, Rule, load_policy

from server_harness import ServerThread

PROMPT = "def main(argv):\n    return"
POLICY = RoutePolicy(rules=(Rule("small", max_prompt_tokens=64, max_tokens=8), Rule("large")),
                     fallback={"large": "small"}, saturated_waiting=1)


@pytest.fixture(scope="module")
def server(engine):
    # One slot per model, so a second long request on "large" waits and saturates it (saturated_waiting=1).
    econf = EngineConfig(SchedulerConfig(max_num_seqs=1, max_waiting=8), CacheConfig(kv_budget_bytes=32 << 20))
    s = ServerThread(engine("llama"), econf, models={"small": engine("qwen2")}, model_name="large", route=POLICY)
    yield s
    s.stop()


def alone(engine_dir, prompt: str, max_tokens: int) -> str:
    """What the engine generates greedily on its own, in process: the truth a hosted model must match."""
    e = Engine(engine_dir, EngineConfig(SchedulerConfig(max_num_seqs=1), CacheConfig(kv_budget_bytes=16 << 20)))
    return e.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0]["text"]


def complete(server, **body):
    return httpx.post(f"{server.http_url}/v1/completions", json={"prompt": PROMPT, "temperature": 0, **body},
                      timeout=60)


def test_models_are_listed_and_each_name_gets_exactly_its_engine(server, engine):
    client = OpenAI(base_url=f"{server.http_url}/v1", api_key="none")
    assert [m.id for m in client.models.list()] == ["large", "small", "auto"]
    for name, ckpt in (("large", "llama"), ("small", "qwen2")):
        r = client.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.model == name
        assert r.choices[0].text == alone(engine(ckpt), PROMPT, 12)
    raw = complete(server, model="large", max_tokens=2)
    assert "x-quicksilver-route" not in raw.headers           # named: no routing, nothing to say
    unknown = complete(server, model="gpt-4", max_tokens=2)
    assert unknown.status_code == 404 and "'large', 'small', 'auto'" in unknown.json()["error"]["message"]   # vLLM's 404
    assert complete(server, model=["large"], max_tokens=2).status_code == 400
    ids = complete(server, model="auto", prompt=[1, 2, 3], max_tokens=2)     # ids are one model's vocabulary
    assert ids.status_code == 400 and "name the model" in ids.json()["error"]["message"]
    assert server.metric("quicksilver_requests_finished_total", model_name="small") >= 1
    assert server.metric("quicksilver_requests_finished_total", model_name="large") >= 2


def test_auto_follows_the_rules_in_order(server, engine):
    short = complete(server, model="auto", max_tokens=8, ignore_eos=True)
    assert short.status_code == 200 and short.json()["model"] == "small"
    assert short.headers["x-quicksilver-route"] == "small; auto: rule 0"
    assert short.json()["choices"][0]["text"] == alone(engine("qwen2"), PROMPT, 8)
    longer = complete(server, model="auto", max_tokens=9)                      # past rule 0's max_tokens
    assert longer.json()["model"] == "large" and longer.headers["x-quicksilver-route"] == "large; auto: rule 1"
    long_prompt = complete(server, model="auto", prompt="x " * 100, max_tokens=4)   # past rule 0's prompt bound
    assert long_prompt.json()["model"] == "large"
    chat = httpx.post(f"{server.http_url}/v1/chat/completions", timeout=60,      # chat default: the rest of the
                      json={"model": "auto", "messages": [{"role": "user", "content": "hi"}],   # context, > 8
                            "stream": True, "max_completion_tokens": None, "temperature": 0})
    assert chat.headers["x-quicksilver-route"] == "large; auto: rule 1"
    assert '"model":"large"' in chat.text


@contextlib.contextmanager
def large_kept_full(s):
    """Long requests to "large", back to back, one running and one waiting, until the block ends; yields a function
    that waits until the large model's queue (a gauge, a step old) shows a waiting request."""
    stop = threading.Event()

    def hog():
        while not stop.is_set():
            with httpx.stream("POST", f"{s.http_url}/v1/completions", timeout=60,
                              json={"model": "large", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
                                    "stream": True}) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        return        # closing the stream aborts the request and frees its KV

    def wait_for(gauge):
        deadline = time.monotonic() + 30
        while s.metric(gauge, model_name="large") < 1:
            assert time.monotonic() < deadline, f"the long requests never showed in {gauge}"
            time.sleep(0.005)

    hogs = [threading.Thread(target=hog) for _ in range(2)]
    try:
        for t, gauge in zip(hogs, ("quicksilver_requests_running", "quicksilver_requests_waiting")):
            t.start()                 # one at a time: two arriving together could fill a one-place queue
            wait_for(gauge)
        yield lambda: wait_for("quicksilver_requests_waiting")
    finally:
        stop.set()
        for t in hogs:
            t.join(30)


def test_auto_falls_back_to_the_small_model_when_the_large_is_saturated(server, engine):
    """Long requests keep "large" full (one runs, one waits); an auto request that rule 1 sends to "large" is served
    by "small" instead of queueing, and says so; once "large" drains, auto goes back to it."""
    expected = alone(engine("qwen2"), PROMPT, 12)
    saturated = "small; fallback: large saturated (1 waiting)"
    with large_kept_full(server) as full:

        def while_full(send, route_of, discard=lambda result: None):
            """`send()` once "large" is seen full. A hog's finished request takes a few ms to be replaced, and a
            request routed then rightly goes to "large" (its route says so): that one is discarded and sent again,
            so a broken fallback still fails here."""
            for _ in range(5):
                full()
                result = send()
                if route_of(result) != "large; auto: rule 1":
                    return result
                discard(result)
            raise AssertionError("no request was routed while large was saturated")

        r = while_full(lambda: complete(server, model="auto", max_tokens=12, ignore_eos=True),
                       lambda r: r.headers["x-quicksilver-route"])
        assert r.status_code == 200 and r.json()["model"] == "small"
        assert r.headers["x-quicksilver-route"] == saturated
        assert r.json()["choices"][0]["text"] == expected
        with Client(server.grpc_target) as c:                          # gRPC: the same choice, in metadata
            call = while_full(lambda: c.stub.Generate(_grpc_request(PROMPT, 12), metadata=c.metadata),
                              lambda call: dict(call.initial_metadata())["x-quicksilver-route"],
                              lambda call: call.cancel())
            assert dict(call.initial_metadata())["x-quicksilver-route"] == saturated
            assert "".join(m.text for m in call) == expected
    deadline = time.monotonic() + 30
    while server.metric("quicksilver_requests_running", model_name="large") > 0:
        assert time.monotonic() < deadline, "the hogs' KV was not freed"
        time.sleep(0.02)
    again = complete(server, model="auto", max_tokens=12)
    assert again.json()["model"] == "large" and again.headers["x-quicksilver-route"] == "large; auto: rule 1"


def _grpc_request(prompt: str, max_tokens: int):
    from runtime.server.proto import quicksilver_pb2 as pb
    return pb.GenerateRequest(text=prompt, model="auto", sampling=pb.SamplingParams(max_tokens=max_tokens,
                                                                                    ignore_eos=True))


def test_grpc_names_models_and_model_info_describes_each(server, engine):
    with Client(server.grpc_target) as c:
        assert c.model_info().model == "large" and c.model_info("small").model == "small"
        with pytest.raises(grpc.RpcError) as err:
            c.model_info("nope")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        text = "".join(m.text for m in c.generate(PROMPT, max_tokens=6, model="small", ignore_eos=True))
        assert text == alone(engine("qwen2"), PROMPT, 6)
        call = c.stub.Generate(_grpc_request(PROMPT, 4), metadata=c.metadata)
        list(call)
        assert dict(call.initial_metadata())["x-quicksilver-route"] == "small; auto: rule 0"


def test_route_files_are_validated(tmp_path, engine):
    def policy(obj):
        path = tmp_path / "route.json"
        path.write_text(json.dumps(obj) if not isinstance(obj, str) else obj)
        return load_policy(path)

    assert policy({"auto": [{"model": "a", "max_tokens": 8}], "fallback": {"b": "a"}}) == \
        RoutePolicy((Rule("a", None, 8),), {"b": "a"}, None)
    for bad, says in (("{", "not JSON"), ({"rules": []}, "expected an object"),
                      ({"auto": [{"model": "a", "max_tokens": 0}]}, "positive integer"),
                      ({"auto": [{"name": "a"}]}, r"auto\[0\]"), ({"fallback": {"a": 1}}, "fallback"),
                      ({"saturated_waiting": True}, "saturated_waiting")):
        with pytest.raises(ValueError, match=says):
            policy(bad)
    with pytest.raises(ValueError, match="cannot read"):
        load_policy(tmp_path / "missing.json")
    econf = EngineConfig(SchedulerConfig(max_num_seqs=1), CacheConfig(kv_budget_bytes=8 << 20))
    for bad, says in ((RoutePolicy((Rule("big"),)), "'big', which this server does not serve"),
                      (RoutePolicy(fallback={"large": "small", "small": "large"}), "cycle")):
        with pytest.raises(ValueError, match=says):
            ServerThread(engine("llama"), econf, models={"small": engine("qwen2")}, model_name="large", route=bad)


# -- the router's choice, as a property (stand-ins carry only what routing reads: name, queue, limits) --------------

class _Model:
    def __init__(self, name, waiting, max_waiting, max_model_len):
        self.model_name, self.waiting, self.max_waiting, self.max_model_len = name, waiting, max_waiting, max_model_len


NAMES = ["m0", "m1", "m2", "m3"]


@st.composite
def setups(draw):
    models = [_Model(n, draw(st.integers(0, 5)), draw(st.integers(1, 4)), draw(st.sampled_from([64, 256])))
              for n in NAMES]
    rules = tuple(Rule(draw(st.sampled_from(NAMES)), draw(st.none() | st.integers(1, 300)),
                       draw(st.none() | st.integers(1, 64))) for _ in range(draw(st.integers(0, 3))))
    order = draw(st.permutations(NAMES))          # a chain without cycles: each falls back to a later one
    fallback = {a: b for a, b in zip(order, order[1:]) if draw(st.booleans())}
    saturated = draw(st.none() | st.integers(1, 4))
    return models, RoutePolicy(rules, fallback, saturated), draw(st.integers(1, 300)), draw(st.none() | st.integers(1, 64))


@settings(max_examples=300, deadline=None)
@given(setups())
def test_auto_picks_the_first_rule_that_holds_and_leaves_a_saturated_model_when_it_can(setup):
    models, policy, prompt_tokens, max_tokens = setup
    router = Router(models, policy)
    route = router.auto(prompt_tokens, max_tokens)
    rule = next((r for r in policy.rules if r.holds(prompt_tokens, max_tokens)), None)
    chosen = router.bridges[rule.model] if rule else models[0]
    full = lambda m: m.waiting >= (policy.saturated_waiting or m.max_waiting)     # noqa: E731
    chain, m = [], chosen.model_name
    while m in policy.fallback:
        m = policy.fallback[m]
        chain.append(router.bridges[m])
    fits = lambda m: prompt_tokens + (max_tokens or 1) <= m.max_model_len        # noqa: E731  (else a 400 there)
    room = [c for c in chain if not full(c) and fits(c)]
    if not full(chosen) or not room:
        assert route.bridge is chosen and route.reason.startswith("auto:")
    else:
        assert route.bridge is room[0]          # the first in the chain with room, never a later one
        assert route.reason == f"fallback: {chosen.model_name} saturated ({chosen.waiting} waiting)"


def test_named_models_and_auto_with_one_model():
    only = Router([_Model("solo", 0, 4, 64)])
    assert only.named(None) is only.primary and only.named("auto") is only.primary and only.named("solo") is only.primary
    with pytest.raises(InvalidRequest, match="unknown model 'x'"):
        only.named("x")
    with pytest.raises(ValueError, match="share a name"):
        Router([_Model("a", 0, 4, 64), _Model("a", 0, 4, 64)])
    assert isinstance(Router([_Model("a", 0, 4, 64), _Model("b", 0, 4, 64)]).auto(1, 1), Route)


def test_cli_refuses_a_route_without_models_and_malformed_model_options(tmp_path):
    from click.testing import CliRunner

    from runtime.cli import main
    route = tmp_path / "route.json"
    route.write_text('{"auto": [{"model": "small"}]}')
    for args, says in ((["--route", str(route)], "add them with --model NAME=ENGINE"),
                       (["--model", "small"], "'small' is not NAME=ENGINE"),
                       (["--model", "a=x", "--model", "a=y"], "model name 'a' is given twice")):
        r = CliRunner().invoke(main, ["serve", str(tmp_path), *args])
        assert r.exit_code == 2 and says in r.output, r.output


def test_a_request_the_large_model_sheds_is_served_by_its_fallback(engine):
    """The policy's saturation mark (5 waiting) is above the engine's own limit (1 waiting): the router picks
    "large", its engine sheds the request at admission, and the request goes to "small" instead of a 429 — over
    HTTP and gRPC, with the tenant charged once."""
    econf = EngineConfig(SchedulerConfig(max_num_seqs=1, max_waiting=1), CacheConfig(kv_budget_bytes=32 << 20))
    policy = RoutePolicy(fallback={"large": "small"}, saturated_waiting=5)
    s = ServerThread(engine("llama"), econf, models={"small": engine("qwen2")}, model_name="large", route=policy)
    try:
        with large_kept_full(s) as full:
            # The queue's state is read from a gauge a step old: a request sent as the running one finishes may be
            # admitted. So each check is tried until the engine really was full; nothing else may happen meanwhile.
            def until(check, tries=40):
                for _ in range(tries):
                    full()
                    if check():
                        return
                pytest.fail("the large model never shed a request")

            def named_is_shed():
                status = complete(s, model="large", max_tokens=2).status_code
                assert status in (200, 429)
                return status == 429                                                # named: shed, no fallback
            until(named_is_shed)
            expected = alone(engine("qwen2"), PROMPT, 12)

            def http_falls_back():
                r = complete(s, model="auto", max_tokens=12, ignore_eos=True)
                assert r.status_code == 200                                         # auto: never a 429 here
                if r.json()["model"] == "large":
                    assert r.headers["x-quicksilver-route"] == "large; auto: default model"
                    return False
                assert r.headers["x-quicksilver-route"] == "small; fallback: large shed the request"
                assert r.json()["choices"][0]["text"] == expected
                return True
            until(http_falls_back)

            def grpc_falls_back():
                with Client(s.grpc_target) as c:
                    call = c.stub.Generate(_grpc_request(PROMPT, 12), metadata=c.metadata)
                    route = dict(call.initial_metadata())["x-quicksilver-route"]
                    text = "".join(m.text for m in call)
                if route == "large; auto: default model":
                    return False
                assert route == "small; fallback: large shed the request" and text == expected
                return True
            until(grpc_falls_back)
    finally:
        s.stop()
