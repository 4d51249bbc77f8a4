"""EngineReplica: one engine (its own engine thread and ONNX Runtime threads) as a Ray Serve deployment replica.

The ingress (runtime.cluster.remote) streams a request through `generate`: token ids in, the engine's
RequestOutputs out, tagged so refusals cross the process boundary as values, not pickled exceptions. Closing the
stream at the ingress (client gone, deadline, shutdown) cancels this generator on the replica, which aborts the
request in its engine and frees its KV there. Each replica publishes its engine metrics (Prometheus text) and
queue to the cluster's MetricsBoard twice a second, which the ingress's /metrics merges with a replica label.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path

import ray
from ray import serve

from ..async_engine import AsyncEngine
from ..config import EngineConfig
from ..engine import Engine, EngineOverloaded
from ..metrics import Metrics
from ..request import InvalidRequest, SamplingParams

log = logging.getLogger("quicksilver.cluster")
PUBLISH_S = 0.5           # how often a replica publishes its metrics and queue


@ray.remote(num_cpus=0)
class MetricsBoard:
    """The replicas' latest metrics, by replica; what a replica stopped publishing ages out."""

    def __init__(self):
        self.entries: dict[tuple[str, str], tuple[float, bytes, int]] = {}

    def put(self, app: str, replica: str, text: bytes, waiting: int) -> None:
        self.entries[app, replica] = (time.monotonic(), text, waiting)

    def get(self, app: str, max_age_s: float = 5.0) -> dict[str, tuple[bytes, int]]:
        """replica → (its exposition, requests waiting in its engine), for one app (model)."""
        now = time.monotonic()
        for key in [k for k, (t, _, _) in self.entries.items() if now - t > max_age_s]:
            del self.entries[key]
        return {r: (text, waiting) for (a, r), (_, text, waiting) in self.entries.items() if a == app}


class EngineReplica:
    def __init__(self, engine_dir: str, config: EngineConfig, board: str | None = None):
        self.engine = Engine(Path(engine_dir), config)
        self.metrics = Metrics()
        self.aengine = AsyncEngine(self.engine, on_step=self.metrics.on_step)
        context = serve.get_replica_context()
        self.name, self.app = context.replica_id.unique_id, context.app_name
        self._stop = threading.Event()
        if board is not None:
            self._board = ray.get_actor(board)
            threading.Thread(target=self._publish, name="quicksilver-metrics", daemon=True).start()
        log.info("replica %s: %s loaded", self.name, engine_dir)

    def describe(self) -> dict:
        """What the ingress needs to know of the engine and cannot read from the engine folder alone."""
        info = dataclasses.asdict(self.engine.info)
        return {k: v for k, v in info.items() if k not in ("engine_dir", "manifest")}

    async def generate(self, prompt: list[int], params: SamplingParams, priority: int = 0, waited_s: float = 0.0,
                       prefix_keys: list[int] | None = None, avoid: str | None = None):
        """Stream ("out", RequestOutput) messages, or one ("overloaded" | "invalid", reason). `waited_s`: how long
        the request had waited when the ingress sent it (clocks differ between machines; TTFT counts it; a
        resubmitted request's counts its first replica's time too). `prefix_keys` and `avoid` (a resubmitted
        request's lost replica) are the router's, unused here."""
        arrival = time.monotonic() - max(0.0, waited_s)
        try:
            async for out in self.aengine.generate(prompt, params, "", priority, arrival):
                yield ("out", out)
        except EngineOverloaded as e:
            yield ("overloaded", str(e))
        except InvalidRequest as e:
            yield ("invalid", str(e))

    def check_health(self) -> None:
        """Serve restarts a replica whose engine thread has died."""
        if not self.aengine.alive:
            raise RuntimeError("the engine thread has stopped")

    def _publish(self) -> None:
        while not self._stop.wait(PUBLISH_S):
            try:
                self.metrics.published.set(time.time())
                self._board.put.remote(self.app, self.name, self.metrics.exposition(),
                                       self.engine.num_waiting)
            except Exception as e:      # the board is gone: the cluster is shutting down
                log.debug("metrics not published: %s", e)

    def __del__(self):
        self._stop.set()
        self.aengine.shutdown()
