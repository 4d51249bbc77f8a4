"""Credentials, read once per request by one function for every purpose: authentication, the caller's tenant and
priority floor, and the tenant that labels its metrics. Both transports hand over every `authorization` entry (HTTP
headers, gRPC metadata); more than one is refused, so no two readers can ever see different credentials.

    authorization: Bearer <token>        (RFC 6750: the scheme is case-insensitive; one credential per request)

A value that is not a bearer credential counts as none. Tokens are compared with every configured key in constant
time.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from ..config import ServerConfig
from .tenants import DEFAULT, Tenant

OPEN_GRPC_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")
WRONG = "missing or wrong bearer token"


class Unauthenticated(Exception):
    """The request's credentials are refused: HTTP 401 / gRPC UNAUTHENTICATED."""


@dataclass(frozen=True)
class Caller:
    """Who a request comes from, as its one credential says; policy reads this, never the headers."""

    tenant: Tenant | None          # whose limits the request counts against (None: no tenant)
    priority_floor: int            # the most urgent (lowest) priority it may ask for

    @property
    def label(self) -> str:
        """The tenant name its metrics carry."""
        return self.tenant.name if self.tenant is not None else DEFAULT


def authorization_values(entries) -> list[str]:
    """Every `authorization` value among a transport's (name, value) pairs: ASGI's raw header list (bytes) or gRPC
    invocation metadata (str). All of them: a dict would keep one and hide the others."""
    values = []
    for name, value in entries or ():
        if isinstance(name, bytes):
            name, value = name.decode("latin-1"), value.decode("latin-1")
        if name.lower() == "authorization":
            values.append(value)
    return values


def bearer_token(values: Iterable[str]) -> str | None:
    """The request's one bearer token: None when it carries no bearer credential; Unauthenticated when it carries
    more than one Authorization value (whatever they hold)."""
    values = list(values)
    if len(values) > 1:
        raise Unauthenticated(f"more than one Authorization credential ({len(values)}); send exactly one")
    parts = values[0].split() if values else []
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return None
    return parts[1]


def _same(token: str | None, key: str | None) -> bool:
    return token is not None and bool(key) and hmac.compare_digest(token.encode(), key.encode())


def identify(values: Iterable[str], config: ServerConfig) -> Caller:
    """The caller that a request's Authorization values name, or Unauthenticated: more than one credential, or none
    of the configured keys where the server requires one (--api-key, --tenants)."""
    token = bearer_token(values)
    # lists, not any(): every key is compared whatever matches, so the time taken says nothing about which did
    tenants = [t for t in config.tenants if _same(token, t.key)]
    floors = [floor for key, floor in config.priority_keys if _same(token, key)]
    api = [_same(token, config.api_key)]
    if config.requires_auth and not (tenants or floors or any(api)):
        raise Unauthenticated(WRONG)
    tenant = tenants[0] if tenants else None
    floor = tenant.priority_floor if tenant else floors[0] if floors else config.priority_floor
    return Caller(tenant, floor)


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls whose metadata `identify` refuses with UNAUTHENTICATED (health and reflection stay open)."""

    def __init__(self, config: ServerConfig):
        self.config = config

    async def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_GRPC_PREFIXES):
            return await continuation(details)
        try:
            identify(authorization_values(details.invocation_metadata), self.config)
        except Unauthenticated as e:
            return await self._deny(continuation, details, str(e))
        return await continuation(details)

    @staticmethod
    async def _deny(continuation, details, reason: str):
        handler = await continuation(details)
        if handler is None:               # no such method: gRPC answers UNIMPLEMENTED
            return None

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
            yield  # pragma: no cover

        async def deny_unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny_stream, handler.request_deserializer, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(deny_unary, handler.request_deserializer, handler.response_serializer)
