"""Engine: submit / abort / step over one engine artifact, on whichever backend its target needs. Each step:

    plan = scheduler.schedule()                       # who computes how many tokens (guesses included), KV reserved
    inp = ModelInput.from_plan(plan, guesses)         # the proposer's guesses for those that speculate
    out = backend.run(inp)                            # logits
    results = self._results(inp, out)                 # sampled tokens, or verified guesses
    scheduler.update(plan, results); stream the tokens

The loop is written once: the backend (runtime/backends) is a KV manager + a model runner + a proposer behind
declared protocols, and nothing here knows which one runs. The Engine is single-threaded by design
(AsyncEngine runs it on one loop thread); it never imports torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

import artifact

from .backends import load_backend
from .config import EngineConfig
from .constraints import Constraint, GrammarFailed, Grammars, Matcher
from .detokenizer import IncrementalDetokenizer, StopStringFilter
from .engine_client import EngineInfo
from .outputs import ModelInput, RequestOutput, RunnerOutput, StepResult, Usage
from .request import InvalidRequest, Request, RequestStatus, SamplingParams, generation_defaults
from .sampler import Sampler
from .scheduler import Scheduler
from .spec_decode.speculator import Speculator


log = logging.getLogger("quicksilver.engine")
MIN_PRIORITY, MAX_PRIORITY = -100, 100      # the engine's range; servers cap it further per caller


class EngineOverloaded(RuntimeError):
    """The waiting queue is full: retry later."""


@dataclass
class _Stream:
    """Per-request output state: detokenizer, stop-string filter, tokens not yet reported."""

    detok: IncrementalDetokenizer
    stops: StopStringFilter
    new_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict] = field(default_factory=list)
    decoded: int = 0                # characters the detokenizer has produced, some maybe held by the stop filter:
                                    # a token's text_offset (counting reported text put later tokens too early)


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    last_step_s: float = 0.0
    last_batch: int = 0
    last_step_prefill: bool = False
    failed_steps: int = 0
    grammar_s: float = 0.0          # masking logits and advancing grammars (constrained requests)


class Engine:
    def __init__(self, engine_dir: str | Path, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.sampler = Sampler()
        self.backend = backend = load_backend(engine_dir, config, self.sampler)
        self.runner, self.draft, self.kv = backend.runner, backend.draft, backend.kv
        self.max_model_len = backend.max_model_len
        manifest = self.runner.manifest
        self.tokenizer = Tokenizer.from_file(str(Path(engine_dir) / "tokenizer.json"))
        self.eos_ids = frozenset(manifest["tokenizer"]["eos_token_ids"])
        self.sampling_defaults = generation_defaults(engine_dir)      # what requests that leave options out get
        artifact.check_unchanged(engine_dir, manifest)   # everything opened by path is what was verified
        self.grammars = Grammars(self.tokenizer.to_str(), self.runner.vocab_size, self.eos_ids)
        self._matchers: dict[str, Matcher] = {}        # constrained requests' grammar state
        self._failed_grammars: dict[str, str] = {}     # request id → why its grammar failed this step
        self.speculator, planner = None, None
        if backend.proposer is not None:
            self.speculator = Speculator(config.spec, backend.proposer, self.sampler, backend.cost, backend.step_cost)
            planner = speculation_planner(self.speculator, backend)
        self.scheduler = Scheduler(config.scheduler, self.kv, planner)
        self.requests: dict[str, Request] = {}
        self._streams: dict[str, _Stream] = {}
        self.stats = EngineStats()
        self.info = EngineInfo(Path(engine_dir), manifest, self.runner.vocab_size, self.max_model_len,
                               config.cache.block_size, config.scheduler.max_num_seqs, config.scheduler.max_waiting,
                               self.kv.num_slots, config.speculation if self.speculator else None,
                               Path(self.draft.engine_dir).resolve().name if self.draft is not None else None,
                               self.sampling_defaults)
        backend.warm_up()

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str = "",
                    priority: int = 0, arrival: float | None = None) -> Request:
        """Validate and queue a request; raises InvalidRequest (bad input) or EngineOverloaded (queue full).
        `arrival` (time.monotonic) is when the caller received it: TTFT and queue time count from there."""
        params = (params or SamplingParams()).resolve(self.sampling_defaults)
        vocab = self.runner.vocab_size
        ids = _token_ids(self.tokenizer.encode(prompt).ids if isinstance(prompt, str) else prompt, vocab)
        if ids is None:
            raise InvalidRequest(f"the prompt's text tokenizes to ids outside the model's vocabulary [0, {vocab})"
                                 if isinstance(prompt, str) else f"prompt token ids must be integers in [0, {vocab})")
        if not ids:
            raise InvalidRequest("the prompt is empty")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise InvalidRequest(f"logit_bias token ids must be below the vocabulary size {vocab}")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                                 f"context length of {self.max_model_len} tokens")
        if request_id and request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            raise InvalidRequest(f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], not {priority}")
        if self.scheduler.num_waiting >= self.config.scheduler.max_waiting:
            raise EngineOverloaded(f"{self.scheduler.num_waiting} requests are already waiting")
        matcher = None
        if params.constraint is not None:
            if not isinstance(params.constraint, Constraint):
                raise InvalidRequest("constraint must be a runtime.constraints.Constraint")
            matcher = self.grammars.matcher(params.constraint)
        req = Request(ids, params, request_id, priority)
        if arrival is not None:
            req.arrival = arrival
        if not self.kv.can_ever_fit(req):
            raise InvalidRequest(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) needs more KV memory "
                                 "than the cache has; lower max_tokens or raise the KV budget")
        self.requests[req.request_id] = req
        if matcher is not None:
            self._matchers[req.request_id] = matcher
        self._streams[req.request_id] = _Stream(IncrementalDetokenizer(self.tokenizer, req.prompt_ids),
                                                StopStringFilter(params.stop))
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its KV now; returns its final output (None if unknown or already done)."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        return self._finish(req, "abort")

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every request with an error (after a failure outside a step's execution), freeing their KV."""
        return self._fail(list(self.requests.values()), message)

    def _fail(self, reqs: list[Request], message: str) -> list[RequestOutput]:
        outs = []
        for req in reqs:
            if req.request_id in self.requests:
                out = self._finish(req, "error")
                out.error = message
                outs.append(out)
        return outs

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def idle(self) -> bool:
        """One slice of the work worth doing while no request runs (KVManager.idle: cache copies, memory made
        resident ahead of the next burst); True while more is left. AsyncEngine calls it between requests."""
        return self.kv.idle()

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        self.stats.preemptions += len(plan.preempted)
        if not plan:
            return []
        try:
            proposals = {}
            if plan.gammas:
                spec = [r for r in plan.decodes if r.request_id in plan.gammas]
                proposals = self.speculator.propose(spec, [plan.gammas[r.request_id] for r in spec])
            inp = ModelInput.from_plan(plan, proposals)
            out = self.backend.run(inp)
            results = self._results(inp, out)
        except Exception as e:      # a failed run fails the requests it carried; the others keep running
            log.exception("engine step failed")
            self.stats.failed_steps += 1
            return self._fail(plan.requests, f"internal error: {type(e).__name__}: {e}")
        prompt_before = {r.request_id: min(r.num_computed, len(r.prompt_ids)) for r in plan.requests}
        self.scheduler.update(plan, results)
        outputs = self._grammar_failures()
        for req in plan.requests:
            if req.finished:
                continue
            self.stats.prompt_tokens += min(req.num_computed, len(req.prompt_ids)) - prompt_before[req.request_id]
            emitted = results[req.request_id].tokens
            if emitted:
                outputs.append(self._append(req, emitted))
        self.stats.steps += 1
        self.stats.last_step_s, self.stats.last_batch = time.perf_counter() - t0, len(plan.requests)
        if self.speculator is not None and not plan.chunks:
            self.speculator.observe(len(plan.decodes), bool(plan.gammas),
                                    sum(len(r.tokens) for r in results.values()), self.stats.last_step_s)
        self.scheduler.observe(plan, self.stats.last_step_s, out.decode_s)
        self.stats.last_step_prefill = bool(plan.chunks)
        return outputs

    def _results(self, inp: ModelInput, out: RunnerOutput) -> dict[str, StepResult]:
        """Tokens from logits: a sample where a sequence caught up, verified guesses where it speculated."""
        results = {}
        for s, logits in zip(inp.seqs, out.logits):
            matcher = self._matchers.get(s.req.request_id)
            if matcher is not None and s.num_logits:      # what the grammar forbids never gets sampled or accepted
                t0 = time.perf_counter()
                guesses = s.proposal.tokens if s.proposal is not None else ()
                try:
                    logits = matcher.mask(logits[-len(guesses) - 1:], guesses)
                except GrammarFailed as e:               # this request ends with the error; the step goes on
                    self._failed_grammars[s.req.request_id] = str(e)
                    results[s.req.request_id] = StepResult(s.start + len(s.tokens) - len(guesses), [])
                    continue
                finally:
                    self.stats.grammar_s += time.perf_counter() - t0
            if s.proposal is not None:
                emitted, length = self.speculator.verify(s.req, s.proposal, logits)
                results[s.req.request_id] = StepResult(length, emitted)
            else:
                sampled = [self.sampler.sample(logits[-1], s.req)] if s.num_logits else []
                results[s.req.request_id] = StepResult(s.start + len(s.tokens), sampled)
        return results

    def _grammar_failures(self) -> list[RequestOutput]:
        """End the requests whose grammar failed this step with the reason, and forget their compiled grammar."""
        outputs = []
        for rid, message in self._failed_grammars.items():
            req = self.requests.get(rid)
            if req is None:
                continue
            self.grammars.forget(req.params.constraint)
            out = self._finish(req, "error")
            out.error = message
            outputs.append(out)
        self._failed_grammars.clear()
        return outputs

    def _append(self, req: Request, results: list) -> RequestOutput:
        """Add sampled tokens to `req` (stopping at the first that finishes it); one output message for them."""
        stream, p, text = self._streams[req.request_id], req.params, ""
        matcher = self._matchers.get(req.request_id)
        now = time.monotonic()
        for result in results:
            if matcher is not None and not self._advance(matcher, result.token):
                out = self._finish(req, "error", text)
                out.error = f"internal error: the grammar refused a sampled token ({matcher.error})"
                return out
            req.output_ids.append(result.token)
            self.stats.generation_tokens += 1
            if req.first_token_time is None:
                req.first_token_time = now
            stream.new_ids.append(result.token)
            if p.logprobs is not None:
                stream.new_logprobs.append({"token": result.token, "logprob": result.logprob, "top": result.top_logprobs,
                                            "text_offset": stream.decoded})
            reason, hit = None, False
            if (result.token in self.eos_ids and not p.ignore_eos) or result.token in p.stop_token_ids:
                reason = "stop"
            else:
                decoded = stream.detok.push(result.token)
                stream.decoded += len(decoded)
                delta, hit = stream.stops.feed(decoded)
                text += delta
                if hit:
                    reason = "stop"
                elif matcher is not None and matcher.done:
                    reason = "stop"                         # the constrained output is complete
                elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
                    reason = "length"
            if reason is not None:
                return self._finish(req, reason, text, stop_string_hit=hit)
        return self._emit(req, text)

    def _advance(self, matcher: Matcher, token: int) -> bool:
        t0 = time.perf_counter()
        ok = matcher.accept(token)
        self.stats.grammar_s += time.perf_counter() - t0
        return ok

    def _emit(self, req: Request, text: str) -> RequestOutput:
        stream = self._streams[req.request_id]
        out = RequestOutput(req.request_id, stream.new_ids, text, stream.new_logprobs or None)
        stream.new_ids, stream.new_logprobs = [], []
        return out

    def _finish(self, req: Request, reason: str, text: str = "", stop_string_hit: bool = False) -> RequestOutput:
        stream = self._streams.pop(req.request_id)
        if not stop_string_hit:   # release text held back for a stop string that never completed
            text += stream.stops.feed(stream.detok.flush())[0] + stream.stops.flush()
        self.scheduler.remove(req, cache=reason != "error")   # complete KV stays reusable in the prefix cache
        self.sampler.forget(req)
        self._matchers.pop(req.request_id, None)
        if self.speculator:
            self.speculator.forget(req)
        req.status, req.finish_reason, req.finish_time = RequestStatus.FINISHED, reason, time.monotonic()
        del self.requests[req.request_id]
        return RequestOutput(req.request_id, stream.new_ids, text, stream.new_logprobs or None, True, reason, usage(req))

    # -- convenience ------------------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[dict]:
        """Run prompts to completion (blocking); returns per prompt {"token_ids", "text", "finish_reason", "usage"}."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        results = {r.request_id: {"token_ids": [], "text": "", "finish_reason": None, "usage": None} for r in reqs}
        while any(results[r.request_id]["finish_reason"] is None for r in reqs):
            for out in self.step():
                res = results[out.request_id]
                res["token_ids"] += out.token_ids
                res["text"] += out.text
                if out.finished:
                    res["finish_reason"], res["usage"] = out.finish_reason, out.usage
        return [results[r.request_id] for r in reqs]


def _token_ids(prompt, vocab_size: int) -> list[int] | None:
    """A prompt's token ids (any flat iterable of integers, or the tokenizer's: it may know more tokens than the
    model) as a list of ints, None unless every one is an integer in [0, vocab_size); booleans alone are not ids.
    Checked as one array: a Python loop over a 1,400-token prompt took 0.3 ms of the engine thread."""
    try:
        ids = np.asarray(prompt if isinstance(prompt, np.ndarray) else list(prompt))
    except (ValueError, TypeError):         # ragged, or not iterable
        return None
    if ids.ndim != 1 or (ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= vocab_size)):
        return None
    return ids.tolist()


def speculation_planner(speculator: Speculator, backend) -> Callable[[list[Request], int], dict[str, int]]:
    """The scheduler's hook: γ per decode, priced by the backend. A closure over the parts rather than a method of
    the Engine, so the engine has no reference cycle and is freed (with its ONNX Runtime sessions) when dropped,
    not inside some later garbage collection."""
    def plan(decodes: list[Request], budget: int) -> dict[str, int]:
        return speculator.plan(decodes, backend.max_model_len, budget)
    return plan


def usage(req: Request) -> Usage:
    n = len(req.output_ids)
    ttft = req.first_token_time - req.arrival if req.first_token_time else None
    tpot = (req.finish_time - req.first_token_time) / (n - 1) if req.first_token_time and req.finish_time and n > 1 else None
    return Usage(len(req.prompt_ids), req.num_cached, n,
                 queue_wait_s=(req.first_scheduled - req.arrival) if req.first_scheduled else None,
                 ttft_s=ttft, tpot_s=tpot, e2e_s=(req.finish_time - req.arrival) if req.finish_time else None,
                 spec_proposed=req.spec_proposed, spec_accepted=req.spec_accepted, prefill_chunks=req.prefill_chunks,
)
