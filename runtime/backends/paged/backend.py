"""The paged backend: `--target cuda` engines — packed tokens over block tables, one call per step.

Every decode, prefill chunk and speculative verification of a step goes into one ONNX Runtime call over the
block tables (PagedAttention handles ragged batches with cached + new tokens), so unlike the CPU backend,
verifying several sequences' guesses costs one call. A draft model keeps its KV in its own caches under the
target's block tables (same block ids: the target's reservation covers both).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

import artifact
from ...config import EngineConfig
from ...kv.layout import KVLayout
from .kv import PagedKVManager, build_paged_batch
from ...outputs import ModelInput, RunnerOutput
from .runner import PagedModelRunner
from ...sampler import Sampler
from .draft import PagedDraftProposer
from ...spec_decode.speculator import CostModel
from ..base import context_length, make_proposer


def gpu_kv_budget(models: list[dict]) -> int | None:
    """Paged KV pool for GPU engines: 85 % of the device's free memory less the weights about to load; None
    when libqs_cuda (which can ask the device) is not installed or there is no device."""
    from ...cuda_kernels import CudaKernels, KernelError

    try:
        free, _ = CudaKernels().device_memory()
    except KernelError:
        return None
    weights = sum(f["size"] for m in models for f in m["files"].values())
    return max(0, int(free * 0.85) - weights) or None


def ort_runner(config: EngineConfig) -> Callable[[Path, int, int], PagedModelRunner]:
    """The ONNX Runtime paged runner (PagedAttention on the CUDA execution provider, or a reference op in tests)."""
    def make(engine_dir: Path, num_blocks: int, block_size: int) -> PagedModelRunner:
        return PagedModelRunner(engine_dir, num_blocks, block_size, verify=config.verify_artifact,
                                providers=list(config.ort.providers) if config.ort.providers else None,
                                custom_ops_library=config.ort.custom_ops_library)
    return make


class PagedBackend:
    def __init__(self, engine_dir: Path, config: EngineConfig, sampler: Sampler,
                 make_runner: Callable[[Path, int, int], object] | None = None,
                 budget: Callable[[list[dict]], int | None] = gpu_kv_budget, token_bytes: int | None = None):
        """Block pools sized by the KV budget, the same block ids in each model's caches; prefix caching is the
        pool itself. make_runner(engine_dir, num_blocks, block_size): the model runner (ONNX Runtime's by
        default; the cuda backend passes its own); budget(manifests): the KV bytes when none is configured;
        token_bytes: KV bytes a token takes in all models (default: the manifests' fp16 layout)."""
        dirs = [Path(engine_dir)] + ([Path(config.draft)] if config.draft is not None else [])
        models = [artifact.load(d, verify=False) for d in dirs]
        for d, m in zip(dirs, models):
            if m.get("target") != "cuda":
                raise ValueError(f"the draft {d} targets {m.get('target')!r}; a cuda engine needs a cuda draft")
        c = config.cache
        block_bytes = (token_bytes or sum(KVLayout.from_manifest(m["kv_cache"]).token_bytes for m in models)) * c.block_size
        budget = c.kv_budget_bytes or budget(models) or c.budget()
        num_blocks = int(budget // block_bytes)
        if num_blocks < 1:
            raise ValueError(f"KV budget {budget / 2**20:.0f} MiB holds no {c.block_size}-token block")
        make_runner = make_runner or ort_runner(config)
        runners = [make_runner(d, num_blocks, c.block_size) for d in dirs]
        self.runner, self.draft = runners[0], (runners[1] if len(runners) > 1 else None)
        self.max_model_len = context_length(config, self.runner, self.draft)
        self.kv = PagedKVManager(num_blocks, c.block_size, config.scheduler.max_num_seqs, self.max_model_len,
                                 with_draft=self.draft is not None, prefix_cache=c.enable_prefix_cache)
        self.cost = CostModel()
        self.proposer = make_proposer(config, lambda: PagedDraftProposer(self.draft, self.kv, sampler))

    def run(self, inp: ModelInput) -> RunnerOutput:
        ids, counts, rows, end = [], [], [], 0
        for s in inp.seqs:
            ids.extend(s.tokens)
            counts.append(len(s.tokens))
            end += len(s.tokens)
            rows.append(range(end - s.num_logits, end))
        batch = self.kv.step_batch([s.req for s in inp.seqs], counts, self.runner.max_blocks_per_seq)
        t0 = time.perf_counter()
        out = self.runner.step(np.asarray(ids, np.int64), batch, np.asarray([i for r in rows for i in r], np.int64))
        self.cost.record("step", end, time.perf_counter() - t0)
        self._feed_draft(inp)
        logits, at = [], 0
        for r in rows:
            logits.append(out[at:at + len(r)].copy() if len(r) else None)
            at += len(r)
        return RunnerOutput(logits)

    def _feed_draft(self, inp: ModelInput) -> None:
        """The draft reads the prompt chunks the target just computed, so its first guesses need no catch-up (a
        block is cached only once both models computed it). (The CPU backend's draft reads none: it catches up
        on a sequence when it first proposes for it, so it computes only what speculation uses.)"""
        if not isinstance(self.proposer, PagedDraftProposer):
            return
        chunks = [s for s in inp.seqs if s.proposal is None and not s.is_decode and s.req.num_computed_draft == s.start]
        if chunks:
            self.proposer.feed([s.req for s in chunks], [s.tokens for s in chunks])

    def step_cost(self, num_decodes: int) -> Callable[[Sequence[int]], float]:
        """Verification rides in the step's one packed call: a guess costs the step's marginal time per token."""
        def seconds(guesses: Sequence[int]) -> float:
            draft = max(guesses) * self.cost("draft", len(guesses)) if guesses else 0.0
            return self.cost("step", num_decodes + sum(guesses)) + draft
        return seconds

    def warm_up(self) -> None:
        """Packed steps over block 0 that write no KV (slot -1); their costs feed speculation."""
        for n in (8, 1, 2, 4, 16, 32) if self.proposer else (8,):
            warm = build_paged_batch([([0] * -(-n // self.kv.block_size), 0, n)], self.kv.block_size)
            warm = replace(warm, slot_mapping=np.full(n, -1, np.int64))
            for runner, kind in ((self.runner, "step"), (self.draft, "draft")):
                if runner is None:
                    continue
                t0 = time.perf_counter()
                runner.step(np.zeros(n, np.int64), warm, np.arange(n))
                self.cost.record(kind, n, time.perf_counter() - t0)
