"""What the engine loop runs on, chosen from the engine's target: `cpu` engines on the CPU backend (KV slots for
GroupQueryAttention); `cuda` engines on the cuda backend (our forward on PyTorch + plugins/cuda, block tables),
or on the paged backend (the graph's PagedAttention under ONNX Runtime) when execution providers are named, or
when PyTorch is missing and ONNX Runtime has its CUDA provider. See base.py for the protocols all implement."""

from __future__ import annotations

from pathlib import Path

import artifact
from ..config import EngineConfig
from ..sampler import Sampler
from .base import Backend, KVManager


def load_backend(engine_dir: str | Path, config: EngineConfig, sampler: Sampler) -> Backend:
    """The backend for the engine in `engine_dir` (and config.draft), its models loaded and KV memory reserved."""
    target = artifact.load(Path(engine_dir), verify=False).get("target")
    if target == "cuda":
        if config.ort.providers is None and not _ort_cuda_only():
            try:
                from .cuda import CudaBackend
            except ModuleNotFoundError as e:
                if e.name != "torch":
                    raise
                from .paged.runner import BackendUnavailable

                raise BackendUnavailable(f"{engine_dir} is a --target cuda engine, whose backend runs on PyTorch: "
                                         "pip install 'quicksilver[cuda]' (or '.[cuda]' in the checkout)") from None
            return CudaBackend(Path(engine_dir), config, sampler)
        from .paged.backend import PagedBackend

        return PagedBackend(Path(engine_dir), config, sampler)
    if config.cuda.device == "cuda":
        raise ValueError(f"{engine_dir} is a --target {target} engine; --device cuda serves --target cuda engines "
                         "(rebuild with compile build --target cuda)")
    from .cpu.backend import CpuBackend

    return CpuBackend(Path(engine_dir), config, sampler)


def _ort_cuda_only() -> bool:
    """PyTorch (the cuda backend's extra) is not installed, but ONNX Runtime's CUDA provider is."""
    import importlib.util

    import onnxruntime as ort

    return importlib.util.find_spec("torch") is None and "CUDAExecutionProvider" in ort.get_available_providers()


__all__ = ["Backend", "KVManager", "load_backend"]
