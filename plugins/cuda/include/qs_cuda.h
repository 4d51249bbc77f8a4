// C API of Quicksilver's CUDA kernels: paged attention, KV append, fused RMSNorm + residual, rotary.
//
// All tensor pointers are device pointers; every call is asynchronous on `stream` (NULL: the default
// stream). Arguments are checked on the host before anything is launched, so a bad call returns
// QS_ERR_INVALID_ARGUMENT (or QS_ERR_UNSUPPORTED) and touches no memory; qs_last_error() says why.
//
// Paged KV layout (the same as ONNX Runtime's com.microsoft.PagedAttention, so one pool serves both):
//   k_cache, v_cache  [num_blocks, block_size, kv_heads, head_dim]
//   block_tables      int32 [num_seqs, max_blocks_per_seq]   physical block of each logical block
//   a token's slot is block_id * block_size + offset; slot -1 means "do not write" (padding, cached prefix)
#pragma once
#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define QS_API __attribute__((visibility("default")))
#else
#define QS_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { QS_DTYPE_F32 = 0, QS_DTYPE_F16 = 1, QS_DTYPE_BF16 = 2, QS_DTYPE_FP8_E4M3 = 3 } qs_dtype;

typedef enum {
  QS_OK = 0,
  QS_ERR_INVALID_ARGUMENT = 1,  // a shape, pointer, dtype or size that cannot be right
  QS_ERR_UNSUPPORTED = 2,       // valid but not built (e.g. a head_dim without a kernel)
  QS_ERR_CUDA = 3,              // the CUDA runtime refused (no device, launch failure, ...)
} qs_status;

// Message of the last failed call on this thread ("" after a success).
QS_API const char* qs_last_error(void);

// Free and total memory of the current device, in bytes (sizes the paged KV pool).
QS_API int qs_device_memory(size_t* free_bytes, size_t* total_bytes);

// Bytes of workspace qs_paged_attention_* needs for `num_rows` query rows (tokens) whose KV length is at
// most `max_seq_len`; 0 when one pass suffices (max_seq_len <= QS_PARTITION_TOKENS). Its contents need no
// initialization: a call reads only the partials it wrote itself (each row's partitions of its own keys).
#define QS_PARTITION_TOKENS 256
QS_API size_t qs_paged_attention_workspace_size(int num_rows, int num_heads, int head_dim, int max_seq_len);

// Decode attention: one query token per sequence.
//   out, query   [num_seqs, num_heads, head_dim]          dtype (F16 or BF16)
//   seq_lens     int32 [num_seqs]  KV length of each sequence including this step's token (already appended);
//                0 (a padding sequence) gives a zero output
//   max_seq_len  an upper bound on seq_lens (trusted, like ORT's attention_metadata: it sizes the split-K grid)
//   window       attend only the last `window` keys (sliding window); <= 0: all
//   kv_dtype     dtype, or QS_DTYPE_FP8_E4M3 with per-tensor dequantization scales k_scale/v_scale (device float[1])
QS_API int qs_paged_attention_decode(void* out, const void* query, const void* k_cache, const void* v_cache,
                              const int32_t* block_tables, const int32_t* seq_lens, int num_seqs, int num_heads,
                              int kv_heads, int head_dim, int block_size, int max_blocks_per_seq, int max_seq_len,
                              int window, float scale, const float* k_scale, const float* v_scale, qs_dtype dtype,
                              qs_dtype kv_dtype, void* workspace, size_t workspace_bytes, void* stream);

// Multi-token attention (chunked prefill, speculative verification) over a packed ragged batch:
//   out, query     [num_tokens, num_heads, head_dim]; sequence b owns rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]
//   cu_seqlens_q   int32 [num_seqs + 1]
//   seq_lens       int32 [num_seqs]  KV length after this step (cached + new; new K/V already appended)
// Causal over cached + new tokens: row i of sequence b (q_len_b rows) sees keys [0, seq_len_b - q_len_b + i].
QS_API int qs_paged_attention_prefill(void* out, const void* query, const void* k_cache, const void* v_cache,
                               const int32_t* block_tables, const int32_t* seq_lens, const int32_t* cu_seqlens_q,
                               int num_tokens, int num_seqs, int num_heads, int kv_heads, int head_dim,
                               int block_size, int max_blocks_per_seq, int max_seq_len, int window, float scale,
                               const float* k_scale, const float* v_scale, qs_dtype dtype, qs_dtype kv_dtype,
                               void* workspace, size_t workspace_bytes, void* stream);

// Packed paged attention with ONNX Runtime com.microsoft.PagedAttention semantics (what the TensorRT plugin
// runs): qkv [num_tokens, (num_heads + 2 * kv_heads) * head_dim] packed per token; rotary (half rotation)
// with cos/sin [max_position, head_dim / 2] (dtype) at position past_seqlens[b] + index in the sequence;
// K/V written to the cache (dtype) at slot_mapping (int32, -1 skips); causal attention over cached + new
// keys → out [num_tokens, num_heads * head_dim]. max_seq_len bounds past + new of every sequence (trusted).
QS_API size_t qs_packed_attention_workspace_size(int num_tokens, int num_seqs, int num_heads, int head_dim,
                                                 int max_seq_len);
QS_API int qs_packed_paged_attention(void* out, const void* qkv, void* k_cache, void* v_cache,
                                     const int32_t* cu_seqlens_q, const int32_t* past_seqlens,
                                     const int32_t* block_tables, const int32_t* slot_mapping, const void* cos_cache,
                                     const void* sin_cache, int num_tokens, int num_seqs, int num_heads, int kv_heads,
                                     int head_dim, int block_size, int max_blocks_per_seq, int max_seq_len,
                                     int window, float scale, qs_dtype dtype, void* workspace,
                                     size_t workspace_bytes, void* stream);

// KV append: write new K/V [num_tokens, kv_heads, head_dim] (dtype) into the cache at slot_mapping
// [num_tokens] (int64; -1 skips). With kv_dtype FP8_E4M3 the values are divided by *k_scale / *v_scale
// and saturated to e4m3.
QS_API int qs_kv_append(const void* key, const void* value, void* k_cache, void* v_cache, const int64_t* slot_mapping,
                 int num_tokens, int kv_heads, int head_dim, qs_dtype dtype, qs_dtype kv_dtype,
                 const float* k_scale, const float* v_scale, void* stream);

// residual += x (when x is not NULL); out = residual / rms(residual) * weight.   [rows, hidden], dtype.
QS_API int qs_rmsnorm_residual(void* out, void* residual, const void* x, const void* weight, int rows, int hidden,
                        float eps, qs_dtype dtype, void* stream);

// Rotary embedding in place (half-rotation, as Llama): q [num_tokens, num_heads, head_dim],
// k [num_tokens, kv_heads, head_dim] (NULL to skip), positions int32 [num_tokens],
// cos/sin float [max_position, rotary_dim / 2]. Channels past rotary_dim are left as they are.
QS_API int qs_rotary(void* q, void* k, const int32_t* positions, const float* cos_cache, const float* sin_cache,
              int num_tokens, int num_heads, int kv_heads, int head_dim, int rotary_dim, qs_dtype dtype,
              void* stream);

#ifdef __cplusplus
}
#endif
