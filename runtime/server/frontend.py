"""The per-request policy both transports share, applied once: which model serves a request (the one it names,
or for "auto" the one the route policy picks), the semantic cache (lookup with the checks admission would make,
and keeping the answer), and opening the request's stream with fallback when an auto-routed model sheds it.
Transports parse, call these, and format."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from ..async_engine import Arrivals
from ..request import InvalidRequest, SamplingParams
from . import semantic_cache
from .bridge import Bridge, Draining, Overloaded, check_tag
from .router import Route, Router

log = logging.getLogger("quicksilver.server")
CACHE_HEADER = "x-quicksilver-cache"     # HTTP header and gRPC metadata: bypass | miss | hit; …


class Frontend:
    def __init__(self, router: Router, cache: semantic_cache.SemanticCache | None = None,
                 arrivals: Arrivals | None = None):
        """`arrivals`: the requests being received, which the transports count (the engines wait for them)."""
        self.router, self.cache = router, cache
        self.arrivals = arrivals if arrivals is not None else Arrivals()

    async def choose(self, model, text_prompt: bool, count: Callable[[Bridge], Awaitable],
                     prompt_len: Callable[[object], int], max_tokens: int | None):
        """(bridge, route or None, the first model's prepared prompt or None). `count(bridge)` prepares the
        prompt for a model (its template and tokenizer), `prompt_len` reads its token count from what `count`
        returned; `max_tokens` None: the request leaves it to the context (it passes no max_tokens bound)."""
        named = self.router.named(model)
        if named is not None:
            return named, None, None
        if not text_prompt:
            raise InvalidRequest("token-id prompts belong to one model's vocabulary: name the model "
                                 "(\"auto\" routes text prompts)")
        counted = await count(self.router.primary)
        route: Route = self.router.auto(prompt_len(counted), max_tokens)
        return route.bridge, route, counted

    async def first_output(self, bridge: Bridge, route: Route | None, prompt_tokens: int, max_tokens: int | None,
                           open_stream: Callable[[Bridge], object], on_fallback: Callable[[Bridge], Awaitable]):
        """(bridge, route, stream, its first output): admission and shedding happen at the first output. When an
        auto-routed model sheds the request (its queue filled after routing), the route's fallback takes it:
        `on_fallback(bridge)` prepares the request for that model before `open_stream(bridge)` opens it there."""
        stream = open_stream(bridge)
        try:
            return bridge, route, stream, await _first(stream)
        except Overloaded as e:
            fallback = route and e.shed and self.router.fallback_after(bridge, prompt_tokens, max_tokens)
            if not fallback:
                raise
        await on_fallback(fallback.bridge)
        stream = open_stream(fallback.bridge)
        return fallback.bridge, fallback, stream, await _first(stream)

    async def lookup(self, bridge: Bridge, query: semantic_cache.Query | None, prompt: list[int],
                     params: SamplingParams, priority: int, floor: int, tenant=None, tag: str = ""):
        """(hit or None, {CACHE_HEADER: …}): the cache's answer, after the checks the bridge makes before admission
        (an answer from the cache passes no more than a generated one would: a hit counts against the caller's
        tenant limits as a request of its prompt and answer). `query` None: not cacheable. A lookup that fails
        (a model or index error) is logged and is a miss: the request is generated."""
        if self.cache is None:
            return None, {}
        if query is None:
            bridge.metrics.on_semantic_lookup("bypass")
            return None, {CACHE_HEADER: "bypass"}
        if bridge.draining:
            raise Draining("the server is shutting down")
        check_tag(tag)
        bridge.check_priority(priority, floor)
        bridge.check_limits(prompt, params)
        t0 = time.perf_counter()
        try:
            hit = await asyncio.to_thread(self.cache.lookup, query)
        except Exception:     # noqa: BLE001  (the cache only saves work: the request is generated instead)
            log.exception("semantic cache: a lookup failed; the request is generated")
            hit = None
        if hit is not None and not fits(hit.answer, params.max_tokens):
            query.rejected.append("length")
            hit = None
        bridge.metrics.on_semantic_lookup(hit.kind if hit else "miss", time.perf_counter() - t0)
        if hit is not None:                 # answered at once: admitted and settled as a generated request is
            bridge.admit(tenant, len(prompt), params.max_tokens)
            bridge.settle(tenant, params.max_tokens - hit.answer.completion_tokens, hit.answer.completion_tokens)
        for rejected in query.rejected:
            bridge.metrics.on_semantic_candidate(rejected)
        if hit is None:
            return None, {CACHE_HEADER: "miss"}
        if hit.kind == "semantic":
            bridge.metrics.on_semantic_candidate("verified")
        return hit, {CACHE_HEADER: hit.describe()}

    def keeper(self, query: semantic_cache.Query | None):
        """None, or the callback that stores a finished answer `keep(text, token_ids, last output)`."""
        if self.cache is None or query is None:
            return None

        async def keep(text: str, token_ids: list[int], out) -> None:
            if out.finish_reason not in ("stop", "length") or out.usage is None:
                return
            try:
                answer = semantic_cache.Answer(text, out.finish_reason, out.usage.completion_tokens,
                                               tuple(token_ids))
                await asyncio.to_thread(self.cache.store, query, answer)
            except Exception:     # noqa: BLE001  (the answer was generated and goes out; only caching failed)
                log.exception("semantic cache: storing an answer failed")
            for name, b in self.router.bridges.items():     # a store may have evicted other models' entries
                b.metrics.semantic_entries.set(self.cache.count(name))
        return keep


async def _first(stream):
    """A stream's first output; the stream is closed (its request aborted) if there is none."""
    try:
        return await stream.__anext__()
    except BaseException:
        await stream.aclose()
        raise


def fits(answer: semantic_cache.Answer, max_tokens: int) -> bool:
    """Whether a stored answer is the one a request allowed `max_tokens` would get: no longer, and not cut at a
    length this request would have gone past (a paraphrase's chat default, the rest of a context of another
    length, may differ from the stored request's)."""
    n = answer.completion_tokens
    return n <= max_tokens and not (answer.finish_reason == "length" and n < max_tokens)
