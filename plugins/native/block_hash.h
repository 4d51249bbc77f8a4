// Chained block hash for automatic prefix caching.
//
// key(block i) = H(key(block i-1), token ids of block i): a block's key identifies the whole prefix up
// to and including it, so equal keys mean reusable KV (the cache also compares the stored tokens on a
// hit, so a 64-bit collision can never return wrong KV). Must match runtime/kv/hashing.py bit for bit.
#pragma once
#include <cstddef>
#include <cstdint>

namespace qs {

constexpr uint64_t kHashSeed = 0x51ED270B27A3B4C5ull;

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Hash of one block of `n` token ids chained onto `parent` (0 for the first block).
inline uint64_t hash_block(uint64_t parent, const int64_t* tokens, size_t n) {
  uint64_t h = splitmix64(parent ^ kHashSeed) ^ (static_cast<uint64_t>(n) * 0x9E3779B97F4A7C15ull);
  for (size_t i = 0; i < n; ++i) h = splitmix64(h ^ static_cast<uint32_t>(tokens[i]));
  return h;
}

// Keys of the full blocks of `tokens` [num_tokens]: out [num_tokens / block_size].
inline void hash_blocks(uint64_t parent, const int64_t* tokens, size_t num_tokens, size_t block_size,
                        uint64_t* out) {
  const size_t full = num_tokens / block_size;
  for (size_t b = 0; b < full; ++b) parent = out[b] = hash_block(parent, tokens + b * block_size, block_size);
}

}  // namespace qs
