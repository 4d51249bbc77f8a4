"""Request, its status, and SamplingParams (all parameter validation lives here)."""

from __future__ import annotations

import enum
import itertools
import json
import secrets
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from .constraints import Constraint


class InvalidRequest(ValueError):
    """A request the engine refuses: the message says which parameter and why."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0          # 0: greedy
    top_k: int = 0                    # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0   # >1 discourages tokens already in prompt or output
    presence_penalty: float = 0.0     # subtracted once per token present in the output
    frequency_penalty: float = 0.0    # subtracted per occurrence in the output
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None       # top-n log-probabilities per generated token (0: only the chosen one)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) pairs; a dict is accepted
    constraint: "Constraint | None" = None  # runtime.constraints: the output follows a JSON schema / regex / grammar
    # SAMPLING_KEYS the caller left out: the engine takes the model's generation_config.json value for them
    # (resolve), else keeps the value set here (a transport's own default, e.g. OpenAI's temperature 1.0)
    defaulted: frozenset = frozenset()

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "defaulted", frozenset(self.defaulted))
        if not self.defaulted <= set(SAMPLING_KEYS):
            raise InvalidRequest(f"defaulted names sampling options outside {', '.join(SAMPLING_KEYS)}")
        try:
            bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
            object.__setattr__(self, "logit_bias", tuple((t, b) for t, b in bias))
        except (TypeError, ValueError):
            raise InvalidRequest("logit_bias must map token ids to biases") from None
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be an integer ≥ 1"),
            (0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be an integer ≥ 0 (0 disables it)"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63), "seed must be an integer in [0, 2^63)"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (len(self.stop) <= 16 and all(len(s) <= 256 for s in self.stop), "at most 16 stop strings of ≤ 256 characters"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative integers"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20), "logprobs must be in [0, 20]"),
            (len(self.logit_bias) <= 300 and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                 and isinstance(b, (int, float)) and not isinstance(b, bool)
                                                 and -100.0 <= b <= 100.0
                                                 for t, b in self.logit_bias),
             "logit_bias maps at most 300 token ids (integers ≥ 0) to biases in [-100, 100]"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequest(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def resolve(self, model_defaults: dict) -> "SamplingParams":
        """These params with the options the caller left out taken from the model's defaults (generation_defaults)
        where it has them: the one place every entry point's requests get the model's defaults (Engine.add_request)."""
        taken = {k: model_defaults[k] for k in self.defaulted if k in model_defaults}
        return replace(self, **taken, defaulted=frozenset()) if self.defaulted else self

    @classmethod
    def from_options(cls, given: dict, fallback: dict | None = None, **rest) -> "SamplingParams":
        """SamplingParams from a caller's options (`given`: only what the caller set, None meaning unset), marking
        the SAMPLING_KEYS left out as `defaulted`; `fallback`: a transport's own defaults for those."""
        given = {k: v for k, v in given.items() if v is not None}
        left_out = frozenset(k for k in SAMPLING_KEYS if k not in given)
        fallback = {k: v for k, v in (fallback or {}).items() if k in left_out}
        return cls(**{**fallback, **given}, **rest, defaulted=left_out)


SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def generation_defaults(engine_dir: str | Path) -> dict:
    """The sampling defaults a model ships in its generation_config.json (copied into the engine by `compile
    build`), as SamplingParams fields — what the model's authors say it reads best with, as transformers and vLLM
    apply them. `do_sample: false` means greedy whatever its temperature says. Absent or unreadable: {}."""
    try:
        config = json.loads((Path(engine_dir) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    found = {k: config[k] for k in SAMPLING_KEYS if isinstance(config.get(k), (int, float)) and not isinstance(config.get(k), bool)}
    if config.get("do_sample") is False:
        found.update(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
    return found


class RequestStatus(enum.Enum):
    WAITING = "waiting"       # queued, holds no KV
    RUNNING = "running"       # owns a slot; prefilling or decoding
    PREEMPTED = "preempted"   # slot taken back; recomputes (mostly from the prefix cache) when readmitted
    FINISHED = "finished"


_ids = itertools.count()


def new_id(prefix: str, nbytes: int = 12) -> str:
    """A unique, unguessable id: the engine's request ids (req-), OpenAI's response (cmpl-, chatcmpl-) and tool
    call (call_) ids — one generator for all of them."""
    return f"{prefix}{secrets.token_hex(nbytes)}"


@dataclass(eq=False)
class Request:
    """One generation. The scheduler only looks at token counts: `num_computed` tokens of `all_ids` have KV."""

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    priority: int = 0                          # lower runs first; FCFS within a priority
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0                      # tokens whose KV is in the slot
    num_computed_draft: int = 0                # tokens whose KV is in the draft's slot (speculation)
    spec_proposed: int = 0
    prefill_chunks: int = 0                    # prompt chunks computed (the scheduler counts them)
    spec_accepted: int = 0
    num_cached: int = 0                        # prompt tokens served from the prefix cache (first admission)
    steps_sat_out: int = 0                     # consecutive steps a long prompt yielded to short ones (aging)
    in_slices: bool = False                    # its prompt went in slices beside decodes: it stays in them
    slot: int | None = None
    finish_reason: str | None = None
    seq_no: int = field(default_factory=lambda: next(_ids))
    first_scheduled: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    seen: np.ndarray | None = field(default=None, repr=False)   # sorted distinct ids of the first seen_upto tokens
    seen_upto: int = 0                                           # (sampler.seen_ids keeps them for penalties)

    def __post_init__(self):
        if not self.request_id:     # unguessable: a client cannot name (or collide with) another client's request
            self.request_id = new_id("req-")

    @property
    def all_ids(self) -> list[int]:
        """prompt + output as one new list (O(context)): per-step code uses tokens() instead."""
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, copying only those."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:] + self.output_ids[:end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens without KV yet: the whole prompt at first, 1 while decoding, more after preemption."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
