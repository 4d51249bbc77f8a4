"""The step contracts, in the order a step passes through them:

    SchedulePlan (scheduler) → ModelInput (engine: tokens and draft guesses) → RunnerOutput (backend: logits)
    → StepResult per request (engine: sampled / verified tokens) → Scheduler.update → RequestOutput (client)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .request import Request


@dataclass
class SchedulePlan:
    """One engine step, inside the scheduler's token budget: decodes (1 token each, plus `gammas[id]` guesses for
    those that speculate) and prompt chunks (request, tokens). KV for all of it is reserved before the plan is
    returned; `preempted` lists the requests that gave their KV back to make room."""

    decodes: list[Request] = field(default_factory=list)
    chunks: list[tuple[Request, int]] = field(default_factory=list)
    gammas: dict[str, int] = field(default_factory=dict)     # request id → guesses to verify this step
    preempted: list[Request] = field(default_factory=list)
    sliced: bool = False          # prompt chunks beside decodes were cut to the step-time bound (the scheduler adapts it)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.chunks)

    @property
    def requests(self) -> list[Request]:
        return self.decodes + [r for r, _ in self.chunks]

    @property
    def num_tokens(self) -> int:
        """Tokens computed by the target this step (what the token budget bounds)."""
        return len(self.decodes) + sum(self.gammas.values()) + sum(n for _, n in self.chunks)


@dataclass
class SeqInput:
    """One sequence's share of a step: `tokens` fed at positions [start, start + len(tokens)), and which logits
    come back — none (a prompt chunk that does not finish the prompt), the last row, or every row (verification
    of `proposal`, whose guesses are the tail of `tokens`)."""

    req: Request
    start: int
    tokens: list[int]
    num_logits: int                       # 0, 1, or len(tokens)
    proposal: object | None = None        # spec_decode.proposer.Proposal

    @property
    def is_decode(self) -> bool:
        """One token, one logits row, nothing to verify: batched with the other decodes."""
        return len(self.tokens) == 1 and self.num_logits == 1 and self.proposal is None


@dataclass
class ModelInput:
    """What a backend runs for one step: decodes first, then prompt chunks, then verifications."""

    seqs: list[SeqInput]

    @classmethod
    def from_plan(cls, plan: SchedulePlan, proposals: dict[str, object]) -> "ModelInput":
        seqs = []
        for req in plan.decodes:
            start = req.num_computed
            prop = proposals.get(req.request_id)
            if prop is not None and not prop.tokens:      # nothing to verify (prompt lookup found no match):
                prop = None                                # a plain decode, batched with the others
            tokens = req.tokens(start, start + 1) + (list(prop.tokens) if prop is not None else [])
            seqs.append(SeqInput(req, start, tokens, len(tokens) if prop is not None else 1, prop))
        for req, n in plan.chunks:
            start = req.num_computed
            seqs.append(SeqInput(req, start, req.tokens(start, start + n), int(start + n == req.num_tokens)))
        seqs.sort(key=lambda s: 0 if s.is_decode else 2 if s.proposal is not None else 1)
        return cls(seqs)


@dataclass
class RunnerOutput:
    """Logits of one step: logits[i] is [seqs[i].num_logits, vocab] (None where no row was asked for).
    `decode_s`: seconds the step's batched decode call took, where the backend times it apart (the scheduler
    sizes prompt slices against what the same decodes cost alone)."""

    logits: list[np.ndarray | None]
    decode_s: float | None = None


@dataclass
class StepResult:
    """What one step did for one request: its target KV length now, and the tokens it emits."""

    num_computed: int
    tokens: list = field(default_factory=list)     # sampler.SampleResult, in order


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
    prefill_chunks: int = 0       # prompt chunks its prefill took (chunked prefill beside other requests)


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
