"""Engine: submit / abort / step over one engine artifact. Each step is three calls:

    plan = scheduler.schedule();  logits = self._execute(plan);  outputs = self._update(plan, logits)

The Engine is single-threaded by design (AsyncEngine runs it on one loop thread); it never imports torch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from compile import artifact

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer, StopStringFilter
from .kv.manager import KVCacheManager, KVLayout
from .kv.paged import PagedKVManager
from .model_runner import ModelRunner, check_same_tokenizer
from .outputs import RequestOutput, SchedulePlan, Usage
from .paged_executor import PagedExecutor, load_paged_runners
from .request import InvalidRequest, Request, RequestStatus, SamplingParams
from .sampler import Sampler
from .scheduler import Scheduler
from .spec_decode.draft_model import DraftModelProposer
from .spec_decode.ngram import NgramProposer
from .spec_decode.paged_draft import PagedDraftProposer
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


class Engine:
    def __init__(self, engine_dir: str | Path, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.paged = artifact.load(Path(engine_dir), verify=False).get("target") == "cuda"
        if self.paged:
            self.runner, self.draft = load_paged_runners(Path(engine_dir), config)
        else:
            self.runner = ModelRunner(engine_dir, threads=config.threads, verify=config.verify_artifact, spin=config.spin)
            self.draft = (ModelRunner(config.draft, threads=config.threads, verify=config.verify_artifact, spin=config.spin)
                          if config.draft else None)
        manifest = self.runner.manifest
        self.tokenizer = Tokenizer.from_file(str(Path(engine_dir) / "tokenizer.json"))
        self.eos_ids = frozenset(manifest["tokenizer"]["eos_token_ids"])
        self.max_model_len = min(config.cache.max_model_len or self.runner.max_seq_len, self.runner.max_seq_len)
        if self.draft is not None:
            check_same_tokenizer(self.runner, self.draft)
            self.max_model_len = min(self.max_model_len, self.draft.max_seq_len)
        if self.paged:
            self.kv = PagedKVManager(self.runner.num_blocks, self.runner.block_size, config.scheduler.max_num_seqs,
                                     self.max_model_len, with_draft=self.draft is not None)
        else:
            layouts = [self.runner.kv_layout] + ([self.draft.kv_layout] if self.draft is not None else [])
            self.kv = self._make_kv(config, layouts)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.sampler = Sampler()
        self.speculator = None
        if config.speculation is not None:
            if config.speculation == "ngram":
                proposer = NgramProposer()
            elif self.paged:
                proposer = PagedDraftProposer(self.draft, self.kv, self.sampler)
            else:
                proposer = DraftModelProposer(self.draft, self.kv.pools[1], self.sampler)
            self.speculator = Speculator(config.spec, proposer, self.runner, self.sampler)
        self.requests: dict[str, Request] = {}
        if self.paged:
            self.paged_executor = PagedExecutor(self.runner, self.draft, self.kv, self.speculator, self.requests,
                                                self.max_model_len)
        self._streams: dict[str, _Stream] = {}
        self._uncached: set[str] = set()   # requests whose new full blocks go to the prefix cache next step
        self.stats = EngineStats()
        self._warm_up()

    def _warm_up(self) -> None:
        """ONNX Runtime's first runs pay for allocation and weight prepacking: pay it here, not in a user's TTFT.
        With speculation, also measure the step costs its decisions are based on."""
        if self.paged:
            self.paged_executor.warm_up()
            return
        models = [(self.runner, self.kv.slots)] + ([(self.draft, self.kv.pools[1])] if self.draft else [])
        self.kv.blocks.prefault()
        for runner, pool in models:
            pool.prefault()
            for n in (8, 1):
                runner.prefill(pool, 0, [0] * n, 0)
        if self.speculator is None:
            return
        cost, sizes = self.speculator.cost, [b for b in (1, 2, 4, 8, 16, 32) if b <= self.kv.slots.num_slots]

        def timed(fn) -> float:
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return float(np.median(times))

        for b in sizes:
            rows = [(s, 0, 16) for s in range(b)]
            cost.record("dec", b, timed(lambda: self.runner.decode(self.kv.slots, rows, set())))
            if self.draft is not None:
                cost.record("draft", b, timed(lambda: self.draft.decode(self.kv.pools[1], rows, set())))
        for g in range(1, self.config.spec.max_gamma + 1):
            cost.record("ver", g + 1, timed(lambda: self.runner.prefill(self.kv.slots, 0, [0] * (g + 1), 16, True)))

    def _make_kv(self, config: EngineConfig, layouts: list[KVLayout]) -> KVCacheManager:
        c = config.cache
        token_bytes = sum(m.token_bytes for m in layouts)
        budget = c.budget()
        slot_budget = budget * (1 - c.prefix_cache_fraction if c.enable_prefix_cache else 1)
        num_slots = min(config.scheduler.max_num_seqs, int(slot_budget // (token_bytes * self.max_model_len)))
        if num_slots < 1:
            raise ValueError(f"KV budget {budget / 2**20:.0f} MiB cannot hold one sequence of {self.max_model_len} "
                             "tokens; raise the budget or lower max_model_len")
        num_blocks = int(budget * c.prefix_cache_fraction // (token_bytes * c.block_size)) if c.enable_prefix_cache else 0
        return KVCacheManager(layouts, num_slots, self.max_model_len, num_blocks, c.block_size)

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str = "",
                    priority: int = 0, arrival: float | None = None) -> Request:
        """Validate and queue a request; raises InvalidRequest (bad input) or EngineOverloaded (queue full).
        `arrival` (time.monotonic) is when the caller received it: TTFT and queue time count from there."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt).ids if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequest("the prompt is empty")
        if any(not isinstance(t, (int, np.integer)) or not 0 <= t < self.runner.vocab_size for t in ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {self.runner.vocab_size})")
        if any(t >= self.runner.vocab_size for t, _ in params.logit_bias):
            raise InvalidRequest(f"logit_bias token ids must be below the vocabulary size {self.runner.vocab_size}")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                                 f"context length of {self.max_model_len} tokens")
        if request_id and request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            raise InvalidRequest(f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], not {priority}")
        if self.scheduler.num_waiting >= self.config.scheduler.max_waiting:
            raise EngineOverloaded(f"{self.scheduler.num_waiting} requests are already waiting")
        req = Request([int(t) for t in ids], params, request_id, priority)
        if arrival is not None:
            req.arrival = arrival
        if self.paged and not self.kv.can_ever_fit(req):
            raise InvalidRequest(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) needs more KV blocks "
                                 f"than the cache has ({self.kv.blocks.num_blocks} × {self.kv.block_size} tokens); "
                                 "lower max_tokens or raise the KV budget")
        self.requests[req.request_id] = req
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

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self._cache_blocks()
        plan = self.scheduler.schedule()
        self.stats.preemptions += len(plan.preempted)
        if not plan:
            return []
        try:
            outputs = self._update(plan, self._execute(plan))
        except Exception as e:      # a failed run fails the requests it carried; the others keep running
            log.exception("engine step failed")
            self.stats.failed_steps += 1
            return self._fail(plan.decodes + [r for r, _ in plan.chunks], f"internal error: {type(e).__name__}: {e}")
        self.stats.steps += 1
        self.stats.last_step_s, self.stats.last_batch = time.perf_counter() - t0, len(plan.decodes) + len(plan.chunks)
        self.scheduler.observe(plan, self.stats.last_step_s)
        self.stats.last_step_prefill = bool(plan.chunks)
        return outputs

    def _cache_blocks(self) -> None:
        """Copy last step's newly full blocks into the prefix cache. Done at the start of the next step, after
        the outputs went out, so the copy never delays a token; a finishing request is cached in _finish."""
        for rid in self._uncached:
            req = self.requests.get(rid)
            if req is not None and req.slot is not None:
                self.kv.cache_computed(req)
        self._uncached.clear()

    def _execute(self, plan: SchedulePlan) -> tuple[dict[str, np.ndarray], dict[str, tuple]]:
        """Run the plan. Returns (logits [vocab] for every request that catches up without speculating,
        {request id: (emitted tokens, target KV length)} for the ones that speculated)."""
        if self.paged:
            return self.paged_executor.execute(plan)
        pool, logits = self.kv.slots, {}
        running = {r.slot for r in self.scheduler.running}
        gammas = self.speculator.plan(plan.decodes, self.max_model_len) if self.speculator else {}
        spec = [r for r in plan.decodes if r.request_id in gammas]
        plain = [r for r in plan.decodes if r.request_id not in gammas]
        if plain:
            t0 = time.perf_counter()
            rows = [(r.slot, r.tokens(r.num_computed, r.num_computed + 1)[0], r.num_computed) for r in plain]
            out = self.runner.decode(pool, rows, running - {r.slot for r in plain})
            if self.speculator:
                self.speculator.cost.record("dec", len(plain), time.perf_counter() - t0)
            logits.update((r.request_id, row) for r, row in zip(plain, out))
        for req, n in plan.chunks:
            start, tokens = req.num_computed, req.tokens(req.num_computed, req.num_computed + n)
            last = self.runner.prefill(pool, req.slot, tokens, start)
            if self.draft is not None and req.num_computed_draft == start:   # the draft reads the prompt too
                self.draft.prefill(self.kv.pools[1], req.slot, tokens, start)
                req.num_computed_draft = start + n
            if start + n == req.num_tokens:
                logits[req.request_id] = last[0]
        speculated = {}
        if spec:
            busy = running - {r.slot for r in spec}
            speculated = self.speculator.run(spec, [gammas[r.request_id] for r in spec], busy, pool)
        return logits, speculated

    def _update(self, plan: SchedulePlan, results: tuple[dict[str, np.ndarray], dict[str, tuple]]) -> list[RequestOutput]:
        logits, speculated = results
        outputs = []
        for req, n in [(r, 1) for r in plan.decodes] + plan.chunks:
            before = req.num_computed
            if req.request_id in speculated:
                emitted, req.num_computed = speculated[req.request_id]
            else:
                req.num_computed += n
                row = logits.get(req.request_id)
                emitted = [self.sampler.sample(row, req)] if row is not None else []
            self.stats.prompt_tokens += max(0, min(req.num_computed, len(req.prompt_ids)) - before)
            if self.config.cache.enable_prefix_cache:
                self._uncached.add(req.request_id)
            if emitted:
                outputs.append(self._append(req, emitted))
        return outputs

    def _append(self, req: Request, results: list) -> RequestOutput:
        """Add sampled tokens to `req` (stopping at the first that finishes it); one output message for them."""
        stream, p, text = self._streams[req.request_id], req.params, ""
        now = time.monotonic()
        for result in results:
            req.output_ids.append(result.token)
            self.stats.generation_tokens += 1
            if req.first_token_time is None:
                req.first_token_time = now
            stream.new_ids.append(result.token)
            if p.logprobs is not None:
                stream.new_logprobs.append({"token": result.token, "logprob": result.logprob, "top": result.top_logprobs})
            reason, hit = None, False
            if (result.token in self.eos_ids and not p.ignore_eos) or result.token in p.stop_token_ids:
                reason = "stop"
            else:
                delta, hit = stream.stops.feed(stream.detok.push(result.token))
                text += delta
                if hit:
                    reason = "stop"
                elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
                    reason = "length"
            if reason is not None:
                return self._finish(req, reason, text, stop_string_hit=hit)
        return self._emit(req, text)

    def _emit(self, req: Request, text: str) -> RequestOutput:
        stream = self._streams[req.request_id]
        out = RequestOutput(req.request_id, stream.new_ids, text, stream.new_logprobs or None)
        stream.new_ids, stream.new_logprobs = [], []
        return out

    def _finish(self, req: Request, reason: str, text: str = "", stop_string_hit: bool = False) -> RequestOutput:
        stream = self._streams.pop(req.request_id)
        if not stop_string_hit:   # release text held back for a stop string that never completed
            text += stream.stops.feed(stream.detok.flush())[0] + stream.stops.flush()
        if self.config.cache.enable_prefix_cache and req.slot is not None and reason != "error":
            self.kv.cache_computed(req)      # its KV is complete and about to be freed: keep the reusable part
        self._uncached.discard(req.request_id)
        self.scheduler.remove(req)
        self.sampler.forget(req)
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


def usage(req: Request) -> Usage:
    n = len(req.output_ids)
    ttft = req.first_token_time - req.arrival if req.first_token_time else None
    tpot = (req.finish_time - req.first_token_time) / (n - 1) if req.first_token_time and req.finish_time and n > 1 else None
    return Usage(len(req.prompt_ids), req.num_cached, n,
                 queue_wait_s=(req.first_scheduled - req.arrival) if req.first_scheduled else None,
                 ttft_s=ttft, tpot_s=tpot, e2e_s=(req.finish_time - req.arrival) if req.finish_time else None,
                 spec_proposed=req.spec_proposed, spec_accepted=req.spec_accepted)
