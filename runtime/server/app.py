"""`runtime serve`: load the engine, run gRPC and HTTP on one event loop, shut down gracefully on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import ssl
import sys
import time
from dataclasses import replace
from pathlib import Path

import uvicorn

from ..async_engine import Arrivals, AsyncEngine
from ..config import EngineConfig, ServerConfig
from ..engine import Engine
from ..metrics import Metrics
from .bridge import Bridge
from .frontend import Frontend
from .chat import load_chat_template
from .grpc_server import start_grpc
from .http_server import HttpApi
from .router import Router
from .tenants import TenantLimits

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

    def __init__(self, engine_dir, engine_config: EngineConfig, config: ServerConfig,
                 models: dict[str, Path] | None = None):
        """`models`: more engines to host beside `engine_dir` (name → engine folder), without speculation; requests
        pick one by name or are routed by config.route (runtime.server.router)."""
        check_config(config)            # before the engine loads: a typo should not cost a model load
        t0 = time.perf_counter()
        self.config = config
        self.tracing = None
        if config.otlp_endpoint:
            from ..tracing import Tracing
            self.tracing = Tracing(config.otlp_endpoint, service_name=f"quicksilver:{Path(engine_dir).name}")
        limits = TenantLimits(config.tenants) if config.tenants else None      # one set of buckets for all models
        arrivals = Arrivals()           # requests the transports are reading, which idle engines wait for
        self.bridges: list[Bridge] = []
        self.cluster = None
        try:
            hosted = [(config.model_name, engine_dir, engine_config)]
            hosted += [(name, path, replace(engine_config, draft=None, speculation=None))
                       for name, path in (models or {}).items()]
            if config.cluster is not None:     # engines as Ray Serve replicas; Ray is imported only here
                from ..cluster.remote import Cluster
                self.cluster = Cluster(config.cluster)
            self.engines: list[Engine] = []      # the local engines (tests reach into them; serving never does)
            for name, path, econf in hosted:
                metrics = Metrics()
                if self.cluster is not None:
                    aengine = self.cluster.deploy(name or Path(path).resolve().name, Path(path), econf)
                else:
                    self.engines.append(Engine(path, econf))
                    aengine = AsyncEngine(self.engines[-1], on_step=metrics.on_step, arrivals=arrivals)
                self.bridges.append(Bridge(aengine, metrics, config, self.tracing, name, limits))
            self.router = Router(self.bridges, config.route)
            self.semantic_cache = None
            if config.semantic_cache is not None:
                from .semantic_cache import SemanticCache
                self.semantic_cache = SemanticCache(config.semantic_cache)
        except BaseException:
            self._shutdown_engines()
            raise
        self.frontend = Frontend(self.router, self.semantic_cache, arrivals)
        self.bridge = self.bridges[0]
        self.engine = self.engines[0] if self.engines else None
        self.aengine, self.metrics = self.bridge.aengine, self.bridge.metrics
        self.load_s = time.perf_counter() - t0
        self.grpc = self.http = self._http_task = None
        self.grpc_port = self.http_port = None

    async def start(self) -> None:
        """Bind both ports exclusively or raise OSError naming the one that is taken (nothing left running)."""
        c = self.config
        # The HTTP socket is ours (uvicorn would log a traceback and exit); the gRPC port is probed the same way
        # first, since gRPC's own bind error says only "Failed to bind".
        http_sock = listen_socket(c.host, c.http_port, "HTTP") if c.http_port >= 0 else None
        try:
            if c.grpc_port > 0:
                listen_socket(c.host, c.grpc_port, "gRPC").close()
            if c.grpc_port >= 0:
                self.grpc, self.grpc_port, self._health = await start_grpc(self.frontend, c)
        except BaseException:
            if http_sock is not None:
                http_sock.close()
            await asyncio.to_thread(self._shutdown_engines)
            raise
        if http_sock is not None:
            api = HttpApi(self.frontend, {b.model_name: load_chat_template(b.info.engine_dir,
                                                                         template_file=c.chat_template)
                                        for b in self.bridges})
            tls = dict(ssl_certfile=str(c.tls_cert), ssl_keyfile=str(c.tls_key)) if c.tls_cert else {}
            self.http = _Uvicorn(uvicorn.Config(api.app, host=c.host, port=c.http_port, log_level="warning",
                                                lifespan="off", access_log=False, timeout_graceful_shutdown=1, **tls))
            self._http_task = asyncio.create_task(self.http.serve(sockets=[http_sock]))
            while not self.http.started:
                if self._http_task.done():
                    self._http_task.result()
                await asyncio.sleep(0.01)
            self.http_port = http_sock.getsockname()[1]
        for b in self.bridges:
            log.info("%s", _model_line(b, c))
        if any(b.info.manifest.get("target", "cpu") == "cpu" for b in self.bridges):
            from .. import cpu_ops

            log.info("cpu kernels: %s", cpu_ops.describe())
        log.info("features: %s", ", ".join(self.features()) or "none")
        log.info("serving %s on %s grpc=%s http=%s, loaded in %.2f s", ", ".join(self.router.bridges), c.host,
                 self.grpc_port, self.http_port, self.load_s)

    def features(self) -> list[str]:
        """The optional parts that are on, for the startup log."""
        c, policy = self.config, self.router.policy
        on = ["api key" if c.api_key else "", f"tenants ({len(c.tenants)})" if c.tenants else "",
              f"priority keys ({len(c.priority_keys)})" if c.priority_keys else "",
              "semantic cache" if self.semantic_cache is not None else "",
              f"tracing to {c.otlp_endpoint}" if self.tracing is not None else "",
              f"routes ({len(policy.rules)} rules, {len(policy.fallback)} fallbacks)" if self.router.routes else "",
              "TLS" if c.tls_cert else "", f"replicas ({c.cluster.replicas})" if c.cluster else ""]
        return [f for f in on if f]

    async def stop(self) -> None:
        """Stop accepting, give in-flight requests `grace_s` to finish, cancel the rest, stop everything."""
        for b in self.bridges:
            b.draining = True
        if self.grpc is not None:
            await self._health.enter_graceful_shutdown()
            grpc_stop = asyncio.create_task(self.grpc.stop(self.config.grace_s))
        deadline = time.monotonic() + self.config.grace_s
        while any(b.in_flight for b in self.bridges) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for b in self.bridges:
            b.abort_all()
        if self.grpc is not None:
            await grpc_stop
        if self.http is not None:
            self.http.should_exit = True
            await self._http_task
        await asyncio.to_thread(self._shutdown_engines)     # joins the engine threads: not on the event loop
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # exports the spans still buffered

    def _shutdown_engines(self) -> None:
        for b in self.bridges:
            b.aengine.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()


def _model_line(b: Bridge, c: ServerConfig) -> str:
    """What a hosted model is and how many sequences it runs and queues (slots beyond the running ones keep
    finished sequences' KV for reuse)."""
    i = b.info
    m, retained = i.manifest, max(0, i.num_slots - i.max_num_seqs)
    return (f"model {b.model_name}: {m['model']['architecture']}, {m['precision']['weights']} weights, "
            f"{m['precision']['kv_cache']} KV, context {i.max_model_len}, {i.max_num_seqs} running sequences"
            f"{f' (+{retained} slots kept for prefix reuse)' if retained else ''}, {i.max_waiting} queued"
            f"{f', speculation={i.speculation}' if i.speculation else ''}"
            f"{f' per replica, {c.cluster.replicas} replicas' if c.cluster else ''}")


def check_config(c: ServerConfig) -> None:
    """Refuse what would fail (or silently misbehave) only after the model loaded: ports outside 0..65535 (gRPC
    takes 70000 as 4464), a host that does not resolve, a TLS key that does not match its certificate."""
    for name, port in (("--grpc-port", c.grpc_port), ("--http-port", c.http_port)):
        if not -1 <= port <= 65535:
            raise ValueError(f"{name} {port} is not a port (1..65535; 0: any free port; -1: off)")
    try:
        socket.getaddrinfo(c.host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        raise ValueError(f"--host {c.host}: not an address of this machine ({e.strerror or e})") from None
    if c.tls_cert is not None:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(c.tls_cert, c.tls_key)
        except ssl.SSLError as e:
            if "KEY_VALUES_MISMATCH" in str(e):
                raise ValueError(f"TLS key {c.tls_key} does not match certificate {c.tls_cert}") from None
            raise ValueError(f"cannot load TLS certificate {c.tls_cert} with key {c.tls_key}: {e.reason or e}") from None


def listen_socket(host: str, port: int, what: str) -> socket.socket:
    """A listening TCP socket without SO_REUSEPORT: a port another server holds is an error, not a shared port."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.create_server(address, family=family)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)    # accepted connections inherit it
        return sock
    except OSError as e:
        raise OSError(f"cannot listen for {what} on {host}:{port}: {e.strerror or e}") from None


async def serve(engine_dir, engine_config: EngineConfig, config: ServerConfig,
                models: dict[str, Path] | None = None) -> None:
    server = Server(engine_dir, engine_config, config, models)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: draining for up to %.0f s", config.grace_s)
    await server.stop()
    log.info("stopped")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The server's event loop: uvloop where it is installed (not on Windows), else asyncio's own. The engine thread
    hands each step's outputs to the loop with call_soon_threadsafe, which wakes the loop by writing a byte to it;
    asyncio's loop writes it with the GIL released, so the engine thread then waited for the GIL while the loop,
    just woken, streamed those outputs (py-spy, bundled target streaming at conc 1: 11 % of the engine thread's
    samples in that write; 2.9 % with uvloop, whose wake-up keeps the GIL)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(coro):
    """Run the server's main coroutine to completion on `new_event_loop()` (Python 3.10: asyncio's own loop)."""
    if sys.version_info < (3, 11):                 # pragma: no cover
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)
