"""OpenAI-compatible HTTP transport (Starlette): /v1/completions, /v1/chat/completions (SSE streaming),
/v1/models, /health, /metrics. Request JSON ⇄ Bridge, nothing else."""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..metrics import CONTENT_TYPE_LATEST
from ..request import InvalidRequest, SamplingParams
from .auth import token_ok
from .bridge import Bridge, Draining, Overloaded

OPEN_PATHS = ("/health", "/metrics")


def error(status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status, headers=headers)


def sampling_from_json(body: dict, chat: bool) -> SamplingParams:
    """OpenAI fields (plus top_k, min_p, repetition_penalty, ignore_eos) → SamplingParams; defaults as OpenAI's.
    Fields that would change the result but are not supported (n, best_of > 1, tools, suffix, a JSON
    response_format) are refused, not ignored."""
    def number(key, default):
        v = body.get(key, default)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise InvalidRequest(f"{key} must be a finite number")
        return v

    def integer(key, default):
        v = body.get(key, default)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidRequest(f"{key} must be an integer")
        return v

    if integer("n", 1) != 1:
        raise InvalidRequest("only n = 1 is supported")
    if integer("best_of", 1) != 1:
        raise InvalidRequest("only best_of = 1 is supported")
    unsupported = [("tools", "tool calling"), ("functions", "function calling"), ("suffix", "suffix (insert) completions")]
    for key, what in unsupported:
        if body.get(key):
            raise InvalidRequest(f"{key}: {what} is not supported")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type", "text") != "text"):
        raise InvalidRequest("response_format: only {\"type\": \"text\"} is supported (no constrained decoding)")
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise InvalidRequest("logit_bias must be an object mapping token ids to biases")
    try:
        bias = {int(k): v for k, v in bias.items()}
    except ValueError:
        raise InvalidRequest("logit_bias keys must be token ids (integers)") from None
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in bias.values()):
        raise InvalidRequest("logit_bias values must be finite numbers")
    stop = body.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise InvalidRequest("stop must be a string or a list of strings")
    max_tokens = integer("max_completion_tokens", None) if chat else None
    max_tokens = max_tokens if max_tokens is not None else integer("max_tokens", None if chat else 16)
    if chat:
        logprobs = integer("top_logprobs", 0) if body.get("logprobs") else None
    else:
        logprobs = integer("logprobs", None)
    kwargs = dict(temperature=float(number("temperature", 1.0)), top_p=float(number("top_p", 1.0)),
                  top_k=integer("top_k", 0), min_p=float(number("min_p", 0.0)),
                  repetition_penalty=float(number("repetition_penalty", 1.0)),
                  presence_penalty=float(number("presence_penalty", 0.0)),
                  frequency_penalty=float(number("frequency_penalty", 0.0)), seed=integer("seed", None),
                  stop=tuple(stop), ignore_eos=bool(body.get("ignore_eos", False)), logprobs=logprobs,
                  logit_bias={k: float(v) for k, v in bias.items()})
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    return SamplingParams(**kwargs)


class HttpApi:
    def __init__(self, bridge: Bridge, chat_template):
        self.bridge, self.chat_template = bridge, chat_template
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ])
        self.app.add_middleware(_Guard, bridge=bridge)

    async def health(self, request: Request) -> Response:
        if self.bridge.draining:
            return JSONResponse({"status": "draining"}, 503)
        return JSONResponse({"status": "ok", "model": self.bridge.model_name})

    async def metrics(self, request: Request) -> Response:
        return Response(self.bridge.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.bridge.model_name, "object": "model",
                                                         "created": 0, "owned_by": "quicksilver",
                                                         "max_model_len": self.bridge.max_model_len,
                                                         "vocab_size": self.bridge.aengine.engine.runner.vocab_size}]})

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def _handle(self, request: Request, chat: bool) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(400, f"malformed JSON body: {e}")
        if not isinstance(body, dict):
            return error(400, "the body must be a JSON object")
        try:
            self.bridge.check_model(body.get("model"))
            params = sampling_from_json(body, chat)
            prompt = self.chat_template(body.get("messages")) if chat else _prompt(body.get("prompt"))
            echo = "" if chat or not body.get("echo") else (prompt if isinstance(prompt, str) else
                                                             self.bridge.tokenizer.decode(prompt))
            if echo and params.logprobs is not None:
                raise InvalidRequest("echo with logprobs is not supported (prompt log-probabilities are not computed)")
            timeout = body.get("timeout")
            if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
                raise InvalidRequest("timeout must be a positive number of seconds")
            stream = self.bridge.stream(prompt, params, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}",
                                        timeout_s=timeout)
            first = await stream.__anext__()       # surfaces validation, shedding and deadline errors as statuses
        except InvalidRequest as e:
            return error(400, str(e))
        except Overloaded as e:
            return error(429, f"{e}; retry later", "overloaded_error", {"Retry-After": str(max(1, round(e.retry_after_s)))})
        except Draining as e:
            return error(503, str(e), "unavailable_error")
        except asyncio.TimeoutError:
            return error(504, "request timed out and was aborted", "timeout_error")
        except StopAsyncIteration:
            return error(500, "no output", "internal_error")
        shape = _Shape(first.request_id, self.bridge.model_name, chat)
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(self._sse(stream, first, shape, include_usage, echo),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._collect(request, stream, first, shape, echo)

    async def _sse(self, stream, first, shape, include_usage: bool, echo: str = ""):
        """Server-sent events; if the client goes away Starlette cancels this generator and the request is aborted."""
        out = first
        try:
            if shape.chat:
                yield _event(shape.chunk({"role": "assistant", "content": ""}, None))
            if echo:                        # completions with echo: the prompt comes first
                yield _event(shape.chunk(echo, None))
            while True:
                if out.text or out.finished:
                    yield _event(shape.chunk(out.text, out.finish_reason, out.logprobs))
                if out.finished:
                    if include_usage:
                        yield _event(shape.usage_chunk(out.usage))
                    break
                try:
                    out = await stream.__anext__()
                except asyncio.TimeoutError:
                    yield _event({"error": {"message": "request timed out and was aborted", "type": "timeout_error", "code": 504}})
                    break
            yield "data: [DONE]\n\n"
        finally:
            await stream.aclose()

    async def _collect(self, request: Request, stream, first, shape, echo: str = "") -> Response:
        text, logprobs, out = [echo, first.text], list(first.logprobs or []), first
        consume = asyncio.ensure_future(_drain(stream, text, logprobs, out))
        while not consume.done():          # a non-streaming client that disconnects also aborts its request
            done, _ = await asyncio.wait({consume}, timeout=0.25)
            if not done and await request.is_disconnected():
                consume.cancel()
                await stream.aclose()
                return Response(status_code=499)
        try:
            out = consume.result()
        except asyncio.TimeoutError:
            return error(504, "request timed out and was aborted", "timeout_error")
        return JSONResponse(shape.full("".join(text), out.finish_reason, out.usage, logprobs))


async def _drain(stream, text: list, logprobs: list, out):
    if out.finished:
        return out
    async for out in stream:
        text.append(out.text)
        logprobs.extend(out.logprobs or [])
    return out


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


def _usage(u) -> dict | None:
    if u is None:
        return None
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "completion_tokens_details": {"speculative_proposed_tokens": u.spec_proposed,
                                          "speculative_accepted_tokens": u.spec_accepted}}


class _Shape:
    """OpenAI response objects for one request (completion or chat, whole or chunked)."""

    def __init__(self, rid: str, model: str, chat: bool):
        self.rid, self.model, self.chat, self.created = rid, model, chat, int(time.time())

    def _base(self, kind: str) -> dict:
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model}

    def _logprobs(self, logprobs):
        if not logprobs:
            return None
        if self.chat:
            return {"content": [{"token": str(lp["token"]), "logprob": lp["logprob"],
                                 "top_logprobs": [{"token": str(t), "logprob": v} for t, v in lp["top"] or []]}
                                for lp in logprobs]}
        return {"tokens": [str(lp["token"]) for lp in logprobs], "token_logprobs": [lp["logprob"] for lp in logprobs],
                "top_logprobs": [{str(t): v for t, v in lp["top"] or []} for lp in logprobs]}

    def chunk(self, delta, finish_reason, logprobs=None) -> dict:
        if self.chat:
            d = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
            choice = {"index": 0, "delta": d, "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": delta, "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}
        return {**self._base("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage) -> dict:
        return {**self._base("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": _usage(usage)}

    def full(self, text: str, finish_reason, usage, logprobs) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}
            return {**self._base("chat.completion"), "choices": [choice], "usage": _usage(usage)}
        choice = {"index": 0, "text": text, "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}
        return {**self._base("text_completion"), "choices": [choice], "usage": _usage(usage)}


class _Guard:
    """ASGI middleware: bearer auth (except /health, /metrics) and the body size limit, before any parsing."""

    def __init__(self, app, bridge: Bridge):
        self.app, self.bridge = app, bridge

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = self.bridge.config.api_key
        if key and scope["path"] not in OPEN_PATHS and not token_ok(headers.get("authorization"), key):
            return await error(401, "missing or wrong bearer token", "authentication_error")(scope, receive, send)
        limit = self.bridge.config.max_body_bytes
        try:
            declared = int(headers.get("content-length", "0"))
        except ValueError:
            declared = 0
        if declared > limit:
            return await error(413, f"request body of {declared} bytes exceeds the limit of {limit}")(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise InvalidRequest(f"request body exceeds the limit of {limit} bytes")
            return message

        try:
            await self.app(scope, limited_receive, send)
        except InvalidRequest as e:
            await error(413, str(e))(scope, receive, send)
