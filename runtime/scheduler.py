"""Token-budget scheduler: continuous batching, chunked prefill, speculation inside the budget, admission and
KV growth through the backend's KV manager, preemption.

The one place a request's `num_computed` (tokens with KV) is written: at admission (its cached prefix), after
each step (`update`) and at preemption (back to 0). How it sizes prompt chunks, orders requests and picks
victims: docs/design.md, "Scheduler".
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable

from .backends.base import KVManager
from .config import SchedulerConfig
from .outputs import SchedulePlan, StepResult
from .request import Request, RequestStatus

# (decodes, guesses left in the budget) → γ per request id that should speculate
SpecPlanner = Callable[[list[Request], int], dict[str, int]]


def _order(req: Request) -> tuple[int, int]:
    return req.priority, req.seq_no


class Scheduler:
    MIN_CHUNK = 16
    MAX_SAT_OUT = 4       # consecutive steps a long prompt yields to short prompts before it gets a MIN_CHUNK
    FLOOR_STEPS = 3       # MIN_CHUNK slices over the ratio's target whose least cost is then held (see observe)

    def __init__(self, config: SchedulerConfig, kv: KVManager, plan_speculation: SpecPlanner | None = None):
        self.config, self.kv, self.plan_speculation = config, kv, plan_speculation
        self.waiting: list[tuple[int, int, Request]] = []     # heap of (priority, seq_no, request)
        self.running: list[Request] = []
        # prompt tokens beside decodes, adapted by observe(): it starts small (a first slice of a whole chunk
        # stalled 7 streams 210 ms at the API) and at most doubles a step while steps stay under the target
        self.mixed_tokens = self.MIN_CHUNK
        self._decode_step_s: float | None = None              # moving average of decode-only steps
        self._step_rest_s: float | None = None                # of their time beyond the backend's decode call
        # where even a MIN_CHUNK slice costs more than the ratio allows: the first such steps' costs, then the
        # least of them, the level held until decode-only steps return (see observe)
        self._floor_s: list[float] = []
        self._held_s: float | None = None
        # a prompt token's cost in steps that computed prompts whole, and how far into its prompt such a token lay
        # on average (a moving average of both): what a burst would stall the decoding streams for (_burst_fits)
        self._prompt_token_s: float | None = None
        self._prompt_reach: float | None = None

    def observe(self, plan: SchedulePlan, seconds: float, decode_s: float | None = None) -> None:
        """Feed back a step's measured time: tracks decode-only steps and adapts the prompt slice beside decodes.

        A slice's target is `mixed_step_ratio` × what the step's decodes cost alone. Where the backend timed its
        decode call (`decode_s`), that is the call plus the rest of a decode-only step (sampling, delivery: a
        moving average of such steps' time beyond their call), so the reference follows the batch a slice
        rides with; else a moving average of decode-only steps, whatever their batch. That one misled where the
        batch had just changed: six streams started together, two prompts arrived as they decoded, and the
        reference was the one- and two-stream steps of the traffic before (4 ms, where 7 decodes alone took
        10): every slice read over its target, 445-token prompts went in 5–16 tokens a step, and the streams'
        gaps stayed at 1.6× for 60 steps (smollm2 int4, in process).

        Where even a MIN_CHUNK slice costs more than the target (a model whose prompt tokens cost much beside
        its decodes, or a long prompt whose slices attend over more of its own context each step), what the
        first FLOOR_STEPS such steps cost (the least of them: noise only slows a step, and a prompt's first
        slice runs cold, ~1.3x the next ones) becomes the target, and slices shrink below MIN_CHUNK to hold it:
        the streams' gaps stay even instead of growing with the prompt, at some cost to the long prompt's TTFT.
        qwen2.5-0.5b int4, 4 streams and an 8,000-token prompt (tools/bench_burst.py): 16-token slices took the
        step from 35 to 110 ms.

        A step that computed prompts whole (a burst, or nobody decoding) gives a prompt token's cost, for
        _burst_fits; its reach (the token-weighted mean position the chunks end at, after `update`) goes with it."""
        tokens = sum(n for _, n in plan.chunks)
        if plan.chunks and not plan.sliced and tokens >= self.MIN_CHUNK:
            reach = max(1.0, sum(n * r.num_computed for r, n in plan.chunks) / tokens)
            self._prompt_token_s = _average(self._prompt_token_s, seconds / tokens)
            self._prompt_reach = _average(self._prompt_reach, reach)
        if plan.decodes and not plan.chunks:
            self._decode_step_s = _average(self._decode_step_s, seconds)
            if decode_s is not None and not plan.gammas:     # a speculating step's rest holds its verifications
                self._step_rest_s = _average(self._step_rest_s, seconds - decode_s)
            if self._held_s is not None:              # the hold is over: MIN_CHUNK is the floor again
                self.mixed_tokens = max(self.mixed_tokens, self.MIN_CHUNK)
            self._floor_s, self._held_s = [], None
            return
        alone = self._decode_step_s if decode_s is None else decode_s + (self._step_rest_s or 0.0)
        if plan.sliced and alone:
            target = self.config.mixed_step_ratio * alone
            if self._held_s is None and self.mixed_tokens <= self.MIN_CHUNK and seconds > target:
                self._floor_s.append(seconds)
                if len(self._floor_s) == self.FLOOR_STEPS:
                    self._held_s = min(self._floor_s)
            # held: as few tokens as still always make a chunk (prompt_chunk refuses to leave a single token, so
            # with min_chunk 2 a cap of 2 can give 0: three tokens pending would then wait for the streams to end)
            floor = self.MIN_CHUNK if self._held_s is None else 2 * self.kv.min_chunk - 1
            # Proportional: a slice's cost is close to linear in its length at a given context. Rounded, not
            # truncated: truncation ratchets a slice held near its target down a token at a time.
            scale = min(2.0, max(target, self._held_s or 0.0) / seconds)
            self.mixed_tokens = max(floor, min(self.config.prefill_chunk, round(self.mixed_tokens * scale)))

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add(self, req: Request) -> None:
        heapq.heappush(self.waiting, (req.priority, req.seq_no, req))

    def remove(self, req: Request, cache: bool = True) -> None:
        """Drop a request wherever it is and free its KV (abort, error, finish); `cache`: its computed blocks may
        stay in the prefix cache (not after an error, whose KV may be incomplete)."""
        if req in self.running:
            self.running.remove(req)
        else:
            entries = [e for e in self.waiting if e[2] is not req]
            if len(entries) != len(self.waiting):
                self.waiting = entries
                heapq.heapify(self.waiting)
        self.kv.free(req, cache)

    def update(self, plan: SchedulePlan, results: dict[str, StepResult]) -> None:
        """After a step: each planned request's KV length is what the step left (verification may keep fewer
        tokens than it computed); its newly full blocks go to the prefix cache at the next step."""
        for req in plan.requests:
            result = results.get(req.request_id)
            if result is not None:
                req.num_computed = result.num_computed
                self.kv.computed(req)

    # -- preemption and admission -----------------------------------------------------------------
    def _preempt(self, victim: Request, plan: SchedulePlan) -> None:
        if victim in plan.decodes:                  # planned earlier this step (a prompt chunk ahead of it needs room)
            plan.decodes.remove(victim)
            plan.gammas.pop(victim.request_id, None)
        plan.chunks = [(r, n) for r, n in plan.chunks if r is not victim]
        self.running.remove(victim)
        self.kv.free(victim, cache=True)
        victim.num_computed = victim.num_computed_draft = 0
        victim.status = RequestStatus.PREEMPTED
        self.add(victim)
        plan.preempted.append(victim)

    def _victim(self, req: Request) -> Request | None:
        """The running request that gives way to `req`: the last in (priority, arrival) order behind it."""
        behind = [r for r in self.running if _order(r) > _order(req)]
        return max(behind, key=_order) if behind else None

    def _admit(self, plan: SchedulePlan) -> None:
        """Move waiting requests into the KV manager (preempting strictly lower priorities when there is no room)."""
        while self.waiting:
            req = self.waiting[0][2]
            hit = self._allocate(req)
            if hit is None:
                victims = [r for r in self.running if r.priority > req.priority]
                if not victims:
                    return
                self._preempt(max(victims, key=_order), plan)
                hit = self._allocate(req)
                if hit is None:
                    return
            heapq.heappop(self.waiting)
            req.num_computed = hit                   # (the KV manager set num_computed_draft)
            if req.status is RequestStatus.WAITING:
                req.num_cached = hit
                req.first_scheduled = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def _allocate(self, req: Request) -> int | None:
        return self.kv.allocate(req) if len(self.running) < self.config.max_num_seqs else None

    def _reserve(self, req: Request, num_tokens: int, plan: SchedulePlan) -> bool:
        """KV for `req`'s first `num_tokens` tokens, taken from the requests behind it if need be; False if `req`
        itself had to give way (it is preempted then)."""
        while not self.kv.reserve(req, num_tokens):
            victim = self._victim(req)
            self._preempt(victim or req, plan)
            if victim is None:
                return False
        return True

    # -- the plan ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulePlan:
        self.kv.flush()
        plan = SchedulePlan()
        self._admit(plan)
        budget = self.config.token_budget
        chunk = self.config.prefill_chunk
        for req in sorted((r for r in self.running if r.num_pending == 1), key=_order):
            if req.status is RequestStatus.RUNNING and self._reserve(req, req.num_tokens, plan):
                plan.decodes.append(req)
        budget -= len(plan.decodes)
        # no guesses while a prompt waits for its first token: they would take its budget and lengthen its steps
        if (self.plan_speculation is not None and plan.decodes and budget > 0
                and not any(r.num_pending > 1 for r in self.running)):
            gammas = self.plan_speculation(plan.decodes, budget)
            for req in plan.decodes:
                gamma = gammas.get(req.request_id, 0)
                if gamma > 0 and self.kv.reserve(req, req.num_tokens + gamma):    # guesses never preempt anyone
                    plan.gammas[req.request_id] = gamma
                    budget -= gamma
        # Prefills shortest-remaining first; while any short prompt (≤ one chunk) waits for its first token,
        # long prompts sit this step out (but one aged one gets MIN_CHUNK tokens), so a short request's TTFT
        # includes at most a sliver of a long prompt.
        prefills = sorted((r for r in self.running if r.num_pending > 1), key=lambda r: (r.priority, r.num_pending))
        # a burst (see above): the decoding streams stall once — unless that stall would be long
        whole = 2 * len(prefills) >= len(plan.decodes) and (not plan.decodes or self._burst_fits(prefills, budget))
        if whole:
            limit = budget
        else:
            limit = chunk if self.config.mixed_step_ratio == float("inf") else min(chunk, self.mixed_tokens)
            budget = min(budget, limit)
        short_waiting = any(r.num_pending <= chunk for r in prefills)
        aged_served = False
        for req in prefills:
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:     # gave way to an earlier request's KV this step
                continue
            cap = limit
            if short_waiting and req.num_pending > chunk:
                if aged_served or req.steps_sat_out < self.MAX_SAT_OUT:
                    req.steps_sat_out += 1
                    continue
                aged_served, cap = True, self.MIN_CHUNK
            req.steps_sat_out = 0
            n = prompt_chunk(req.num_pending, min(cap, budget), self.kv.min_chunk)
            if n and self._reserve(req, req.num_computed + n, plan):
                plan.chunks.append((req, n))
                req.prefill_chunks += 1
                budget -= n
        plan.sliced = bool(plan.decodes) and not whole and any(n < r.num_pending for r, n in plan.chunks)
        if plan.sliced:
            for req, _ in plan.chunks:
                req.in_slices = True
        return plan

    def _burst_fits(self, prefills: list[Request], budget: int) -> bool:
        """Whether computing `prefills` whole (shortest first, within `budget`) stalls the decoding streams at most
        max_burst_stall_s, at the prompt token's measured cost (none measured yet: it does). A token attends over
        the prompt before it, so a token further in than the measured ones costs more: the cost is scaled by how
        much further (an overestimate where the weights' share dominates, which errs towards slices). Why: one
        stream decoding and a 3,000-token prompt arriving were a burst, taken whole: one 3.8 s gap
        (qwen2.5-0.5b int4, tools/bench_burst.py --long-prompt), where #49 asks p99 ≤ 1.5 × p50 while it prefills."""
        if self.config.max_burst_stall_s == float("inf"):
            return True
        if any(req.in_slices for req in prefills):     # a prompt begun in slices ends in them: taking its tail whole
            return False                               # stalled the streams once more (480 ms, a 1,500-token prompt)
        if self._prompt_token_s is None:
            return True
        stall = 0.0
        for req in prefills:
            n = min(req.num_pending, budget)
            if n <= 0:
                break
            stall += n * self._prompt_token_s * max(1.0, (req.num_computed + n) / self._prompt_reach)
            budget -= n
        return stall <= self.config.max_burst_stall_s


def _average(old: float | None, new: float) -> float:
    """Moving average of step times (the first sample alone)."""
    return new if old is None else 0.8 * old + 0.2 * new


def prompt_chunk(pending: int, cap: int, min_chunk: int = 2) -> int:
    """Tokens to prefill of `pending` within `cap`. With `min_chunk` 2 (the cpu backend's KV manager says so):
    never a single token, and never leaving a single token for later (0 if the cap allows neither) — ONNX
    Runtime's GroupQueryAttention computes one query row with MLAS's M=1 kernel, which rounds differently from
    its multi-row kernel; keeping every prompt token in a chunk of two or more makes its KV and logits
    independent of how the step budget split the prompt. Backends without that kernel take any chunk."""
    if pending <= cap or min_chunk <= 1:
        return min(pending, cap)
    n = cap if pending - cap >= 2 else cap - 1
    return n if n >= 2 else 0
