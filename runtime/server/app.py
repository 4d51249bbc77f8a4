"""`runtime serve`: load the engine, run gRPC and HTTP on one event loop, shut down gracefully on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time

import uvicorn

from ..async_engine import AsyncEngine
from ..config import EngineConfig, ServerConfig
from ..engine import Engine
from ..metrics import Metrics
from .bridge import Bridge
from .chat import load_chat_template
from .grpc_server import start_grpc
from .http_server import HttpApi

log = logging.getLogger("quicksilver.server")


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: `serve` owns SIGTERM/SIGINT and the shutdown order."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:
        pass


class Server:
    """Everything `runtime serve` runs; `start()` binds ports, `stop()` drains and shuts down."""

    def __init__(self, engine_dir, engine_config: EngineConfig, config: ServerConfig):
        t0 = time.perf_counter()
        self.engine = Engine(engine_dir, engine_config)
        self.config, self.metrics = config, Metrics()
        self.aengine = AsyncEngine(self.engine, on_step=self.metrics.on_step)
        self.bridge = Bridge(self.aengine, self.metrics, config)
        self.load_s = time.perf_counter() - t0
        self.grpc = self.http = self._http_task = None
        self.grpc_port = self.http_port = None

    async def start(self) -> None:
        c = self.config
        if c.grpc_port >= 0:
            self.grpc, self.grpc_port, self._health = await start_grpc(self.bridge, c)
        if c.http_port >= 0:
            api = HttpApi(self.bridge, load_chat_template(self.engine.runner.engine_dir))
            ssl = dict(ssl_certfile=str(c.tls_cert), ssl_keyfile=str(c.tls_key)) if c.tls_cert else {}
            self.http = _Uvicorn(uvicorn.Config(api.app, host=c.host, port=c.http_port, log_level="warning",
                                                lifespan="off", access_log=False, timeout_graceful_shutdown=1, **ssl))
            self._http_task = asyncio.create_task(self.http.serve())
            while not self.http.started:
                if self._http_task.done():
                    self._http_task.result()       # raises the bind error
                await asyncio.sleep(0.01)
            self.http_port = self.http.servers[0].sockets[0].getsockname()[1]
        e, m = self.engine, self.engine.runner.manifest
        log.info("serving %s (%s, %s weights, %s KV, context %d, %d slots%s) on %s grpc=%s http=%s, loaded in %.2f s",
                 self.bridge.model_name, m["model"]["architecture"], m["precision"]["weights"],
                 m["precision"]["kv_cache"], e.max_model_len,
                 e.kv.num_slots, f", speculation={e.config.speculation}" if e.speculator else "",
                 c.host, self.grpc_port, self.http_port, self.load_s)

    async def stop(self) -> None:
        """Stop accepting, give in-flight requests `grace_s` to finish, cancel the rest, stop everything."""
        b = self.bridge
        b.draining = True
        if self.grpc is not None:
            await self._health.enter_graceful_shutdown()
            grpc_stop = asyncio.create_task(self.grpc.stop(self.config.grace_s))
        deadline = time.monotonic() + self.config.grace_s
        while b.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self.engine.requests):
            self.aengine.abort(rid)
        if self.grpc is not None:
            await grpc_stop
        if self.http is not None:
            self.http.should_exit = True
            await self._http_task
        self.aengine.shutdown()


async def serve(engine_dir, engine_config: EngineConfig, config: ServerConfig) -> None:
    server = Server(engine_dir, engine_config, config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: draining for up to %.0f s", config.grace_s)
    await server.stop()
    log.info("stopped")
