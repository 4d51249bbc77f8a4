"""gRPC transport (quicksilver.v1.Generation, grpc.health.v1, reflection): protobuf ⇄ Bridge, nothing else."""

from __future__ import annotations

import time

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ..config import ServerConfig
from ..constraints import Constraint
from ..outputs import RequestOutput
from ..request import SAMPLING_KEYS, InvalidRequest, SamplingParams
from .auth import BearerAuthInterceptor, authorization_values, identify
from .bridge import Overloaded, brief
from . import errors
from .frontend import choose_model
from .proto import quicksilver_pb2 as pb
from .proto import quicksilver_pb2_grpc as pb_grpc
from .router import Router

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
    def __init__(self, router: Router):
        self.router = router

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        arrival, b = time.monotonic(), self.router.primary          # TTFT counts from here
        try:
            if isinstance(request, Malformed):
                raise InvalidRequest(f"malformed request: {request.error}")
            which = request.WhichOneof("prompt")
            if which is None:
                raise InvalidRequest("the request has no prompt (set text or token_ids)")
            prompt = request.text if which == "text" else [int(t) for t in request.token_ids.ids]
            params = sampling_from_pb(request.sampling)
            metadata = context.invocation_metadata() or ()
            caller = identify(authorization_values(metadata), b.config)    # the interceptor's reading, once more
            b, route, counted = await choose_model(self.router, request.model, which == "text",
                                                   lambda bridge: bridge.encode(prompt), len, params.max_tokens)
            if counted is not None:
                prompt_tokens = len(counted)
                prompt = counted if b is self.router.primary else prompt

            def open_stream(bridge):
                return bridge.stream(prompt, params, request.request_id, request.priority, context.time_remaining(),
                                     caller.priority_floor, arrival, dict(metadata), caller.tenant)

            stream = open_stream(b)
            try:
                try:
                    first = await stream.__anext__()   # admission (and shedding) happen here, before any reply
                except Overloaded as e:
                    fallback = route and e.shed and self.router.fallback_after(b, prompt_tokens)
                    if not fallback:
                        raise
                    await stream.aclose()
                    route, b = fallback, fallback.bridge
                    prompt = request.text                  # re-tokenized by this model
                    stream = open_stream(b)
                    first = await stream.__anext__()
                if route is not None:
                    await context.send_initial_metadata(tuple(route.headers.items()))
                out = first
                while True:
                    yield response_to_pb(out, request.request_id or out.request_id)   # the client's tag, if any
                    if out.finished:
                        break
                    out = await stream.__anext__()
            except StopAsyncIteration:
                pass
            finally:
                await stream.aclose()
        except errors.HANDLED as e:
            await _abort(context, e, b)

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, brief(f"malformed request: {request.error}"))
        return pb.TokenizeResponse(token_ids=await self.router.primary.encode(request.text))

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


async def _abort(context, e: Exception, bridge) -> None:
    """End a call with the status errors.TABLE gives `e`, counted, its details `brief` (gRPC sends them as
    metadata: an echoed input must not overflow the client's limit) and, when overloaded, a retry hint."""
    a = errors.answer(e)
    if isinstance(e, Overloaded):
        context.set_trailing_metadata((("retry-after-ms", str(int(e.retry_after_s * 1000))),))
    bridge.metrics.on_error(a.name)
    await context.abort(a.grpc, brief(errors.message(e)))


async def start_grpc(router: Router, config: ServerConfig) -> tuple[grpc.aio.Server, int, health.HealthServicer]:
    """Start the gRPC server; returns (server, bound port, health servicer)."""
    options = [("grpc.max_receive_message_length", config.max_body_bytes),
               ("grpc.max_send_message_length", 16 << 20),
               ("grpc.so_reuseport", 0)]       # gRPC's default lets a second server share the port silently
    interceptors = [BearerAuthInterceptor(config)]     # open servers too: it refuses two credentials
    server = grpc.aio.server(options=options, interceptors=interceptors)
    servicer = GenerationServicer(router)
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
