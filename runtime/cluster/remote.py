"""The ingress side of `runtime serve --replicas N`: engine replicas on Ray Serve behind the usual transports.

`Cluster` starts (or joins) Ray, deploys EngineReplica × N with the prefix-aware request router, and gives the
server a `RemoteAsyncEngine` per model: the same surface as AsyncEngine (generate / abort / shutdown and an
`engine` to read the tokenizer, limits and manifest from), so the Bridge — limits, shedding, deadlines, draining,
tenants, tracing — and both transports run unchanged in front of it. The engine folder must be readable at the
same path on every node (the ingress reads its tokenizer and manifest; each replica loads the model).

What crosses to a replica is token ids, sampling parameters and the prompt's prefix keys (the router's); what
comes back is the engine's RequestOutputs. A replica that dies takes its streams with it, and Serve starts a
replacement: a request that had streamed nothing yet (queued or prefilling there) is sent once more, to another
replica, and its client sees a normal response; one that had streamed ends with ReplicaLost (503 / UNAVAILABLE,
retryable) at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import grpc
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError, RequestCancelledError
from tokenizers import Tokenizer

import artifact
from ..config import ClusterConfig, EngineConfig
from ..constraints import Grammars
from ..engine import EngineOverloaded
from ..engine_client import EngineInfo
from ..outputs import RequestOutput
from ..request import InvalidRequest
from ..server.bridge import Failed, ReplicaLost
from .replica import PUBLISH_S, EngineReplica, MetricsBoard
from .routing import prefix_keys

log = logging.getLogger("quicksilver.cluster")
RESUBMITS = 1             # times a request whose replica was lost before its first output is sent to another
ROUTERS = {"prefix": "runtime.cluster.ray_router:PrefixAwareRouter",
           "round-robin": "runtime.cluster.ray_router:RoundRobinRouter"}


class Cluster:
    """Ray + Serve for one server: an app per hosted model, a metrics board, and their shutdown."""

    def __init__(self, config: ClusterConfig):
        self.config = config
        self.prefix = f"quicksilver-{secrets.token_hex(4)}"      # this server's apps and actors
        started = config.address is None
        if started:
            cpus = os.cpu_count() or 1
            if config.replicas * config.threads > cpus:
                log.warning("%d replicas x %d threads need more CPUs than this machine's %d: they will share cores",
                            config.replicas, config.threads, cpus)
            ray.init(num_cpus=max(cpus, config.replicas * config.threads), include_dashboard=False,
                     namespace="quicksilver", log_to_driver=False, configure_logging=False)
        else:
            ray.init(address=config.address, namespace="quicksilver", log_to_driver=False, configure_logging=False)
        self._owns_ray = started
        serve.start(proxy_location="Disabled")      # our own HTTP and gRPC servers are the ingress
        self.board = MetricsBoard.options(name=f"{self.prefix}-metrics").remote()
        self.apps: list[str] = []

    def deploy(self, name: str, engine_dir: Path, config: EngineConfig) -> "RemoteAsyncEngine":
        """Start `replicas` engines of `engine_dir` and wait until all are up; the handle routes by prefix."""
        c, sched = self.config, config.scheduler
        app = f"{self.prefix}-{len(self.apps)}"
        deployment = serve.deployment(EngineReplica).options(
            name="engine", num_replicas=c.replicas,
            # the replica runs our generator on its own event loop, not on a second loop in another thread that
            # every streamed output hops across (Serve's "throughput optimized" setting; the engine has its own
            # thread and nothing of ours blocks the loop): a prefix hit's first token came ~3 ms sooner at idle
            ray_actor_options={"num_cpus": c.threads,
                               "runtime_env": {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}}},
            # the engines shed, as a single server does: a replica takes more than its engine holds (slots + queue),
            # so a full engine refuses at once (429) rather than Serve queueing for it; the handle's own queue only
            # holds requests being routed, bounded by what the whole deployment can hold
            max_ongoing_requests=2 * sched.max_num_seqs + sched.max_waiting,
            max_queued_requests=c.replicas * (sched.max_num_seqs + sched.max_waiting),
            health_check_period_s=2.0, health_check_timeout_s=30.0, graceful_shutdown_timeout_s=5.0,
            request_router_config=RequestRouterConfig(request_router_class=ROUTERS[c.routing],
                                                      request_router_kwargs={"saturated_at": sched.max_num_seqs}))
        replica_config = replace(config, ort=replace(config.ort, threads=c.threads))
        handle = serve.run(deployment.bind(str(Path(engine_dir).resolve()), replica_config, f"{self.prefix}-metrics"),
                           name=app, route_prefix=None)
        self.apps.append(app)
        with ThreadPoolExecutor(1) as pool:     # a handle's blocking result() refuses to run on an event loop
            info = pool.submit(lambda: handle.describe.remote().result()).result()
        log.info("model %s: %d replicas x %d threads on Ray (%s routing)", name, c.replicas, c.threads, c.routing)
        return RemoteAsyncEngine(remote_info(Path(engine_dir), info), _Waiting(self, app), self, app)

    def published(self, app: str) -> dict[str, tuple[bytes, int]] | None:
        """replica → (metrics exposition, requests waiting), as the app's replicas last published them; None where
        the board cannot be read (its actor died), which must fail neither routing nor /metrics. Asked on the event
        loop: bounded by PUBLISH_S."""
        try:
            return ray.get(self.board.get.remote(app), timeout=PUBLISH_S)
        except Exception as e:     # noqa: BLE001
            log.warning("model %s: what its replicas published could not be read (%s)", app, type(e).__name__)
            return None

    def shutdown(self) -> None:
        try:
            for app in self.apps:
                serve.delete(app)
            ray.kill(self.board)
            if self._owns_ray:
                serve.shutdown()
        finally:
            if self._owns_ray:
                ray.shutdown()


class _Waiting:
    """scheduler.num_waiting for the routing between models: the least-loaded replica's queue as last published
    (read at most every PUBLISH_S: it is asked on the event loop). The least, not the sum: Serve sends a request
    to a replica with room, so the model is saturated (against one replica's max_waiting) only when every replica
    is; the sum read two half-full replicas as full. Where the board cannot be read (its actor died) the last
    value stands, and routing goes on."""

    def __init__(self, cluster: Cluster, app: str):
        self.cluster, self.app = cluster, app
        self._value, self._at = 0, float("-inf")

    @property
    def num_waiting(self) -> int:
        if time.monotonic() - self._at > PUBLISH_S:
            self._at = time.monotonic()
            published = self.cluster.published(self.app)
            if published is not None:
                self._value = min((waiting for _, waiting in published.values()), default=0)
        return self._value


def remote_info(engine_dir: Path, described: dict) -> EngineInfo:
    """The engine-client info of an engine on replicas: the folder's manifest here, the rest as a replica
    described its engine (Replica.describe: EngineInfo's other fields)."""
    return EngineInfo(engine_dir=engine_dir, manifest=artifact.load(engine_dir, verify=False), **described)


class _Lost(ReplicaLost):
    """The replica streaming a request was lost; `replica`: its actor id (hex) where Ray named it."""

    def __init__(self, reason: str, replica: str | None = None):
        super().__init__(f"{reason}; retry the request")
        self.reason, self.replica = reason, replica


class RemoteAsyncEngine:
    """AsyncEngine's surface over a Serve deployment handle."""

    def __init__(self, info: EngineInfo, waiting: _Waiting | None, cluster: Cluster | None, app: str):
        self.info, self._waiting, self.cluster, self.app = info, waiting, cluster, app
        self._handle = None
        self._streams: dict[str, object] = {}        # request id → the response it streams now (None: between two)
        self._aborted: set[str] = set()

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_file(str(artifact.path(self.info.engine_dir, self.info.manifest, "tokenizer.json")))

    @functools.cached_property
    def grammars(self) -> Grammars:
        return Grammars(self.tokenizer.to_str(), self.info.vocab_size,
                        frozenset(self.info.manifest["tokenizer"]["eos_token_ids"]))

    @property
    def num_waiting(self) -> int:
        """Requests queued on the least-loaded replica, as they last published it (what routing compares with
        one replica's max_waiting: _Waiting)."""
        return self._waiting.num_waiting

    def _stream_handle(self):
        """The handle requests stream through, made at the first request, on the server's event loop: its router
        runs on that loop (not on Serve's router thread, which every request and every output hopped across) and
        it reaches the replicas over Serve's gRPC transport, by value (not Ray actor calls whose outputs go
        through the owner's object store protocol): Serve's "throughput optimized" settings. A tiny prompt's
        request to first output at the ingress, idle, p50 6.9 -> 5.2 ms."""
        if self._handle is None:
            handle = serve.get_deployment_handle("engine", app_name=self.app)
            handle._init(_run_router_in_separate_loop=False)
            self._handle = handle.options(stream=True, _by_reference=False)
        return self._handle

    async def generate(self, prompt, params, request_id: str = "", priority: int = 0, arrival: float | None = None):
        """Stream a request from the replica the router picks; raises InvalidRequest / EngineOverloaded before the
        first output, Failed if the replica raised, ReplicaLost if its replica is lost. A request whose replica is
        lost before its first output (queued or prefilling there: nothing reached the client) is sent again, once,
        to another replica (the router ranks the lost one last), so its client sees one normal response; once an
        output went out it fails as ReplicaLost (retryable). Closing it early cancels the request on the replica
        (which aborts it and frees its KV)."""
        if isinstance(prompt, str):
            prompt = (await asyncio.to_thread(self.tokenizer.encode_batch, [prompt]))[0].ids
        start = arrival if arrival is not None else time.monotonic()
        avoid = None                                  # the lost replica's actor id, for the resubmission's router
        self._streams[request_id] = None
        try:
            for attempt in range(1 + RESUBMITS):
                streamed = False
                try:
                    async with contextlib.aclosing(self._attempt(prompt, params, request_id, priority,
                                                                 time.monotonic() - start, avoid)) as outputs:
                        async for out in outputs:
                            streamed = True
                            yield out
                    return
                except _Lost as e:
                    if streamed or attempt == RESUBMITS or request_id in self._aborted:
                        raise
                    avoid = e.replica
                    log.warning("%s: %s before its first output; resubmitted to another replica",
                                request_id or "a request", e.reason)
        finally:
            self._streams.pop(request_id, None)
            self._aborted.discard(request_id)

    async def _attempt(self, prompt: list[int], params, request_id: str, priority: int, waited: float,
                       avoid: str | None):
        """One submission of a request to a replica (any but `avoid`, where another has room); _Lost if that
        replica is lost before the request finishes."""
        response, finished = None, False
        kwargs = {"prefix_keys": prefix_keys(prompt, self.info.block_size)}
        if avoid is not None:
            kwargs["avoid"] = avoid
        try:
            response = self._stream_handle().generate.remote(list(prompt), params, priority, waited, **kwargs)
            self._streams[request_id] = response
            async for kind, payload in response:
                if kind == "overloaded":
                    raise EngineOverloaded(payload)
                if kind == "invalid":
                    raise InvalidRequest(payload)
                finished = payload.finished
                yield payload
                if finished:
                    return
            raise _Lost("the replica ended the stream early")
        except (RequestCancelledError, ray.exceptions.TaskCancelledError) as e:
            if request_id not in self._aborted:
                raise _Lost(f"the replica's stream was cancelled ({type(e).__name__})") from None
            finished = True           # abort() cancelled it (a hang-up, a deadline, shutdown): it ends as the
            yield RequestOutput(request_id, [], "", finished=True, finish_reason="abort")     # local engine's does
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            raise _Lost(f"the replica serving this request stopped ({type(e).__name__})", e.actor_id) from None
        except grpc.aio.AioRpcError as e:     # the transport broke (a replica's errors come as values, below)
            raise _Lost(f"the stream from the replica broke ({e.code().name})") from None
        except ray.exceptions.RayTaskError as e:
            raise Failed(f"replica error: {e.cause!r}" if e.cause is not None else str(e).splitlines()[0]) from None
        except BackPressureError as e:     # every replica is full and the handle's queue too: never sent
            response = None                # (cancelling it would raise the refusal again)
            raise EngineOverloaded(str(e).splitlines()[0]) from None
        finally:
            if response is not None and not finished:
                response.cancel()

    def replica_metrics(self) -> dict[str, bytes]:
        """replica → its engine metrics (Prometheus text), for /metrics; none where the board cannot be read."""
        return {r: text for r, (text, _) in (self.cluster.published(self.app) or {}).items()}

    def abort(self, request_id: str) -> None:
        if request_id not in self._streams:
            return
        self._aborted.add(request_id)                 # not resubmitted if its replica is lost now
        response = self._streams[request_id]
        if response is not None:
            response.cancel()

    def shutdown(self) -> None:
        """The cluster (runtime.server.app.Server) deletes the deployments; nothing is held here."""
