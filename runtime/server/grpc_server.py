"""gRPC transport (quicksilver.v1.Generation, grpc.health.v1, reflection): protobuf ⇄ Bridge, nothing else."""

from __future__ import annotations

import contextlib
import time

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ..config import ServerConfig
from ..constraints import Constraint
from ..outputs import RequestOutput
from ..request import SAMPLING_KEYS, InvalidRequest, SamplingParams, new_id
from .auth import BearerAuthInterceptor, authorization_values, identify
from .bridge import Bridge, Overloaded, brief
from . import errors
from .frontend import Frontend
from . import semantic_cache
from .tenants import DEFAULT as DEFAULT_TENANT
from .proto import quicksilver_pb2 as pb
from .proto import quicksilver_pb2_grpc as pb_grpc

SERVICE = "quicksilver.v1.Generation"
_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty", "seed", "ignore_eos", "logprobs")


def sampling_from_pb(s: pb.SamplingParams) -> SamplingParams:
    kwargs = {f: getattr(s, f) for f in _FIELDS if s.HasField(f)}
    for f in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if f in kwargs and kwargs[f] != kwargs[f]:   # NaN
            raise InvalidRequest(f"{f} must be a number, not NaN")
    constraint = None
    kind = s.constraint.WhichOneof("kind") if s.HasField("constraint") else None
    if kind == "json_object":
        constraint = Constraint("json_object")
    elif kind is not None:
        constraint = Constraint(kind, getattr(s.constraint, kind))
    given = {k: kwargs.pop(k) for k in SAMPLING_KEYS if k in kwargs}     # left out: the model's defaults (engine)
    return SamplingParams.from_options(given, **kwargs, stop=tuple(s.stop),
                                       stop_token_ids=tuple(int(t) for t in s.stop_token_ids),
                                       logit_bias=dict(s.logit_bias), constraint=constraint)


def response_to_pb(out: RequestOutput, request_id: str) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=request_id, token_ids=out.token_ids, text=out.text,
                              finish_reason=out.finish_reason or "")
    for lp in out.logprobs or []:
        msg.logprobs.add(token_id=lp["token"], logprob=lp["logprob"],
                         top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp["top"] or []])
    if out.usage is not None:
        u = out.usage
        ms = lambda v: 1e3 * v if v is not None else 0.0  # noqa: E731
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens,
                                    completion_tokens=u.completion_tokens, spec_proposed_tokens=u.spec_proposed,
                                    spec_accepted_tokens=u.spec_accepted, queue_wait_ms=ms(u.queue_wait_s),
                                    ttft_ms=ms(u.ttft_s), tpot_ms=ms(u.tpot_s), e2e_ms=ms(u.e2e_s)))
    return msg


def _priority(request, caller) -> int:
    """The request's priority; 0 is proto3's unset, so the caller's default (Bridge.default_priority) stands for it."""
    return Bridge.default_priority(request.priority or None, caller.priority_floor)


class Malformed:
    """Stands in for a request that did not parse (e.g. invalid UTF-8), so the handler can answer INVALID_ARGUMENT
    instead of gRPC's generic UNKNOWN."""

    def __init__(self, error: Exception):
        self.error = error


def lenient(message_type):
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            return Malformed(e)
    return parse


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, frontend: Frontend):
        self.frontend, self.router = frontend, frontend.router

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        with self.frontend.arrivals.receiving():      # until the request reaches an engine (async_engine.Arrivals)
            async with contextlib.aclosing(self._generate(request, context)) as messages:   # a cancel closes it now
                async for msg in messages:
                    yield msg

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        arrival, b = time.monotonic(), self.router.primary          # TTFT counts from here
        try:
            if isinstance(request, Malformed):
                raise InvalidRequest(f"malformed request: {request.error}")
            which = request.WhichOneof("prompt")
            if which is None:
                raise InvalidRequest("the request has no prompt (set text or token_ids)")
            text = request.text if which == "text" else None
            prompt = text if text is not None else [int(t) for t in request.token_ids.ids]
            params = sampling_from_pb(request.sampling)
            metadata = context.invocation_metadata() or ()
            caller = identify(authorization_values(metadata), b.config)    # the interceptor's reading, once more
            b, route, counted = await self.frontend.choose(request.model, text is not None,
                                                           lambda bridge: bridge.encode(prompt), len,
                                                           params.max_tokens)
            ids = counted if counted is not None and b is self.router.primary else None
            query, cache_headers = self._query(b, request, text, params, caller.tenant), {}
            if self.frontend.cache is not None:
                if query is not None and ids is None:
                    ids = await b.encode(text)
                hit, cache_headers = await self.frontend.lookup(b, query, ids, params, _priority(request, caller),
                                                                caller.priority_floor, caller.tenant,
                                                                request.request_id)
                if hit is not None:
                    await context.send_initial_metadata(tuple({**(route.headers if route else {}),
                                                               **cache_headers}.items()))
                    yield _cached(hit, request.request_id or new_id("req-"), len(ids))
                    return
            generated = self._generated(b, route, ids or prompt, len(counted or ()), params, request, context,
                                        arrival, caller, query, cache_headers)
            async with contextlib.aclosing(generated):      # a cancelled call aborts its request now, not at GC
                async for msg in generated:
                    yield msg
        except errors.HANDLED as e:
            await _abort(context, e, b)

    def _query(self, bridge, request, text, params, tenant):
        """The semantic cache's key for a text prompt, or None (no cache, a token-id prompt, not cacheable).
        Whether it is sampled is read from the options as the engine will resolve them: a request that leaves
        temperature out samples if the model's generation_config.json says so."""
        if self.frontend.cache is None or text is None:
            return None
        asked = request.semantic_cache if request.HasField("semantic_cache") else None
        if semantic_cache.bypassed(asked, 1, params.resolve(bridge.info.sampling_defaults)):
            return None
        return semantic_cache.query_for_text(text, asked, params, tenant.name if tenant else DEFAULT_TENANT,
                                             bridge.model_name)

    async def _generated(self, b, route, prompt, prompt_tokens: int, params, request, context, arrival, caller,
                         query, cache_headers: dict):
        """The request's responses as the engine streams them (admission, with fallback, at the first);
        `prompt_tokens`: the prompt's length as routing counted it (for the fallback's context check)."""
        metadata = dict(context.invocation_metadata() or ())

        def open_stream(bridge):
            p = prompt if bridge is b else request.text        # a fallback model tokenizes the text itself
            return bridge.stream(p, params, request.request_id, _priority(request, caller), context.time_remaining(),
                                 caller.priority_floor, arrival, metadata, caller.tenant)

        async def on_fallback(bridge):
            if query is not None:                              # its answer will be this model's
                query.namespace = (query.namespace[0], bridge.model_name)

        b, route, stream, out = await self.frontend.first_output(b, route, prompt_tokens, params.max_tokens,
                                                                 open_stream, on_fallback)
        keep, texts, ids = self.frontend.keeper(query), [], []
        try:
            if route is not None or cache_headers:          # after admission: the model that took it
                await context.send_initial_metadata(tuple({**(route.headers if route else {}),
                                                           **cache_headers}.items()))
            while True:
                yield response_to_pb(out, request.request_id or out.request_id)   # the client's tag, if any
                if keep is not None:                           # the answer, kept once it finishes
                    texts.append(out.text)
                    ids.extend(out.token_ids)
                if out.finished:
                    break
                out = await stream.__anext__()
            if keep is not None:
                await keep("".join(texts), ids, out)
        except StopAsyncIteration:
            pass
        finally:
            await stream.aclose()

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        """The first model's token ids of a text; a request of its caller's tenant (its requests_per_minute and
        max_concurrency hold: a megabyte of text is a tenth of a second of a core)."""
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, brief(f"malformed request: {request.error}"))
        b = self.router.primary
        try:
            tenant = identify(authorization_values(context.invocation_metadata() or ()), b.config).tenant
            if tenant is not None:    # (without tenants nothing is counted: the request metrics are generations')
                b.admit(tenant, 0, 0)
        except errors.HANDLED as e:
            await _abort(context, e, b)
        try:
            return pb.TokenizeResponse(token_ids=await b.encode(request.text))
        finally:
            if tenant is not None:
                b.settle(tenant, 0, 0)

    async def ModelInfo(self, request, context) -> pb.ModelInfoResponse:
        """The first model's, or the one `model` names."""
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, brief(f"malformed request: {request.error}"))
        try:
            bridge = self.router.named(request.model) or self.router.primary
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, brief(str(e)))
        i = bridge.info
        m = i.manifest
        return pb.ModelInfoResponse(model=bridge.model_name, architecture=m["model"]["architecture"],
                                    precision=m["precision"]["weights"], max_model_len=i.max_model_len,
                                    vocab_size=i.vocab_size, draft_model=i.draft or "",
                                    speculation=i.speculation or "")


def _cached(hit, request_id: str, prompt_tokens: int) -> pb.GenerateResponse:
    """A semantic-cache hit as the one message that carries a whole answer."""
    a = hit.answer
    msg = pb.GenerateResponse(request_id=request_id, token_ids=a.token_ids, text=a.text,
                              finish_reason=a.finish_reason,
                              usage=pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=a.completion_tokens),
                              cache=pb.CacheHit(kind=hit.kind, similarity=hit.similarity))
    if hit.verifier_score is not None:
        msg.cache.verifier_score = hit.verifier_score
    return msg


async def _abort(context, e: Exception, bridge) -> None:
    """End a call with the status errors.TABLE gives `e`, counted, its details `brief` (gRPC sends them as
    metadata: an echoed input must not overflow the client's limit) and, when overloaded, a retry hint."""
    a = errors.answer(e)
    if isinstance(e, Overloaded):
        context.set_trailing_metadata((("retry-after-ms", str(int(e.retry_after_s * 1000))),))
    bridge.metrics.on_error(a.name)
    await context.abort(a.grpc, brief(errors.message(e)))


async def start_grpc(frontend: Frontend, config: ServerConfig) -> tuple[grpc.aio.Server, int, health.HealthServicer]:
    """Start the gRPC server; returns (server, bound port, health servicer)."""
    options = [("grpc.max_receive_message_length", config.max_body_bytes),
               ("grpc.max_send_message_length", 16 << 20),
               ("grpc.so_reuseport", 0)]       # gRPC's default lets a second server share the port silently
    interceptors = [BearerAuthInterceptor(config)]     # open servers too: it refuses two credentials
    server = grpc.aio.server(options=options, interceptors=interceptors)
    servicer = GenerationServicer(frontend)
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(servicer.Generate, lenient(pb.GenerateRequest),
                                                         pb.GenerateResponse.SerializeToString),
        "Tokenize": grpc.unary_unary_rpc_method_handler(servicer.Tokenize, lenient(pb.TokenizeRequest),
                                                        pb.TokenizeResponse.SerializeToString),
        "ModelInfo": grpc.unary_unary_rpc_method_handler(servicer.ModelInfo, lenient(pb.ModelInfoRequest),
                                                         pb.ModelInfoResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    host = f"[{config.host}]" if ":" in config.host else config.host       # IPv6 literals need brackets
    address = f"{host}:{config.grpc_port}"
    try:
        if config.tls_cert:
            creds = grpc.ssl_server_credentials([(config.tls_key.read_bytes(), config.tls_cert.read_bytes())])
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:
        raise OSError(f"cannot listen for gRPC on {address}") from None
    await server.start()
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer
