"""Token-budget scheduler: continuous batching, chunked prefill, admission by KV slots, priority preemption.

There are no prefill or decode phases, only requests catching up: each step, every running request with
one pending token joins the decode batch, requests with more pending tokens (new prompts, recompute after
preemption) get a chunk of at most `prefill_chunk` tokens, and the step never exceeds `token_budget`.
Because a chunk is capped below the budget, a long prompt never holds the step alone: decodes run every
step, and a short request arriving behind a long prompt is admitted into the same step, so its time to
first token is about one step rather than the long prompt's whole prefill.

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
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config, self.kv = config, kv
        self.waiting: list[tuple[int, int, Request]] = []     # heap of (priority, seq_no, request)
        self.running: list[Request] = []

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

    def schedule(self) -> SchedulePlan:
        plan = SchedulePlan()
        budget = self.config.token_budget
        for req in sorted(self.running, key=lambda r: (r.priority, r.seq_no)):
            if req.num_pending == 1:
                plan.decodes.append(req)
                budget -= 1
        for req in sorted(self.running, key=lambda r: (r.priority, r.seq_no)):
            if req.num_pending > 1 and budget > 0:
                n = min(req.num_pending, self.config.prefill_chunk, budget)
                plan.chunks.append((req, n))
                budget -= n
        while self.waiting and budget > 0:
            req = self.waiting[0][2]
            if len(self.running) >= self.config.max_num_seqs or not self.kv.allocate(req):
                victim = self._preempt_for(req)
                if victim is None or not self.kv.allocate(req):
                    break
                plan.preempted.append(victim)
                plan.decodes = [r for r in plan.decodes if r is not victim]
                plan.chunks = [(r, n) for r, n in plan.chunks if r is not victim]
            heapq.heappop(self.waiting)
            if req.status is RequestStatus.WAITING:
                req.num_cached = req.num_computed
                req.first_scheduled = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.num_pending == 1:
                plan.decodes.append(req)
                budget -= 1
            else:
                n = min(req.num_pending, self.config.prefill_chunk, budget)
                plan.chunks.append((req, n))
                budget -= n
        return plan
