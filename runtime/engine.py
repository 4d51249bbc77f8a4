"""Engine: submit / abort / step over one engine artifact. Each step is three calls:

    plan = scheduler.schedule();  logits = self._execute(plan);  outputs = self._update(plan, logits)

The Engine is single-threaded by design (AsyncEngine runs it on one loop thread); it never imports torch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer, StopStringFilter
from .kv.manager import KVCacheManager
from .kv.slots import SlotRange
from .model_runner import ModelRunner
from .outputs import RequestOutput, SchedulePlan, Usage
from .request import InvalidRequest, Request, RequestStatus, SamplingParams
from .sampler import Sampler
from .scheduler import Scheduler


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


class Engine:
    def __init__(self, engine_dir: str | Path, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.runner = ModelRunner(engine_dir, threads=config.threads, verify=config.verify_artifact)
        manifest = self.runner.manifest
        self.tokenizer = Tokenizer.from_file(str(Path(engine_dir) / "tokenizer.json"))
        self.eos_ids = frozenset(manifest["tokenizer"]["eos_token_ids"])
        self.max_model_len = min(config.cache.max_model_len or self.runner.max_seq_len, self.runner.max_seq_len)
        self.kv = self._make_kv(config)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self._streams: dict[str, _Stream] = {}
        self.stats = EngineStats()
        self._warm_up()

    def _warm_up(self) -> None:
        """ONNX Runtime's first runs pay for allocation and weight prepacking: pay it here, not in a user's TTFT."""
        pool, slot = self.kv.slots, SlotRange(0, 1)
        for n in (8, 1):
            self.runner.execute(np.zeros((1, n), np.int64), np.array([n - 1], np.int32), np.array([n - 1]), pool, slot)

    def _make_kv(self, config: EngineConfig) -> KVCacheManager:
        r, c = self.runner, config.cache
        token_bytes = 2 * r.num_layers * r.kv_heads * r.head_dim * 4
        budget = c.budget()
        slot_budget = budget * (1 - c.prefix_cache_fraction if c.enable_prefix_cache else 1)
        num_slots = min(config.scheduler.max_num_seqs, int(slot_budget // (token_bytes * self.max_model_len)))
        if num_slots < 1:
            raise ValueError(f"KV budget {budget / 2**20:.0f} MiB cannot hold one sequence of {self.max_model_len} "
                             "tokens; raise the budget or lower max_model_len")
        num_blocks = int(budget * c.prefix_cache_fraction // (token_bytes * c.block_size)) if c.enable_prefix_cache else 0
        return KVCacheManager(r.num_layers, r.kv_heads, r.head_dim, num_slots, self.max_model_len, num_blocks, c.block_size)

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str = "",
                    priority: int = 0) -> Request:
        """Validate and queue a request; raises InvalidRequest (bad input) or EngineOverloaded (queue full)."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt).ids if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequest("the prompt is empty")
        if any(not isinstance(t, (int, np.integer)) or not 0 <= t < self.runner.vocab_size for t in ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {self.runner.vocab_size})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                                 f"context length of {self.max_model_len} tokens")
        if request_id and request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if self.scheduler.num_waiting >= self.config.scheduler.max_waiting:
            raise EngineOverloaded(f"{self.scheduler.num_waiting} requests are already waiting")
        req = Request([int(t) for t in ids], params, request_id, priority)
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
        """End every request with an error (after an internal failure), freeing their KV."""
        outs = []
        for req in list(self.requests.values()):
            out = self._finish(req, "error")
            out.error = message
            outs.append(out)
        return outs

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        self.stats.preemptions += len(plan.preempted)
        if not plan:
            return []
        logits = self._execute(plan)
        outputs = self._update(plan, logits)
        self.stats.steps += 1
        self.stats.last_step_s, self.stats.last_batch = time.perf_counter() - t0, len(plan.decodes) + len(plan.chunks)
        return outputs

    def _decode_groups(self, plan: SchedulePlan) -> list[list[Request]]:
        """Decodes split into runs of slots that a single batched call may bind: a run may span free slots
        (dummy rows) but never a slot of a running request that is not decoding this step."""
        busy = {r.slot for r in self.scheduler.running} - {r.slot for r in plan.decodes}
        groups: list[list[Request]] = []
        for req in sorted(plan.decodes, key=lambda r: r.slot):
            if groups and not any(s in busy for s in range(groups[-1][-1].slot + 1, req.slot)):
                groups[-1].append(req)
            else:
                groups.append([req])
        return groups

    def _execute(self, plan: SchedulePlan) -> dict[str, np.ndarray]:
        """Run the plan; returns logits [vocab] for every request that catches up this step."""
        run, pool, out = self.runner, self.kv.slots, {}
        for group in self._decode_groups(plan):
            lo = group[0].slot
            rows = group[-1].slot - lo + 1
            ids, seqlens = np.zeros((rows, 1), np.int64), np.zeros(rows, np.int32)
            for req in group:
                ids[req.slot - lo, 0] = req.all_ids[req.num_computed]
                seqlens[req.slot - lo] = req.num_computed
            index = np.array([r.slot - lo for r in group], np.int64)
            logits = run.execute(ids, seqlens, index, pool, SlotRange(lo, rows))
            for req, row in zip(group, logits):
                out[req.request_id] = row.copy()
        for req, n in plan.chunks:
            start = req.num_computed
            ids = np.asarray([req.all_ids[start:start + n]], np.int64)
            logits = run.execute(ids, np.array([start + n - 1], np.int32), np.array([n - 1]), pool, SlotRange(req.slot, 1))
            if start + n == req.num_tokens:
                out[req.request_id] = logits[0].copy()
        return out

    def _update(self, plan: SchedulePlan, logits: dict[str, np.ndarray]) -> list[RequestOutput]:
        outputs = []
        for req, n in [(r, 1) for r in plan.decodes] + plan.chunks:
            req.num_computed += n
            self.stats.prompt_tokens += max(0, min(req.num_computed, len(req.prompt_ids)) - (req.num_computed - n))
            if self.config.cache.enable_prefix_cache:
                self.kv.cache_computed(req)
            row = logits.get(req.request_id)
            if row is None:
                continue
            result = self.sampler.sample(row, req)
            out = self._append(req, result)
            if out is not None:
                outputs.append(out)
        return outputs

    def _append(self, req: Request, result) -> RequestOutput | None:
        now = time.monotonic()
        req.output_ids.append(result.token)
        self.stats.generation_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
        stream, p = self._streams[req.request_id], req.params
        stream.new_ids.append(result.token)
        if p.logprobs is not None:
            stream.new_logprobs.append({"token": result.token, "logprob": result.logprob, "top": result.top_logprobs})
        reason, text, hit = None, "", False
        if (result.token in self.eos_ids and not p.ignore_eos) or result.token in p.stop_token_ids:
            reason = "stop"
        else:
            text, hit = stream.stops.feed(stream.detok.push(result.token))
            if hit:
                reason = "stop"
            elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
                reason = "length"
        if reason is None:
            return self._emit(req, text)
        return self._finish(req, reason, text, stop_string_hit=hit)

    def _emit(self, req: Request, text: str) -> RequestOutput:
        stream = self._streams[req.request_id]
        out = RequestOutput(req.request_id, stream.new_ids, text, stream.new_logprobs or None)
        stream.new_ids, stream.new_logprobs = [], []
        return out

    def _finish(self, req: Request, reason: str, text: str = "", stop_string_hit: bool = False) -> RequestOutput:
        stream = self._streams.pop(req.request_id)
        if not stop_string_hit:   # release text held back for a stop string that never completed
            text += stream.stops.feed(stream.detok.flush())[0] + stream.stops.flush()
        self.scheduler.remove(req)
        self.sampler.forget(req)
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
                 ttft_s=ttft, tpot_s=tpot, e2e_s=(req.finish_time - req.arrival) if req.finish_time else None)
