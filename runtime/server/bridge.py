"""Bridge: the one place where transports (gRPC, HTTP) meet the engine — limits, shedding, deadlines,
draining, metrics and the per-request log line. Transports translate its exceptions into their own codes (and
count them in quicksilver_request_errors, since they also refuse requests before any reach the bridge):

    InvalidRequest → INVALID_ARGUMENT / 400      Overloaded → RESOURCE_EXHAUSTED / 429 (+ retry hint)
    asyncio.TimeoutError → DEADLINE_EXCEEDED / 504   Unavailable (Draining, ReplicaLost) → UNAVAILABLE / 503
    Failed (the engine step that carried the request failed) → INTERNAL / 500
    RecursionError (input nested too deeply for a parser) → INVALID_ARGUMENT / 400

Every message a client gets goes through `brief` (at most MAX_ERROR_BYTES); JSON from clients through `load_json`
(at most MAX_JSON_DEPTH deep).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import AsyncIterator

from ..async_engine import AsyncEngine
from ..config import ServerConfig
from ..engine import MAX_PRIORITY, MIN_PRIORITY, EngineOverloaded
from ..metrics import Metrics
from ..outputs import RequestOutput
from ..prefix_tokenizer import PrefixTokenizer
from ..request import InvalidRequest, SamplingParams, new_id
from .tenants import DEFAULT, RateLimited, Tenant, TenantLimits

log = logging.getLogger("quicksilver.server")
# a line per finished, failed, refused or aborted request (runtime serve --disable-log-requests silences it)
request_log = logging.getLogger("quicksilver.server.requests")
MAX_TAG = 256             # longest client-chosen request id (echoed in every message)


def check_tag(tag: str) -> None:
    """A client-chosen request id: at most MAX_TAG characters, printable (it is logged: a line break in it forged
    request-log lines)."""
    if len(tag) > MAX_TAG:
        raise InvalidRequest(f"request_id is {len(tag)} characters; at most {MAX_TAG}")
    if not tag.isprintable():
        raise InvalidRequest("request_id must be printable text (no control characters or line breaks)")
INLINE_CHARS = 512        # most characters tokenized on the event loop (~0.2 ms with the bundled tokenizer)
INLINE_TEXT_CHARS = 1 << 16   # longest prompt tokenized there at all (reusing its ids is linear in its length)
MAX_ERROR_BYTES = 1024    # longest error message (UTF-8) a client gets: gRPC sends it as metadata (8 KB by default)
MAX_JSON_DEPTH = 64       # deepest nesting of arrays and objects in a request body or a JSON schema


def brief(message: str) -> str:
    """An error message as a client gets it: at most MAX_ERROR_BYTES of UTF-8, cut on a character boundary and
    ended with an ellipsis (messages may echo input, which may be megabytes)."""
    data = message.encode("utf-8", "replace")
    if len(data) <= MAX_ERROR_BYTES:
        return message
    return data[:MAX_ERROR_BYTES - 3].decode("utf-8", "ignore") + "…"


def json_depth(value, stop: int = MAX_JSON_DEPTH) -> int:
    """How deep arrays and objects nest in `value` (a scalar: 0; `[[]]`: 2), counted level by level without
    recursion; counting ends past `stop`."""
    depth, level = 0, [value]
    while depth <= stop:
        level = [v for v in level if isinstance(v, (dict, list))]
        if not level:
            break
        depth += 1
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v)]
    return depth


def load_json(text: str | bytes, what: str = "the body"):
    """JSON text → value, nested at most MAX_JSON_DEPTH deep; else InvalidRequest, also where it is not JSON at all
    (malformed, not UTF-8, or an integer past Python's 4,300 digits: a ValueError that was a 500 over HTTP and an
    UNKNOWN over gRPC). The parser recurses: nesting past the interpreter's limit ends it with a RecursionError."""
    try:
        value = json.loads(text)
    except RecursionError:
        value = None
    except ValueError as e:                      # JSONDecodeError, UnicodeDecodeError, the digits limit
        raise InvalidRequest(f"{what} is not valid JSON: {e}") from None
    else:
        if json_depth(value) <= MAX_JSON_DEPTH:
            return value
    raise InvalidRequest(f"{what} is nested more than {MAX_JSON_DEPTH} deep (arrays and objects)")


if sys.version_info >= (3, 11):
    async def _next_within(gen: AsyncIterator, seconds: float):
        """`gen`'s next item, or asyncio.TimeoutError after `seconds`. A timer on the awaiting task: wait_for wraps
        each await in a task of its own, one more task per streamed output (Python < 3.12)."""
        async with asyncio.timeout(seconds):
            return await gen.__anext__()
else:                                      # pragma: no cover (3.10)
    def _next_within(gen: AsyncIterator, seconds: float):
        return asyncio.wait_for(gen.__anext__(), seconds)


class Overloaded(Exception):
    def __init__(self, message: str, retry_after_s: float, shed: bool = True):
        """`shed`: the engine's queue was full (another model may take the request); False: the caller's own
        rate limit, which holds on every model."""
        super().__init__(message)
        self.retry_after_s, self.shed = retry_after_s, shed


class Unavailable(Exception):
    """Not served now; the same request may succeed if retried."""


class Draining(Unavailable):
    """The server is shutting down and takes no new requests."""


class ReplicaLost(Unavailable):
    """The replica running the request stopped (runtime serve --replicas); Ray Serve starts another."""


class Failed(Exception):
    """The engine failed the request (a step that carried it raised); the message is the engine's reason."""


class Bridge:
    def __init__(self, aengine: AsyncEngine, metrics: Metrics, config: ServerConfig, tracing=None,
                 model_name: str | None = None, limits: TenantLimits | None = None):
        """`tracing`: a runtime.tracing.Tracing when requests are traced, else None (no tracing work at all).
        `model_name`: the id clients use (default: config.model_name, else the engine folder's name).
        `limits`: the tenants' buckets, shared by every model a server hosts (default: built from config)."""
        self.aengine, self.metrics, self.config, self.tracing = aengine, metrics, config, tracing
        self.limits = limits if limits is not None else TenantLimits(config.tenants) if config.tenants else None
        info = self.info = aengine.info
        self.model_name = model_name or config.model_name or info.name
        self.max_model_len, self.max_waiting = info.max_model_len, info.max_waiting
        self.tokenizer = aengine.tokenizer
        self.prompts = PrefixTokenizer(aengine.tokenizer)    # a next turn, a new question: only what is new
        self.draining = False
        self.active: set[str] = set()   # engine ids of the requests being streamed (touched on the event loop only)

    @property
    def in_flight(self) -> int:
        return len(self.active)

    @property
    def waiting(self) -> int:
        """Requests queued for a slot (read from another thread: a snapshot, which is all routing needs)."""
        return self.aengine.num_waiting

    def abort_all(self) -> None:
        """Abort every request being streamed (through the engine's inbox: no engine state is read here)."""
        for rid in list(self.active):
            self.aengine.abort(rid)

    async def encode(self, text: str) -> list[int]:
        """The tokenizer's ids for `text`, reusing a recent prompt's where the text extends it. A prompt of at
        most INLINE_TEXT_CHARS with at most INLINE_CHARS to tokenize (a chat's next turn, a short prompt: 0.12 ms
        for a 6K-character chat) is done here on the event loop, where a worker thread's hand-off and wake-up cost
        more than the work; anything more goes to a thread, so a long prompt never stalls the loop (the
        tokenizer's `encode_batch` releases the GIL while it works)."""
        ids = self.prompts.encode(text, max_chars=INLINE_CHARS) if len(text) <= INLINE_TEXT_CHARS else None
        return ids if ids is not None else await asyncio.to_thread(self.prompts.encode, text)

    async def decode(self, ids: list[int]) -> str:
        return (await asyncio.to_thread(self.tokenizer.decode_batch, [ids]))[0]

    def check_choices(self, n: int, tenant: Tenant | None = None) -> None:
        """A request for `n` choices queues n requests at once: more than --max-waiting, or than the tenant may run at
        once, could never all be taken (a 429 there asked the client to retry what can never succeed)."""
        if n > 1 and n > self.max_waiting:
            raise InvalidRequest(f"n={n} is more choices than this server queues at once (--max-waiting "
                                 f"{self.max_waiting}); ask for at most {self.max_waiting}")
        limit = tenant.max_concurrency if tenant is not None else None
        if n > 1 and limit is not None and n > limit:
            raise InvalidRequest(f"n={n} is more choices than tenant {tenant.name} may run at once "
                                 f"(max_concurrency {limit}); ask for at most {limit}")

    def _compile(self, constraint) -> None:
        """Compile a request's constraint (in a worker thread: cached, but a first compile takes milliseconds)
        and pin it until the engine has the request (the caller unpins)."""
        if constraint.kind == "json_schema":
            load_json(constraint.spec, "json_schema")
        try:
            self.aengine.grammars.pin(constraint)
        except RecursionError:
            raise InvalidRequest(f"the {constraint.kind} constraint is nested too deeply to compile") from None

    def check_limits(self, prompt: list[int], params: SamplingParams) -> None:
        c = self.config
        if c.max_tokens_limit is not None and params.max_tokens > c.max_tokens_limit:
            raise InvalidRequest(f"max_tokens {params.max_tokens} exceeds this server's limit of {c.max_tokens_limit}")
        if c.max_prompt_tokens is not None:
            n = len(prompt)
            if n > c.max_prompt_tokens:
                raise InvalidRequest(f"prompt has {n} tokens; this server accepts at most {c.max_prompt_tokens}")

    @staticmethod
    def default_priority(priority, floor: int):
        """`priority` as asked, or where the request asks for none (HTTP: absent; gRPC: 0, which proto3 cannot tell
        from unset) 0, or the caller's floor above it: a caller held to a floor of 10 that asked for nothing was
        refused for asking for 0."""
        return max(0, floor) if priority is None else priority

    @staticmethod
    def check_priority(priority: int, floor: int) -> None:
        """Lower is more urgent; `floor` is the most urgent this caller may ask for (auth.priority_floor)."""
        if isinstance(priority, bool) or not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            raise InvalidRequest(f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], not {priority!r}")
        if priority < floor:
            raise InvalidRequest(f"priority {priority} is more urgent than this caller may ask for "
                                 f"(lowest allowed: {floor})")

    async def stream(self, prompt: str | list[int], params: SamplingParams, tag: str = "", priority: int = 0,
                     timeout_s: float | None = None, priority_floor: int = 0,
                     arrival: float | None = None, carrier=None, tenant=None) -> AsyncIterator[RequestOutput]:
        """Validate, admit and stream one request; the request is aborted if the consumer stops early.
        The bridge names the request itself (unguessable, so no client can take or collide with another's id);
        `tag` is the client's own name for it (a gRPC request_id, an HTTP response id), only logged here.
        `arrival` (time.monotonic) is when the transport received the request: TTFT and queue time count from it.
        `carrier`: the transport's headers or metadata, for the caller's W3C trace context when tracing.
        `priority_floor`, `tenant`: the caller's (auth.identify), whose limits the request counts against."""
        if self.draining:
            raise Draining("the server is shutting down")
        check_tag(tag)
        self.check_priority(priority, priority_floor)
        if isinstance(prompt, str):   # here, not on the engine thread, where encode would hold the GIL
            prompt = await self.encode(prompt)
        self.check_limits(prompt, params)
        if params.constraint is not None:   # compiled here (cached), not on the engine thread where it would stall steps
            await asyncio.to_thread(self._compile, params.constraint)
        try:
            if self.draining:         # checked again: the server may have begun to stop while we tokenized
                raise Draining("the server is shutting down")
            self.admit(tenant, len(prompt), params.max_tokens)
            generated, shed, inner = 0, False, self._stream(prompt, params, tag, priority, timeout_s, arrival, carrier)
            try:
                async for out in inner:
                    generated += len(out.token_ids)
                    yield out
            except (Overloaded, InvalidRequest):
                shed = generated == 0     # never ran (shed, or refused by the engine): its prompt and place refunded
                raise
            finally:
                await inner.aclose()      # now, not at garbage collection: closing it aborts an unfinished request
                self.settle(tenant, params.max_tokens - generated + (len(prompt) if shed else 0), generated,
                            ran=not shed)
        finally:
            if params.constraint is not None:
                self.aengine.grammars.unpin(params.constraint)

    def token_room(self, tenant, prompt_tokens: int) -> int | None:
        """The most new tokens a request of `tenant` with this prompt could ever be admitted with (its
        tokens_per_minute less the prompt), or None where no such limit applies."""
        if tenant is None or self.limits is None or tenant.name not in self.limits.tokens:
            return None
        return int(self.limits.tokens[tenant.name].capacity) - prompt_tokens

    def admit(self, tenant, prompt_tokens: int, max_tokens: int) -> None:
        """Count a request (generated or answered from the semantic cache) against its caller's tenant limits:
        over them, Overloaded (not shed: the caller's limit holds on every model). Settle it when it ends."""
        name = tenant.name if tenant is not None else DEFAULT
        if tenant is not None and self.limits is not None:
            try:
                self.limits.admit(tenant, prompt_tokens + max_tokens)
            except RateLimited as e:
                self.metrics.on_tenant(name, "rate_limited")
                raise Overloaded(str(e), e.retry_after_s, shed=False) from None
        self.metrics.on_tenant(name, "admitted", prompt_tokens)

    def settle(self, tenant, unused_tokens: int, generated: int, ran: bool = True) -> None:
        """An admitted request ended: its tokens counted, its slot and the tokens it did not use given back (and
        its place in requests_per_minute where it never ran)."""
        self.metrics.on_tenant_tokens(tenant.name if tenant is not None else DEFAULT, generated)
        if tenant is not None and self.limits is not None:
            self.limits.release(tenant, unused_tokens, ran)

    async def _stream(self, prompt: list[int], params: SamplingParams, tag: str, priority: int,
                      timeout_s: float | None, arrival: float | None, carrier) -> AsyncIterator[RequestOutput]:
        timeout = min(timeout_s or self.config.request_timeout_s, self.config.request_timeout_s)
        deadline = time.monotonic() + timeout
        rid = new_id("req-")
        span = None
        if self.tracing is not None:
            span = self.tracing.start(carrier, arrival or time.monotonic(), {
                "quicksilver.request_id": rid, "gen_ai.request.model": self.model_name,
                "gen_ai.request.max_tokens": params.max_tokens, "gen_ai.request.temperature": params.temperature,
                "quicksilver.priority": priority, "quicksilver.constrained": params.constraint is not None})
        gen = self.aengine.generate(prompt, params, rid, priority, arrival)
        self.active.add(rid)
        last, finished, refused, failed = None, None, None, None
        name = f"{rid} ({tag})" if tag else rid      # for the log lines
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise asyncio.TimeoutError
                try:
                    out = await _next_within(gen, remaining)
                except EngineOverloaded as e:
                    refused = e
                    raise Overloaded(str(e), retry_after_s=1.0) from None
                except InvalidRequest as e:
                    refused = e
                    raise
                except StopAsyncIteration:
                    return
                now = time.monotonic()
                if last is not None:          # the first message's wait is a TTFT, not an inter-token latency
                    self.metrics.observe_itl(now - last, len(out.token_ids), len(prompt))
                if out.token_ids:
                    last = now
                if out.error is not None:
                    failed = out
                    raise Failed(out.error)
                if out.finished:
                    finished = out
                yield out
                if out.finished:
                    return
        finally:
            self.active.discard(rid)
            await gen.aclose()        # aborts the request (and frees its KV) if it did not finish
            self._ended(name, span, finished, failed, refused)

    def _ended(self, name: str, span, finished, failed, refused) -> None:
        """A request's end in the metrics, the request log and its trace: finished, failed (an engine error),
        refused (before it ran) or aborted (the client went away, a deadline, shutdown)."""
        if finished is not None:
            self.metrics.on_finish(finished.finish_reason, finished.usage)
            u = finished.usage
            request_log.info("%s prompt=%d cached=%d completion=%d ttft_ms=%.1f e2e_ms=%.1f finish=%s", name,
                             u.prompt_tokens, u.cached_tokens, u.completion_tokens, 1e3 * (u.ttft_s or 0),
                             1e3 * (u.e2e_s or 0), finished.finish_reason)
        elif failed is not None:
            self.metrics.on_finish("error", None)
            request_log.info("%s failed: %s", name, failed.error)
        elif refused is not None:
            request_log.info("%s refused: %s", name, refused)
        else:
            self.metrics.on_finish("abort", None)
            request_log.info("%s aborted (client gone, deadline or shutdown)", name)
        if span is not None:
            self.tracing.end(span, finished.usage if finished else None,
                             finished.finish_reason if finished else "error" if failed or refused else "abort",
                             failed.error if failed else str(refused) if refused else None)
