"""runtime serve --replicas: a request whose replica is lost before its first output is resubmitted, once, to
another replica, and its client sees a normal response; one that had streamed fails retryably, as before.

First the ingress's rule on a scripted Serve handle (which submissions, with which replica to avoid, when it gives
up), then a real cluster: 2 Ray Serve replicas × 1 thread behind the real HTTP server, each running 4 streams and
holding queued requests when one replica is killed — its queued requests finish on the other replica with the
engine's greedy output, its streams end with the retryable error."""

import asyncio
import json
import threading
from types import SimpleNamespace

import httpx
import pytest

from runtime.config import ClusterConfig
from runtime.engine import Engine
from runtime.outputs import RequestOutput
from runtime.request import SamplingParams
from runtime.server.bridge import ReplicaLost

from server_harness import ServerThread
from test_replicas import econf, replica_values, wait_for

ray = pytest.importorskip("ray", reason="pip install '.[cluster]'")
from ray.exceptions import ActorUnavailableError  # noqa: E402

from runtime.cluster.ray_router import avoided_last  # noqa: E402
from runtime.cluster.remote import RemoteAsyncEngine  # noqa: E402

# --- the ingress's rule, on a scripted handle ---------------------------------------------------------------------


class Script:
    """A Serve response: yields ("out", RequestOutput) for each token, then raises `error` (if any)."""

    def __init__(self, tokens: list[int], error: BaseException | None = None, on_start=None):
        self.tokens, self.error, self.on_start, self.cancelled = tokens, error, on_start, False

    async def __aiter__(self):
        if self.on_start is not None:
            self.on_start()
        for i, t in enumerate(self.tokens):
            yield "out", RequestOutput("r", [t], str(t), finished=self.error is None and i == len(self.tokens) - 1)
        if self.error is not None:
            raise self.error

    def cancel(self):
        self.cancelled = True


class Handle:
    """generate.remote(...) hands out the scripted responses in turn and records each call's kwargs."""

    def __init__(self, *responses: Script):
        self.responses, self.calls = list(responses), []
        self.generate = SimpleNamespace(remote=self._remote)

    def _remote(self, prompt, params, priority, waited, **kwargs):
        self.calls.append(kwargs)
        return self.responses.pop(0)


def remote(handle: Handle) -> RemoteAsyncEngine:
    r = RemoteAsyncEngine(SimpleNamespace(block_size=4), waiting=None, cluster=None, app="test")
    r._handle = handle
    return r


def run(engine: RemoteAsyncEngine, request_id: str = "req-1") -> list[int]:
    async def go():
        return [t for out in [o async for o in engine.generate([1, 2, 3, 4, 5], None, request_id)]
                for t in out.token_ids]
    return asyncio.run(go())


def lost(actor: ray.ActorID | None = None) -> ActorUnavailableError:
    return ActorUnavailableError("Actor is unavailable.", (actor or ray.ActorID.from_random()).binary())


def test_lost_before_the_first_output_is_resubmitted_once_avoiding_that_replica():
    actor = ray.ActorID.from_random()
    first = Script([], lost(actor))
    handle = Handle(first, Script([7, 8, 9]))
    assert run(remote(handle)) == [7, 8, 9]
    assert [c.get("avoid") for c in handle.calls] == [None, actor.hex()]
    assert handle.calls[0]["prefix_keys"] == handle.calls[1]["prefix_keys"]
    assert first.cancelled


@pytest.mark.parametrize("error", [None, "early end"])
def test_a_broken_or_early_ended_stream_is_resubmitted_without_a_replica_to_avoid(error):
    import grpc
    broken = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata())
    handle = Handle(Script([], broken if error is None else None), Script([5]))
    assert run(remote(handle)) == [5]
    assert [c.get("avoid") for c in handle.calls] == [None, None]


def test_lost_after_an_output_fails_retryably_and_is_not_resubmitted():
    handle = Handle(Script([7], lost()), Script([7, 8]))
    with pytest.raises(ReplicaLost, match="retry"):
        run(remote(handle))
    assert len(handle.calls) == 1


def test_lost_twice_before_any_output_fails_retryably():
    handle = Handle(Script([], lost()), Script([], lost()), Script([1]))
    with pytest.raises(ReplicaLost, match="retry"):
        run(remote(handle))
    assert len(handle.calls) == 2


def test_an_aborted_request_is_not_resubmitted():
    engine = remote(Handle())
    engine._handle.responses = [Script([], lost(), on_start=lambda: engine.abort("req-1")), Script([1])]
    with pytest.raises(ReplicaLost):
        run(engine)
    assert len(engine._handle.calls) == 1 and not engine._streams and not engine._aborted


def test_an_aborted_stream_ends_with_an_abort_not_an_error():
    """abort() cancels the replica's stream (a hang-up, a deadline, the server stopping) and Serve raises its
    cancellation: the request ends as the local engine's does, with finish_reason "abort" (it cut SSE streams and
    made whole responses 500s at shutdown). A cancellation nobody asked for is a lost replica."""
    from ray.serve.exceptions import RequestCancelledError

    engine = remote(Handle())
    engine._handle.responses = [Script([7], RequestCancelledError("req-1"), on_start=lambda: engine.abort("req-1"))]

    async def go():
        return [o async for o in engine.generate([1, 2, 3, 4, 5], None, "req-1")]
    outs = asyncio.run(go())
    assert [o.token_ids for o in outs] == [[7], []] and (outs[-1].finished, outs[-1].finish_reason) == (True, "abort")
    assert not engine._streams and not engine._aborted
    handle = Handle(Script([], RequestCancelledError("req-1")), Script([4]))
    assert run(remote(handle)) == [4] and len(handle.calls) == 2      # before any output: resubmitted


def test_routing_reads_the_least_loaded_replica_and_survives_a_dead_board(monkeypatch):
    """A model on replicas is saturated only when every replica's queue is (the sum read two half-full replicas
    as full, and auto sent their requests to the fallback model); a board that cannot be read (its actor died)
    leaves the last reading, where every auto-routed request and /metrics answered 500."""
    from runtime.cluster import remote as remote_module

    def died(app):
        raise ray.exceptions.ActorDiedError()
    dead = SimpleNamespace(board=SimpleNamespace(get=SimpleNamespace(remote=died)))      # the board's actor handle
    assert remote_module.Cluster.published(dead, "app") is None

    readings = [{"a": (b"", 4), "b": (b"", 4)}, {"a": (b"", 8), "b": (b"", 6)}, None]
    monkeypatch.setattr(remote_module, "PUBLISH_S", 0.0)
    waiting = remote_module._Waiting(SimpleNamespace(published=lambda app: readings.pop(0)), "app")
    assert waiting.num_waiting == 4          # 4 and 4 of 8 places each: room
    assert waiting.num_waiting == 6
    assert waiting.num_waiting == 6          # the board died: the last reading
    engine = RemoteAsyncEngine(SimpleNamespace(block_size=4), waiting=None, app="test",
                               cluster=SimpleNamespace(published=lambda app: None))
    assert engine.replica_metrics() == {}


def test_the_replica_to_avoid_is_ranked_last():
    a, b, c = (SimpleNamespace(actor_id=ray.ActorID.from_random()) for _ in range(3))
    ranks = [[a], [b, c]]
    request = SimpleNamespace(kwargs={"prefix_keys": [], "avoid": a.actor_id.hex()})
    assert avoided_last(ranks, request) == [[b, c], [a]]
    assert avoided_last(ranks, SimpleNamespace(kwargs={"avoid": b.actor_id.hex()})) == [[a], [c], [b]]
    assert avoided_last(ranks, SimpleNamespace(kwargs={"prefix_keys": []})) == ranks
    assert avoided_last(ranks, None) == ranks


# --- a real cluster -----------------------------------------------------------------------------------------------

HELD = 8              # long streams: 4 running on each replica
QUEUED = 4            # then these wait in the replicas' queues
HOLD_TOKENS = 1900    # the held streams outlast the test (the model's context is 2048)


@pytest.fixture(scope="module")
def server(bundled):
    s = ServerThread(bundled["target"], econf(), start_timeout=300, model_name="target",
                     cluster=ClusterConfig(replicas=2, threads=1))
    yield s
    s.stop()


class Held:
    """A long streamed completion read on its own thread: its events, until it ends or `stop` is set."""

    def __init__(self, url: str, prompt: str):
        self.events: list[str] = []
        self.first, self.ended, self.stop = threading.Event(), threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._read, args=(url, prompt), daemon=True)
        self.thread.start()

    def _read(self, url: str, prompt: str):
        body = {"prompt": prompt, "max_tokens": HOLD_TOKENS, "stream": True, "ignore_eos": True, "temperature": 0}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        self.events.append(line)
                        self.first.set()
                    if self.stop.is_set():
                        return
        finally:
            self.ended.set()

    @property
    def failed_retryably(self) -> bool:
        """Ended with an error event of code "unavailable" (503's: retry the request), then [DONE]."""
        if not (self.ended.is_set() and len(self.events) >= 2 and self.events[-1] == "data: [DONE]"):
            return False
        return json.loads(self.events[-2][len("data:"):]).get("error", {}).get("code") == "unavailable"


def kill_replica(unique_id: str) -> None:
    """Kill a replica's actor process (as a crash would), without Serve's graceful shutdown."""
    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].endswith("#" + unique_id)]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


def test_queued_requests_of_a_killed_replica_finish_on_the_other_and_streams_fail_retryably(server, bundled):
    prompts = [f"# task {i}: parse the input file\ndef step_{i}(" for i in range(QUEUED)]
    alone = Engine(bundled["target"], econf()).generate(
        prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    held = []
    for i in range(HELD):     # one at a time, each streaming before the next: the router fills both evenly
        held.append(Held(server.http_url, f"# stream {i}\nclass Worker{i}:"))
        assert held[-1].first.wait(60), f"held stream {i} never started"
    running = wait_for(lambda: (lambda v: v if sorted(v.values()) == [4.0, 4.0] else None)(
        replica_values(server, "quicksilver_requests_running")), 10, "4 streams running on each replica")

    results: dict[int, httpx.Response] = {}

    def ask(i: int):
        results[i] = httpx.post(f"{server.http_url}/v1/completions", timeout=120, json={   # alone's parameters,
            "prompt": prompts[i], "max_tokens": 16, "temperature": 0, "ignore_eos": True,      # none left to the
            "repetition_penalty": 1.0})                                                        # model's defaults
    askers = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(QUEUED)]
    for t in askers:
        t.start()
    waiting = wait_for(lambda: (lambda v: v if sum(v.values()) == QUEUED else None)(
        replica_values(server, "quicksilver_requests_waiting")), 10, "the queued requests to wait on the replicas")
    victim = max(waiting, key=waiting.get)
    assert waiting[victim] >= 1 and set(waiting) == set(running)
    assert not any(h.ended.is_set() for h in held), "a held stream ended before the kill: raise HOLD_TOKENS"
    kill_replica(victim)

    # its 4 streams end with the retryable error; the other replica's keep streaming
    failed = wait_for(lambda: (lambda f: f if len(f) >= 4 else None)([h for h in held if h.ended.is_set()]),
                      20, "the killed replica's streams to end")
    assert len(failed) == 4 and all(h.failed_retryably for h in failed), [h.events[-2:] for h in failed]
    for h in held:            # hang up the survivors: their slots go to the queued requests
        h.stop.set()
    for t in askers + [h.thread for h in held]:
        t.join(120)
    # every queued request completes, as if nothing had happened: the engine's greedy output, token for token
    assert sorted(results) == list(range(QUEUED))
    assert [results[i].status_code for i in range(QUEUED)] == [200] * QUEUED, [r.text for r in results.values()]
    assert [results[i].json()["choices"][0]["text"] for i in range(QUEUED)] == [a["text"] for a in alone]
    assert [results[i].json()["usage"]["completion_tokens"] for i in range(QUEUED)] == [16] * QUEUED
