"""The CPU backend: GroupQueryAttention over contiguous KV slots, one ONNX Runtime session per model.

Decodes run as one batched call per contiguous range of slots, and so do speculative verifications where the
engine's attention allows it (ModelRunner.batches_verifications; else each runs as one call for its sequence, as a
prompt chunk always does: GroupQueryAttention refuses several new tokens on a past in a batch > 1).
KV lives in KVCacheManager's slots (address space reserved per sequence, memory resident as tokens arrive)
and its prefix-cache blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ...config import EngineConfig
from .kv import KVCacheManager
from .runner import ModelRunner, check_same_tokenizer
from ...outputs import ModelInput, RunnerOutput
from ...sampler import Sampler
from .draft import DraftModelProposer
from ...spec_decode.speculator import CostModel
from ..base import context_length, make_proposer


CATCH_UP_PROBE = 64     # tokens of the draft's catch-up timed at warm-up (a 500-token prompt's costs less a token)


def timed(fn: Callable[[], object], repeat: int = 3) -> float:
    """Median seconds of `repeat` calls (warm-up measurements)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


class CpuBackend:
    def __init__(self, engine_dir: Path, config: EngineConfig, sampler: Sampler):
        opts = dict(threads=config.ort.threads, verify=config.verify_artifact, spin=config.ort.spin,
                    huge_pages=config.ort.huge_pages)
        self.runner = ModelRunner(engine_dir, **opts)
        # The draft runs on the engine thread alone: a worker of its own spun beside the target's after every
        # call (bundled pair, fixed γ=4 at batch 1 in process: 0.80x -> 1.19x of plain decoding); sleeping workers
        # lost at the API. Its small decode steps take as long on one thread (0.41 ms); its catch-up on a
        # 500-token prompt takes 21 ms (14 on two).
        self.draft = ModelRunner(config.draft, **dict(opts, threads=1)) if config.draft else None
        if self.draft is not None:
            check_same_tokenizer(self.runner, self.draft)
        self.max_model_len = context_length(config, self.runner, self.draft)
        self.kv = self._make_kv(config)
        self._max_num_seqs = config.scheduler.max_num_seqs
        self.cost = CostModel()
        # prompt chunks ride beside decodes in one call where the engine can (off: a call each, as in engines
        # built before it; tools/bench_burst.py compares the two)
        self.pack_steps = self.runner.packs_steps
        self.proposer = make_proposer(config, lambda: DraftModelProposer(self.draft, self.kv, sampler))
        self._max_gamma = config.spec.max_gamma

    def _make_kv(self, config: EngineConfig) -> KVCacheManager:
        """Slots for max_num_seqs running sequences and `retained_slots` finished ones of the full context are only
        address space; the budget bounds the tokens resident in them (and the prefix cache's blocks, a fixed share
        of it). Retained slots are a cache on top of the running ones, so keeping a chat's KV between its turns
        never takes a running sequence's place."""
        c = config.cache
        layouts = [self.runner.kv_layout] + ([self.draft.kv_layout] if self.draft is not None else [])
        token_bytes = sum(m.token_bytes for m in layouts)
        budget = c.budget()
        slot_tokens = int(budget * (1 - c.prefix_cache_fraction if c.enable_prefix_cache else 1) // token_bytes)
        if slot_tokens < self.max_model_len:
            raise ValueError(f"KV budget {budget / 2**20:.0f} MiB cannot hold one sequence of {self.max_model_len} "
                             "tokens; raise the budget or lower max_model_len")
        num_blocks = int(budget * c.prefix_cache_fraction // (token_bytes * c.block_size)) if c.enable_prefix_cache else 0
        retained = c.retained_slots if c.enable_prefix_cache else 0
        return KVCacheManager(layouts, config.scheduler.max_num_seqs + retained, self.max_model_len, num_blocks,
                              c.block_size, budget_tokens=slot_tokens, retained_slots=retained,
                              reserve_bytes=c.prefix_reserve_bytes,
                              huge_pages=c.kv_huge_pages)

    def run(self, inp: ModelInput) -> RunnerOutput:
        seqs = inp.seqs
        if self.pack_steps and len(seqs) > 1 and any(s.is_decode or s.proposal is not None for s in seqs):
            return self._run_packed(inp)
        pool, logits, decode_s = self.kv.slots, [None] * len(inp.seqs), None
        decodes = [i for i, s in enumerate(inp.seqs) if s.is_decode]
        if decodes:
            t0 = time.perf_counter()
            rows = [(inp.seqs[i].req.slot, inp.seqs[i].tokens[0], inp.seqs[i].start) for i in decodes]
            out = self.runner.decode(pool, rows, *self.kv.decode_fence({r[0] for r in rows}))
            decode_s = time.perf_counter() - t0
            self.cost.record("dec", len(decodes), decode_s)
            for i, row in zip(decodes, out):
                logits[i] = row[None]
        if self.runner.batches_verifications:
            self._verify_batched(inp, logits)
        for i, s in enumerate(inp.seqs):
            if s.is_decode or logits[i] is not None:
                continue
            t0 = time.perf_counter()
            out = self.runner.prefill(pool, s.req.slot, s.tokens, s.start, all_logits=s.num_logits > 1)
            if s.proposal is not None:
                self.cost.record("ver", len(s.tokens), time.perf_counter() - t0)
            logits[i] = out if s.num_logits else None
        return RunnerOutput(logits, decode_s)

    def _run_packed(self, inp: ModelInput) -> RunnerOutput:
        """A step of several sequences with decodes or verifications among them, in one call (ModelRunner.step):
        one pass over the weights where the decodes' call, the verifications' and one per prompt read them each
        again (7 smollm2 decodes and a 16-token slice: 21 vs 24 ms), and no dummy rows or splits around other
        slots. Prompts alone keep a call each: packing a burst of six gained nothing (0.98–1.08x, the larger
        call's activations out of cache). A call without prompt chunks is recorded by its tokens, which is how
        step_cost prices decodes and guesses; a step with chunks reports its decodes' share at what decode-only
        calls of as many cost (the scheduler sizes slices against it)."""
        seqs = inp.seqs
        t0 = time.perf_counter()
        logits = self.runner.step(self.kv.slots, [(s.req.slot, s.tokens, s.start, s.num_logits) for s in seqs])
        seconds = time.perf_counter() - t0
        decodes = sum(s.is_decode for s in seqs)
        if any(not s.is_decode and s.proposal is None for s in seqs):        # prompt chunks
            return RunnerOutput(logits, self.cost("dec", decodes) or None if decodes else None)
        self.cost.record("dec", sum(len(s.tokens) for s in seqs), seconds)
        return RunnerOutput(logits, seconds if decodes == len(seqs) else None)

    def _verify_batched(self, inp: ModelInput, logits: list) -> None:
        """The step's verifications in one call, their logits into `logits`. Rows are padded to the longest, so one
        whose padding would pass its slot's end is left to a call of its own (as is a lone verification)."""
        pool = self.kv.slots
        longest = max((len(s.tokens) for s in inp.seqs if s.proposal is not None), default=0)
        batch = [i for i, s in enumerate(inp.seqs) if s.proposal is not None and s.start + longest <= pool.capacity]
        if len(batch) < 2:
            return
        seqs = [inp.seqs[i] for i in batch]
        t0 = time.perf_counter()
        out = self.runner.verify(pool, [(s.req.slot, s.tokens, s.start) for s in seqs],
                                 self.kv.fenced_slots({s.req.slot for s in seqs}))
        self.cost.record("ver", len(seqs) * max(len(s.tokens) for s in seqs), time.perf_counter() - t0)
        for i, rows in zip(batch, out):
            logits[i] = rows

    def step_cost(self, num_decodes: int) -> Callable[[Sequence[int]], float]:
        """Packed steps: one call of every decode's token and every guess ("dec" is keyed by the tokens a call
        computes: a decode-only call's are its rows). Otherwise plain decodes batched; verifications batched (each
        row padded to the longest: "ver" is keyed by the tokens a call computes) or each its own call. The draft's
        guess steps batched."""
        batched = self.runner.batches_verifications
        memo: dict[tuple[str, int], float] = {}

        def cost(kind: str, n: int) -> float:
            if (kind, n) not in memo:
                memo[kind, n] = self.cost(kind, n) if n else 0.0
            return memo[kind, n]

        if self.pack_steps:
            def packed(guesses: Sequence[int]) -> float:
                draft = max(guesses) * cost("draft", len(guesses)) if guesses else 0.0
                return cost("dec", num_decodes + sum(guesses)) + draft
            return packed

        def seconds(guesses: Sequence[int]) -> float:
            k = len(guesses)
            if not k:
                return cost("dec", num_decodes)
            verify = cost("ver", k * (max(guesses) + 1)) if batched and k > 1 else sum(cost("ver", g + 1) for g in guesses)
            return cost("dec", num_decodes - k) + verify + max(guesses) * cost("draft", k)
        return seconds

    def warm_up(self) -> None:
        """ONNX Runtime's first runs pay for allocation and weight prepacking: pay it here, not in a user's TTFT.
        With speculation, also measure the step costs its decisions are based on. Runs in slots that are given
        back afterwards, so warm-up leaves no KV memory resident."""
        models = [(self.runner, self.kv.slots)] + ([(self.draft, self.kv.pools[1])] if self.draft else [])
        sizes = [b for b in (1, 2, 4, 8, 16, 32) if b <= self._max_num_seqs]
        with self.kv.scratch_slots(max(sizes), max(16 + self._max_gamma + 1, CATCH_UP_PROBE)):
            for runner, pool in models:
                for n in (8, 1):
                    runner.prefill(pool, 0, [0] * n, 0)
            # decode calls of each size: what speculation prices, and the reference of a packed step's slices
            for b in sizes:
                rows = [(s, 0, 16) for s in range(b)]
                self.cost.record("dec", b, timed(lambda: self.runner.decode(self.kv.slots, rows, set())))
                if self.draft is not None:
                    self.cost.record("draft", b, timed(lambda: self.draft.decode(self.kv.pools[1], rows, set())))
            if self.proposer is None:
                return
            if self.draft is not None:      # a token of catch-up, which the speculator charges its tries ahead
                chunk = [0] * CATCH_UP_PROBE
                self.cost.record("catch_up", 1,
                                 timed(lambda: self.draft.prefill(self.kv.pools[1], 0, chunk, 0)) / CATCH_UP_PROBE)
            if self.pack_steps:         # a speculating step is one call, priced by its tokens
                for b in sizes:
                    for g in sorted({1, 3, self._max_gamma}):
                        seqs = [(s, [0] * (g + 1), 16, g + 1) for s in range(b)]
                        self.cost.record("dec", b * (g + 1), timed(lambda: self.runner.step(self.kv.slots, seqs)))
                return
            for g in range(1, self._max_gamma + 1):
                self.cost.record("ver", g + 1, timed(lambda: self.runner.prefill(self.kv.slots, 0, [0] * (g + 1), 16, True)))
            if self.runner.batches_verifications:
                for b in sizes[1:]:
                    for g in sorted({1, 3, self._max_gamma}):
                        rows = [(s, [0] * (g + 1), 16) for s in range(b)]
                        self.cost.record("ver", b * (g + 1), timed(lambda: self.runner.verify(self.kv.slots, rows, set())))
