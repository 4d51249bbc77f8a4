"""The step contracts: what the scheduler plans, and what a request's stream receives."""

from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request


@dataclass
class SchedulePlan:
    """One engine step. Every scheduled request catches up `num_tokens` of its pending tokens."""

    decodes: list[Request] = field(default_factory=list)               # 1 token each, batched by slot range
    chunks: list[tuple[Request, int]] = field(default_factory=list)    # (request, tokens) one ONNX run each
    preempted: list[Request] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.chunks)


@dataclass
class Usage:
    prompt_tokens: int
    cached_tokens: int            # prompt tokens served from the prefix cache
    completion_tokens: int
    queue_wait_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None   # mean time per output token after the first
    e2e_s: float | None = None
    spec_proposed: int = 0        # speculative tokens proposed / accepted for this request
    spec_accepted: int = 0


@dataclass
class RequestOutput:
    """One message of a request's stream: new tokens since the last message, or the final one."""

    request_id: str
    token_ids: list[int]
    text: str                                             # text delta (never a split UTF-8 character)
    logprobs: list[dict] | None = None                    # per new token: {"token", "logprob", "top": [(id, lp)]}
    finished: bool = False
    finish_reason: str | None = None                      # stop | length | abort | error
    usage: Usage | None = None                            # on the final message
    error: str | None = None
