"""PagedExecutor: runs the Engine's plans on `--target cuda` engines — one packed call per step.

Every decode, prefill chunk and speculative verification of a plan goes into one ONNX Runtime call over the
block tables (PagedAttention handles ragged batches with cached + new tokens), so unlike the CPU path,
verifying several sequences' guesses costs one call. A draft model keeps its KV in its own caches under the
target's block tables (same block ids: the target's reservation covers both) and reads prompt chunks
alongside the target.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from compile import artifact

from .config import EngineConfig
from .kv.manager import KVLayout
from .kv.paged import PagedKVManager, build_paged_batch
from .outputs import SchedulePlan
from .paged_runner import PagedModelRunner
from .request import Request
from .spec_decode.speculator import Speculator


def gpu_kv_budget(models: list[dict]) -> int | None:
    """Paged KV pool for GPU engines: 85 % of the device's free memory less the weights about to load; None
    when libqs_cuda (which can ask the device) is not installed or there is no device."""
    from .cuda_kernels import CudaKernels, KernelError

    try:
        free, _ = CudaKernels().device_memory()
    except KernelError:
        return None
    weights = sum(f["size"] for m in models for f in m["files"].values())
    return max(0, int(free * 0.85) - weights) or None


def load_paged_runners(engine_dir: Path, config: EngineConfig) -> tuple[PagedModelRunner, PagedModelRunner | None]:
    """--target cuda engines (and their draft): fp16 block pools sized by the KV budget, the same block ids in
    each model's caches; prefix caching is the pool itself."""
    dirs = [engine_dir] + ([Path(config.draft)] if config.draft is not None else [])
    models = [artifact.load(d, verify=False) for d in dirs]
    for d, m in zip(dirs, models):
        if m.get("target") != "cuda":
            raise ValueError(f"the draft {d} targets {m.get('target')!r}; a cuda engine needs a cuda draft")
    c = config.cache
    block_bytes = sum(KVLayout.from_manifest(m["kv_cache"]).token_bytes for m in models) * c.block_size
    budget = c.kv_budget_bytes or gpu_kv_budget(models) or c.budget()
    num_blocks = int(budget // block_bytes)
    if num_blocks < 1:
        raise ValueError(f"KV budget {budget / 2**20:.0f} MiB holds no {c.block_size}-token block")
    runners = [PagedModelRunner(d, num_blocks, c.block_size, verify=config.verify_artifact,
                                providers=list(config.providers) if config.providers else None,
                                custom_ops_library=config.custom_ops_library) for d in dirs]
    return runners[0], (runners[1] if len(runners) > 1 else None)


class PagedExecutor:
    def __init__(self, runner: PagedModelRunner, draft: PagedModelRunner | None, kv: PagedKVManager,
                 speculator: Speculator | None, requests: dict[str, Request], max_model_len: int):
        self.runner, self.draft, self.kv, self.speculator = runner, draft, kv, speculator
        self.requests, self.max_model_len = requests, max_model_len

    def warm_up(self) -> None:
        """Packed steps over block 0 that write no KV (slot -1); their costs feed speculation."""
        for n in (8, 1, 2, 4, 16, 32) if self.speculator else (8,):
            warm = build_paged_batch([([0] * -(-n // self.kv.block_size), 0, n)], self.kv.block_size)
            warm = replace(warm, slot_mapping=np.full(n, -1, np.int64))
            for runner, kind in ((self.runner, "step"), (self.draft, "draft")):
                if runner is None:
                    continue
                t0 = time.perf_counter()
                runner.step(np.zeros(n, np.int64), warm, np.arange(n))
                if self.speculator:
                    self.speculator.cost.record(kind, n, time.perf_counter() - t0)

    def execute(self, plan: SchedulePlan) -> tuple[dict[str, np.ndarray], dict[str, tuple]]:
        """Run the plan. Returns (logits [vocab] of every request that catches up without speculating,
        {request id: (emitted tokens, target KV length)} of those that speculated)."""
        chunk_tokens = sum(n for _, n in plan.chunks)
        gammas = (self.speculator.plan_packed(plan.decodes, self.max_model_len, len(plan.decodes) + chunk_tokens)
                  if self.speculator else {})
        spec = [r for r in plan.decodes if r.request_id in gammas]
        proposals = {}
        if spec:
            t0 = time.perf_counter()
            guesses = self.speculator.proposer.propose(spec, [gammas[r.request_id] for r in spec], set())
            proposals = {r.request_id: g for r, g in zip(spec, guesses)}
            if self.draft is not None:
                self.speculator.cost.record("draft", len(spec), (time.perf_counter() - t0) / max(gammas.values()))
        reqs, counts, ids, rows, end = [], [], [], {}, 0
        for req, n in [(r, 1) for r in plan.decodes] + plan.chunks:
            tokens = req.tokens(req.num_computed, req.num_computed + n)
            if req.request_id in proposals:
                tokens = tokens + proposals[req.request_id].tokens
            if not self.kv.reserve(req, req.num_computed + len(tokens)):    # admission reserved the worst case
                raise RuntimeError(f"request {req.request_id} outgrew its reserved KV blocks")
            reqs.append(req)
            counts.append(len(tokens))
            ids.extend(tokens)
            end += len(tokens)
            if req.request_id in proposals:                 # every position verifies a guess
                rows[req.request_id] = range(end - len(tokens), end)
            elif req.num_computed + n == req.num_tokens:    # caught up: its next token is sampled
                rows[req.request_id] = range(end - 1, end)
        batch = self.kv.step_batch(reqs, counts, self.runner.max_blocks_per_seq)
        wanted = np.asarray([i for r in rows.values() for i in r], np.int64)
        t0 = time.perf_counter()
        out = self.runner.step(np.asarray(ids, np.int64), batch, wanted)
        if self.speculator:
            self.speculator.cost.record("step", end, time.perf_counter() - t0)
        if self.draft is not None:
            self._draft_prefill(plan.chunks)
        logits, speculated, at = {}, {}, 0
        for rid, r in rows.items():
            block, at = out[at:at + len(r)], at + len(r)
            if rid in proposals:
                speculated[rid] = self.speculator.verify(self.requests[rid], proposals[rid], block)
            else:
                logits[rid] = block[0]
        return logits, speculated

    def _draft_prefill(self, chunks: list[tuple[Request, int]]) -> None:
        """The draft reads prompt chunks alongside the target (one packed call), so its first guesses need no
        catch-up and the blocks can go to the prefix cache for both models."""
        chunks = [(r, n) for r, n in chunks if r.num_computed_draft == r.num_computed]
        if chunks:
            self.speculator.proposer.feed([r for r, _ in chunks],
                                          [r.tokens(r.num_computed, r.num_computed + n) for r, n in chunks])
