"""runtime serve --replicas: the bundled target as 2 Ray Serve replicas × 1 thread behind the real HTTP and gRPC
servers. Streams equal the engine's greedy output; a shared prefix goes to one replica (its cache hits); a client
hang-up frees the KV on the replica; a killed replica fails its stream with a retryable error at once and Ray
starts another; without --replicas, Ray is never imported."""

import asyncio
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from openai import OpenAI

from runtime.client import Client
from runtime.config import CacheConfig, ClusterConfig, EngineConfig, SchedulerConfig
from runtime.engine import Engine
from runtime.request import SamplingParams

from server_harness import ServerThread

ray = pytest.importorskip("ray", reason="pip install '.[cluster]'")

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\nimport sys\n\ndef main():",
           "for i in range(10):"]
SYSTEM = "".join(f"# rule {i}: keep functions short, name things for what they do, test the edge cases\n"
                 for i in range(12))          # ~250 tokens shared by every turn of one user


def econf() -> EngineConfig:
    return EngineConfig(SchedulerConfig(max_num_seqs=4, max_waiting=8), CacheConfig(kv_budget_bytes=64 << 20))


@pytest.fixture(scope="module")
def server(bundled):
    s = ServerThread(bundled["target"], econf(), start_timeout=300, model_name="target",
                     cluster=ClusterConfig(replicas=2, threads=1))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def alone(bundled):
    """What the engine generates greedily on its own, in process, for a request that gives only the temperature
    (the rest, as over the API, from the model's generation_config.json): the truth every replica must match."""
    e = Engine(bundled["target"], econf())

    def run(prompt: str, max_tokens: int) -> str:
        params = SamplingParams.from_options({"temperature": 0.0}, max_tokens=max_tokens, ignore_eos=True)
        return e.generate([prompt], params)[0]["text"]
    return run


def replica_values(server, name: str) -> dict[str, float]:
    """replica → value of an engine metric, as the replicas last published it."""
    text = httpx.get(f"{server.http_url}/metrics").text
    values = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and 'replica="' in line:
            replica = line.split('replica="')[1].split('"')[0]
            values[replica] = float(line.rsplit(" ", 1)[1])
    return values


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def published_since(server, t: float) -> None:
    """Both replicas have published their engine series after `t` (time.time())."""
    wait_for(lambda: [v > t for v in replica_values(server, "quicksilver_metrics_published_timestamp_seconds")
                      .values()] == [True, True], 15, "both replicas to publish")


def test_streams_over_http_and_grpc_equal_the_engines_greedy_output(server, alone):
    client = OpenAI(base_url=f"{server.http_url}/v1", api_key="none")
    for prompt in PROMPTS:
        chunks = [c.choices[0].text for c in client.completions.create(
            model="target", prompt=prompt, max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True})]
        assert len(chunks) > 1
        assert "".join(chunks) == alone(prompt, 24)
    with Client(server.grpc_target) as grpc_client:
        text = "".join(r.text for r in grpc_client.generate(PROMPTS[0], max_tokens=24, temperature=0, ignore_eos=True))
    assert text == alone(PROMPTS[0], 24)
    assert [m.id for m in client.models.list()] == ["target", "auto"]      # "auto" is served, so it is listed


def test_a_users_turns_go_to_the_replica_that_holds_their_prefix(server):
    client = OpenAI(base_url=f"{server.http_url}/v1", api_key="none")
    published_since(server, time.time())              # what earlier tests did is published
    before = replica_values(server, "quicksilver_prefix_cache_hits_tokens_total")
    cached, prompt_tokens, history = [], [], SYSTEM
    for turn in range(5):     # each turn is the whole conversation so far and a new line
        history += f"# turn {turn}: write a parser\n"
        r = client.completions.create(model="target", prompt=history, max_tokens=4, temperature=0)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        prompt_tokens.append(r.usage.prompt_tokens)
        history += r.choices[0].text
    # every later turn hit at least the turn before's prompt but its last block (whose last token may re-tokenize
    # with the answer's text)
    assert cached[0] == 0 and all(c >= prev - 16 for c, prev in zip(cached[1:], prompt_tokens)), \
        (cached, prompt_tokens)
    def gained():               # published twice a second: wait until the hits these turns made are in
        now = replica_values(server, "quicksilver_prefix_cache_hits_tokens_total")
        g = {r: v - before.get(r, 0) for r, v in now.items()}
        return g if len(g) == 2 and sum(g.values()) >= sum(cached) else None
    g = wait_for(gained, 15, "the replicas to publish this conversation's prefix hits")
    assert sorted(g.values())[0] == 0 and sorted(g.values())[1] >= sum(cached)


def test_new_users_behind_a_shared_prefix_spread_over_both_replicas(server):
    published_since(server, time.time())
    before = replica_values(server, "quicksilver_prompt_tokens_total")
    shared = SYSTEM[:SYSTEM.index("# rule 2")]        # ~40 tokens every user's prompt starts with, ~100 of its own
    computed = 0
    for i in range(16):       # each branches off the shared part, which the first went on from: the least cached
        r = httpx.post(f"{server.http_url}/v1/completions", timeout=60,
                       json={"prompt": shared + f"# user {i} " * 20, "max_tokens": 1})
        r.raise_for_status()
        usage = r.json()["usage"]
        computed += usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]

    def published():          # wait until the replicas published every prompt token they computed for these
        now = replica_values(server, "quicksilver_prompt_tokens_total")
        g = {r: v - before.get(r, 0) for r, v in now.items()}
        return g if len(g) == 2 and sum(g.values()) >= computed else None
    gained = wait_for(published, 15, "the replicas to publish these prompts' tokens")
    # both took a fair share (following the shared line would send every user to the replica that took it first)
    assert len(gained) == 2 and min(gained.values()) >= 0.25 * sum(gained.values()), gained


def test_a_client_hang_up_frees_the_kv_on_its_replica(server):
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.http_url}/v1/completions",
                         json={"prompt": PROMPTS[1], "max_tokens": 1500, "stream": True, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            running = wait_for(lambda: {k: v for k, v in replica_values(server, "quicksilver_requests_running").items()
                                        if v > 0}, 10, "the request to run on a replica")
            assert list(running.values()) == [1.0]
    # the connection is closed: the ingress cancels the stream and the replica aborts the request
    wait_for(lambda: all(v == 0 for v in replica_values(server, "quicksilver_requests_running").values())
             and all(v == 0 for v in replica_values(server, "quicksilver_kv_cache_usage_percent").values()),
             15, "the replica to free the request's KV")
    assert server.metric("quicksilver_requests_finished_total", finish_reason="abort") >= 1


def test_a_grpc_deadline_aborts_the_request_on_its_replica(server):
    with Client(server.grpc_target) as grpc_client:
        with pytest.raises(grpc.RpcError) as e:
            for _ in grpc_client.generate(PROMPTS[3], timeout=0.5, max_tokens=1500, ignore_eos=True):
                pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: all(v == 0 for v in replica_values(server, "quicksilver_requests_running").values())
             and all(v == 0 for v in replica_values(server, "quicksilver_kv_cache_usage_percent").values()),
             15, "the replica to free the request's KV")


def test_past_every_replicas_slots_and_queues_requests_are_shed_with_a_retry_hint(server):
    """Each replica's engine holds 4 running + 8 waiting; past that it refuses at once with 429 + Retry-After, as a
    single server sheds (Serve does not queue for it), and nothing is left running."""
    async def burst(n: int) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            async def one(i: int) -> httpx.Response:
                async with http.stream("POST", f"{server.http_url}/v1/completions", json={
                        "prompt": f"# burst {i}\n" + PROMPTS[i % 4], "max_tokens": 400, "stream": True,
                        "ignore_eos": True}) as r:
                    await r.aread() if r.status_code != 200 else None
                    return r              # a 200 is closed after its first token: the request is cancelled
            return await asyncio.gather(*[one(i) for i in range(n)])

    responses = asyncio.run(burst(40))
    codes = [r.status_code for r in responses]
    shed = [r for r in responses if r.status_code == 429]
    assert set(codes) <= {200, 429} and codes.count(200) > 12 and shed, codes     # > one engine's 12: both took
    assert all(r.headers["retry-after"] and r.json()["error"]["code"] == "overloaded" for r in shed)
    wait_for(lambda: all(v == 0 for v in replica_values(server, "quicksilver_requests_running").values())
             and all(v == 0 for v in replica_values(server, "quicksilver_kv_cache_usage_percent").values()),
             60, "every replica to be idle again")


def test_a_killed_replica_fails_its_stream_retryably_and_is_replaced(server):
    before = set(replica_values(server, "quicksilver_requests_running"))
    assert len(before) == 2
    events = []
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.http_url}/v1/completions",
                         json={"prompt": PROMPTS[2], "max_tokens": 1500, "stream": True, "ignore_eos": True}) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data:"))
            events.append(next(lines))
            busy = wait_for(lambda: [k for k, v in replica_values(server, "quicksilver_requests_running").items()
                                     if v > 0], 10, "the request to run on a replica")
            (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["name"].endswith("#" + busy[0])]
            killed = time.monotonic()
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
            events += list(lines)                     # the stream ends, with an error event: no hang
            ended = time.monotonic() - killed
    assert events[-1] == "data: [DONE]" and '"code": "unavailable"' in events[-2].replace('":"', '": "'), events[-3:]
    assert ended < 20
    # Serve replaces the replica; requests keep being served meanwhile and after
    assert httpx.post(f"{server.http_url}/v1/completions", timeout=60,
                      json={"prompt": PROMPTS[0], "max_tokens": 4}).status_code == 200
    after = wait_for(lambda: (lambda now: now if len(now) == 2 and now != before else None)(
        set(replica_values(server, "quicksilver_requests_running"))), 120, "a replacement replica")
    assert busy[0] not in after and len(after & before) == 1


def test_the_single_server_never_imports_ray():
    code = ("import sys, runtime.cli, runtime.server.app, runtime.server.http_server, runtime.server.grpc_server; "
            "print(any(m == 'ray' or m.startswith('ray.') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
