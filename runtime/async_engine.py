"""AsyncEngine: the Engine on its own loop thread, with asyncio streams per request.

Thread-safety: the Engine and everything it owns are touched only by the loop thread. Callers (asyncio
servers, tests) hand it work through a locked inbox and receive outputs through their own event loop
(`call_soon_threadsafe`), so no engine state is shared. ONNX Runtime releases the GIL while it computes,
so the event loop stays responsive during steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from .engine import Engine
from .outputs import RequestOutput
from .request import SamplingParams

log = logging.getLogger("quicksilver.engine")
# The engine's loop thread and the servers' event loop hand the GIL to each other many times a request (a step's
# ONNX Runtime call, a prompt's tokenization and numpy copies release it); a thread that wants it back while the
# other runs Python waits up to the interpreter's switch interval, 5 ms by default (more than a decode step of
# the bundled model). At 0.5 ms: an 8k-token prompt served warm right after its first turn 39 vs 55 ms at the
# API (smollm2 int4, AMD EPYC Zen 4, medians of 4 rounds), decode rates at conc 1 and 8 unchanged (1.03x, 1.02x).
# The interval is the interpreter's, for every thread of the process, and stays lowered after shutdown.
SWITCH_INTERVAL_S = 0.0005
# How long an idle engine waits, at most, for requests a transport has received but not yet handed over (see
# Arrivals) before it starts a step. A burst of 8 streaming requests reaches the server within 1–7 ms, but each
# is read, parsed and tokenized before it reaches the engine: the first started a prefill alone and the others
# came in while it ran — prefilled in slices beside the first one's decodes (steps up to 2x long for ~40 steps) or
# in a second burst (the first stream stalled ~1 s). Waited for (smollm2 int4 at the API, AMD EPYC Zen 4, 6
# rounds): the burst is one prefill, the streams' longest gap 20.7 vs 631 ms, decode per stream 1.14x.
GATHER_S = 0.010


class Arrivals:
    """Requests a transport has received and not yet handed to an engine: their body being read and parsed, their
    prompt tokenized and routed. An idle engine about to start a step on what it has waits (at most GATHER_S) until
    they are handed over, so requests that arrive together are computed together. A lone request waits for
    nothing. Shared by every engine of a server (a request counts before it is known which model it is for).

    A transport counts a request with `with arrivals.receiving():` around its handling; `AsyncEngine.generate`
    hands it over when it posts it (the count is a context variable of the request's task, so nothing is passed
    down the call chain), and leaving the block releases it in any case: answered from a cache, refused."""

    def __init__(self):
        self._pending = 0
        self._quiet = threading.Condition()

    @property
    def pending(self) -> int:
        return self._pending

    @contextlib.contextmanager
    def receiving(self) -> Iterator[None]:
        ticket = _Ticket(self)
        with self._quiet:
            self._pending += 1
        try:
            _RECEIVING.set(ticket)
            yield
        finally:
            ticket.handed_over()      # (the variable may stay set: a released ticket is released once)

    def _release(self) -> None:
        with self._quiet:
            self._pending -= 1
            if not self._pending:
                self._quiet.notify_all()

    def wait_quiet(self, timeout: float) -> bool:
        """Wait until no request is being received, at most `timeout` seconds; whether there were any."""
        with self._quiet:
            if not self._pending:
                return False
            self._quiet.wait_for(lambda: not self._pending, timeout)
            return True


class _Ticket:
    """One received request's count in its Arrivals, released once."""

    def __init__(self, arrivals: Arrivals):
        self.arrivals, self.released = arrivals, False

    def handed_over(self) -> None:
        if not self.released:
            self.released = True
            self.arrivals._release()


_RECEIVING: contextvars.ContextVar[_Ticket | None] = contextvars.ContextVar("quicksilver_receiving", default=None)


@dataclass
class _Submit:
    prompt: str | list[int]
    params: SamplingParams
    request_id: str
    priority: int
    arrival: float                     # when the caller received the request (time.monotonic)
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    accepted: asyncio.Future
    engine_id: str | None = None       # set by the loop thread once the engine took it


class AsyncEngine:
    def __init__(self, engine: Engine, on_step=None, arrivals: Arrivals | None = None, gather_s: float = GATHER_S):
        """`on_step(engine)`, if given, runs on the loop thread after every step (metrics). `arrivals`: the
        server's requests still being received, which an idle engine waits for, at most `gather_s` (Arrivals)."""
        self.engine, self.on_step, self.arrivals, self.gather_s = engine, on_step, arrivals, gather_s
        self.info, self.tokenizer, self.grammars = engine.info, engine.tokenizer, engine.grammars
        self._inbox: list = []
        self._wake = threading.Condition()
        self._queues: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._stopping = False
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:     # (never raised: a host process may want it lower)
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._thread = threading.Thread(target=self._loop, name="quicksilver-engine", daemon=True)
        self._thread.start()

    # -- caller side (any thread / event loop) ----------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str = "",
                       priority: int = 0, arrival: float | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; raises InvalidRequest / EngineOverloaded before the first one.
        Closing the iterator early (client gone, cancellation) aborts the request and frees its KV. TTFT counts
        from `arrival` (time.monotonic when the transport received it), by default from this call: the inbox wait
        and tokenization are part of what the client waits for."""
        loop = asyncio.get_running_loop()
        sub = _Submit(prompt, params or SamplingParams(), request_id, priority,
                      time.monotonic() if arrival is None else arrival, asyncio.Queue(), loop, loop.create_future())
        self._post(sub)
        ticket = _RECEIVING.get()
        if ticket is not None:        # the transport's request has reached an engine
            ticket.handed_over()
        finished = False
        try:
            await sub.accepted
            while True:
                out = await sub.queue.get()
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            if not finished:          # also when the caller gave up before the engine took the request
                self._post(("cancel", sub))

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot (read from another thread: a snapshot, which is all routing needs)."""
        return self.engine.num_waiting

    @property
    def alive(self) -> bool:
        """The loop thread runs (it stops only at shutdown, or if the loop itself failed)."""
        return self._thread.is_alive()

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def shutdown(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    def _post(self, item) -> None:
        with self._wake:
            self._inbox.append(item)
            self._wake.notify()

    # -- loop thread ------------------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their callers: one wake-up per event loop per step (each
        call_soon_threadsafe writes the loop's self-pipe), not one per request."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            entry = self._queues.get(out.request_id)
            if entry is None:
                continue
            queue, loop = entry
            if out.finished:
                del self._queues[out.request_id]
            batches.setdefault(loop, []).append((queue, out))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:   # the caller's event loop is closed: nobody is listening
                pass

    def _drain_inbox(self) -> None:
        with self._wake:
            items, self._inbox = self._inbox, []
        for item in items:
            if isinstance(item, _Submit):
                try:
                    req = self.engine.add_request(item.prompt, item.params, item.request_id, item.priority,
                                                  item.arrival)
                except Exception as e:  # InvalidRequest / EngineOverloaded reach the caller as exceptions
                    item.loop.call_soon_threadsafe(_set_exception, item.accepted, e)
                    continue
                item.engine_id = req.request_id
                self._queues[req.request_id] = (item.queue, item.loop)
                item.loop.call_soon_threadsafe(_set_result, item.accepted, req.request_id)
                continue
            kind, target = item   # ("abort", request id) | ("cancel", _Submit): the inbox is FIFO, so a cancel
            rid = target if kind == "abort" else target.engine_id    # always follows its submit's handling
            out = self.engine.abort(rid) if rid else None
            if out is not None:
                self._deliver([out])

    def _idle_slice(self) -> bool:
        try:
            return self.engine.idle()
        except Exception:   # idle work is an optimisation: a failure must not stop serving
            log.exception("idle work failed")
            return False

    def _loop(self) -> None:
        idle_left = True                  # the engine may have idle work (after any step it may)
        while True:
            with self._wake:
                while (idle := not self._inbox and not self._stopping and not self.engine.has_work()) and not idle_left:
                    self._wake.wait()
                stopping = self._stopping
            if idle:                      # a slice at a time: a request arriving waits for one slice at most
                idle_left = self._idle_slice()
                continue
            idle_left = True
            was_idle = not self.engine.has_work()
            self._drain_inbox()           # at shutdown too: aborts posted just before it still free their KV
            if stopping:
                return
            gather = was_idle and self.arrivals is not None and self.engine.has_work()
            if gather and self.arrivals.wait_quiet(self.gather_s):
                self._drain_inbox()       # what came in meanwhile starts with it
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug must not kill the loop: fail the running requests, keep serving
                log.exception("engine step failed")
                outputs = self.engine.fail_all(f"internal error: {type(e).__name__}: {e}")
            self._deliver(outputs)
            if self.on_step is not None:
                try:
                    self.on_step(self.engine)
                except Exception:     # metrics must never stop the engine
                    log.exception("on_step callback failed")


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
