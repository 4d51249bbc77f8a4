// qs.CausalAttention: causal self-attention over a static KV cache for the cpu engines, an ONNX Runtime custom op.
//
// It takes what com.microsoft.GroupQueryAttention takes in our cpu graphs (packed QKV, the past ≡ present static
// cache [B, kv_heads, max_len, head_dim], seqlens_k, rotary tables) and means the same: rotate the new tokens'
// q and k at positions total - S + s, write k/v into the cache at those rows, attend causally (optionally within a
// local window: the query and the `local_window_size` - 1 keys before it, as GroupQueryAttention does), and write
// [B, S, heads·head_dim].
//
// Why our own: ORT's CPU kernel runs every (row, head) as a GEMM with M = S, which for a decode step (M = 1)
// reads ~6 GB/s of KV; over 30 layers and a few hundred tokens of context that was a third of a smollm2 decode
// step, and at batch 8 most of it. Here every query row is one task: its dots against the keys in one pass, a
// vectorised softmax, and the weighted sum of values, each with a fixed order of operations, so a row's result
// does not depend on the batch it is in, the chunk it was prefilled in or the thread that ran it (prefix-cache
// hits, chunked prefill and batched decoding give bitwise the same attention).
//
// A row's keys are taken in segments of kSegment from its first key: each segment's softmax is computed against
// its own max, and the segments' partial sums are combined in segment order (as flash-decoding does). Every
// path computes a row this way, so the bits do not depend on the path; what the segments buy is a split of a
// long context across threads where a step has too few rows to keep both cores reading KV (batch-1 decode had
// 3 KV heads for 2 threads and read the cache at ~10 GB/s of this machine's ~20).
//
// The cache holds float32, or IEEE half (engines built with --kv-cache fp16: the op is registered for both
// element types). A decode step's attention streams the whole cache, so half storage reads half the bytes; keys
// and values are widened to float32 as they are loaded and every sum stays in float32.

#include "ops.h"

#include <algorithm>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

namespace {

constexpr int kLanes = 16;   // softmax reductions in 16 independent lanes

// How far ahead the KV cache is asked for. The cache lies on 4 KiB pages (unless serve --kv-huge-pages grows a long
// sequence by huge ones, runtime/backends/cpu/slots.py), where the linears' 16 KiB (ops.h, measured on huge-page
// weights) ran a decode group's keys and values from memory at 27.7 ns a key (qwen2.5-0.5b's 7 heads × 64) and 68.1
// (1.5b's 6 × 128); 2.5 KiB took 0.86× and 0.79× the time, the same bits (tools/bench_attention_cycles.py, Intel
// Xeon SPR). On huge pages 2.5 KiB is still the best (4–16 KiB 1.04–1.19× slower).
constexpr int64_t kKvStreamAhead = 2560;
inline void qs_kv_ahead(const void* data, size_t bytes = 1) { qs_stream_ahead(data, bytes, kKvStreamAhead); }

using half_t = uint16_t;     // IEEE binary16 bits (--kv-cache fp16)

// float32 <-> half, round to nearest even (what F16C and numpy do), so a cache written here equals numpy's
// float16 of the same float32 values.
inline float to_float(float x) { return x; }
inline float to_float(half_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits;
  if (exp == 0x1f) bits = sign | 0x7f800000u | (man << 13);                    // inf, nan
  else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);               // normal
  else if (!man) bits = sign;                                                  // zero
  else {                                                                       // subnormal: normalise
    int e = -1;
    do { man <<= 1; ++e; } while (!(man & 0x400u));
    bits = sign | ((112 - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}
inline half_t to_half(float f) {
#ifdef __F16C__
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
  if (a >= 0x7f800000u) return static_cast<half_t>(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0));
  if (a >= 0x477ff000u) return static_cast<half_t>(sign | 0x7c00u);           // rounds past 65504: inf
  if (a < 0x38800000u) {                                                       // subnormal or zero
    float m;
    std::memcpy(&m, &a, sizeof m);
    return static_cast<half_t>(sign | static_cast<uint32_t>(std::nearbyint(m * 16777216.0f)));
  }
  uint32_t r = a + 0x0fffu + ((a >> 13) & 1u);                                 // round to nearest even
  return static_cast<half_t>(sign | ((r - 0x38000000u) >> 13));
#endif
}

// Keeps a vector that several rows' FMAs share in a register. GCC otherwise folds its load into each of those FMAs:
// one 512-bit load per FMA, and Zen 4 takes one such load a cycle, so the loads set the pace. Pinned: a 4,096-token
// prompt slice's attention on 3,704 cached tokens (smollm2's heads) took 0.89x the time, with the same bits
// (AMD EPYC Zen 4). Groups of four rows instead of two were slower (1.25x for the scores, 1.0x for the values).
template <typename V>
inline void in_register([[maybe_unused]] V& v) {
#if defined(__GNUC__) && defined(__AVX512F__)
  asm("" : "+v"(v));
#endif
}

// One cache row of n values from float32.
inline void store_row(const float* src, int64_t n, float* dst) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(const float* src, int64_t n, half_t* dst) {
  int64_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) dst[i] = to_half(src[i]);
}

#ifdef __AVX2__
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const half_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif

// Scores of one query row against 8 consecutive keys: lane partial sums over d (one FMA chain per lane), then a
// fixed pairwise tree per key, so a key's score is the same whichever block it falls in.
template <int D, typename T>
inline void dot8(const float* __restrict q, const T* __restrict k, float* __restrict out) {
#ifdef __AVX2__
  __m256 a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
  for (int d = 0; d < D; d += 8) {
    __m256 qv = _mm256_loadu_ps(q + d);
    for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, load8(k + i * D + d), a[i]);
  }
  __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
#else
  for (int i = 0; i < 8; ++i) {
    float a[8] = {};
    for (int d = 0; d < D; d += 8)
      for (int l = 0; l < 8; ++l) a[l] = std::fma(q[d + l], to_float(k[i * D + d + l]), a[l]);
    out[i] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
  }
#endif
}

#ifdef __AVX512F__
// The same scores as dot8, two keys to a 512-bit register: a block of 8 keys packed once per tile (pack8), then
// one or two rows at a time against it (two rows: twice the FMA chains in flight). Lane l of key i still sums
// q[d]·k[d] over d ≡ l (mod 8) in d order, and the lanes of a key are added by the same pairwise tree, so a
// score has the same bits on either path.
//
// It also asks for the block kKvStreamAhead bytes on (qs_kv_ahead), a line whenever its steps reach a new one:
// spread out, the asks no longer stall on a full miss queue as a block's 16 at once did.
template <int D, typename T>
inline void pack8(const T* __restrict k, float* __restrict dst) {
  for (int j = 0; j < 4; ++j)
    for (int c = 0; c < D / 8; ++c) {
      const size_t at = static_cast<size_t>(c) * 16 * sizeof(T);     // step c's share of keys 2j, 2j + 1's bytes
      if (at % 64 == 0) qs_kv_ahead(reinterpret_cast<const char*>(k + 2 * j * D) + at);
      _mm512_store_ps(dst + (j * (D / 8) + c) * 16,
                      _mm512_insertf32x8(_mm512_castps256_ps512(load8(k + (2 * j) * D + 8 * c)),
                                         load8(k + (2 * j + 1) * D + 8 * c), 1));
    }
}

// vhaddps within each 128-bit lane: [a0+a1, a2+a3, b0+b1, b2+b3]
inline __m512 hadd512(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

// acc j holds keys 2j (low 256 bits) and 2j + 1 (high): per key ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)), as dot8
inline void store_scores(const __m512* a, float* out) {
  __m512 u = hadd512(hadd512(a[0], a[1]), hadd512(a[2], a[3]));
  __m512 v = _mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, 0xB1));
  __m512 order = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0), v);
  _mm256_storeu_ps(out, _mm512_castps512_ps256(order));
}

template <int D, int R>
inline void dot8_packed(const float* const* q, const float* __restrict packed, float* const* out) {
  __m512 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = _mm512_setzero_ps();
  for (int c = 0; c < D / 8; ++c) {
    __m512 qq[R];
    for (int r = 0; r < R; ++r) qq[r] = _mm512_broadcast_f32x8(_mm256_loadu_ps(q[r] + 8 * c));
    for (int j = 0; j < 4; ++j) {
      __m512 kk = _mm512_load_ps(packed + (j * (D / 8) + c) * 16);
      if constexpr (R > 1) in_register(kk);
      for (int r = 0; r < R; ++r) a[r][j] = _mm512_fmadd_ps(qq[r], kk, a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) store_scores(a[r], out[r]);
}
#endif

// acc_r[0:D] += Σ_k p_r[k] · v[k, 0:D] for R rows over the same n values, in key order, in registers: each lane d
// of a row is one FMA chain over the keys whatever the vector width, so a row's sums do not depend on R or on the
// path. Two rows keep twice the chains in flight (one row's D/16 leave the FMA units waiting on their latency).
template <int D, int R, typename T>
inline void accumulate(const float* const* p, const T* __restrict v, int n, float* const* acc) {
#ifdef __AVX512F__
  if constexpr (std::is_same_v<T, float> && D % 16 == 0) {
    __m512 a[R][D / 16];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < D / 16; ++i) a[r][i] = _mm512_loadu_ps(acc[r] + i * 16);
    for (int k = 0; k < n; ++k) {
      __m512 pk[R];
      for (int r = 0; r < R; ++r) pk[r] = _mm512_set1_ps(p[r][k]);
      for (int i = 0; i < D / 16; ++i) {
        __m512 vk = _mm512_loadu_ps(v + k * D + i * 16);
        if constexpr (R > 1) in_register(vk);
        for (int r = 0; r < R; ++r) a[r][i] = _mm512_fmadd_ps(pk[r], vk, a[r][i]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < D / 16; ++i) _mm512_storeu_ps(acc[r] + i * 16, a[r][i]);
    return;
  }
#endif
  for (int r = 0; r < R; ++r) {
#ifdef __AVX2__
    __m256 a[D / 8];
    for (int i = 0; i < D / 8; ++i) a[i] = _mm256_loadu_ps(acc[r] + i * 8);
    for (int k = 0; k < n; ++k) {
      __m256 pk = _mm256_set1_ps(p[r][k]);
      for (int i = 0; i < D / 8; ++i) a[i] = _mm256_fmadd_ps(pk, load8(v + k * D + i * 8), a[i]);
    }
    for (int i = 0; i < D / 8; ++i) _mm256_storeu_ps(acc[r] + i * 8, a[i]);
#else
    for (int k = 0; k < n; ++k)
      for (int d = 0; d < D; ++d) acc[r][d] = std::fma(p[r][k], to_float(v[k * D + d]), acc[r][d]);
#endif
  }
}

constexpr int kMaxGroupRows = 8;   // the most query heads a KV head has in the models we build

// f(std::integral_constant<int, rows>{}), the kernel compiled for that many rows; false for rows outside
// 1..kMaxGroupRows.
template <class F>
inline bool with_rows(int rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); return true;
    case 2: f(std::integral_constant<int, 2>{}); return true;
    case 3: f(std::integral_constant<int, 3>{}); return true;
    case 4: f(std::integral_constant<int, 4>{}); return true;
    case 5: f(std::integral_constant<int, 5>{}); return true;
    case 6: f(std::integral_constant<int, 6>{}); return true;
    case 7: f(std::integral_constant<int, 7>{}); return true;
    case 8: f(std::integral_constant<int, 8>{}); return true;
    default: return false;
  }
}

#ifdef __AVX512F__
// Vectors of a row that one pass of accumulate_rows keeps in registers: R rows' chunks, at most 28 of the 32.
constexpr int chunk_vectors(int vectors, int rows) {
  int c = vectors;
  while (c > 1 && (rows * c > 28 || vectors % c)) --c;
  return c;
}

// accumulate's sums for R rows that all take the same n half values (the query heads of one KV head in a decode
// step): each 16-value vector is widened once in a register and taken by every row, with no float copy of the
// block, and the rows' accumulators stay in registers across the keys. A row's lanes are independent FMA chains
// over the keys in key order, as in accumulate, so taking them in chunks (what fits in registers) changes no bit.
// The values are asked for kKvStreamAhead bytes on a key at a time (a block's 64 asks at once stalled on the miss
// queue: 12 % of a decode step's attention at 8k tokens).
template <int D, int R>
inline void accumulate_rows(const float* const* p, const half_t* __restrict v, int n, float* const* acc) {
  constexpr int V = D / 16, C = chunk_vectors(V, R);
  for (int i0 = 0; i0 < V; i0 += C) {
    __m512 a[R][C];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < C; ++i) a[r][i] = _mm512_loadu_ps(acc[r] + (i0 + i) * 16);
    for (int k = 0; k < n; ++k) {
      if (i0 == 0) qs_kv_ahead(v + k * D, sizeof(half_t) * D);
      for (int i = 0; i < C; ++i) {
        __m512 vk = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + k * D + (i0 + i) * 16)));
        for (int r = 0; r < R; ++r) a[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(p[r][k]), vk, a[r][i]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < C; ++i) _mm512_storeu_ps(acc[r] + (i0 + i) * 16, a[r][i]);
  }
}

#endif

// n cache elements as float32: float ones as they are, half ones widened into `buf` (exactly, so arithmetic on
// the copy equals arithmetic on the elements converted one by one).
template <typename T>
inline const float* as_float(const T* __restrict src, int n, float* __restrict buf) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    int i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(buf + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#endif
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
    for (; i < n; ++i) buf[i] = to_float(src[i]);
    return buf;
  }
}

// one(r) or two(r0, r1) for each row r < rows that `takes`, two consecutive ones together where `pair` allows.
template <class Takes, class Pair, class One, class Two>
inline void in_pairs(int rows, Takes takes, Pair pair, One one, Two two) {
  int pending = -1;
  for (int r = 0; r < rows; ++r) {
    if (!takes(r)) continue;
    if (pending < 0) {
      pending = r;
    } else if (pair(pending, r)) {
      two(pending, r);
      pending = -1;
    } else {
      one(pending);
      pending = r;
    }
  }
  if (pending >= 0) one(pending);
}

// GQA's rotary (rotary_interleaved = 0): x[i], x[i + D/2] rotated by the angle of (pos, i).
inline void rotate(const float* __restrict x, const float* __restrict cos, const float* __restrict sin,
                   int head_dim, float scale, float* __restrict out) {
  int half = head_dim / 2;
  for (int i = 0; i < half; ++i) {
    float x1 = x[i], x2 = x[i + half];
    out[i] = (x1 * cos[i] - x2 * sin[i]) * scale;
    out[i + half] = (x2 * cos[i] + x1 * sin[i]) * scale;
  }
}

template <typename T>
struct Step {
  const float* qkv;
  T* keys;             // present key cache [B, kv_heads, capacity, D]
  T* values;
  const int32_t* seqlens_k;
  const float* cos;    // [max_pos, D/2]
  const float* sin;
  float* out;          // [B, S, heads·D]
  // Packed steps (inputs 7 and 8): sequence b's tokens are query_starts[b] … query_starts[b + 1] − 1 of the
  // flattened qkv (and out), and its KV is cache row kv_rows[b]; batch counts sequences and seq is the longest's
  // tokens. Null: right-padded rows, row b's tokens b·seq … and its KV row b.
  const int32_t* query_starts;
  const int32_t* kv_rows;
  int64_t batch, seq, heads, kv_heads, head_dim, capacity, max_pos, window, tile, heads_per_task;
  float scale;
  bool bf16;           // bf16 products (half caches; attend_tile_bf16)
  bool split;          // few rows, long context: one task per (b, KV head, run of segments of keys)
  int segs;            // the most segments a row of this step has
  int run;             // split: the consecutive segments one task takes
  struct Partials* shared;   // split: every row's partials
  int* runs_done;            // split: per (b, KV head), the runs finished (the last one combines the group's rows)

  int64_t total(int64_t b) const { return static_cast<int64_t>(seqlens_k[b]) + 1; }
  // query tokens of sequence b this step (its slots in a padded row: seq)
  int64_t queries(int64_t b) const { return query_starts ? query_starts[b + 1] - query_starts[b] : seq; }
  int64_t past(int64_t b) const { return std::max<int64_t>(0, total(b) - queries(b)); }
  // index of query token s of sequence b in the flattened qkv and out
  int64_t at(int64_t b, int64_t s) const { return query_starts ? query_starts[b] + s : b * seq + s; }
  // the first key the query at `pos` attends to (0, or the start of its local window)
  int64_t first_key(int64_t pos) const { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }
  const float* token(int64_t b, int64_t s) const { return qkv + at(b, s) * (heads + 2 * kv_heads) * head_dim; }
  T* cache(T* base, int64_t b, int64_t kvh, int64_t pos) const {
    int64_t row = kv_rows ? kv_rows[b] : b;
    return base + ((row * kv_heads + kvh) * capacity + pos) * head_dim;
  }
};

// Phase 1, one task per (b, s): rotate k and write k, v at the token's position (padding rows write nothing).
template <typename T>
void write_kv(void* user, size_t task) {
  const Step<T>& st = *static_cast<const Step<T>*>(user);
  int64_t b = task / st.seq, s = task % st.seq, pos = st.past(b) + s;
  if (pos >= st.total(b)) return;
  const float* tok = st.token(b, s);
  const float* cos = st.cos + pos * (st.head_dim / 2);
  const float* sin = st.sin + pos * (st.head_dim / 2);
  for (int64_t h = 0; h < st.kv_heads; ++h) {
    const float* k = tok + (st.heads + h) * st.head_dim;
    const float* v = tok + (st.heads + st.kv_heads + h) * st.head_dim;
    float rotated[128];                         // head_dim <= 128: attention_for refused the rest
    rotate(k, cos, sin, static_cast<int>(st.head_dim), 1.0f, rotated);
    store_row(rotated, st.head_dim, st.cache(st.keys, b, h, pos));
    store_row(v, st.head_dim, st.cache(st.values, b, h, pos));
  }
}

constexpr int kTile = 16;       // query tokens per prefill task (× the heads sharing a KV head)
constexpr int kValueBlock = 32; // keys whose values stay in L1 while every row of a tile takes them
constexpr int kSegment = 128;   // keys per softmax segment (a multiple of kValueBlock)
constexpr int kMinSharedRows = 4;    // rows of a task that make copying a block of keys or values as float32 pay
constexpr int kMinGroupedTasks = 8;  // fewer (b, KV head, tile) tasks than this: one task per head, or split keys
constexpr int kRunsPerGroup = 2;     // split keys: the runs of consecutive segments a group's keys are taken in

inline int segments_of(int len) { return (len + kSegment - 1) / kSegment; }

// The segments of the row of query token s of batch row b (0 for a padding token): the partials combine reads.
template <typename T>
int row_segments(const Step<T>& st, int64_t b, int64_t s) {
  int64_t pos = st.past(b) + s;
  return pos < st.total(b) ? segments_of(static_cast<int>(pos + 1 - st.first_key(pos))) : 0;
}

// exp(x) of a softmax argument (x ≤ 0 after the max is subtracted): qs_exp_inplace's Cody-Waite reduction and
// degree-6 polynomial (ops.h, ~1 ulp) with every multiply-add fused and the power of two applied by an exact
// scaling, written out so that the AVX-512 path (one register at a time, a masked tail) and the scalar one give the
// same bits for every element wherever it falls in a row. Scaling by 2^k (vscalefps, ldexp) rounds p·2^k once, as
// the exponent-bits product did.
inline float softmax_exp(float x) {
  if (x != x) return x;            // NaN stays NaN (max_ps(-87, v) keeps its second operand)
  float v = std::max(x, -87.0f);
  float k = std::fma(v, kQsExpLog2e, kQsExpRound) - kQsExpRound;
  float r = std::fma(k, kQsExpLn2Lo, std::fma(-k, kQsExpLn2Hi, v));
  float p = kQsExpPoly[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, r, kQsExpPoly[i]);
  return std::ldexp(std::fma(p, r * r, r) + 1.0f, static_cast<int>(k));
}

#ifdef __AVX512F__
inline __m512 softmax_exp(__m512 x) {
  __m512 v = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
  __m512 k = _mm512_sub_ps(_mm512_fmadd_ps(v, _mm512_set1_ps(kQsExpLog2e), _mm512_set1_ps(kQsExpRound)),
                           _mm512_set1_ps(kQsExpRound));
  __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(kQsExpLn2Lo), _mm512_fnmadd_ps(k, _mm512_set1_ps(kQsExpLn2Hi), v));
  __m512 p = _mm512_set1_ps(kQsExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kQsExpPoly[i]));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, k);
}
#endif

// softmax numerators in place over n ≥ 1 scores: exp(score − max); returns max, and Σ exp(score − max) in *sum,
// folded over kLanes lanes (lane l: the numerators j ≡ l (mod kLanes) in j order) and the lanes added pairwise
// (l += l + w for w = 8, 4, 2, 1). One pass for the max, one for the numerators and their sum.
//
// The max's order is free: max is exact, ignores NaN scores on every path (max_ps keeps its second operand), and
// ±0 maxima differ only in the sign of a zero that is subtracted or exponentiated.
inline float softmax_unnormalised(float* scores, int n, float* sum) {
#ifdef __AVX512F__
  static_assert(kLanes == 16, "one 512-bit register of lanes");
  const int whole = n / kLanes * kLanes;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - whole)) - 1);
  __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0;
  int j = 0;
  for (; j + 2 * kLanes <= whole; j += 2 * kLanes) {
    m0 = _mm512_max_ps(_mm512_loadu_ps(scores + j), m0);
    m1 = _mm512_max_ps(_mm512_loadu_ps(scores + j + kLanes), m1);
  }
  if (j < whole) m0 = _mm512_max_ps(_mm512_loadu_ps(scores + j), m0);
  m1 = _mm512_mask_max_ps(m1, tail, _mm512_maskz_loadu_ps(tail, scores + whole), m1);
  const float m = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
  const __m512 mv = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (j = 0; j < whole; j += kLanes) {
    __m512 e = softmax_exp(_mm512_sub_ps(_mm512_loadu_ps(scores + j), mv));
    _mm512_storeu_ps(scores + j, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (tail) {
    __m512 e = softmax_exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, scores + whole), mv));
    _mm512_mask_storeu_ps(scores + whole, tail, e);
    acc = _mm512_mask_add_ps(acc, tail, acc, e);
  }
  __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  *sum = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
  return m;
#else
  float m = -INFINITY, lanes[kLanes] = {};
  for (int j = 0; j < n; ++j)
    if (scores[j] > m) m = scores[j];
  for (int j = 0; j < n; ++j) {
    scores[j] = softmax_exp(scores[j] - m);
    lanes[j % kLanes] += scores[j];
  }
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  *sum = lanes[0];
  return m;
#endif
}

// A row's partial results, one per segment: the segment's max score, Σ exp(score − max) and Σ exp(score − max)·v.
struct Partials {
  std::vector<float> max, sum, acc;   // [rows · segs], [rows · segs], [rows · segs · D]
  int segs = 0;
  // Sized, not cleared: a task writes the entries of the segments its rows have (their sums of values zeroed as
  // each segment starts) and only those are read (clearing all of them was 2.3 MB a layer for a 16-token step
  // over 8k keys).
  void reset(int rows, int per_row, int head_dim) {
    segs = per_row;
    max.resize(static_cast<size_t>(rows) * segs);
    sum.resize(static_cast<size_t>(rows) * segs);
    acc.resize(static_cast<size_t>(rows) * segs * head_dim);
  }
};

// A row's output from its n segments' partials, in segment order: Σ_k w_k·acc_k / Σ_k w_k·sum_k, w_k =
// exp(max_k − max). With one segment (w = 1 exactly) that is acc / sum as a single softmax gives.
template <int D>
inline void combine(const float* max, const float* sum, const float* acc, int n, float* out) {
  if (n == 0) {
    std::fill(out, out + D, 0.0f);
    return;
  }
  float top = max[0];
  for (int k = 1; k < n; ++k) top = std::max(top, max[k]);
  thread_local std::vector<float> w;
  w.resize(n);
  for (int k = 0; k < n; ++k) w[k] = max[k] - top;
  qs_exp_inplace(w.data(), n);
  float total = 0.0f, num[D] = {};
  for (int k = 0; k < n; ++k) {
    total += w[k] * sum[k];
    for (int d = 0; d < D; ++d) num[d] += w[k] * acc[k * D + d];
  }
  float inv = 1.0f / total;
  for (int d = 0; d < D; ++d) out[d] = num[d] * inv;
}

// The rows of a tile (query tokens s0, s0 + 1, … × heads h0 … h0 + nh − 1 of batch row b, token-major): each one's
// query rotated and scaled, its first key and how many keys it attends to (0 for right padding of a batched prompt).
// Rows that attend share their first key (0 without a window; under a window a task is one token, whose heads share
// its position): `first`.
struct TileRows {
  std::vector<float> q;     // [rows, D]
  std::vector<int> lo, len;
  int max_len = 0, first = 0;

  template <int D, typename T>
  void set(const Step<T>& st, int64_t b, int64_t s0, int64_t h0, int64_t nh, int rows) {
    q.resize(static_cast<size_t>(rows) * D);
    lo.assign(rows, 0);
    len.assign(rows, 0);
    max_len = first = 0;
    for (int r = 0; r < rows; ++r) {
      int64_t s = s0 + r / nh, h = h0 + r % nh, pos = st.past(b) + s;
      if (pos >= st.total(b)) continue;
      rotate(st.token(b, s) + h * D, st.cos + pos * (D / 2), st.sin + pos * (D / 2), D, st.scale,
             &q[static_cast<size_t>(r) * D]);
      lo[r] = first = static_cast<int>(st.first_key(pos));
      len[r] = static_cast<int>(pos + 1 - lo[r]);
      max_len = std::max(max_len, len[r]);
    }
  }
};

// One task: query tokens [s0, s0 + count) of batch row b, heads [h0, h0 + nh) (which read one KV head), segments
// [seg0, seg1) of each row's keys; partials of row r's segment k go to p at (row0 + r)·p.segs + k (p.segs ≥ seg1
// covers the rows' segments). The rows share each block of keys and values while it is in L1; each row's arithmetic (its
// dots, each segment's softmax, and the sums of values in key order) is the same as if it were alone, so results
// do not depend on the tiling.
//
// Segment by segment, each whole (its scores, its softmax, its values) before the next: a segment's scores stay
// in L1, where whole rows' scores (a prompt tile's 48 rows over 8k keys: 1.5 MB) went out to L2 and L3 and back
// for each pass. Every score, softmax and sum is the same arithmetic in the same order either way.
template <int D, typename T>
void attend_tile(const Step<T>& st, int64_t b, int64_t s0, int64_t count, int64_t h0, int64_t nh, int seg0, int seg1,
                 Partials& p, int64_t row0 = 0) {
  const int64_t kvh = h0 / (st.heads / st.kv_heads);
  const int rows = static_cast<int>(count * nh);
  constexpr int stride = kSegment;                // a row's scores of one segment
  thread_local std::vector<float> scores;
  thread_local TileRows tile;
  scores.resize(static_cast<size_t>(rows) * stride);
  tile.set<D>(st, b, s0, h0, nh, rows);
  const float* qbuf = tile.q.data();
  const int *lo = tile.lo.data(), *len = tile.len.data();
  const int max_len = tile.max_len, first = tile.first;
  const T* keys = st.cache(st.keys, b, kvh, 0);
  const T* values = st.cache(st.values, b, kvh, 0);
  // Half keys and values are widened once per block for all the tile's rows (converting them row by row bound the
  // loops), unless the rows are few: a decode task's (the heads of one KV group) read each block once or twice,
  // so a copy only adds to the reads and they take the cache as it is (the same arithmetic either way).
  const bool share = rows >= kMinSharedRows;
  alignas(64) float wide[kValueBlock * D];
  alignas(64) T tail[8 * D];
  for (int seg = seg0; seg < seg1; ++seg) {
    // this segment's keys [k_begin, k_end) after each row's first key; scores[r·stride + j] is key k_begin + j's
    const int k_begin = seg * kSegment, k_end = std::min(max_len, (seg + 1) * kSegment);
    if (k_begin >= k_end) break;
    auto score = [&](int r, int k) { return &scores[static_cast<size_t>(r) * stride + (k - k_begin)]; };
    // scores: blocks of 8 keys; a block is taken by every row that covers it fully, and each row's last partial
    // block is scored against a zero-padded copy (a block never straddles a segment).
    for (int r = 0; r < rows; ++r) {
      int full = len[r] / 8 * 8;
      if (full < len[r] && full >= k_begin && full < k_end) {
        std::memset(tail, 0, sizeof tail);
        std::memcpy(tail, keys + static_cast<int64_t>(lo[r] + full) * D, sizeof(T) * D * (len[r] - full));
        dot8<D>(&qbuf[r * D], tail, score(r, full));
      }
    }
    for (int k = k_begin; k < k_end; k += 8) {
      const T* block = keys + static_cast<int64_t>(first + k) * D;
      auto covers = [&](int r) { return k + 8 <= len[r] / 8 * 8; };
      if (!share) {
        qs_kv_ahead(block, sizeof(T) * 8 * D);  // a task reads its keys once: ask ahead (pack8 asks below)
        for (int r = 0; r < rows; ++r)
          if (covers(r)) dot8<D>(&qbuf[r * D], block, score(r, k));
        continue;
      }
      if (k + 8 > max_len / 8 * 8) continue;      // no row covers the block (its keys may run past the cache)
#ifdef __AVX512F__
      pack8<D>(block, wide);
      in_pairs(rows, covers, [](int, int) { return true; },
               [&](int r) {
                 const float* q[1] = {&qbuf[r * D]};
                 float* o[1] = {score(r, k)};
                 dot8_packed<D, 1>(q, wide, o);
               },
               [&](int r0, int r1) {
                 const float* q[2] = {&qbuf[r0 * D], &qbuf[r1 * D]};
                 float* o[2] = {score(r0, k), score(r1, k)};
                 dot8_packed<D, 2>(q, wide, o);
               });
#else
      const float* widened = as_float(block, 8 * D, wide);
      for (int r = 0; r < rows; ++r)
        if (covers(r)) dot8<D>(&qbuf[r * D], widened, score(r, k));
#endif
    }
    for (int r = 0; r < rows; ++r) {
      if (seg >= segments_of(len[r])) continue;
      int n = std::min(kSegment, len[r] - k_begin);
      size_t at = static_cast<size_t>(row0 + r) * p.segs + seg;
      p.max[at] = softmax_unnormalised(score(r, k_begin), n, &p.sum[at]);
      std::fill_n(&p.acc[at * D], D, 0.0f);     // the values below add into it
    }
    // values: blocks of kValueBlock keys, each row adds its share in key order to its segment's sum (rows of equal
    // shares two at a time, sharing each value load)
    for (int k = k_begin; k < k_end; k += kValueBlock) {
      auto count = [&](int r) { return std::min(k + kValueBlock, len[r]) - k; };
      auto sum = [&](int r) { return &p.acc[(static_cast<size_t>(row0 + r) * p.segs + seg) * D]; };
      const T* block = values + static_cast<int64_t>(first + k) * D;
      auto one = [&](const auto* v, int r) {
        const float* s[1] = {score(r, k)};
        float* a[1] = {sum(r)};
        accumulate<D, 1>(s, v, count(r), a);
      };
#ifdef __AVX512F__
      // one token's heads (a decode step's rows) over a half cache, each taking the whole block: in registers,
      // asking as they go
      if constexpr (std::is_same_v<T, half_t> && D % 16 == 0) {
        bool same = rows <= kMaxGroupRows && count(0) > 0;
        const float* s[kMaxGroupRows];
        float* a[kMaxGroupRows];
        for (int r = 0; same && r < rows; ++r) s[r] = score(r, k), a[r] = sum(r), same = count(r) == count(0);
        if (same && rows > 1 &&
            with_rows(rows, [&](auto r) { accumulate_rows<D, decltype(r)::value>(s, block, count(0), a); }))
          continue;
      }
#endif
      qs_kv_ahead(block, sizeof(T) * kValueBlock * D);    // and its values
      if (!share) {
        for (int r = 0; r < rows; ++r)
          if (count(r) > 0) one(block, r);
        continue;
      }
      const float* widened = as_float(block, std::min(kValueBlock, max_len - k) * D, wide);
      in_pairs(rows, [&](int r) { return count(r) > 0; }, [&](int r0, int r1) { return count(r0) == count(r1); },
               [&](int r) { one(widened, r); },
               [&](int r0, int r1) {
                 const float* s[2] = {score(r0, k), score(r1, k)};
                 float* a[2] = {sum(r0), sum(r1)};
                 accumulate<D, 2>(s, widened, count(r0), a);
               });
    }
  }
}

// bf16 products (attribute bf16_products = 1, over a half cache): keys, values, queries and probabilities are
// rounded to bfloat16 as they are loaded and multiplied in pairs with float32 sums (vdpbf16ps: 32 products an
// instruction where vfmadd231ps takes 16). Why: a long prompt's attention is bound by its arithmetic (every row of
// a tile against every key), and halving the multiplies took an 8,000-token prefill to 0.76–0.82× the time and a
// 48-token chunk after it to 0.69–0.72× (smollm2, qwen2.5-0.5b; AMD EPYC Zen 4); a decode step's attention gained
// less, 0.93× at 8,192 tokens (its packing, score trees and softmax stay: tools/bench_attention_cycles.py). The cost
// is precision: a bf16 has 8 significant bits where a half has 11 (llama.cpp's bf16 KV cache computes the same
// way). A row's arithmetic is still fixed whatever the path: a key's score is its 8 lanes (lane l sums
// the pairs of dimensions 16c + 2l, 16c + 2l + 1 over c in order) added by store_scores' tree; a row's values are
// taken in pairs of keys (0, 1), (2, 3), … from its first key, its last key paired with zero when it has an odd
// number, each lane d one chain over the pairs in order.
using bf16_t = uint16_t;

// 32 bf16: keys 2j, 2j + 1 of a block at 16 dimensions (pack_keys), or 16 dimensions of a pair of keys'
// values interleaved, (v[t][d], v[t + 1][d]) for 16 d (pack_values)
struct alignas(64) Chunk {
  bf16_t v[32];
};

#if defined(__AVX512BF16__)
inline __m512 widen16(const half_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// a's 16 halfs as bf16 in the low half of the result, b's in the high half
inline __m512i bf16_rows(__m512 a, __m512 b) { return (__m512i)_mm512_cvtne2ps_pbh(b, a); }

inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
#else
// float32 → bf16 rounded to nearest even (a NaN stays a NaN), and back
inline bf16_t to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_t>((x >> 16) | 0x40u);
  return static_cast<bf16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
inline float from_bf16(bf16_t h) {
  uint32_t x = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}
// one lane of vdpbf16ps: acc + a0·b0 + a1·b1 (each product exact in float32)
inline float dot_pair(float acc, bf16_t a0, bf16_t a1, bf16_t b0, bf16_t b1) {
  return (acc + from_bf16(a0) * from_bf16(b0)) + from_bf16(a1) * from_bf16(b1);
}
#endif

// n ≤ 128 floats (n a multiple of 16) → bf16
inline void round_bf16(const float* x, int n, bf16_t* out) {
#if defined(__AVX512BF16__)
  for (int i = 0; i < n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
#else
  for (int i = 0; i < n; ++i) out[i] = to_bf16(x[i]);
#endif
}

// A segment's n probabilities as bf16 pairs (p[2m] low, p[2m + 1] high), zero past n.
inline void probability_pairs(const float* p, int n, uint32_t* pairs) {
#if defined(__AVX512BF16__)
  for (int i = 0; i < n; i += 32) {
    const int left = n - i;
    const __mmask16 m0 = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
    const __mmask16 m1 = left >= 32 ? 0xffff : left <= 16 ? 0 : static_cast<__mmask16>((1u << (left - 16)) - 1);
    _mm512_storeu_si512(pairs + i / 2, bf16_rows(_mm512_maskz_loadu_ps(m0, p + i), _mm512_maskz_loadu_ps(m1, p + i + 16)));
  }
#else
  for (int m = 0; 2 * m < n; ++m)
    pairs[m] = to_bf16(p[2 * m]) | (2 * m + 1 < n ? static_cast<uint32_t>(to_bf16(p[2 * m + 1])) << 16 : 0u);
#endif
}

// 8 keys → 4·D/16 chunks, asking for the block kKvStreamAhead bytes on a line a chunk
template <int D>
inline void pack_keys(const half_t* __restrict k, Chunk* __restrict out) {
  for (int j = 0; j < 4; ++j)
    for (int c = 0; c < D / 16; ++c) {
      const int i = j * (D / 16) + c;
      qs_kv_ahead(reinterpret_cast<const char*>(k) + 64 * i);
      const half_t* a = k + (2 * j) * D + 16 * c;
      const half_t* b = a + D;
#if defined(__AVX512BF16__)
      _mm512_store_si512(out + i, bf16_rows(widen16(a), widen16(b)));
#else
      for (int e = 0; e < 16; ++e) out[i].v[e] = to_bf16(to_float(a[e])), out[i].v[16 + e] = to_bf16(to_float(b[e]));
#endif
    }
}

// R rows' scores against a packed block of 8 keys
template <int D, int R>
inline void dot_keys(const bf16_t* const* q, const Chunk* __restrict packed, float* const* out) {
#if defined(__AVX512BF16__)
  __m512 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = _mm512_setzero_ps();
  for (int c = 0; c < D / 16; ++c) {
    __m512i qq[R];
    for (int r = 0; r < R; ++r)
      qq[r] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + 16 * c)));
    for (int j = 0; j < 4; ++j) {
      __m512i kk = _mm512_load_si512(packed + j * (D / 16) + c);
      if constexpr (R > 1) in_register(kk);
      for (int r = 0; r < R; ++r) a[r][j] = dot_pairs(a[r][j], kk, qq[r]);
    }
  }
  for (int r = 0; r < R; ++r) store_scores(a[r], out[r]);
#else
  for (int r = 0; r < R; ++r)
    for (int key = 0; key < 8; ++key) {
      float lane[8] = {};
      for (int c = 0; c < D / 16; ++c) {
        const Chunk& ch = packed[(key / 2) * (D / 16) + c];
        for (int l = 0; l < 8; ++l) {
          const int e = 16 * (key % 2) + 2 * l;
          lane[l] = dot_pair(lane[l], ch.v[e], ch.v[e + 1], q[r][16 * c + 2 * l], q[r][16 * c + 2 * l + 1]);
        }
      }
      out[r][key] = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    }
#endif
}

// `pairs` pairs of value rows from v (a partner of zero where `last_alone`: the final pair is v's last row alone)
template <int D>
inline void pack_values(const half_t* __restrict v, int pairs, bool last_alone, Chunk* __restrict out) {
  for (int m = 0; m < pairs; ++m)
    for (int c = 0; c < D / 16; ++c) {
      const int i = m * (D / 16) + c;
      qs_kv_ahead(reinterpret_cast<const char*>(v) + 64 * i);
      const half_t* a = v + (2 * m) * D + 16 * c;
      const bool alone = last_alone && m == pairs - 1;
#if defined(__AVX512BF16__)
      const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                  23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
      const __m512 b = alone ? _mm512_setzero_ps() : widen16(a + D);
      _mm512_store_si512(out + i, _mm512_permutexvar_epi16(interleave, bf16_rows(widen16(a), b)));
#else
      for (int e = 0; e < 16; ++e)
        out[i].v[2 * e] = to_bf16(to_float(a[e])), out[i].v[2 * e + 1] = alone ? 0 : to_bf16(to_float(a[D + e]));
#endif
    }
}

// acc_r[0:D] += Σ_m the m-th pair of p_r · the m-th pair of values, for R rows over the same packed pairs
template <int D, int R>
inline void add_values(const uint32_t* const* p, const Chunk* __restrict packed, int pairs, float* const* acc) {
#if defined(__AVX512BF16__)
  constexpr int V = D / 16, C = chunk_vectors(V, R);
  for (int i0 = 0; i0 < V; i0 += C) {
    __m512 a[R][C];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < C; ++i) a[r][i] = _mm512_loadu_ps(acc[r] + (i0 + i) * 16);
    for (int m = 0; m < pairs; ++m) {
      __m512i pm[R];
      for (int r = 0; r < R; ++r) pm[r] = _mm512_set1_epi32(static_cast<int>(p[r][m]));
      for (int i = 0; i < C; ++i) {
        __m512i vv = _mm512_load_si512(packed + m * V + i0 + i);
        for (int r = 0; r < R; ++r) a[r][i] = dot_pairs(a[r][i], pm[r], vv);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < C; ++i) _mm512_storeu_ps(acc[r] + (i0 + i) * 16, a[r][i]);
  }
#else
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < pairs; ++m)
      for (int d = 0; d < D; ++d) {
        const Chunk& ch = packed[m * (D / 16) + d / 16];
        acc[r][d] = dot_pair(acc[r][d], static_cast<bf16_t>(p[r][m]), static_cast<bf16_t>(p[r][m] >> 16),
                             ch.v[2 * (d % 16)], ch.v[2 * (d % 16) + 1]);
      }
#endif
}

// attend_tile with bf16 products: the same tasks, segments, blocks and partials.
template <int D>
void attend_tile_bf16(const Step<half_t>& st, int64_t b, int64_t s0, int64_t count, int64_t h0, int64_t nh, int seg0,
                      int seg1, Partials& p, int64_t row0) {
  const int64_t kvh = h0 / (st.heads / st.kv_heads);
  const int rows = static_cast<int>(count * nh);
  constexpr int stride = kSegment, chunks = D / 16;
  thread_local std::vector<float> scores;
  thread_local std::vector<bf16_t> qbuf;
  thread_local std::vector<uint32_t> pairs;     // each row's probabilities of the segment, in bf16 pairs
  thread_local TileRows tile;
  scores.resize(static_cast<size_t>(rows) * stride);
  qbuf.resize(static_cast<size_t>(rows) * D);
  pairs.resize(static_cast<size_t>(rows) * stride / 2);
  tile.set<D>(st, b, s0, h0, nh, rows);
  for (int r = 0; r < rows; ++r) round_bf16(&tile.q[static_cast<size_t>(r) * D], D, &qbuf[static_cast<size_t>(r) * D]);
  const int *lo = tile.lo.data(), *len = tile.len.data();
  const int max_len = tile.max_len, first = tile.first;
  const half_t* keys = st.cache(st.keys, b, kvh, 0);
  const half_t* values = st.cache(st.values, b, kvh, 0);
  Chunk packed[std::max(4, kValueBlock / 2) * chunks], tail_pair[chunks];
  alignas(64) half_t tail[8 * D];
  for (int seg = seg0; seg < seg1; ++seg) {
    const int k_begin = seg * kSegment, k_end = std::min(max_len, (seg + 1) * kSegment);
    if (k_begin >= k_end) break;
    auto score = [&](int r, int k) { return &scores[static_cast<size_t>(r) * stride + (k - k_begin)]; };
    auto q = [&](int r) { return &qbuf[static_cast<size_t>(r) * D]; };
    for (int r = 0; r < rows; ++r) {
      int full = len[r] / 8 * 8;
      if (full < len[r] && full >= k_begin && full < k_end) {
        std::memset(tail, 0, sizeof tail);
        std::memcpy(tail, keys + static_cast<int64_t>(lo[r] + full) * D, sizeof(half_t) * D * (len[r] - full));
        pack_keys<D>(tail, packed);
        const bf16_t* qs[1] = {q(r)};
        float* o[1] = {score(r, full)};
        dot_keys<D, 1>(qs, packed, o);
      }
    }
    for (int k = k_begin; k < k_end; k += 8) {
      if (k + 8 > max_len / 8 * 8) continue;
      pack_keys<D>(keys + static_cast<int64_t>(first + k) * D, packed);
      in_pairs(rows, [&](int r) { return k + 8 <= len[r] / 8 * 8; }, [](int, int) { return true; },
               [&](int r) {
                 const bf16_t* qs[1] = {q(r)};
                 float* o[1] = {score(r, k)};
                 dot_keys<D, 1>(qs, packed, o);
               },
               [&](int r0, int r1) {
                 const bf16_t* qs[2] = {q(r0), q(r1)};
                 float* o[2] = {score(r0, k), score(r1, k)};
                 dot_keys<D, 2>(qs, packed, o);
               });
    }
    for (int r = 0; r < rows; ++r) {
      if (seg >= segments_of(len[r])) continue;
      int n = std::min(kSegment, len[r] - k_begin);
      size_t at = static_cast<size_t>(row0 + r) * p.segs + seg;
      p.max[at] = softmax_unnormalised(score(r, k_begin), n, &p.sum[at]);
      probability_pairs(score(r, k_begin), n, &pairs[static_cast<size_t>(r) * stride / 2]);
      std::fill_n(&p.acc[at * D], D, 0.0f);
    }
    for (int k = k_begin; k < k_end; k += kValueBlock) {
      auto count = [&](int r) { return std::min(k + kValueBlock, len[r]) - k; };
      auto sum = [&](int r) { return &p.acc[(static_cast<size_t>(row0 + r) * p.segs + seg) * D]; };
      auto pair_of = [&](int r) { return &pairs[static_cast<size_t>(r) * stride / 2 + (k - k_begin) / 2]; };
      const half_t* block = values + static_cast<int64_t>(first + k) * D;
      const int n = std::min(kValueBlock, max_len - k);
      pack_values<D>(block, n / 2, false, packed);
      // whole pairs: rows of equal counts together (all of a decode step's rows), then each odd row's last key
      bool same = rows <= kMaxGroupRows && count(0) > 0;
      for (int r = 1; same && r < rows; ++r) same = count(r) == count(0);
      if (same) {
        const uint32_t* ps[kMaxGroupRows];
        float* a[kMaxGroupRows];
        for (int r = 0; r < rows; ++r) ps[r] = pair_of(r), a[r] = sum(r);
        with_rows(rows, [&](auto r) { add_values<D, decltype(r)::value>(ps, packed, count(0) / 2, a); });
      } else {
        in_pairs(rows, [&](int r) { return count(r) > 1; }, [&](int r0, int r1) { return count(r0) / 2 == count(r1) / 2; },
                 [&](int r) {
                   const uint32_t* ps[1] = {pair_of(r)};
                   float* a[1] = {sum(r)};
                   add_values<D, 1>(ps, packed, count(r) / 2, a);
                 },
                 [&](int r0, int r1) {
                   const uint32_t* ps[2] = {pair_of(r0), pair_of(r1)};
                   float* a[2] = {sum(r0), sum(r1)};
                   add_values<D, 2>(ps, packed, count(r0) / 2, a);
                 });
      }
      for (int r = 0; r < rows; ++r) {
        if (count(r) <= 0 || count(r) % 2 == 0) continue;
        pack_values<D>(block + static_cast<int64_t>(count(r) - 1) * D, 1, true, tail_pair);
        const uint32_t* ps[1] = {pair_of(r) + count(r) / 2};
        float* a[1] = {sum(r)};
        add_values<D, 1>(ps, tail_pair, 1, a);
      }
    }
  }
}

#ifdef __AVX512F__
// attend_tile for one query token's heads over a half cache (a decode step's rows, every one with the same keys),
// its two streams read together: segment s's values are taken a block of 8 keys at a time between the blocks of
// segment s + 1's keys, where attend_tile reads a segment's keys and then its values. Why: a decode step streams
// its cache from memory, and one stream at a time kept too few of its lines in flight — on a 2-core Xeon (4 KiB
// pages) 7 rows × head size 64 took 27.7 ns a key from memory against 15.5 in L2, 20.5 with only the keys
// streaming; together 23–25 ns, and a qwen2.5-0.5b int4 decode step at 8,192 tokens 0.956× the time (no change at
// 512 or 2,048 tokens, nor with head size 128, whose 6 × 128 stays at ~55 ns). Each row's arithmetic is
// attend_tile's (the same dots, softmax per segment, and sums of values in key order: a sum leaves its registers
// every 8 keys and comes back exactly), so the bits are the same.
template <int D>
void attend_decode(const Step<half_t>& st, int64_t b, int64_t s0, int64_t h0, int64_t nh, int seg0, int seg1,
                   Partials& p, int64_t row0) {
  const int rows = static_cast<int>(nh);
  thread_local TileRows tile;
  tile.set<D>(st, b, s0, h0, nh, rows);
  const int len = tile.len[0], first = tile.first;  // every row's: one token's heads
  if (len == 0) return;                            // a padding token: no partials (combine writes zeros)
  const int64_t kvh = h0 / (st.heads / st.kv_heads);
  const half_t* keys = st.cache(st.keys, b, kvh, first);
  const half_t* values = st.cache(st.values, b, kvh, first);
  const float* qbuf = tile.q.data();
  alignas(64) float scores[2][kMaxGroupRows * kSegment];   // segment s's in scores[s % 2], row r at r·kSegment
  alignas(64) float wide[8 * D];
  alignas(64) half_t tail[8 * D];
  const int whole = len / 8 * 8;                   // keys in whole blocks of 8
  auto seg_keys = [&](int seg) { return std::min(len, (seg + 1) * kSegment) - seg * kSegment; };
  // the scores of keys [k, k + 8) of segment seg (k relative to the row's first key)
  auto score_block = [&](int seg, int k) {
    float* out = &scores[seg % 2][k - seg * kSegment];
    const half_t* block = keys + static_cast<int64_t>(k) * D;
    if (k + 8 > whole) {                           // the last, partial block: against a zero-padded copy
      std::memset(tail, 0, sizeof tail);
      std::memcpy(tail, block, sizeof(half_t) * D * (len - k));
      for (int r = 0; r < rows; ++r) dot8<D>(&qbuf[r * D], tail, out + r * kSegment);
      return;
    }
    pack8<D>(block, wide);
    int r = 0;
    for (; r + 1 < rows; r += 2) {
      const float* q[2] = {&qbuf[r * D], &qbuf[(r + 1) * D]};
      float* o[2] = {out + r * kSegment, out + (r + 1) * kSegment};
      dot8_packed<D, 2>(q, wide, o);
    }
    if (r < rows) {
      const float* q[1] = {&qbuf[r * D]};
      float* o[1] = {out + r * kSegment};
      dot8_packed<D, 1>(q, wide, o);
    }
  };
  auto softmax = [&](int seg) {
    const int n = seg_keys(seg);
    for (int r = 0; r < rows; ++r) {
      const size_t at = static_cast<size_t>(row0 + r) * p.segs + seg;
      p.max[at] = softmax_unnormalised(&scores[seg % 2][r * kSegment], n, &p.sum[at]);
      std::fill_n(&p.acc[at * D], D, 0.0f);
    }
  };
  // values [k, k + n) of segment seg into its rows' sums
  auto take_values = [&](int seg, int k, int n) {
    const float* s[kMaxGroupRows];
    float* a[kMaxGroupRows];
    for (int r = 0; r < rows; ++r) {
      s[r] = &scores[seg % 2][r * kSegment + (k - seg * kSegment)];
      a[r] = &p.acc[(static_cast<size_t>(row0 + r) * p.segs + seg) * D];
    }
    const half_t* block = values + static_cast<int64_t>(k) * D;
    with_rows(rows, [&](auto r) { accumulate_rows<D, decltype(r)::value>(s, block, n, a); });
  };
  seg1 = std::min(seg1, segments_of(len));
  if (seg0 >= seg1) return;
  for (int k = seg0 * kSegment; k < seg0 * kSegment + seg_keys(seg0); k += 8) score_block(seg0, k);
  softmax(seg0);
  for (int seg = seg0; seg < seg1; ++seg) {
    const int vk = seg * kSegment, vn = seg_keys(seg);
    const bool next = seg + 1 < seg1;
    const int nk = (seg + 1) * kSegment, nn = next ? seg_keys(seg + 1) : 0;
    for (int i = 0; i < std::max(vn, nn); i += 8) {
      if (i < nn) score_block(seg + 1, nk + i);
      if (i < vn) take_values(seg, vk + i, std::min(8, vn - i));
    }
    if (next) softmax(seg + 1);
  }
}
#endif

// A tile's rows by the products the step asks for.
template <int D, typename T>
void attend_rows(const Step<T>& st, int64_t b, int64_t s0, int64_t count, int64_t h0, int64_t nh, int seg0, int seg1,
                 Partials& p, int64_t row0 = 0) {
  if constexpr (std::is_same_v<T, half_t>) {
    if (st.bf16) return attend_tile_bf16<D>(st, b, s0, count, h0, nh, seg0, seg1, p, row0);
#ifdef __AVX512F__
    if constexpr (D % 16 == 0)
      if (count == 1 && nh >= kMinSharedRows && nh <= kMaxGroupRows)
        return attend_decode<D>(st, b, s0, h0, nh, seg0, seg1, p, row0);
#endif
  }
  attend_tile<D>(st, b, s0, count, h0, nh, seg0, seg1, p, row0);
}

// Phase 2 (most steps), one task per (b, heads_per_task heads, tile of query tokens): whole rows.
template <int D, typename T>
void attend(void* user, size_t task) {
  const Step<T>& st = *static_cast<const Step<T>*>(user);
  int64_t tiles = (st.seq + st.tile - 1) / st.tile, chunks = st.heads / st.heads_per_task;
  int64_t t = task % tiles, c = (task / tiles) % chunks, b = task / tiles / chunks;
  int64_t s0 = t * st.tile, count = std::min(st.tile, st.queries(b) - s0), h0 = c * st.heads_per_task, nh = st.heads_per_task;
  if (count <= 0) return;       // a packed sequence shorter than the step's longest
  thread_local Partials p;
  int rows = static_cast<int>(count * nh);
  int segs = segments_of(static_cast<int>(std::min(st.total(b), st.past(b) + s0 + count)));   // of its longest row
  p.reset(rows, segs, D);
  attend_rows<D>(st, b, s0, count, h0, nh, 0, segs, p);
  for (int r = 0; r < rows; ++r) {
    int64_t s = s0 + r / nh, h = h0 + r % nh;
    size_t at = static_cast<size_t>(r) * p.segs;
    combine<D>(&p.max[at], &p.sum[at], &p.acc[at * D], row_segments(st, b, s),
               st.out + (st.at(b, s) * st.heads + h) * D);
  }
}

// Phase 2 of a step with few rows over a long context (Step::split): one task per (b, KV head, run of st.run
// consecutive segments of keys), taking every query token of the step with the group's heads, its partials straight
// into the step's shared ones (the group's rows from (b·kv_heads + g)·seq·nh, token-major as attend_tile numbers
// them; tasks write disjoint entries); combined per row afterwards.
//
// Runs, not single segments: ONNX Runtime hands a ParallelFor's tasks out one at a time, so with a task per segment
// the two threads took alternate segments and each one's reads jumped every 32 KB, past what it had asked ahead
// for; a run is one stream of keys and one of values. Two runs a group, not eight: each run's streams start cold
// (the first kKvStreamAhead bytes were never asked for) and each task is one more hand-out; with two, a
// qwen2.5-0.5b int4 decode step took 0.974× / 0.977× / 0.983× the time at 530 / 2,048 / 8,192 tokens (12–16 blocks
// of steps interleaved in one process; smollm2's three groups 0.98–0.99×, qwen2.5-1.5b unchanged), and two runs a
// group still keep two threads busy whatever the number of groups.
//
// The task that finishes a group's last run combines the group's rows (the same combine, in the same order, as
// one thread after the loop did): the groups combine in parallel, and the thread that wrote half the partials
// reads them from its own cache. (At 8,192 tokens the serial combine took 12 µs of a 0.5b layer's 258.)
template <int D, typename T>
void attend_segment(void* user, size_t task) {
  const Step<T>& st = *static_cast<const Step<T>*>(user);
  const int64_t runs = (st.segs + st.run - 1) / st.run;
  int64_t r = task % runs, g = (task / runs) % st.kv_heads, b = task / runs / st.kv_heads;
  int64_t nh = st.heads / st.kv_heads;
  const int seg0 = static_cast<int>(r * st.run), seg1 = std::min(st.segs, seg0 + st.run);
  attend_rows<D>(st, b, 0, st.queries(b), g * nh, nh, seg0, seg1, *st.shared, (b * st.kv_heads + g) * st.seq * nh);
  // acquire-release: the other runs' partials, written before their increments, are seen by the last one
  if (__atomic_add_fetch(&st.runs_done[b * st.kv_heads + g], 1, __ATOMIC_ACQ_REL) != runs) return;
  for (int64_t s = 0; s < st.queries(b); ++s)
    for (int64_t i = 0; i < nh; ++i) {
      size_t at = static_cast<size_t>(((b * st.kv_heads + g) * st.seq + s) * nh + i) * st.segs;
      combine<D>(&st.shared->max[at], &st.shared->sum[at], &st.shared->acc[at * D], row_segments(st, b, s),
                 st.out + (st.at(b, s) * st.heads + g * nh + i) * D);
    }
}

template <int D, typename T>
void run_attention(OrtKernelContext* context, Step<T>& st) {
  Ort::KernelContext ctx(context);
  if (!st.split) {
    ctx.ParallelFor(attend<D, T>, static_cast<size_t>(st.batch * (st.heads / st.heads_per_task) * ((st.seq + st.tile - 1) / st.tile)), 0, &st);
    return;
  }
  thread_local std::vector<int> runs_done;
  runs_done.assign(static_cast<size_t>(st.batch * st.kv_heads), 0);
  st.runs_done = runs_done.data();
  ctx.ParallelFor(attend_segment<D, T>, static_cast<size_t>(st.batch * st.kv_heads * ((st.segs + st.run - 1) / st.run)),
                  0, &st);
}

// The attention of a head size this op is compiled for; refuses any other before the step writes anything.
template <typename T>
void (*attention_for(int64_t head_dim))(OrtKernelContext*, Step<T>&) {
  switch (head_dim) {
    case 64: return run_attention<64, T>;
    case 128: return run_attention<128, T>;
    case 16: return run_attention<16, T>;
    case 32: return run_attention<32, T>;
    case 96: return run_attention<96, T>;
    default: throw std::invalid_argument("qs.CausalAttention: head_dim must be 16, 32, 64, 96 or 128");
  }
}

std::vector<int64_t> shape_of(const Ort::ConstValue& v) { return v.GetTensorTypeAndShapeInfo().GetShape(); }

template <typename T>
struct CausalAttentionKernel {
  int64_t heads, kv_heads, window;
  float scale;
  bool bf16;

  CausalAttentionKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    heads = ki.GetAttribute<int64_t>("num_heads");
    kv_heads = ki.GetAttribute<int64_t>("kv_num_heads");
    scale = ki.GetAttribute<float>("scale");
    window = ki.GetAttribute<int64_t>("local_window_size");
    try {                                       // optional: absent in engines built before it
      bf16 = ki.GetAttribute<int64_t>("bf16_products") != 0;
    } catch (const Ort::Exception&) {
      bf16 = false;
    }
    if (bf16 && !std::is_same_v<T, half_t>)
      throw std::invalid_argument("qs.CausalAttention: bf16_products needs a float16 cache (--kv-cache fp16)");
    if (heads <= 0 || kv_heads <= 0 || heads % kv_heads) throw std::invalid_argument("num_heads must be a multiple of kv_num_heads");
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto qkv = ctx.GetInput(0), past_k = ctx.GetInput(1), past_v = ctx.GetInput(2), seqlens = ctx.GetInput(3);
    auto cos = ctx.GetInput(5), sin = ctx.GetInput(6);
    auto qs = shape_of(qkv), ks = shape_of(past_k), cs = shape_of(cos);
    if (qs.size() != 3 || ks.size() != 4 || cs.size() != 2) throw std::invalid_argument("qs.CausalAttention: bad input ranks");
    Step<T> st{};
    st.batch = qs[0], st.seq = qs[1], st.heads = heads, st.kv_heads = kv_heads, st.head_dim = ks[3];
    st.capacity = ks[2], st.max_pos = cs[0], st.window = window, st.scale = scale, st.bf16 = bf16;
    if (qs[2] != (heads + 2 * kv_heads) * st.head_dim || ks[1] != kv_heads || cs[1] * 2 != st.head_dim)
      throw std::invalid_argument("qs.CausalAttention: qkv, cache and rotary shapes disagree");
    auto run = attention_for<T>(st.head_dim);
    st.qkv = qkv.GetTensorData<float>();
    st.seqlens_k = seqlens.GetTensorData<int32_t>();
    st.cos = cos.GetTensorData<float>();
    st.sin = sin.GetTensorData<float>();
    const bool starts_given = ctx.GetInputCount() > 7 && ctx.GetInput(7) != nullptr;
    const bool rows_given = ctx.GetInputCount() > 8 && ctx.GetInput(8) != nullptr;
    if (starts_given != rows_given)
      throw std::invalid_argument("qs.CausalAttention: a packed step needs both query_starts and kv_rows");
    if (starts_given)
      packed(ctx.GetInput(7), ctx.GetInput(8), qs[0] * qs[1], ks[0], st);
    else if (ks[0] != st.batch)
      throw std::invalid_argument("qs.CausalAttention: qkv, cache and rotary shapes disagree");
    if (static_cast<int64_t>(seqlens.GetTensorTypeAndShapeInfo().GetElementCount()) != st.batch)
      throw std::invalid_argument("qs.CausalAttention: seqlens_k must hold one length per sequence");
    for (int64_t b = 0; b < st.batch; ++b)
      if (st.total(b) > std::min(st.capacity, st.max_pos) || st.total(b) < (st.kv_rows ? st.queries(b) : 1))
        throw std::out_of_range("qs.CausalAttention: a sequence is longer than the KV cache or rotary table, or "
                                "shorter than its new tokens");
    auto out = ctx.GetOutput(0, {qs[0], qs[1], heads * st.head_dim});
    auto present_k = ctx.GetOutput(1, ks), present_v = ctx.GetOutput(2, ks);
    st.out = out.template GetTensorMutableData<float>();
    st.keys = static_cast<T*>(present_k.GetTensorMutableRawData());
    st.values = static_cast<T*>(present_v.GetTensorMutableRawData());
    size_t cache_bytes = static_cast<size_t>(ks[0] * ks[1] * ks[2] * ks[3]) * sizeof(T);
    if (st.keys != past_k.GetTensorRawData()) std::memcpy(st.keys, past_k.GetTensorRawData(), cache_bytes);
    if (st.values != past_v.GetTensorRawData()) std::memcpy(st.values, past_v.GetTensorRawData(), cache_bytes);

    ctx.ParallelFor(write_kv<T>, static_cast<size_t>(st.batch * st.seq), 0, &st);
    // prefill: tiles of kTile tokens share key blocks (one token per task when a local window gives each its own)
    st.tile = st.seq > 1 && window <= 0 ? kTile : 1;
    // The heads of a KV group share its reads, unless that leaves too few tasks to keep every thread streaming:
    // then a step of one tile whose rows have several segments splits each group's keys by segment, every query
    // token of the step in the same task (batch-1 decode at 512 tokens: 6 tasks; a warm prompt's last tokens or a
    // batch-1 verification at 7k tokens read the cache once, where a task per head read it once per head:
    // 1.24x the time for two tokens), and a shorter one takes a task per head (a row's arithmetic is the same either
    // way). (Under a local window a tile is one token.)
    int64_t tiles = (st.seq + st.tile - 1) / st.tile;
    int64_t longest = 0;
    for (int64_t b = 0; b < st.batch; ++b) longest = std::max(longest, st.total(b));
    st.segs = segments_of(static_cast<int>(longest));
    bool few = st.batch * kv_heads * tiles < kMinGroupedTasks;
    st.split = few && tiles == 1 && st.segs > 1;
    // each group's keys in kRunsPerGroup runs of consecutive segments
    st.run = (st.segs + kRunsPerGroup - 1) / kRunsPerGroup;
    st.heads_per_task = few && !st.split ? 1 : heads / kv_heads;
    thread_local Partials shared;   // (one per element type: a thread runs one step at a time either way)
    if (st.split) shared.reset(static_cast<int>(st.batch * st.seq * heads), st.segs, static_cast<int>(st.head_dim));
    st.shared = &shared;
    run(context, st);
  }

  // A packed step: query_starts [sequences + 1] (0 … tokens, increasing: each sequence at least one token) and
  // kv_rows [sequences] (distinct rows of the cache); st.batch becomes the sequences and st.seq the longest's tokens.
  static void packed(const Ort::ConstValue& starts, const Ort::ConstValue& rows, int64_t tokens, int64_t cache_rows,
                     Step<T>& st) {
    int64_t n = static_cast<int64_t>(rows.GetTensorTypeAndShapeInfo().GetElementCount());
    if (static_cast<int64_t>(starts.GetTensorTypeAndShapeInfo().GetElementCount()) != n + 1)
      throw std::invalid_argument("qs.CausalAttention: query_starts must hold one more entry than kv_rows");
    const int32_t* q = starts.GetTensorData<int32_t>();
    const int32_t* kv = rows.GetTensorData<int32_t>();
    if (q[0] != 0 || q[n] != tokens)
      throw std::invalid_argument("qs.CausalAttention: query_starts must run from 0 to the step's tokens");
    std::vector<bool> taken(static_cast<size_t>(cache_rows), false);
    st.seq = 0;
    for (int64_t b = 0; b < n; ++b) {
      if (q[b + 1] <= q[b]) throw std::invalid_argument("qs.CausalAttention: a packed sequence has no tokens");
      if (kv[b] < 0 || kv[b] >= cache_rows || taken[kv[b]])
        throw std::invalid_argument("qs.CausalAttention: kv_rows must be distinct rows of the cache");
      taken[kv[b]] = true;
      st.seq = std::max<int64_t>(st.seq, q[b + 1] - q[b]);
    }
    st.batch = n, st.query_starts = q, st.kv_rows = kv;
  }
};

// The cache's ONNX element type: float, or float16 (--kv-cache fp16).
template <typename T>
constexpr ONNXTensorElementDataType kCacheType =
    std::is_same_v<T, float> ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;

template <typename T>
struct CausalAttentionOp : Ort::CustomOpBase<CausalAttentionOp<T>, CausalAttentionKernel<T>> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new CausalAttentionKernel<T>(api, info); }
  const char* GetName() const { return "CausalAttention"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  // qkv, past key, past value, seqlens_k, total_sequence_length, cos, sin; then optional (packed steps):
  // query_starts, kv_rows
  size_t GetInputTypeCount() const { return 9; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 3 || i == 4 || i >= 7 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32
           : i == 1 || i == 2 ? kCacheType<T> : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i < 7 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t i) const { return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : kCacheType<T>; }
};

}  // namespace

const OrtCustomOp* qs_causal_attention_op() {
  static CausalAttentionOp<float> op;
  return &op;
}

const OrtCustomOp* qs_causal_attention_f16_op() {
  static CausalAttentionOp<half_t> op;
  return &op;
}
