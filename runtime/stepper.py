"""One sequence's prefill and decode steps on an engine, through the runner its target needs — what the compile
stage compares with references (`compile verify`, the accuracy report) without knowing the runtime's runners.

    steps = open_stepper(engine_dir, capacity)       # a cpu engine: ModelRunner over one KV slot;
    logits = steps.prefill(tokens)                   # a cuda engine: the cuda backend's runner over its own blocks
    logits = steps.decode(token, position)           # (device: cuda, or cpu for its forward on PyTorch CPU tensors)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import artifact


class CpuSteps:
    def __init__(self, engine_dir: Path, capacity: int, verify: bool):
        from .backends.cpu.runner import ModelRunner

        self.runner = ModelRunner(engine_dir, verify=verify)
        self.manifest, self.kv_dtype, self.max_seq_len = self.runner.manifest, self.runner.kv_layout.dtype, self.runner.max_seq_len
        self.pool = self.runner.new_pool(1, capacity=min(capacity, self.max_seq_len))

    def prefill(self, tokens: list[int]) -> np.ndarray:
        """Logits of every token of `tokens`, fed at positions 0.. (a new sequence in the same slot)."""
        return self.runner.prefill(self.pool, 0, tokens, 0, all_logits=True)

    def decode(self, token: int, position: int) -> np.ndarray:
        return self.runner.decode(self.pool, [(0, token, position)], set())


class PagedSteps:
    """A `--target cuda` engine on the cuda backend's runner, one sequence over its own blocks."""

    def __init__(self, engine_dir: Path, capacity: int, verify: bool, device: str | None, block_size: int = 16):
        from .backends.cuda.runner import CudaModelRunner

        self.block_size, self.blocks = block_size, list(range(-(-capacity // block_size)))
        self.runner = CudaModelRunner(engine_dir, len(self.blocks), block_size, device=device, verify=verify,
                                      graphs=False)
        self.manifest, self.kv_dtype, self.max_seq_len = self.runner.manifest, "float16", self.runner.max_seq_len

    def _step(self, tokens: list[int], start: int, rows: np.ndarray) -> np.ndarray:
        from .backends.paged.kv import build_paged_batch

        batch = build_paged_batch([(self.blocks, start, len(tokens))], self.block_size, self.runner.max_blocks_per_seq)
        return self.runner.step(np.asarray(tokens, np.int64), batch, rows)

    def prefill(self, tokens: list[int]) -> np.ndarray:
        return self._step(tokens, 0, np.arange(len(tokens)))

    def decode(self, token: int, position: int) -> np.ndarray:
        return self._step([token], position, np.arange(1))


def open_stepper(engine_dir: str | Path, capacity: int, device: str | None = None, verify: bool = True):
    """Steps over `engine_dir` for one sequence of up to `capacity` tokens (CpuSteps or PagedSteps)."""
    engine_dir = Path(engine_dir)
    if artifact.load(engine_dir, verify=False).get("target") == "cuda":
        return PagedSteps(engine_dir, capacity, verify, device)
    return CpuSteps(engine_dir, capacity, verify)
