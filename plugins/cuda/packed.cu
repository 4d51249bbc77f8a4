// Packed paged attention with ONNX Runtime's com.microsoft.PagedAttention semantics, as one C call:
//   1. prepare: each token's position (past + index in its sequence) and each sequence's KV length;
//   2. rotate q and k (half rotation), write rotated q to the workspace and k, v to their cache slots;
//   3. the multi-token paged attention of paged_attention.cu over cached + new keys.
// This is what the TensorRT plugin enqueues; the graph stays the one `--target cuda` emits.
#include "common.cuh"

namespace qs {
namespace {

template <typename T>
__global__ void prepare_kernel(const int32_t* __restrict__ cu_q, const int32_t* __restrict__ past, int num_seqs,
                               int num_tokens, int32_t* __restrict__ positions, int32_t* __restrict__ seq_lens) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < num_tokens) {
    const int b = find_seq(cu_q, num_seqs, i);
    positions[i] = past[b] + i - cu_q[b];
  }
  if (i < num_seqs) seq_lens[i] = past[i] + cu_q[i + 1] - cu_q[i];
}

// One CTA per token: rotate its q heads into q_out, its k heads into the cache, copy v into the cache.
template <typename T>
__global__ void rotate_append_kernel(const T* __restrict__ qkv, T* __restrict__ q_out, T* __restrict__ k_cache,
                                     T* __restrict__ v_cache, const int32_t* __restrict__ positions,
                                     const int32_t* __restrict__ slot_mapping, const T* __restrict__ cos_cache,
                                     const T* __restrict__ sin_cache, int num_heads, int kv_heads, int head_dim) {
  const int t = blockIdx.x, half = head_dim / 2;
  const int64_t width = static_cast<int64_t>(num_heads + 2 * kv_heads) * head_dim;
  const T* row = qkv + t * width;
  const int32_t slot = slot_mapping[t];
  const T* c = cos_cache + static_cast<int64_t>(positions[t]) * half;
  const T* s = sin_cache + static_cast<int64_t>(positions[t]) * half;
  const int64_t kv_row = static_cast<int64_t>(kv_heads) * head_dim;
  for (int i = threadIdx.x; i < (num_heads + kv_heads) * half; i += blockDim.x) {
    const int head = i / half, j = i % half;
    const T* src = row + head * head_dim;
    const float a = to_float(src[j]), b = to_float(src[j + half]);
    const float cj = to_float(c[j]), sj = to_float(s[j]);
    const T lo = from_float<T>(a * cj - b * sj), hi = from_float<T>(b * cj + a * sj);
    if (head < num_heads) {
      T* dst = q_out + (static_cast<int64_t>(t) * num_heads + head) * head_dim;
      dst[j] = lo;
      dst[j + half] = hi;
    } else if (slot >= 0) {
      T* dst = k_cache + slot * kv_row + (head - num_heads) * head_dim;
      dst[j] = lo;
      dst[j + half] = hi;
    }
  }
  if (slot >= 0) {
    const T* v = row + static_cast<int64_t>(num_heads + kv_heads) * head_dim;
    for (int i = threadIdx.x; i < kv_row; i += blockDim.x) v_cache[slot * kv_row + i] = v[i];
  }
}

struct Layout {
  size_t q, positions, seq_lens, attention, total;
};

Layout layout(int num_tokens, int num_seqs, int num_heads, int head_dim, int max_seq_len) {
  Layout l{};
  l.q = 0;
  l.positions = align256(static_cast<size_t>(num_tokens) * num_heads * head_dim * 2);
  l.seq_lens = l.positions + align256(static_cast<size_t>(num_tokens) * 4);
  l.attention = l.seq_lens + align256(static_cast<size_t>(num_seqs) * 4);
  l.total = l.attention + qs_paged_attention_workspace_size(num_tokens, num_heads, head_dim, max_seq_len);
  return l;
}

template <typename T>
cudaError_t launch_prep(const void* qkv, void* q_out, void* k_cache, void* v_cache, const int32_t* cu_q,
                        const int32_t* past, const int32_t* slots, const void* cos_cache, const void* sin_cache,
                        int32_t* positions, int32_t* seq_lens, int num_tokens, int num_seqs, int num_heads,
                        int kv_heads, int head_dim, cudaStream_t stream) {
  const int n = num_tokens > num_seqs ? num_tokens : num_seqs;
  prepare_kernel<T><<<(n + 255) / 256, 256, 0, stream>>>(cu_q, past, num_seqs, num_tokens, positions, seq_lens);
  if (num_tokens > 0)
    rotate_append_kernel<T><<<num_tokens, 128, 0, stream>>>(
        static_cast<const T*>(qkv), static_cast<T*>(q_out), static_cast<T*>(k_cache), static_cast<T*>(v_cache),
        positions, slots, static_cast<const T*>(cos_cache), static_cast<const T*>(sin_cache), num_heads, kv_heads,
        head_dim);
  return cudaGetLastError();
}

}  // namespace
}  // namespace qs

extern "C" size_t qs_packed_attention_workspace_size(int num_tokens, int num_seqs, int num_heads, int head_dim,
                                                     int max_seq_len) {
  return qs::layout(num_tokens, num_seqs, num_heads, head_dim, max_seq_len).total;
}

extern "C" int qs_packed_paged_attention(void* out, const void* qkv, void* k_cache, void* v_cache,
                                         const int32_t* cu_seqlens_q, const int32_t* past_seqlens,
                                         const int32_t* block_tables, const int32_t* slot_mapping,
                                         const void* cos_cache, const void* sin_cache, int num_tokens, int num_seqs,
                                         int num_heads, int kv_heads, int head_dim, int block_size,
                                         int max_blocks_per_seq, int max_seq_len, int window, float scale,
                                         qs_dtype dtype, void* workspace, size_t workspace_bytes, void* stream) {
  using namespace qs;
  if (num_tokens < 0 || num_seqs < 1)
    return fail(QS_ERR_INVALID_ARGUMENT, "need num_seqs >= 1 and num_tokens >= 0 (got %d, %d)", num_seqs, num_tokens);
  if (num_tokens == 0) return ok();
  if (!qkv || !cu_seqlens_q || !past_seqlens || !slot_mapping || !cos_cache || !sin_cache)
    return fail(QS_ERR_INVALID_ARGUMENT, "qkv, cu_seqlens_q, past_seqlens, slot_mapping and the cos/sin caches must not be NULL");
  if (dtype != QS_DTYPE_F16 && dtype != QS_DTYPE_BF16)
    return fail(QS_ERR_UNSUPPORTED, "packed attention runs in f16 or bf16, not %s", dtype_name(dtype));
  if (head_dim < 2 || head_dim % 2 != 0) return fail(QS_ERR_INVALID_ARGUMENT, "head_dim %d must be even", head_dim);
  const Layout l = layout(num_tokens, num_seqs, num_heads, head_dim, max_seq_len);
  if (workspace == nullptr || workspace_bytes < l.total || !aligned(workspace, 256))
    return fail(QS_ERR_INVALID_ARGUMENT, "a 256-byte aligned workspace of %zu bytes is needed (got %zu); see qs_packed_attention_workspace_size",
                l.total, workspace == nullptr ? 0 : workspace_bytes);
  char* ws = static_cast<char*>(workspace);
  void* q = ws + l.q;
  auto* positions = reinterpret_cast<int32_t*>(ws + l.positions);
  auto* seq_lens = reinterpret_cast<int32_t*>(ws + l.seq_lens);
  // The attention's own checks run before anything is launched.
  const int check = check_attention_shape(num_tokens, num_seqs, num_heads, kv_heads, head_dim, block_size,
                                          max_blocks_per_seq, max_seq_len, scale, dtype, dtype);
  if (check != QS_OK) return check;
  if (!k_cache || !v_cache || !block_tables || !out)
    return fail(QS_ERR_INVALID_ARGUMENT, "out, k_cache, v_cache and block_tables must not be NULL");
  auto s = static_cast<cudaStream_t>(stream);
  const cudaError_t err = dtype == QS_DTYPE_F16
      ? launch_prep<__half>(qkv, q, k_cache, v_cache, cu_seqlens_q, past_seqlens, slot_mapping, cos_cache, sin_cache,
                            positions, seq_lens, num_tokens, num_seqs, num_heads, kv_heads, head_dim, s)
      : launch_prep<__nv_bfloat16>(qkv, q, k_cache, v_cache, cu_seqlens_q, past_seqlens, slot_mapping, cos_cache,
                                   sin_cache, positions, seq_lens, num_tokens, num_seqs, num_heads, kv_heads, head_dim, s);
  if (err != cudaSuccess) return from_cuda(err, "packed attention prepare launch");
  return run_paged_attention(out, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, num_tokens, num_seqs,
                             num_heads, kv_heads, head_dim, block_size, max_blocks_per_seq, max_seq_len, window, scale,
                             nullptr, nullptr, dtype, dtype, ws + l.attention, l.total - l.attention, stream);
}
