"""Compile check of plugins/cuda for sm_80 and sm_90, so CUDA code cannot rot on GPU-less CI.

Runs wherever nvcc is installed (it is on our CI machines); skipped, with the reason, elsewhere.
"""

import subprocess

from conftest import requires_nvcc

API = ["qs_last_error", "qs_device_memory", "qs_paged_attention_workspace_size", "qs_paged_attention_decode",
       "qs_paged_attention_prefill", "qs_packed_attention_workspace_size", "qs_packed_paged_attention", "qs_kv_append",
       "qs_rmsnorm_residual", "qs_rotary"]


@requires_nvcc
def test_cuda_kernels_compile_for_sm80_and_sm90_and_export_only_the_c_api(cuda_build):
    lib = cuda_build / "libqs_cuda.so"
    assert lib.is_file(), "libqs_cuda was not produced"
    exported = {line.split()[-1] for line in subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True,
                                                             text=True).stdout.splitlines() if " T " in line}
    assert set(API) <= exported and not {s for s in exported if s.startswith("_Z")}, exported
    needed = subprocess.run(["ldd", str(lib)], capture_output=True, text=True).stdout
    assert "libcudart" not in needed        # static runtime: loads on machines without the CUDA toolkit
