"""A real Quicksilver server on 127.0.0.1 with ephemeral ports, run on its own event-loop thread."""

from __future__ import annotations

import asyncio
import re
import threading

import httpx

from runtime.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig
from runtime.server.app import Server, new_event_loop


class ServerThread:
    def __init__(self, engine_dir, engine_config: EngineConfig | None = None, models=None, start_timeout: float = 60,
                 **server_kwargs):
        """`models`: more engines to host (name → folder); `server_kwargs`: ServerConfig fields;
        `start_timeout`: seconds the server may take to load (replicas on Ray take longer)."""
        self.loop = new_event_loop()              # uvloop, as `runtime serve` runs
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        econf = engine_config or EngineConfig(SchedulerConfig(max_num_seqs=4, max_waiting=8),
                                              CacheConfig(kv_budget_bytes=32 << 20))
        sconf = ServerConfig(grpc_port=0, http_port=0, **server_kwargs)
        try:
            self.server = self._run(self._make(engine_dir, econf, sconf, models), start_timeout)
        except BaseException:                     # a server refused at start (the tests of bad options) leaves no
            self.close_loop()                    # event loop running on a thread into the interpreter's exit
            raise
        self._run(self.server.start())
        scheme = "https" if sconf.tls_cert else "http"
        self.grpc_target = f"127.0.0.1:{self.server.grpc_port}"
        self.http_url = f"{scheme}://127.0.0.1:{self.server.http_port}"

    async def _make(self, engine_dir, econf, sconf, models):
        return Server(engine_dir, econf, sconf, models)

    def _run(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def metric(self, name: str, **labels) -> float:
        """The sum over the samples of `name` that carry these labels (among others, such as model_name)."""
        text = httpx.get(f"{self.http_url}/metrics", verify=False).text
        total = 0.0
        for found, value in re.findall(rf"^{re.escape(name)}(?:{{([^}}]*)}})? ([0-9.e+-]+)$", text, re.M):
            sample = dict(re.findall(r'(\w+)="([^"]*)"', found))
            if all(sample.get(k) == str(v) for k, v in labels.items()):
                total += float(value)
        return total

    def stop(self, timeout: float = 60) -> None:
        self._run(self.server.stop(), timeout)
        self.close_loop()

    def close_loop(self) -> None:
        """Stop the loop thread and free the loop with its executor threads. Left running, each server's loop
        and its executor threads lived on into the interpreter's exit (33 threads alive after the suite), and one
        CI run of about eight segfaulted there after every test had passed."""
        self._run(self.loop.shutdown_default_executor())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()
