// Small fused kernels of a decoder layer: residual add + RMSNorm, and rotary embedding in place.
// Both are memory-bound one-pass kernels; they exist so a layer does not round-trip through memory
// between the residual add and the norm, or between the QKV projection and the KV append.
#include "common.cuh"

namespace qs {
namespace {

constexpr int kNormThreads = 256;

template <typename T>
__global__ void rmsnorm_residual_kernel(T* __restrict__ out, T* __restrict__ residual, const T* __restrict__ x,
                                        const T* __restrict__ weight, int hidden, float eps) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * hidden;
  float ss = 0.f;
  for (int i = threadIdx.x; i < hidden; i += kNormThreads) {
    float r = to_float(residual[base + i]);
    if (x != nullptr) {
      r += to_float(x[base + i]);
      residual[base + i] = from_float<T>(r);
    }
    ss = fmaf(r, r, ss);
  }
  __shared__ float s_part[kNormThreads / 32];
  for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (threadIdx.x % 32 == 0) s_part[threadIdx.x / 32] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kNormThreads / 32; ++w) total += s_part[w];
  const float inv = rsqrtf(total / hidden + eps);
  // Each thread re-reads the values it wrote above (same indices), so no barrier is needed.
  for (int i = threadIdx.x; i < hidden; i += kNormThreads)
    out[base + i] = from_float<T>(to_float(residual[base + i]) * inv * to_float(weight[i]));
}

template <typename T>
__global__ void rotary_kernel(T* __restrict__ q, T* __restrict__ k, const int32_t* __restrict__ positions,
                              const float* __restrict__ cos_cache, const float* __restrict__ sin_cache, int num_heads,
                              int kv_heads, int head_dim, int rotary_dim) {
  const int token = blockIdx.x, half = rotary_dim / 2;
  const int64_t pos = positions[token];
  const float* c = cos_cache + pos * half;
  const float* s = sin_cache + pos * half;
  const int work = (num_heads + (k != nullptr ? kv_heads : 0)) * half;
  for (int i = threadIdx.x; i < work; i += blockDim.x) {
    const int head = i / half, j = i % half;
    T* v = head < num_heads ? q + (static_cast<int64_t>(token) * num_heads + head) * head_dim
                            : k + (static_cast<int64_t>(token) * kv_heads + head - num_heads) * head_dim;
    const float a = to_float(v[j]), b = to_float(v[j + half]);
    v[j] = from_float<T>(a * c[j] - b * s[j]);
    v[j + half] = from_float<T>(b * c[j] + a * s[j]);
  }
}

}  // namespace
}  // namespace qs

extern "C" int qs_rmsnorm_residual(void* out, void* residual, const void* x, const void* weight, int rows, int hidden,
                                   float eps, qs_dtype dtype, void* stream) {
  using namespace qs;
  if (rows < 0 || hidden < 1) return fail(QS_ERR_INVALID_ARGUMENT, "rows (%d) must be >= 0 and hidden (%d) >= 1", rows, hidden);
  if (rows == 0) return ok();
  if (!out || !residual || !weight) return fail(QS_ERR_INVALID_ARGUMENT, "out, residual and weight must not be NULL");
  if (!(eps > 0.f)) return fail(QS_ERR_INVALID_ARGUMENT, "eps must be > 0, not %g", eps);
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case QS_DTYPE_F32:
      rmsnorm_residual_kernel<float><<<rows, kNormThreads, 0, s>>>(static_cast<float*>(out), static_cast<float*>(residual),
          static_cast<const float*>(x), static_cast<const float*>(weight), hidden, eps);
      break;
    case QS_DTYPE_F16:
      rmsnorm_residual_kernel<__half><<<rows, kNormThreads, 0, s>>>(static_cast<__half*>(out), static_cast<__half*>(residual),
          static_cast<const __half*>(x), static_cast<const __half*>(weight), hidden, eps);
      break;
    case QS_DTYPE_BF16:
      rmsnorm_residual_kernel<__nv_bfloat16><<<rows, kNormThreads, 0, s>>>(static_cast<__nv_bfloat16*>(out),
          static_cast<__nv_bfloat16*>(residual), static_cast<const __nv_bfloat16*>(x),
          static_cast<const __nv_bfloat16*>(weight), hidden, eps);
      break;
    default: return fail(QS_ERR_INVALID_ARGUMENT, "RMSNorm dtype %s: expected f32, f16 or bf16", dtype_name(dtype));
  }
  return from_cuda(cudaGetLastError(), "rmsnorm launch");
}

extern "C" int qs_rotary(void* q, void* k, const int32_t* positions, const float* cos_cache, const float* sin_cache,
                         int num_tokens, int num_heads, int kv_heads, int head_dim, int rotary_dim, qs_dtype dtype,
                         void* stream) {
  using namespace qs;
  if (num_tokens < 0) return fail(QS_ERR_INVALID_ARGUMENT, "num_tokens must be >= 0, not %d", num_tokens);
  if (num_tokens == 0) return ok();
  if (!q || !positions || !cos_cache || !sin_cache)
    return fail(QS_ERR_INVALID_ARGUMENT, "q, positions, cos_cache and sin_cache must not be NULL");
  if (num_heads < 1 || (k != nullptr && kv_heads < 1))
    return fail(QS_ERR_INVALID_ARGUMENT, "num_heads (%d) and kv_heads (%d) must be >= 1", num_heads, kv_heads);
  if (rotary_dim < 2 || rotary_dim % 2 != 0 || rotary_dim > head_dim)
    return fail(QS_ERR_INVALID_ARGUMENT, "rotary_dim %d must be even and within head_dim %d", rotary_dim, head_dim);
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case QS_DTYPE_F32:
      rotary_kernel<float><<<num_tokens, 128, 0, s>>>(static_cast<float*>(q), static_cast<float*>(k), positions, cos_cache,
                                                     sin_cache, num_heads, kv_heads, head_dim, rotary_dim);
      break;
    case QS_DTYPE_F16:
      rotary_kernel<__half><<<num_tokens, 128, 0, s>>>(static_cast<__half*>(q), static_cast<__half*>(k), positions, cos_cache,
                                                      sin_cache, num_heads, kv_heads, head_dim, rotary_dim);
      break;
    case QS_DTYPE_BF16:
      rotary_kernel<__nv_bfloat16><<<num_tokens, 128, 0, s>>>(static_cast<__nv_bfloat16*>(q), static_cast<__nv_bfloat16*>(k),
                                                             positions, cos_cache, sin_cache, num_heads, kv_heads, head_dim, rotary_dim);
      break;
    default: return fail(QS_ERR_INVALID_ARGUMENT, "rotary dtype %s: expected f32, f16 or bf16", dtype_name(dtype));
  }
  return from_cuda(cudaGetLastError(), "rotary launch");
}
