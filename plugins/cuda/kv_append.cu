// KV append: scatter each new token's K/V rows into its paged-cache slot.
// One thread block per token; threads stride over kv_heads * head_dim elements with 16-byte vectors
// when the row is aligned (head_dim * sizeof(T) is a multiple of 16 for every supported model).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "qs_cuda.h"

namespace {

template <typename T>
__global__ void kv_append_kernel(const T* __restrict__ key,    // [num_tokens, kv_heads * head_dim]
                                 const T* __restrict__ value,  // [num_tokens, kv_heads * head_dim]
                                 T* __restrict__ k_cache,      // [num_blocks, block_size, kv_heads * head_dim]
                                 T* __restrict__ v_cache,      // [num_blocks, block_size, kv_heads * head_dim]
                                 const int64_t* __restrict__ slot_mapping,  // [num_tokens]
                                 int row) {
  const int64_t slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;
  const bool vec = (row * sizeof(T)) % sizeof(uint4) == 0;
  if (vec) {
    const int n = row * sizeof(T) / sizeof(uint4);
    const uint4* k_src = reinterpret_cast<const uint4*>(key + blockIdx.x * static_cast<int64_t>(row));
    const uint4* v_src = reinterpret_cast<const uint4*>(value + blockIdx.x * static_cast<int64_t>(row));
    uint4* k_dst = reinterpret_cast<uint4*>(k_cache + slot * row);
    uint4* v_dst = reinterpret_cast<uint4*>(v_cache + slot * row);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      k_dst[i] = k_src[i];
      v_dst[i] = v_src[i];
    }
  } else {
    for (int i = threadIdx.x; i < row; i += blockDim.x) {
      k_cache[slot * row + i] = key[blockIdx.x * static_cast<int64_t>(row) + i];
      v_cache[slot * row + i] = value[blockIdx.x * static_cast<int64_t>(row) + i];
    }
  }
}

template <typename T>
cudaError_t launch(const void* key, const void* value, void* k_cache, void* v_cache, const int64_t* slots,
                   int num_tokens, int row, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  kv_append_kernel<T><<<num_tokens, 128, 0, stream>>>(static_cast<const T*>(key), static_cast<const T*>(value),
                                                       static_cast<T*>(k_cache), static_cast<T*>(v_cache), slots, row);
  return cudaGetLastError();
}

}  // namespace

extern "C" int qs_kv_append(const void* key, const void* value, void* k_cache, void* v_cache,
                            const int64_t* slot_mapping, int num_tokens, int kv_heads, int head_dim,
                            int block_size, qs_dtype dtype, void* stream) {
  (void)block_size;  // slots already encode block_id * block_size + offset
  const int row = kv_heads * head_dim;
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case QS_DTYPE_F32: return launch<float>(key, value, k_cache, v_cache, slot_mapping, num_tokens, row, s);
    case QS_DTYPE_F16: return launch<__half>(key, value, k_cache, v_cache, slot_mapping, num_tokens, row, s);
    case QS_DTYPE_BF16: return launch<__nv_bfloat16>(key, value, k_cache, v_cache, slot_mapping, num_tokens, row, s);
  }
  return cudaErrorInvalidValue;
}
