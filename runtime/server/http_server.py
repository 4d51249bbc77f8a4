"""OpenAI-compatible HTTP transport (Starlette): /v1/completions, /v1/chat/completions (SSE streaming),
/v1/models, /health, /metrics. Request JSON ⇄ Bridge, nothing else."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..metrics import CONTENT_TYPE_LATEST, render
from ..outputs import RequestOutput, Usage
from ..request import InvalidRequest, SamplingParams, new_id
from .auth import Unauthenticated, authorization_values, identify
from .bridge import Bridge, Failed, Overloaded, Unavailable, brief, load_json
from . import errors, semantic_cache
from .frontend import Frontend
from .router import AUTO
from .tenants import DEFAULT as DEFAULT_TENANT
from .structured import ToolRequest, response_format
from .token_text import TokenText

log = logging.getLogger("quicksilver.server")
OPEN_PATHS = ("/health", "/metrics")
ARRIVAL = "quicksilver.arrival"   # scope key: time.monotonic() when the request's headers arrived
CALLER = "quicksilver.caller"     # scope key: the auth.Caller its one credential names (read once, by _Guard)
MAX_CHOICES = 16          # most completions (n) one request may ask for


# HTTP status → OpenAI-style error.code (a string, as OpenAI's are); quicksilver_request_errors counts the same names.
CODES = {400: "invalid_argument", 401: "unauthenticated", 404: "not_found", 405: "method_not_allowed",
         413: "request_too_large", 429: "overloaded", 500: "internal", 503: "unavailable", 504: "deadline_exceeded"}


def error(status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_json(status, message, kind), status, headers=headers)


def error_json(status: int, message: str, kind: str) -> dict:
    """Every error a client gets, whole or in a stream: OpenAI's shape, the message `brief` (under 1 KB)."""
    return {"error": {"message": brief(message), "type": kind, "code": CODES.get(status, "internal")}}


def flag(body: dict, key: str, default: bool = False) -> bool:
    """A boolean field: JSON true/false (or absent/null); "yes" or 1 is refused rather than taken as true."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise InvalidRequest(f"{key} must be true or false")
    return v


def _check_unicode(body) -> None:
    """JSON may escape lone surrogates ("\\ud800") that are not text: refuse them here, not with a 500 later."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest("the body holds a lone UTF-16 surrogate (such as \\ud800), which is not text") from None


def _finite(v) -> bool:
    """A JSON number that is finite as a float: not a bool, NaN or ±Infinity, nor an integer too large for a float
    (math.isfinite raised OverflowError on one: a 500)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def sampling_from_json(body: dict, chat: bool) -> tuple[SamplingParams, int]:
    """OpenAI fields (plus top_k, min_p, repetition_penalty, ignore_eos) → (SamplingParams, n choices); defaults as
    OpenAI's; response_format becomes the request's constraint. Fields that would change the result but are not
    supported (best_of ≠ n, suffix) are refused, not ignored."""
    def number(key, default):
        v = body.get(key, default)
        if v is None:
            return default
        if not _finite(v):
            raise InvalidRequest(f"{key} must be a finite number")
        return v

    def integer(key, default):
        v = body.get(key, default)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidRequest(f"{key} must be an integer")
        return v

    n = integer("n", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidRequest(f"n must be in [1, {MAX_CHOICES}]")
    if integer("best_of", n) != n:
        raise InvalidRequest("best_of must equal n (choices are not ranked)")
    if body.get("suffix"):
        raise InvalidRequest("suffix: suffix (insert) completions are not supported")
    if not chat and body.get("tools"):
        raise InvalidRequest("tools are a chat feature: use /v1/chat/completions")
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise InvalidRequest("logit_bias must be an object mapping token ids to biases")
    try:
        bias = {int(k): v for k, v in bias.items()}         # JSON keys are strings; values are checked by SamplingParams
    except ValueError:
        raise InvalidRequest("logit_bias keys must be token ids (integers)") from None
    stop = body.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise InvalidRequest("stop must be a string or a list of strings")
    max_tokens = integer("max_completion_tokens", None) if chat else None
    max_tokens = max_tokens if max_tokens is not None else integer("max_tokens", None if chat else 16)
    if chat:
        logprobs = integer("top_logprobs", 0) if flag(body, "logprobs") else None
    else:
        logprobs = integer("logprobs", None)
    given = dict(temperature=number("temperature", None), top_p=number("top_p", None), top_k=integer("top_k", None),
                 min_p=number("min_p", None), repetition_penalty=number("repetition_penalty", None))
    given = {k: (v if k == "top_k" or v is None else float(v)) for k, v in given.items()}
    kwargs = dict(presence_penalty=float(number("presence_penalty", 0.0)),
                  frequency_penalty=float(number("frequency_penalty", 0.0)), seed=integer("seed", None),
                  stop=tuple(stop), ignore_eos=flag(body, "ignore_eos"), logprobs=logprobs,
                  logit_bias=bias, constraint=response_format(body))
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    # options left out: the model's generation_config.json (the engine fills them), else OpenAI's defaults
    return SamplingParams.from_options(given, OPENAI_DEFAULTS, **kwargs), n


class HttpApi:
    def __init__(self, frontend: Frontend, chat_templates: dict):
        """`chat_templates`: each model's, by name (runtime.server.chat.load_chat_template)."""
        self.frontend, self.router, self.chat_templates = frontend, frontend.router, chat_templates
        self.bridge = self.router.primary
        self.token_texts = {name: TokenText(b.tokenizer) for name, b in self.router.bridges.items()}
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ], exception_handlers={HTTPException: _http_error, Exception: self._internal_error})
        self.app.add_middleware(_Guard, bridge=self.bridge)

    async def _internal_error(self, request: Request, e: Exception) -> JSONResponse:
        """An unexpected exception (uvicorn logs its traceback): OpenAI error JSON, not plain text."""
        self.bridge.metrics.on_error(CODES[500])
        return error(500, "internal server error (logged)", "internal_error")

    async def health(self, request: Request) -> Response:
        if self.bridge.draining:
            return JSONResponse({"status": "draining"}, 503)
        return JSONResponse({"status": "ok", "model": self.bridge.model_name, "models": list(self.router.bridges)})

    async def metrics(self, request: Request) -> Response:
        replicas = {}               # runtime serve --replicas: each replica's engine metrics, as it last published them
        for name, b in self.router.bridges.items():
            if hasattr(b.aengine, "replica_metrics"):
                replicas[name] = await asyncio.to_thread(b.aengine.replica_metrics)
        return Response(render({name: b.metrics for name, b in self.router.bridges.items()}, replicas),
                        media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "quicksilver",
                 "max_model_len": b.max_model_len, "vocab_size": b.info.vocab_size}
                for name, b in self.router.bridges.items()]
        if data:                   # "auto" is accepted with one model too: listed, it routes to that one
            data.append({"id": AUTO, "object": "model", "created": 0, "owned_by": "quicksilver",
                         "routes_to": list(self.router.bridges)})
        return JSONResponse({"object": "list", "data": data})

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def _prepare(self, bridge: Bridge, body: dict, chat: bool, tools, params: SamplingParams, tenant=None):
        """The request's prompt ids for this model (its chat template and tokenizer), its echo text, and params with
        the chat default for max_tokens (the rest of this model's context, and of the caller's tokens a minute)."""
        # Templates, tokenization and decoding run in threads: a long prompt must not stall the event loop.
        if chat:
            prompt = await asyncio.to_thread(self.chat_templates[bridge.model_name], body.get("messages"),
                                             tools.tools if tools.mode else None)
        else:
            prompt = _prompt(body.get("prompt"))
        text = prompt if isinstance(prompt, str) else None
        if text is not None:                       # once for every choice and the chat default below
            prompt = await bridge.encode(text)
        if chat and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            params = self._rest_of_context(bridge, prompt, params, tenant)
        echo = "" if chat or not flag(body, "echo") else (text if text is not None else await bridge.decode(prompt))
        if echo and params.logprobs is not None:
            raise InvalidRequest("echo with logprobs is not supported (prompt log-probabilities are not computed)")
        return prompt, echo, params

    async def _handle(self, request: Request, chat: bool) -> Response:
        with self.frontend.arrivals.receiving():      # until the request reaches an engine (async_engine.Arrivals)
            return await self._respond(request, chat)

    async def _respond(self, request: Request, chat: bool) -> Response:
        streams = []
        try:
            body = await _json_body(request)
            stream, include_usage, asked, n, tools = await _options_off_the_loop(body, chat)
            chat_default = chat and body.get("max_tokens") is None and body.get("max_completion_tokens") is None

            caller = request.scope[CALLER]
            floor, tenant = caller.priority_floor, caller.tenant      # checked and counted by the bridge

            def prepare(b):
                return self._prepare(b, body, chat, tools, asked, tenant)
            limit = None if chat_default else asked.max_tokens
            bridge, route, counted = await self.frontend.choose(
                body.get("model"), chat or isinstance(_prompt(body.get("prompt")), str), prepare,
                lambda c: len(c[0]), limit)
            prompt, echo, params = counted if bridge is self.router.primary and counted else await prepare(bridge)
            priority = bridge.default_priority(body.get("priority"), floor)   # lower is more urgent, as vLLM's
            bridge.check_choices(n, tenant)
            timeout = body.get("timeout")
            if timeout is not None and (not _finite(timeout) or timeout <= 0):     # NaN passed `<= 0`: a 500
                raise InvalidRequest("timeout must be a positive number of seconds")
            rid = new_id("chatcmpl-" if chat else "cmpl-", 8)
            query = self._query(bridge, body, chat, asked, n, tenant)
            hit, cache_headers = await self.frontend.lookup(bridge, query, prompt, params, priority, floor, tenant)
            if hit is not None:
                shape = _Shape(rid, bridge.model_name, chat, self.token_texts[bridge.model_name])
                return self._cached(shape, hit, len(prompt), stream, include_usage,
                                    {**(route.headers if route else {}), **cache_headers})
            choices = _Choices(streams, bridge, prompt, params, n, rid, priority, timeout, floor, tenant, request)
            firsts = await _unless_hung_up(request, choices.open(self.frontend, route, prepare, query, limit))
            if firsts is None:
                await _close(streams)
                return Response(status_code=499)
            route, bridge = choices.route, choices.bridge
            echo = echo if choices.echo is None else choices.echo
        except (InvalidRequest, Overloaded, Unavailable, Failed, asyncio.TimeoutError, StopAsyncIteration,
                RecursionError) as e:
            await _close(streams)
            return _error_for(e)
        shape = _Shape(rid, bridge.model_name, chat, self.token_texts[bridge.model_name])
        shape.tool_outputs = [tools.output() for _ in firsts] if chat and tools.mode else None
        headers = {**(route.headers if route else {}), **cache_headers}
        keep = self.frontend.keeper(query)
        if stream:
            return StreamingResponse(self._sse(bridge, streams, firsts, shape, include_usage, echo, keep),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
        return await self._collect(request, streams, firsts, shape, echo, headers, keep)

    def _query(self, bridge: Bridge, body: dict, chat: bool, asked: SamplingParams, n: int, tenant):
        """The semantic cache's key for this request, or None (no cache, or not cacheable). `asked`: the
        parameters as the client gave them (the chat default for max_tokens depends on the prompt's length, so it
        would keep a paraphrase from matching)."""
        if self.frontend.cache is None:
            return None
        try:
            return semantic_cache.query_for(body, chat, asked, n, tenant.name if tenant else DEFAULT_TENANT,
                                            bridge.model_name)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None

    def _cached(self, shape: "_Shape", hit, prompt_tokens: int, stream: bool, include_usage: bool,
                headers: dict) -> Response:
        """A semantic-cache hit as the response a generated answer would have been (whole or as SSE), its usage
        saying where it came from."""
        a = hit.answer
        usage = _usage([Usage(prompt_tokens, 0, a.completion_tokens)])
        usage["semantic_cache"] = hit.usage()
        if not stream:
            return JSONResponse({**shape.full([(a.text, a.finish_reason, None)], [None]), "usage": usage},
                                headers=headers)
        events = ([_event(shape.chunk({"role": "assistant", "content": ""}, None))] if shape.chat else [])
        events += [_event(shape.chunk(a.text, None)), _event(shape.chunk("", a.finish_reason))]
        if include_usage:
            events.append(_event({**shape.usage_chunk([None]), "usage": usage}))
        events.append("data: [DONE]\n\n")
        return StreamingResponse(iter(events), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **headers})

    @staticmethod
    def _rest_of_context(bridge: Bridge, ids: list[int], params: SamplingParams, tenant=None) -> SamplingParams:
        """OpenAI's chat default for max_tokens: what the context leaves after the prompt, within the server's cap
        and what the caller's tokens_per_minute could ever admit beside the prompt (charged the whole context, a
        tenant whose minute holds less got a 400 on every chat request that named no max_tokens)."""
        room = [bridge.max_model_len - len(ids), bridge.config.max_tokens_limit, bridge.token_room(tenant, len(ids))]
        return replace(params, max_tokens=max(1, min(r for r in room if r is not None)))

    async def _sse(self, bridge: Bridge, streams, firsts, shape, include_usage: bool, echo: str = "", keep=None):
        """Server-sent events, the choices' chunks interleaved as they come; if the client goes away Starlette
        cancels this generator and every choice is aborted. `keep(text, token ids, last output)`: given the whole answer of a
        single choice once it finished (the semantic cache)."""
        usages, kept, kept_ids = {}, [], []
        try:
            for i, out in enumerate(firsts):
                if shape.chat:
                    yield _event(shape.chunk({"role": "assistant", "content": ""}, None, index=i))
                if echo:                    # completions with echo: the prompt comes first
                    yield _event(shape.chunk(echo, None, index=i))
            async with contextlib.aclosing(_interleaved(streams, firsts)) as choices:
                async for i, out in choices:
                    if shape.tool_outputs:
                        for chunk in shape.tool_chunks(i, out):
                            yield _event(chunk)
                    elif out.text or out.finished or out.logprobs:
                        # (a token that ends inside a character has no text yet: its log-probability goes now)
                        yield _event(shape.chunk(out.text, out.finish_reason, out.logprobs, index=i))
                    if keep is not None:
                        kept.append(out.text)
                        kept_ids.extend(out.token_ids)
                        if out.finished:
                            await keep("".join(kept), kept_ids, out)
                    if out.finished:
                        usages[i] = out.usage
            if include_usage:
                yield _event(shape.usage_chunk([usages[i] for i in sorted(usages)]))
            yield "data: [DONE]\n\n"
        except asyncio.TimeoutError:            # after the 200: the error goes in the stream, and is counted here
            bridge.metrics.on_error(CODES[504])
            yield _event(error_json(504, "request timed out and was aborted", "timeout_error"))
            yield "data: [DONE]\n\n"
        except Failed as e:
            bridge.metrics.on_error(CODES[500])
            yield _event(error_json(500, str(e), "internal_error"))
            yield "data: [DONE]\n\n"
        except Unavailable as e:
            bridge.metrics.on_error(CODES[503])
            yield _event(error_json(503, str(e), "unavailable_error"))
            yield "data: [DONE]\n\n"
        finally:
            await _close(streams)

    async def _collect(self, request: Request, streams, firsts, shape, echo: str = "", headers=None,
                       keep=None) -> Response:
        texts = [[echo, f.text] for f in firsts]
        logprobs = [list(f.logprobs or []) for f in firsts]
        ids = [list(f.token_ids) for f in firsts]
        tasks = [asyncio.ensure_future(_drain(s, texts[i], logprobs[i], ids[i], firsts[i]))
                 for i, s in enumerate(streams)]
        try:                               # a non-streaming client that disconnects also aborts its request
            outs = await _unless_hung_up(request, asyncio.gather(*tasks))
            if outs is None:
                return Response(status_code=499)
        except (asyncio.TimeoutError, Failed, Unavailable) as e:
            return _error_for(e)
        finally:
            await _cancel(tasks)
            await _close(streams)
        if keep is not None:
            await keep("".join(texts[0][1:]), ids[0], outs[0])
        return JSONResponse(shape.full([("".join(t), o.finish_reason, lp) for t, o, lp in zip(texts, outs, logprobs)],
                                       [o.usage for o in outs]), headers=headers)


async def _drain(stream, text: list, logprobs: list, ids: list, out):
    if out.finished:
        return out
    async for out in stream:
        text.append(out.text)
        logprobs.extend(out.logprobs or [])
        ids.extend(out.token_ids)
    return out


async def _interleaved(streams, firsts) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) as the choices produce them, each from its first output on. A single choice (the
    usual request) is read in place; several are awaited together, one task per choice in flight."""
    if len(streams) == 1:
        out = firsts[0]
        yield 0, out
        if not out.finished:
            async for out in streams[0]:
                yield 0, out
                if out.finished:
                    return
        return
    pending: dict[asyncio.Future, int] = {}
    ready = list(enumerate(firsts))
    try:
        while ready or pending:
            for i, out in ready:
                yield i, out
                if not out.finished:
                    pending[asyncio.ensure_future(streams[i].__anext__())] = i
            ready = []
            if pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    try:
                        ready.append((i, task.result()))
                    except StopAsyncIteration:
                        pass
                ready.sort()
    finally:
        await _cancel(pending)


async def _cancel(tasks) -> None:
    """Cancel unfinished tasks and wait for them (a stream must not be closed while a task awaits it)."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _close(streams) -> None:
    """Close every choice's stream: the bridge aborts (and frees the KV of) any request still running."""
    for s in streams:
        await s.aclose()


async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    """Starlette's 404 / 405 as OpenAI error JSON (it answers plain text otherwise)."""
    return error(e.status_code, f"{request.method} {request.url.path}: {e.detail}", headers=e.headers)


def _error_for(e: Exception) -> JSONResponse:
    """The response errors.TABLE gives `e`, with a retry hint where retrying can help."""
    a = errors.answer(e)
    headers = ({"Retry-After": str(max(1, round(e.retry_after_s)))} if isinstance(e, Overloaded) else
               {"Retry-After": "1"} if isinstance(e, Unavailable) else None)
    return error(a.http, errors.message(e), a.kind, headers)


async def _options_off_the_loop(body: dict, chat: bool):
    """_options, in a worker thread when the body carries schemas (tools, response_format): checking a large one
    against the meta-schema takes seconds (a 1 MB anyOf: 4.5 s), which on the event loop stalled every stream."""
    if body.get("tools") or body.get("response_format") is not None:
        return await asyncio.to_thread(_options, body, chat)
    return _options(body, chat)


def _options(body: dict, chat: bool):
    """(stream, include_usage, sampling params as asked, n, tools) of a completion or chat body."""
    stream = flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object")
    asked, n = sampling_from_json(body, chat)
    tools = ToolRequest(body) if chat else None
    if tools is not None and tools.mode in ("named", "required"):
        if asked.constraint is not None:
            raise InvalidRequest("response_format cannot be combined with a required or named tool_choice")
        asked = replace(asked, constraint=tools.constraint())
    return stream, flag(options, "include_usage"), asked, n, tools


class _Choices:
    """Opening a request's n choices on its bridge: choice 0 first (once it has a token its prompt blocks are in
    the prefix cache, so the others prefill only the last partial block), then the rest at once; when choice 0 is
    shed from an "auto"-routed model, the route's fallback takes the request."""

    def __init__(self, streams: list, bridge, prompt, params, n, rid, priority, timeout, floor, tenant, request):
        self.streams, self.bridge, self.prompt, self.params, self.n = streams, bridge, prompt, params, n
        self.rid, self.priority, self.timeout, self.floor, self.tenant = rid, priority, timeout, floor, tenant
        self.request, self.route, self.echo = request, None, None

    def _stream(self, i: int):
        p = self.params
        seeded = replace(p, seed=(p.seed + i) % 2**63) if p.seed is not None and i else p   # a valid seed stays one
        return self.bridge.stream(self.prompt, seeded, self.rid if self.n == 1 else f"{self.rid}-{i}",
                                  self.priority, self.timeout, self.floor, self.request.scope.get(ARRIVAL),
                                  self.request.headers, self.tenant)

    def _open(self, i: int):
        self.streams.append(self._stream(i))
        return self.streams[-1].__anext__()    # surfaces validation, shedding and deadline errors as statuses

    async def open(self, frontend: Frontend, route, prepare, query, max_tokens: int | None) -> list:
        """The first output of every choice; `prepare(bridge)` → (prompt, echo, params) for a fallback model;
        `max_tokens` as routing reads it (None: the chat default, the rest of each model's context)."""
        async def on_fallback(bridge):
            self.bridge = bridge
            if query is not None:            # its answer will be this model's
                query.namespace = (query.namespace[0], bridge.model_name)
            self.prompt, self.echo, self.params = await prepare(bridge)

        self.bridge, self.route, first_stream, first = await frontend.first_output(
            self.bridge, route, len(self.prompt), max_tokens, lambda bridge: self._stream(0), on_fallback)
        self.streams.append(first_stream)
        rest = await asyncio.gather(*(self._open(i) for i in range(1, self.n)), return_exceptions=True)
        for r in rest:                       # all settled first: a stream cannot be closed while it is awaited
            if isinstance(r, BaseException):
                raise r
        return [first] + rest


async def _unless_hung_up(request: Request, work) -> list | None:
    """`work`'s result (the choices' first outputs, or all of their outputs), asking every 0.25 s meanwhile whether
    the client is still there: None where it hung up, `work` cancelled (each stream's cancellation aborts its
    request). Opening the choices is watched too: n choices over fewer free slots ran the first ones to their end
    for a client long gone, and a queued request waited for its first token to find out."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                break
    finally:
        if not task.done():                 # hung up, or this handler itself cancelled: settle before closing
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None


async def _json_body(request: Request) -> dict:
    """The request's body: a JSON object, nested at most bridge.MAX_JSON_DEPTH deep, of text; else InvalidRequest."""
    body = load_json(await request.body())
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    _check_unicode(body)
    return body


def _prompt(prompt) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise InvalidRequest("prompt must be a string or a list of token ids (one prompt per request)")


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _usage(usages: list) -> dict | None:
    """One usage for all choices: the prompt counted once (as choice 0 saw it), completions summed."""
    if not usages or usages[0] is None:
        return None
    u = usages[0]
    completion = sum(x.completion_tokens for x in usages)
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": completion,
            "total_tokens": u.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "completion_tokens_details": {"speculative_proposed_tokens": sum(x.spec_proposed for x in usages),
                                          "speculative_accepted_tokens": sum(x.spec_accepted for x in usages)}}


class _Shape:
    """OpenAI response objects for one request (completion or chat, whole or chunked)."""

    def __init__(self, rid: str, model: str, chat: bool, token_text: TokenText):
        self.rid, self.model, self.chat, self.created = rid, model, chat, int(time.time())
        self.token_text = token_text
        self.tool_outputs = None        # per choice, when the request has tools: text → tool_calls

    def tool_chunks(self, i: int, out) -> list[dict]:
        """Chunks for one engine output of choice i through its tool-call output (the last carries the reason)."""
        post = self.tool_outputs[i]
        deltas, reason = post.delta(out.text), None
        if out.finished:
            more, reason = post.finish(out.finish_reason)
            deltas += more
        chunks = [self.chunk(d, None, out.logprobs if k == 0 else None, index=i) for k, d in enumerate(deltas)]
        if out.finished:
            chunks.append(self.chunk({}, reason, None if deltas else out.logprobs, index=i))
        return chunks

    def _base(self, kind: str) -> dict:
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model}

    def _logprobs(self, logprobs):
        """Tokens as their text (chat adds their UTF-8 bytes), as OpenAI and vLLM show them; completions also give
        each token's `text_offset` (where the text before it ends in the choice's text: the engine counts it, so a
        token that ends inside a character has the offset its character will start at)."""
        if not logprobs:
            return None
        text = self.token_text.text
        if self.chat:
            def entry(token: int, logprob: float) -> dict:
                return {"token": text(token), "logprob": logprob, "bytes": list(self.token_text.bytes(token))}
            return {"content": [{**entry(lp["token"], lp["logprob"]),
                                 "top_logprobs": [entry(t, v) for t, v in lp["top"] or []]} for lp in logprobs]}
        return {"tokens": [text(lp["token"]) for lp in logprobs], "token_logprobs": [lp["logprob"] for lp in logprobs],
                "top_logprobs": [{text(t): v for t, v in lp["top"] or []} for lp in logprobs],
                "text_offset": [lp.get("text_offset", 0) for lp in logprobs]}

    def chunk(self, delta, finish_reason, logprobs=None, index: int = 0) -> dict:
        if self.chat:
            d = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
            choice = {"index": index, "delta": d, "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": delta, "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}
        return {**self._base("text_completion"), "choices": [choice]}

    def usage_chunk(self, usages: list) -> dict:
        return {**self._base("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": _usage(usages)}

    def full(self, choices: list[tuple[str, str, list]], usages: list) -> dict:
        """choices: (text, finish_reason, logprobs) per choice, in index order."""
        if self.chat:
            body = []
            for i, (text, finish, lp) in enumerate(choices):
                message = {"role": "assistant", "content": text}
                if self.tool_outputs:
                    message, finish = self.tool_outputs[i].message(text, finish)
                body.append({"index": i, "message": message, "logprobs": self._logprobs(lp), "finish_reason": finish})
            return {**self._base("chat.completion"), "choices": body, "usage": _usage(usages)}
        body = [{"index": i, "text": text, "logprobs": self._logprobs(lp), "finish_reason": finish}
                for i, (text, finish, lp) in enumerate(choices)]
        return {**self._base("text_completion"), "choices": body, "usage": _usage(usages)}


class _Guard:
    """ASGI middleware: bearer auth (except /health, /metrics) and the body size limit, before any parsing; counts
    error answers (an unexpected 500 is answered outside it, by HttpApi._internal_error)."""

    def __init__(self, app, bridge: Bridge):
        self.app, self.bridge = app, bridge

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[ARRIVAL] = time.monotonic()       # TTFT counts from the request's headers, before its body is read

        async def counted_send(message):        # every error answer counts once in quicksilver_request_errors
            if message["type"] == "http.response.start" and message["status"] in CODES:
                self.bridge.metrics.on_error(CODES[message["status"]])
            await send(message)

        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if scope["path"] not in OPEN_PATHS:
            try:               # the one reading of the request's credentials; handlers take scope[CALLER]
                scope[CALLER] = identify(authorization_values(scope["headers"]), self.bridge.config)
            except Unauthenticated as e:
                refusal = error(401, str(e), "authentication_error", {"WWW-Authenticate": "Bearer"})   # RFC 6750
                return await refusal(scope, receive, counted_send)
        limit = self.bridge.config.max_body_bytes
        try:
            declared = int(headers.get("content-length", "0"))
        except ValueError:
            declared = 0
        if declared > limit:
            refusal = error(413, f"request body of {declared} bytes exceeds the limit of {limit}")
            return await refusal(scope, receive, counted_send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise errors.BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
            return message

        try:
            await self.app(scope, limited_receive, counted_send)
        except InvalidRequest as e:
            await error(413, str(e))(scope, receive, counted_send)
