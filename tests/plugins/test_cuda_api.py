"""The CUDA kernels' C API on a machine without a GPU: every bad call is refused on the host with a message
before anything launches, and a valid call without a device fails cleanly (no crash, no hang).

Device buffers are stand-ins here (DeviceArray with addresses nothing dereferences): the host-side checks
are the thing under test, and they never touch memory.
"""

from __future__ import annotations

import pytest

from runtime.cuda_kernels import CudaKernels, DeviceArray, KernelError, KernelsUnavailable

from conftest import requires_nvcc

pytestmark = requires_nvcc
ADDR = 1 << 40          # 16-byte aligned, never dereferenced


def arr(*shape, dtype="f16", ptr=ADDR):
    return DeviceArray(ptr, tuple(shape), dtype)


def decode_args(**over):
    args = dict(out=arr(2, 8, 64), query=arr(2, 8, 64), k_cache=arr(10, 16, 2, 64), v_cache=arr(10, 16, 2, 64),
                block_tables=arr(2, 4, dtype="i32"), seq_lens=arr(2, dtype="i32"), max_seq_len=64)
    args.update(over)
    return args


@pytest.mark.parametrize("over, message", [
    (dict(query=arr(2, 8, 48), out=arr(2, 8, 48), k_cache=arr(10, 16, 2, 48), v_cache=arr(10, 16, 2, 48)),
     "unsupported: head_dim 48 has no kernel"),
    (dict(query=arr(2, 6, 64), out=arr(2, 6, 64), k_cache=arr(10, 16, 4, 64), v_cache=arr(10, 16, 4, 64)),
     r"num_heads \(6\) must be a positive multiple of kv_heads \(4\)"),
    (dict(max_seq_len=65), "must be >= 1 and fit in max_blocks_per_seq"),
    (dict(max_seq_len=0), "must be >= 1"),
    (dict(block_tables=arr(2, 40, dtype="i32"), max_seq_len=600), "workspace of .* bytes needed"),  # split-K partials
    (dict(query=arr(2, 8, 64, dtype="f32"), out=arr(2, 8, 64, dtype="f32")), "query dtype f32"),
    (dict(k_cache=arr(10, 16, 2, 64, dtype="fp8_e4m3"), v_cache=arr(10, 16, 2, 64, dtype="fp8_e4m3")),
     "fp8 KV cache needs k_scale and v_scale"),
    (dict(query=arr(2, 8, 64, ptr=ADDR + 2)), "16-byte aligned"),
    (dict(query=arr(2, 8, 64, ptr=0)), "must be device pointers, not NULL"),
    (dict(scale=-1.0), "scale must be a positive finite number"),
])
def test_decode_refuses_bad_arguments_on_the_host(cuda_kernels, over, message):
    with pytest.raises(KernelError, match=message):
        cuda_kernels.paged_attention(**decode_args(**over))


@pytest.mark.parametrize("over, message", [
    (dict(query=arr(3, 8, 64), out=arr(3, 8, 64)), "one query row per sequence"),
    (dict(k_cache=arr(10, 16, 2, 32)), "must share shape"),
    (dict(block_tables=arr(2, 4, dtype="i64")), "block_tables must be int32"),
    (dict(seq_lens=arr(3, dtype="i32")), r"seq_lens must be int32 \[2\]"),
])
def test_binding_checks_shapes_against_each_other(cuda_kernels, over, message):
    with pytest.raises(KernelError, match=message):
        cuda_kernels.paged_attention(**decode_args(**over))


def test_prefill_requires_offsets_matching_the_batch(cuda_kernels):
    with pytest.raises(KernelError, match=r"cu_seqlens_q must be int32 \[3\]"):
        cuda_kernels.paged_attention(**decode_args(query=arr(5, 8, 64), out=arr(5, 8, 64)), cu_seqlens_q=arr(2, dtype="i32"))


def test_workspace_size_covers_partials_only_past_one_partition(cuda_kernels):
    assert cuda_kernels.workspace_size(4, 8, 128, 256) == 0
    assert cuda_kernels.workspace_size(4, 8, 128, 8192) == 4 * 8 * 32 * (128 + 2) * 4


def test_valid_call_without_a_device_fails_with_the_cuda_message(cuda_kernels):
    try:
        import torch
        if torch.cuda.is_available():
            pytest.skip("a GPU is present: the GPU tests cover real launches")
    except ImportError:
        pass
    with pytest.raises(KernelError, match="CUDA error: paged attention launch"):
        cuda_kernels.paged_attention(**decode_args())
    with pytest.raises(KernelError, match="CUDA error: cudaMemGetInfo"):
        cuda_kernels.device_memory()


@pytest.mark.parametrize("call, message", [
    (lambda k: k.kv_append(arr(3, 2, 64), arr(3, 2, 64), arr(10, 16, 2, 64), arr(10, 16, 2, 64), arr(3, dtype="i32")),
     "slot_mapping must be int64"),
    (lambda k: k.kv_append(arr(3, 2, 64), arr(3, 2, 64), arr(10, 16, 2, 64, dtype="fp8_e4m3"),
                           arr(10, 16, 2, 64, dtype="fp8_e4m3"), arr(3, dtype="i64")), "fp8 cache needs k_scale"),
    (lambda k: k.rmsnorm_residual(arr(4, 64), arr(4, 64), None, arr(64), 0.0), "eps must be > 0"),
    (lambda k: k.rmsnorm_residual(arr(4, 64), arr(4, 64), None, arr(32), 1e-6), r"weight must be \[64\]"),
    (lambda k: k.rotary(arr(3, 8, 64), None, arr(3, dtype="i32"), arr(100, 32, dtype="f32"), arr(100, 32, dtype="f32"),
                        rotary_dim=63), "must be float32"),
])
def test_small_kernels_refuse_bad_arguments(cuda_kernels, call, message):
    with pytest.raises(KernelError, match=message):
        call(cuda_kernels)


def test_packed_attention_needs_its_workspace(cuda_kernels):
    tokens, heads, kv_heads, dim = 5, 8, 2, 64
    with pytest.raises(KernelError, match="256-byte aligned workspace of .* bytes is needed"):
        cuda_kernels.packed_paged_attention(
            arr(tokens, heads * dim), arr(tokens, (heads + 2 * kv_heads) * dim), arr(10, 16, 2, 64), arr(10, 16, 2, 64),
            arr(3, dtype="i32"), arr(2, dtype="i32"), arr(2, 4, dtype="i32"), arr(tokens, dtype="i32"),
            arr(128, 32), arr(128, 32), num_heads=heads, max_seq_len=64)
    assert cuda_kernels.packed_workspace_size(tokens, 2, heads, dim, 64) >= tokens * heads * dim * 2


def test_missing_library_says_how_to_build_it(tmp_path):
    with pytest.raises(KernelsUnavailable, match="QS_BUILD_CUDA=ON"):
        CudaKernels(tmp_path / "libqs_cuda.so")
