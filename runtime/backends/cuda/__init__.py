"""The cuda backend (backend.py): `--target cuda` engines on PyTorch GEMMs + plugins/cuda kernels + CUDA graphs,
or on PyTorch CPU tensors with reference ops. Imports torch: only loaded for cuda engines (pip install '.[cuda]')."""

from .backend import CudaBackend

__all__ = ["CudaBackend"]
