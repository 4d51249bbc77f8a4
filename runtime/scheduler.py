"""Token-budget scheduler: continuous batching, chunked prefill, admission by KV slots, priority preemption.

There are no prefill or decode phases, only requests catching up: each step, every running request with
one pending token joins the decode batch, requests with more pending tokens (new prompts, recompute after
preemption) get a chunk of at most `prefill_chunk` tokens, and the step never exceeds `token_budget`.
Decodes run every step, so a long prompt stalls them by at most one chunk. Prefills go shortest-remaining
first, and in a step where a short prompt (at most one chunk) is prefilling, long prompts sit out: a short
request arriving behind a 4k-token prompt waits for at most the step in progress, then gets its first
token from a step without the long prompt's chunk. Sitting out ages a long prompt: after `MAX_SAT_OUT`
consecutive steps one aged prompt gets a `MIN_CHUNK` beside the short ones (after them, from what budget they
leave), so a steady stream of short requests slows it down but cannot starve it.

A long prompt's chunk is also sized by time: while others are decoding, a step that carries a long chunk
should cost at most `mixed_step_ratio` plain decode steps (attention makes the same chunk slower as the prompt's context
grows), so after each such step the chunk is scaled by target / measured time (at most doubling) — keeping
the TPOT of running requests bounded while a 4k prompt prefills beside them.

Order: lower `priority` first, then arrival (FCFS). A waiting request that finds no free slot may take the
slot of the running request of the lowest priority (strictly lower than its own); the victim is
preempted — its computed blocks go to the prefix cache, its slot is freed, and it is recomputed (mostly
from that cache) when readmitted.
"""

from __future__ import annotations

import heapq
import time

from .config import SchedulerConfig
from .kv.manager import KVCacheManager
from .outputs import SchedulePlan
from .request import Request, RequestStatus


class Scheduler:
    MIN_CHUNK = 16
    MAX_SAT_OUT = 4       # consecutive steps a long prompt yields to short prompts before it gets a MIN_CHUNK

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config, self.kv = config, kv
        self.waiting: list[tuple[int, int, Request]] = []     # heap of (priority, seq_no, request)
        self.running: list[Request] = []
        self.long_chunk = config.prefill_chunk                # adapted by observe()
        self._decode_step_s: float | None = None              # moving average of decode-only steps

    def observe(self, plan: SchedulePlan, seconds: float) -> None:
        """Feed back a step's measured time: tracks decode-only steps and adapts the long-prompt chunk."""
        if plan.decodes and not plan.chunks:
            old = self._decode_step_s
            self._decode_step_s = seconds if old is None else 0.8 * old + 0.2 * seconds
        elif plan.decodes and self._decode_step_s and any(n == self.long_chunk for _, n in plan.chunks):
            # Proportional: the chunk's cost is close to linear in its length at a given context.
            scale = min(2.0, self.config.mixed_step_ratio * self._decode_step_s / seconds)
            self.long_chunk = max(self.MIN_CHUNK, min(self.config.prefill_chunk, int(self.long_chunk * scale)))

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add(self, req: Request) -> None:
        heapq.heappush(self.waiting, (req.priority, req.seq_no, req))

    def remove(self, req: Request) -> None:
        """Drop a request wherever it is and free its KV (abort, error, finish)."""
        if req in self.running:
            self.running.remove(req)
        else:
            entries = [e for e in self.waiting if e[2] is not req]
            if len(entries) != len(self.waiting):
                self.waiting = entries
                heapq.heapify(self.waiting)
        self.kv.free(req)

    def _preempt_for(self, req: Request) -> Request | None:
        victims = [r for r in self.running if r.priority > req.priority]
        if not victims:
            return None
        victim = max(victims, key=lambda r: (r.priority, r.seq_no))
        self.kv.cache_computed(victim)
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed = victim.num_computed_draft = 0
        victim.status = RequestStatus.PREEMPTED
        self.add(victim)
        return victim

    def _admit(self, plan: SchedulePlan) -> None:
        """Move waiting requests into free slots (preempting lower priorities when none is free)."""
        while self.waiting:
            req = self.waiting[0][2]
            if len(self.running) >= self.config.max_num_seqs or not self.kv.allocate(req):
                victim = self._preempt_for(req)
                if victim is None or not self.kv.allocate(req):
                    return
                plan.preempted.append(victim)
            heapq.heappop(self.waiting)
            if req.status is RequestStatus.WAITING:
                req.num_cached = req.num_computed
                req.first_scheduled = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def schedule(self) -> SchedulePlan:
        plan = SchedulePlan()
        self._admit(plan)
        budget = self.config.token_budget
        chunk = self.config.prefill_chunk
        by_priority = sorted(self.running, key=lambda r: (r.priority, r.seq_no))
        plan.decodes = [r for r in by_priority if r.num_pending == 1]
        budget -= len(plan.decodes)
        # Prefills shortest-remaining first; while any short prompt (≤ one chunk) waits for its first token,
        # long prompts sit this step out (but one aged one gets MIN_CHUNK tokens), so a short request's TTFT
        # includes at most a sliver of a long prompt.
        prefills = sorted((r for r in self.running if r.num_pending > 1), key=lambda r: (r.priority, r.num_pending))
        if not plan.decodes and len(prefills) == 1:
            chunk = budget            # alone: nobody to stall, so no reason to cut the prompt into chunks
        short_waiting = any(r.num_pending <= chunk for r in prefills)
        aged_served = False
        for req in prefills:
            if budget <= 0:
                break
            limit = chunk
            if short_waiting and req.num_pending > chunk:
                if aged_served or req.steps_sat_out < self.MAX_SAT_OUT:
                    req.steps_sat_out += 1
                    continue
                aged_served, limit = True, self.MIN_CHUNK
            req.steps_sat_out = 0
            if req.num_pending > chunk and plan.decodes:     # a long prompt beside decodes: the time-bounded chunk
                limit = min(limit, self.long_chunk)
            n = prompt_chunk(req.num_pending, min(limit, budget))
            if n:
                plan.chunks.append((req, n))
                budget -= n
        return plan


def prompt_chunk(pending: int, cap: int) -> int:
    """Tokens to prefill of `pending` (≥ 2) within `cap`: never a single token, and never leaving a single
    token for later (0 if the cap allows neither). ONNX Runtime's GroupQueryAttention computes one query row
    with MLAS's M=1 kernel, which rounds differently from its multi-row kernel; keeping every prompt token in a
    chunk of two or more makes its KV and logits independent of how the step budget split the prompt."""
    if pending <= cap:
        return pending
    n = cap if pending - cap >= 2 else cap - 1
    return n if n >= 2 else 0
