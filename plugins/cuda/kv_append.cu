// KV append: scatter each new token's K/V rows into its paged-cache slot.
// One CTA per token; threads stride over kv_heads * head_dim elements, 8 at a time (16-byte loads;
// head_dim is a multiple of 8 for every supported model). fp8 caches store x / scale, saturated.
#include "common.cuh"

namespace qs {
namespace {

template <typename T, typename KV>
__global__ void kv_append_kernel(const T* __restrict__ key, const T* __restrict__ value, KV* __restrict__ k_cache,
                                 KV* __restrict__ v_cache, const int64_t* __restrict__ slot_mapping, int row,
                                 const float* __restrict__ k_scale, const float* __restrict__ v_scale) {
  const int64_t slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;
  const float k_inv = k_scale != nullptr ? 1.f / *k_scale : 1.f;
  const float v_inv = v_scale != nullptr ? 1.f / *v_scale : 1.f;
  const T* k_src = key + static_cast<int64_t>(blockIdx.x) * row;
  const T* v_src = value + static_cast<int64_t>(blockIdx.x) * row;
  KV* k_dst = k_cache + slot * row;
  KV* v_dst = v_cache + slot * row;
  for (int i = threadIdx.x * 8; i < row; i += blockDim.x * 8) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      k_dst[i + e] = from_float<KV>(to_float(k_src[i + e]) * k_inv);
      v_dst[i + e] = from_float<KV>(to_float(v_src[i + e]) * v_inv);
    }
  }
}

// Same dtype in and out: a plain 16-byte copy.
template <typename T>
__global__ void kv_copy_kernel(const T* __restrict__ key, const T* __restrict__ value, T* __restrict__ k_cache,
                               T* __restrict__ v_cache, const int64_t* __restrict__ slot_mapping, int row) {
  const int64_t slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;
  const int n = row * static_cast<int>(sizeof(T)) / 16;
  const uint4* k_src = reinterpret_cast<const uint4*>(key + static_cast<int64_t>(blockIdx.x) * row);
  const uint4* v_src = reinterpret_cast<const uint4*>(value + static_cast<int64_t>(blockIdx.x) * row);
  uint4* k_dst = reinterpret_cast<uint4*>(k_cache + slot * row);
  uint4* v_dst = reinterpret_cast<uint4*>(v_cache + slot * row);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    k_dst[i] = k_src[i];
    v_dst[i] = v_src[i];
  }
}

template <typename T>
cudaError_t launch(const void* key, const void* value, void* k_cache, void* v_cache, const int64_t* slots,
                   int num_tokens, int row, qs_dtype kv_dtype, const float* k_scale, const float* v_scale,
                   cudaStream_t s) {
  if (kv_dtype == QS_DTYPE_FP8_E4M3)
    kv_append_kernel<T, fp8><<<num_tokens, 128, 0, s>>>(static_cast<const T*>(key), static_cast<const T*>(value),
                                                        static_cast<fp8*>(k_cache), static_cast<fp8*>(v_cache), slots,
                                                        row, k_scale, v_scale);
  else
    kv_copy_kernel<T><<<num_tokens, 128, 0, s>>>(static_cast<const T*>(key), static_cast<const T*>(value),
                                                 static_cast<T*>(k_cache), static_cast<T*>(v_cache), slots, row);
  return cudaGetLastError();
}

}  // namespace
}  // namespace qs

extern "C" int qs_kv_append(const void* key, const void* value, void* k_cache, void* v_cache,
                            const int64_t* slot_mapping, int num_tokens, int kv_heads, int head_dim, qs_dtype dtype,
                            qs_dtype kv_dtype, const float* k_scale, const float* v_scale, void* stream) {
  using namespace qs;
  if (num_tokens < 0) return fail(QS_ERR_INVALID_ARGUMENT, "num_tokens must be >= 0, not %d", num_tokens);
  if (num_tokens == 0) return ok();
  if (!key || !value || !k_cache || !v_cache || !slot_mapping)
    return fail(QS_ERR_INVALID_ARGUMENT, "key, value, k_cache, v_cache and slot_mapping must be device pointers, not NULL");
  if (kv_heads < 1 || head_dim < 8 || head_dim % 8 != 0)
    return fail(QS_ERR_INVALID_ARGUMENT, "kv_heads (%d) must be >= 1 and head_dim (%d) a multiple of 8", kv_heads, head_dim);
  if (dtype != QS_DTYPE_F32 && dtype != QS_DTYPE_F16 && dtype != QS_DTYPE_BF16)
    return fail(QS_ERR_INVALID_ARGUMENT, "K/V dtype %s: expected f32, f16 or bf16", dtype_name(dtype));
  if (kv_dtype != dtype && kv_dtype != QS_DTYPE_FP8_E4M3)
    return fail(QS_ERR_INVALID_ARGUMENT, "cache dtype %s must equal the K/V dtype %s or be fp8_e4m3", dtype_name(kv_dtype), dtype_name(dtype));
  if (kv_dtype == QS_DTYPE_FP8_E4M3 && (!k_scale || !v_scale))
    return fail(QS_ERR_INVALID_ARGUMENT, "an fp8 cache needs k_scale and v_scale (device float[1])");
  if (!aligned(key, 16) || !aligned(value, 16) || !aligned(k_cache, 8) || !aligned(v_cache, 8))
    return fail(QS_ERR_INVALID_ARGUMENT, "key/value must be 16-byte aligned and the caches 8-byte aligned");
  const int row = kv_heads * head_dim;
  auto s = static_cast<cudaStream_t>(stream);
  cudaError_t err;
  switch (dtype) {
    case QS_DTYPE_F32: err = launch<float>(key, value, k_cache, v_cache, slot_mapping, num_tokens, row, kv_dtype, k_scale, v_scale, s); break;
    case QS_DTYPE_F16: err = launch<__half>(key, value, k_cache, v_cache, slot_mapping, num_tokens, row, kv_dtype, k_scale, v_scale, s); break;
    default: err = launch<__nv_bfloat16>(key, value, k_cache, v_cache, slot_mapping, num_tokens, row, kv_dtype, k_scale, v_scale, s); break;
  }
  return from_cuda(err, "kv append launch");
}
