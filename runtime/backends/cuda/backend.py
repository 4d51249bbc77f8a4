"""The cuda backend: `--target cuda` engines on our own forward (PyTorch GEMMs + plugins/cuda kernels + CUDA
graphs), with the paged backend's KV manager, batching and draft proposer. With device "cpu" the same code runs
on PyTorch CPU tensors with the reference ops (what CI tests)."""

from __future__ import annotations

from pathlib import Path

import torch

import artifact
from ...config import EngineConfig
from ...sampler import Sampler
from ..paged.backend import PagedBackend
from .runner import CudaModelRunner, resolve_device

GPU_MEMORY_FRACTION = 0.85      # of the device's free memory after the weights, for the KV pool (vLLM: 0.9)
CPU_POOL_SEQUENCES = 2          # --device cpu without a budget: blocks for twice max_num_seqs full contexts


class CudaBackend(PagedBackend):
    def __init__(self, engine_dir: Path, config: EngineConfig, sampler: Sampler):
        self.device = device = resolve_device(config.cuda.device)
        itemsize = 2 if device.type == "cuda" else 4

        def runner(d: Path, num_blocks: int, block_size: int) -> CudaModelRunner:
            return CudaModelRunner(d, num_blocks, block_size, device=device.type, verify=config.verify_artifact,
                                   graphs=config.cuda.graphs, max_model_len=config.cache.max_model_len)

        dirs = [engine_dir] + ([config.draft] if config.draft is not None else [])
        token_bytes = sum(_token_bytes(artifact.load(Path(d), verify=False), itemsize) for d in dirs)

        def budget(models: list[dict]) -> int:
            if device.type == "cpu":
                longest = min(config.cache.max_model_len or 1 << 30, *(m["model"]["max_seq_len"] for m in models))
                return (CPU_POOL_SEQUENCES * config.scheduler.max_num_seqs * (longest + config.cache.block_size)
                        * token_bytes)
            free, _ = torch.cuda.mem_get_info(device)
            weights = sum(2 * m["model"]["num_parameters"] for m in models)     # widened to fp16 at load
            return max(int(free * GPU_MEMORY_FRACTION) - weights, 0) or 1

        super().__init__(engine_dir, config, sampler, runner, budget, token_bytes)

    def warm_up(self) -> None:
        """The step graphs of every token bucket first (capturing runs each twice: cuBLAS' first calls), then the
        paged backend's warm-up steps, which now replay them: the step costs speculation is priced by are the
        graphs' (a verification costs what a decode of as many tokens costs: both replay the same graph)."""
        for runner in (self.runner, self.draft):
            if runner is not None:
                runner.capture_graphs()
        super().warm_up()


def _token_bytes(manifest: dict, itemsize: int) -> int:
    m = manifest["model"]
    return 2 * m["num_layers"] * m["num_kv_heads"] * m["head_dim"] * itemsize
