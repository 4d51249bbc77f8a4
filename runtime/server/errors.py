"""One table from a request's failure to what each transport answers: HTTP status, gRPC code, OpenAI error type,
and the name `quicksilver_request_errors` counts. Both servers look errors up here (the first class that matches)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from ..request import InvalidRequest
from .auth import Unauthenticated
from .bridge import Failed, Overloaded, Unavailable
from .router import UnknownModel


class BodyTooLarge(InvalidRequest):
    """A request body past --max-body-bytes, met while it is read (a chunked body declares no length): 413 from
    whichever layer meets it, where the handler's own InvalidRequest answer made it a 400."""


@dataclass(frozen=True)
class Answer:
    http: int
    grpc: grpc.StatusCode
    kind: str           # OpenAI's error type
    name: str           # the metric's code label


TABLE: tuple[tuple[type, Answer], ...] = (
    (UnknownModel, Answer(404, grpc.StatusCode.NOT_FOUND, "not_found_error", "not_found")),
    (BodyTooLarge, Answer(413, grpc.StatusCode.RESOURCE_EXHAUSTED, "invalid_request_error", "request_too_large")),
    (InvalidRequest, Answer(400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error", "invalid_argument")),
    (RecursionError, Answer(400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error", "invalid_argument")),
    (Unauthenticated, Answer(401, grpc.StatusCode.UNAUTHENTICATED, "authentication_error", "unauthenticated")),
    (Overloaded, Answer(429, grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded_error", "overloaded")),
    (Unavailable, Answer(503, grpc.StatusCode.UNAVAILABLE, "unavailable_error", "unavailable")),
    (asyncio.TimeoutError, Answer(504, grpc.StatusCode.DEADLINE_EXCEEDED, "timeout_error", "deadline_exceeded")),
    (Failed, Answer(500, grpc.StatusCode.INTERNAL, "internal_error", "internal")),
)
HANDLED = tuple(cls for cls, _ in TABLE)
INTERNAL = Answer(500, grpc.StatusCode.INTERNAL, "internal_error", "internal")


def answer(e: BaseException) -> Answer:
    return next((a for cls, a in TABLE if isinstance(e, cls)), INTERNAL)


def message(e: BaseException) -> str:
    """What the client reads (before `brief` shortens it)."""
    if isinstance(e, RecursionError):      # a parser below (a schema's regex pattern) met input nested too deeply
        return "the request is nested too deeply to process"
    if isinstance(e, asyncio.TimeoutError):
        return "request timed out and was aborted"
    if isinstance(e, Overloaded):
        return f"{e}; retry after {e.retry_after_s:g} s"
    return str(e) or "no output"
