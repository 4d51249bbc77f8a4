"""What the engine loop runs on, chosen from the engine's target: `cpu` engines on the CPU backend (KV slots for
GroupQueryAttention), `cuda` engines on the paged backend (block tables for PagedAttention). See base.py for the
protocols both implement."""

from __future__ import annotations

from pathlib import Path

from .. import artifact
from ..config import EngineConfig
from ..sampler import Sampler
from .base import Backend, KVManager


def load_backend(engine_dir: str | Path, config: EngineConfig, sampler: Sampler) -> Backend:
    """The backend for the engine in `engine_dir` (and config.draft), its models loaded and KV memory reserved."""
    if artifact.load(Path(engine_dir), verify=False).get("target") == "cuda":
        from .paged import PagedBackend

        return PagedBackend(Path(engine_dir), config, sampler)
    from .cpu import CpuBackend

    return CpuBackend(Path(engine_dir), config, sampler)


__all__ = ["Backend", "KVManager", "load_backend"]
