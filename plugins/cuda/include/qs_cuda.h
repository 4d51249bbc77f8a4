// C API of Quicksilver's CUDA kernels (paged KV cache). All pointers are device pointers.
//
// Paged KV layout: cache [num_blocks, block_size, kv_heads, head_dim], one tensor for K and one for V.
// A token's slot is block_id * block_size + offset; slot -1 means "do not write" (padding).
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { QS_DTYPE_F32 = 0, QS_DTYPE_F16 = 1, QS_DTYPE_BF16 = 2 } qs_dtype;

// Write new K/V [num_tokens, kv_heads, head_dim] into the paged cache at slot_mapping [num_tokens].
// Returns a cudaError_t value (0 on success).
int qs_kv_append(const void* key, const void* value, void* k_cache, void* v_cache,
                 const int64_t* slot_mapping, int num_tokens, int kv_heads, int head_dim,
                 int block_size, qs_dtype dtype, void* stream);

#ifdef __cplusplus
}
#endif
