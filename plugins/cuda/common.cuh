// Shared by the kernels: element conversions, vector loads, and the host-side argument checks.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "qs_cuda.h"

namespace qs {

// ---- host: status and messages ----------------------------------------------------------------
// Records the message for qs_last_error() and returns `status`, so checks read `return fail(...)`.
int fail(qs_status status, const char* fmt, ...);
int ok();
// Turn the outcome of a launch into a status (QS_ERR_CUDA with the runtime's message on failure).
int from_cuda(cudaError_t err, const char* what);

// paged_attention.cu: the pointer-free argument checks (shared with packed.cu) ...
int check_attention_shape(int rows, int num_seqs, int num_heads, int kv_heads, int head_dim, int block_size,
                          int max_blocks, int max_seq_len, float scale, qs_dtype dtype, qs_dtype kv_dtype);
// ... and the full call: checks arguments, then launches the attention (+ reduce) kernels.
int run_paged_attention(void* out, const void* query, const void* k_cache, const void* v_cache,
                        const int32_t* block_tables, const int32_t* seq_lens, const int32_t* cu_q, int rows,
                        int num_seqs, int num_heads, int kv_heads, int head_dim, int block_size, int max_blocks,
                        int max_seq_len, int window, float scale, const float* k_scale, const float* v_scale,
                        qs_dtype dtype, qs_dtype kv_dtype, void* workspace, size_t workspace_bytes, void* stream);

inline size_t align256(size_t n) { return (n + 255) / 256 * 256; }

inline bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }
inline const char* dtype_name(qs_dtype t) {
  switch (t) {
    case QS_DTYPE_F32: return "f32";
    case QS_DTYPE_F16: return "f16";
    case QS_DTYPE_BF16: return "bf16";
    case QS_DTYPE_FP8_E4M3: return "fp8_e4m3";
  }
  return "unknown";
}

// ---- device: conversions ------------------------------------------------------------------------
using fp8 = __nv_fp8_e4m3;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(fp8 x) { return static_cast<float>(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ fp8 from_float<fp8>(float x) { return fp8(x); }  // saturates to ±448

// Eight consecutive elements as raw bits: 16 bytes for 16-bit types, 8 bytes for fp8.
template <typename T> struct Pack8 { using type = uint4; };
template <> struct Pack8<fp8> { using type = uint2; };

template <typename T>
__device__ __forceinline__ typename Pack8<T>::type load8(const T* p) {
  return *reinterpret_cast<const typename Pack8<T>::type*>(p);
}

__device__ __forceinline__ float2 to_float2(__half2 x) { return __half22float2(x); }
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 x) { return __bfloat1622float2(x); }

// 16-bit types: four pairs in 16 bytes.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& r, const T*, float (&f)[8]) {
  using Pair = typename std::conditional<std::is_same<T, __half>::value, __half2, __nv_bfloat162>::type;
  const Pair* h = reinterpret_cast<const Pair*>(&r);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = to_float2(h[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}
__device__ __forceinline__ void unpack8(const uint2& r, const fp8*, float (&f)[8]) {
  const __nv_fp8x2_storage_t* p = reinterpret_cast<const __nv_fp8x2_storage_t*>(&r);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2 h = __half2(__nv_cvt_fp8x2_to_halfraw2(p[i], __NV_E4M3));
    float2 v = __half22float2(h);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

// The sequence owning packed row `row`: the last b with cu_q[b] <= row (sequences with no rows are skipped).
__device__ __forceinline__ int find_seq(const int32_t* cu_q, int num_seqs, int row) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu_q[mid] <= row) lo = mid; else hi = mid - 1;
  }
  return lo;
}

}  // namespace qs
