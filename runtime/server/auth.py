"""Bearer-token checks shared by the gRPC interceptor and the HTTP middleware (constant-time compare)."""

from __future__ import annotations

import hmac

import grpc

from ..config import ServerConfig

OPEN_GRPC_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


def token_ok(header: str | None, api_key: str) -> bool:
    """`header` is the Authorization value; compares in constant time whatever its content."""
    expected = f"Bearer {api_key}".encode()
    return hmac.compare_digest((header or "").encode(), expected)


def authorized(header: str | None, config: ServerConfig) -> bool:
    """`header` carries --api-key, one of the --priority-key tokens or a tenant's key."""
    keys = [config.api_key] + [key for key, _ in config.priority_keys] + [t.key for t in config.tenants]
    return any([token_ok(header, key) for key in keys if key])     # a list: every key compared, whatever matches


def tenant_of(header: str | None, config: ServerConfig):
    """The tenant whose key `header` carries, else None."""
    found = [t for t in config.tenants if token_ok(header, t.key)]
    return found[0] if found else None


def priority_floor(header: str | None, config: ServerConfig) -> int:
    """The most urgent (lowest) priority this caller may ask for: its tenant's or --priority-key's floor, else
    --priority-floor."""
    floors = [t.priority_floor for t in config.tenants if token_ok(header, t.key)]
    floors += [floor for key, floor in config.priority_keys if token_ok(header, key)]
    return floors[0] if floors else config.priority_floor


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without `authorization: Bearer <key>` metadata with UNAUTHENTICATED (health and reflection stay open)."""

    def __init__(self, config: ServerConfig):
        self.config = config

    async def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_GRPC_PREFIXES):
            return await continuation(details)
        header = dict(details.invocation_metadata or ()).get("authorization")
        if authorized(header, self.config):
            return await continuation(details)
        handler = await continuation(details)

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
            yield  # pragma: no cover

        async def deny_unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny_stream, handler.request_deserializer, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(deny_unary, handler.request_deserializer, handler.response_serializer)
