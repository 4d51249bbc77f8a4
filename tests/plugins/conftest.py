"""plugins/cuda built once per session with CMake + nvcc (for sm_80 and sm_90), shared by the compile
check, the C API checks on CPU and the GPU tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

HAVE_NVCC = shutil.which("nvcc") is not None and shutil.which("cmake") is not None


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


requires_nvcc = pytest.mark.skipif(not HAVE_NVCC, reason="nvcc/cmake not installed: CUDA kernels not built")
requires_gpu = pytest.mark.skipif(not (HAVE_NVCC and _has_gpu()),
                                  reason="no CUDA GPU here: kernel correctness runs on a GPU machine only")


@pytest.fixture(scope="session")
def cuda_build(tmp_path_factory) -> Path:
    """The CMake build folder holding libqs_cuda.so (QS_CUDA_BUILD: one already built, e.g. by tools/gpu_check.sh)."""
    if os.environ.get("QS_CUDA_BUILD"):
        return Path(os.environ["QS_CUDA_BUILD"]).resolve()
    if not HAVE_NVCC:
        pytest.skip("nvcc/cmake not installed")
    build = tmp_path_factory.mktemp("qs-cuda")
    configure = ["cmake", "-S", str(ROOT), "-B", str(build), "-DQS_BUILD_PYTHON=OFF", "-DQS_BUILD_CUDA=ON",
                 "-DQS_CUDA_ARCHS=80;90", f"-DCMAKE_CUDA_COMPILER={shutil.which('nvcc')}"]
    for cmd in (configure, ["cmake", "--build", str(build), "-j", "2"]):
        result = subprocess.run(cmd, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return build


@pytest.fixture(scope="session")
def cuda_kernels(cuda_build):
    from runtime.cuda_kernels import CudaKernels

    return CudaKernels(cuda_build / "libqs_cuda.so")
