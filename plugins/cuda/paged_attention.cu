// Paged attention over block tables, for decode (one query per sequence) and for multi-token steps
// (chunked prefill, speculative verification) with the causal mask over cached + new tokens.
//
// One kernel serves both: every query row (token) knows its sequence, and so its block table and how
// many keys it may see. Work split (flash-decoding):
//   grid  = (kv_heads × head chunks, rows, partitions of QS_PARTITION_TOKENS keys)
//   a CTA = one KV head, up to G query heads of its group (GQA: K/V are read once for all of them),
//           one row, one partition; 4 warps.
//   a warp lane group of HD/8 lanes owns one key at a time, 8 channels per lane (16-byte loads of
//           f16/bf16, 8-byte loads of fp8), and keeps an online softmax (running max, sum, output);
//           kUnroll keys are loaded before any is used, so each lane has 2·kUnroll loads in flight.
// Lane groups are merged in shared memory; partitions (when a row has more than one) by a reduce kernel
// that weighs each partition's normalized output by its softmax mass.
//
// The grid is sized from the host's max_seq_len bound (so one launch can be captured in a CUDA graph and
// replayed for any lengths under it); each row's own partition count, ceil(keys it sees / kPart) with
// partitions counted from the window's first key, comes from seq_lens on the device. A CTA past its row's
// count returns without writing, and the reduce reads only that row's partitions: the workspace holds
// nothing of a partition that does not exist, not even a neutral value, and is never read there.
#include <math.h>

#include "common.cuh"

namespace qs {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kPart = QS_PARTITION_TOKENS;
constexpr int kUnroll = 4;
constexpr int kMaxGroup = 8;  // query heads per CTA; larger GQA groups are split over CTAs

struct Params {
  void* out;
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* cu_q;  // nullptr: decode (row == sequence)
  float* part_out;      // [rows, heads, parts, HD]  normalized partial outputs
  float* part_ml;       // [rows, heads, parts, 2]   (max, sum) of each partition
  const float* k_scale;
  const float* v_scale;
  float scale;
  int num_seqs, num_heads, kv_heads, group, head_chunks, block_size, max_blocks, window, num_parts;
};

// The keys a query row sees, [start, ctx) of its sequence `seq`, and how many partitions of kPart keys
// (counted from `start`) they fill: 0 for a row with no keys (a padding sequence of length 0), and never
// more than the grid's num_parts (max_seq_len is trusted to bound seq_lens; keys past it are not seen).
struct RowSpan {
  int seq, start, ctx, parts;
};

__device__ __forceinline__ RowSpan row_span(const Params& p, int row) {
  RowSpan r;
  r.seq = row;
  if (p.cu_q != nullptr) {
    r.seq = find_seq(p.cu_q, p.num_seqs, row);
    const int q_len = p.cu_q[r.seq + 1] - p.cu_q[r.seq];
    r.ctx = p.seq_lens[r.seq] - (q_len - 1 - (row - p.cu_q[r.seq]));  // causal: keys up to this row's token
  } else {
    r.ctx = p.seq_lens[r.seq];
  }
  r.start = p.window > 0 ? max(0, r.ctx - p.window) : 0;
  const int keys = r.ctx - r.start;
  r.parts = keys > 0 ? min((keys + kPart - 1) / kPart, p.num_parts) : 0;
  return r;
}

template <typename T, typename KV, int HD, int G>
__global__ void __launch_bounds__(kThreads) attention_kernel(const Params p) {
  constexpr int L = HD / 8;         // lanes per key
  constexpr int TPW = 32 / L;       // keys per warp per step
  constexpr int NG = kWarps * TPW;  // lane groups per CTA
  __shared__ float s_acc[NG][G][HD];
  __shared__ float s_m[NG][G], s_l[NG][G];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int lg = lane / L, li = lane % L, gid = warp * TPW + lg;
  const int kvh = blockIdx.x / p.head_chunks;
  const int h0 = kvh * p.group + (blockIdx.x % p.head_chunks) * G;
  const int nh = min(G, kvh * p.group + p.group - h0);
  const int row = blockIdx.y, part = blockIdx.z, H = p.num_heads;

  const RowSpan span = row_span(p, row);
  T* out = static_cast<T*>(p.out);

  if (part >= span.parts) {  // no keys here: past this row's keys in a grid sized for the longest
    // Split-K: the reduce reads only this row's span.parts partitions, so there is nothing to write. One
    // pass: only a row with no keys at all gets here (part 0 of 0), and its output is defined as zero.
    if (p.num_parts == 1)
      for (int i = threadIdx.x; i < nh * HD; i += kThreads)
        out[(static_cast<int64_t>(row) * H + h0) * HD + i] = from_float<T>(0.f);
    return;
  }
  const int seq = span.seq;
  const int t0 = span.start + part * kPart, t1 = min(t0 + kPart, span.ctx);  // t0 < t1: part < span.parts

  float q[G][8];
  const T* qp = static_cast<const T*>(p.q) + (static_cast<int64_t>(row) * H + h0) * HD + li * 8;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float f[8] = {};
    if (g < nh) unpack8(load8(qp + g * HD), static_cast<const T*>(nullptr), f);
#pragma unroll
    for (int e = 0; e < 8; ++e) q[g][e] = f[e] * p.scale;
  }
  const float k_scale = p.k_scale != nullptr ? *p.k_scale : 1.f;

  float m[G], l[G], acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
  }

  const KV* kc = static_cast<const KV*>(p.k_cache);
  const KV* vc = static_cast<const KV*>(p.v_cache);
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks;
  const int64_t token_stride = static_cast<int64_t>(p.kv_heads) * HD;
  const int64_t head_offset = static_cast<int64_t>(kvh) * HD + li * 8;

  // w is warp-uniform, so every shuffle below runs with the whole warp converged.
  for (int w = t0 + warp * TPW; w < t1; w += NG * kUnroll) {
    typename Pack8<KV>::type kr[kUnroll], vr[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = w + lg + u * NG;
      kr[u] = {};
      vr[u] = {};
      if (t < t1) {
        const int64_t slot = static_cast<int64_t>(table[t / p.block_size]) * p.block_size + t % p.block_size;
        kr[u] = load8(kc + slot * token_stride + head_offset);
        vr[u] = load8(vc + slot * token_stride + head_offset);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = w + lg + u * NG;
      float kf[8];
      unpack8(kr[u], static_cast<const KV*>(nullptr), kf);
      float s[G];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        s[g] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) s[g] = fmaf(q[g][e], kf[e], s[g]);
#pragma unroll
        for (int o = L / 2; o > 0; o /= 2) s[g] += __shfl_xor_sync(0xffffffffu, s[g], o);
      }
      if (t < t1) {
        float vf[8];
        unpack8(vr[u], static_cast<const KV*>(nullptr), vf);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float sc = s[g] * k_scale;
          const float mn = fmaxf(m[g], sc);
          const float corr = __expf(m[g] - mn), pr = __expf(sc - mn);
          l[g] = l[g] * corr + pr;
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(pr, vf[e], acc[g][e] * corr);
          m[g] = mn;
        }
      }
    }
  }

#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int e = 0; e < 8; ++e) s_acc[gid][g][li * 8 + e] = acc[g][e];
    if (li == 0) {
      s_m[gid][g] = m[g];
      s_l[gid][g] = l[g];
    }
  }
  __syncthreads();

  const float v_scale = p.v_scale != nullptr ? *p.v_scale : 1.f;
  for (int i = threadIdx.x; i < nh * HD; i += kThreads) {
    const int g = i / HD, d = i % HD;
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < NG; ++j) mx = fmaxf(mx, s_m[j][g]);
    float sum = 0.f, o = 0.f;
#pragma unroll
    for (int j = 0; j < NG; ++j) {
      const float wj = s_m[j][g] == -INFINITY ? 0.f : __expf(s_m[j][g] - mx);
      sum = fmaf(s_l[j][g], wj, sum);
      o = fmaf(s_acc[j][g][d], wj, o);
    }
    const float value = sum > 0.f ? o * v_scale / sum : 0.f;
    const int64_t rh = static_cast<int64_t>(row) * H + h0 + g;
    if (p.num_parts == 1) {
      out[rh * HD + d] = from_float<T>(value);
    } else {
      const int64_t idx = rh * p.num_parts + part;
      p.part_out[idx * HD + d] = value;
      if (d == 0) {
        p.part_ml[idx * 2] = mx;
        p.part_ml[idx * 2 + 1] = sum;
      }
    }
  }
}

// One CTA per (row, head): merge the row's partitions' normalized outputs, weighted by l_j · exp(m_j − max).
// Only the partitions that exist for the row (row_span) are read; the workspace past them holds whatever an
// earlier call left there (0 · NaN is NaN, so reading it would not be harmless even with a zero weight).
template <typename T, int HD>
__global__ void reduce_kernel(const Params p) {
  const int64_t rh = blockIdx.x;
  const int n = row_span(p, static_cast<int>(rh / p.num_heads)).parts;
  const float* __restrict__ ml = p.part_ml + rh * p.num_parts * 2;
  const float* __restrict__ po = p.part_out + rh * p.num_parts * HD;
  T* __restrict__ out = static_cast<T*>(p.out) + rh * HD;
  if (n <= 1) {  // one partition is already normalized; none: a row without keys reads as zero
    for (int d = threadIdx.x; d < HD; d += blockDim.x) out[d] = from_float<T>(n == 1 ? po[d] : 0.f);
    return;
  }
  float mx = -INFINITY;
  for (int j = 0; j < n; ++j) mx = fmaxf(mx, ml[2 * j]);
  for (int d = threadIdx.x; d < HD; d += blockDim.x) {
    float sum = 0.f, o = 0.f;
    for (int j = 0; j < n; ++j) {
      const float w = ml[2 * j] == -INFINITY ? 0.f : ml[2 * j + 1] * __expf(ml[2 * j] - mx);
      sum += w;
      o = fmaf(po[j * HD + d], w, o);
    }
    out[d] = from_float<T>(sum > 0.f ? o / sum : 0.f);
  }
}

template <typename T, typename KV, int HD, int G>
cudaError_t launch(const Params& p, int rows, cudaStream_t stream) {
  const dim3 grid(p.kv_heads * p.head_chunks, rows, p.num_parts);
  attention_kernel<T, KV, HD, G><<<grid, kThreads, 0, stream>>>(p);
  if (p.num_parts > 1)
    reduce_kernel<T, HD><<<rows * p.num_heads, HD, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, typename KV, int HD>
cudaError_t dispatch_group(Params& p, int rows, cudaStream_t stream) {
  const int g = p.group <= 1 ? 1 : p.group <= 2 ? 2 : p.group <= 4 ? 4 : kMaxGroup;
  p.head_chunks = (p.group + g - 1) / g;
  switch (g) {
    case 1: return launch<T, KV, HD, 1>(p, rows, stream);
    case 2: return launch<T, KV, HD, 2>(p, rows, stream);
    case 4: return launch<T, KV, HD, 4>(p, rows, stream);
    default: return launch<T, KV, HD, kMaxGroup>(p, rows, stream);
  }
}

template <typename T, typename KV>
cudaError_t dispatch_head_dim(Params& p, int head_dim, int rows, cudaStream_t stream) {
  switch (head_dim) {
    case 32: return dispatch_group<T, KV, 32>(p, rows, stream);
    case 64: return dispatch_group<T, KV, 64>(p, rows, stream);
    case 128: return dispatch_group<T, KV, 128>(p, rows, stream);
    default: return dispatch_group<T, KV, 256>(p, rows, stream);
  }
}

int num_partitions(int max_seq_len) { return max_seq_len <= kPart ? 1 : (max_seq_len + kPart - 1) / kPart; }

}  // namespace

int check_attention_shape(int rows, int num_seqs, int num_heads, int kv_heads, int head_dim, int block_size,
                          int max_blocks, int max_seq_len, float scale, qs_dtype dtype, qs_dtype kv_dtype) {
  if (rows < 0 || num_seqs < 1) return fail(QS_ERR_INVALID_ARGUMENT, "need num_seqs >= 1 and rows >= 0 (got %d, %d)", num_seqs, rows);
  if (num_heads < 1 || kv_heads < 1 || num_heads % kv_heads != 0)
    return fail(QS_ERR_INVALID_ARGUMENT, "num_heads (%d) must be a positive multiple of kv_heads (%d)", num_heads, kv_heads);
  if (head_dim != 32 && head_dim != 64 && head_dim != 128 && head_dim != 256)
    return fail(QS_ERR_UNSUPPORTED, "head_dim %d has no kernel (built: 32, 64, 128, 256)", head_dim);
  if (block_size < 1 || max_blocks < 1)
    return fail(QS_ERR_INVALID_ARGUMENT, "block_size (%d) and max_blocks_per_seq (%d) must be >= 1", block_size, max_blocks);
  if (max_seq_len < 1 || static_cast<int64_t>(max_blocks) * block_size < max_seq_len)
    return fail(QS_ERR_INVALID_ARGUMENT, "max_seq_len %d must be >= 1 and fit in max_blocks_per_seq * block_size = %lld",
                max_seq_len, static_cast<long long>(max_blocks) * block_size);
  if (dtype != QS_DTYPE_F16 && dtype != QS_DTYPE_BF16)
    return fail(QS_ERR_UNSUPPORTED, "query dtype %s: paged attention runs in f16 or bf16", dtype_name(dtype));
  if (kv_dtype != dtype && kv_dtype != QS_DTYPE_FP8_E4M3)
    return fail(QS_ERR_INVALID_ARGUMENT, "kv dtype %s must equal the query dtype %s or be fp8_e4m3", dtype_name(kv_dtype), dtype_name(dtype));
  if (!(scale > 0.f) || !isfinite(scale)) return fail(QS_ERR_INVALID_ARGUMENT, "scale must be a positive finite number, not %g", scale);
  if (rows > 65535) return fail(QS_ERR_UNSUPPORTED, "%d query rows in one call; split the batch (at most 65535)", rows);
  return ok();
}

int run_paged_attention(void* out, const void* query, const void* k_cache, const void* v_cache, const int32_t* block_tables,
        const int32_t* seq_lens, const int32_t* cu_q, int rows, int num_seqs, int num_heads, int kv_heads,
        int head_dim, int block_size, int max_blocks, int max_seq_len, int window, float scale,
        const float* k_scale, const float* v_scale, qs_dtype dtype, qs_dtype kv_dtype, void* workspace,
        size_t workspace_bytes, void* stream) {
  const int shape = check_attention_shape(rows, num_seqs, num_heads, kv_heads, head_dim, block_size, max_blocks,
                                          max_seq_len, scale, dtype, kv_dtype);
  if (shape != QS_OK || rows == 0) return shape;
  if (!out || !query || !k_cache || !v_cache || !block_tables || !seq_lens)
    return fail(QS_ERR_INVALID_ARGUMENT, "out, query, k_cache, v_cache, block_tables and seq_lens must be device pointers, not NULL");
  if (kv_dtype == QS_DTYPE_FP8_E4M3 && (!k_scale || !v_scale))
    return fail(QS_ERR_INVALID_ARGUMENT, "an fp8 KV cache needs k_scale and v_scale (device float[1])");
  const size_t kv_align = kv_dtype == QS_DTYPE_FP8_E4M3 ? 8 : 16;
  if (!aligned(query, 16) || !aligned(out, 16) || !aligned(k_cache, kv_align) || !aligned(v_cache, kv_align))
    return fail(QS_ERR_INVALID_ARGUMENT, "query/out must be 16-byte aligned and the caches %zu-byte aligned", kv_align);
  const size_t need = qs_paged_attention_workspace_size(rows, num_heads, head_dim, max_seq_len);
  if (need > 0 && (workspace == nullptr || workspace_bytes < need))
    return fail(QS_ERR_INVALID_ARGUMENT, "workspace of %zu bytes needed for max_seq_len %d (got %zu); see qs_paged_attention_workspace_size",
                need, max_seq_len, workspace == nullptr ? 0 : workspace_bytes);

  Params p{};
  p.out = out;
  p.q = query;
  p.k_cache = k_cache;
  p.v_cache = v_cache;
  p.block_tables = block_tables;
  p.seq_lens = seq_lens;
  p.cu_q = cu_q;
  p.num_parts = num_partitions(max_seq_len);
  p.part_out = static_cast<float*>(workspace);
  p.part_ml = p.num_parts > 1 ? p.part_out + static_cast<size_t>(rows) * num_heads * p.num_parts * head_dim : nullptr;
  p.k_scale = kv_dtype == QS_DTYPE_FP8_E4M3 ? k_scale : nullptr;
  p.v_scale = kv_dtype == QS_DTYPE_FP8_E4M3 ? v_scale : nullptr;
  p.scale = scale;
  p.num_seqs = num_seqs;
  p.num_heads = num_heads;
  p.kv_heads = kv_heads;
  p.group = num_heads / kv_heads;
  p.block_size = block_size;
  p.max_blocks = max_blocks;
  p.window = window;
  auto s = static_cast<cudaStream_t>(stream);
  cudaError_t err;
  if (dtype == QS_DTYPE_F16)
    err = kv_dtype == QS_DTYPE_FP8_E4M3 ? dispatch_head_dim<__half, fp8>(p, head_dim, rows, s)
                                        : dispatch_head_dim<__half, __half>(p, head_dim, rows, s);
  else
    err = kv_dtype == QS_DTYPE_FP8_E4M3 ? dispatch_head_dim<__nv_bfloat16, fp8>(p, head_dim, rows, s)
                                        : dispatch_head_dim<__nv_bfloat16, __nv_bfloat16>(p, head_dim, rows, s);
  return from_cuda(err, "paged attention launch");
}

}  // namespace qs

extern "C" size_t qs_paged_attention_workspace_size(int num_rows, int num_heads, int head_dim, int max_seq_len) {
  const int parts = qs::num_partitions(max_seq_len);
  if (parts <= 1 || num_rows <= 0) return 0;
  return static_cast<size_t>(num_rows) * num_heads * parts * (head_dim + 2) * sizeof(float);
}

extern "C" int qs_paged_attention_decode(void* out, const void* query, const void* k_cache, const void* v_cache,
                                         const int32_t* block_tables, const int32_t* seq_lens, int num_seqs,
                                         int num_heads, int kv_heads, int head_dim, int block_size,
                                         int max_blocks_per_seq, int max_seq_len, int window, float scale,
                                         const float* k_scale, const float* v_scale, qs_dtype dtype,
                                         qs_dtype kv_dtype, void* workspace, size_t workspace_bytes, void* stream) {
  return qs::run_paged_attention(out, query, k_cache, v_cache, block_tables, seq_lens, nullptr, num_seqs, num_seqs, num_heads,
                 kv_heads, head_dim, block_size, max_blocks_per_seq, max_seq_len, window, scale, k_scale, v_scale,
                 dtype, kv_dtype, workspace, workspace_bytes, stream);
}

extern "C" int qs_paged_attention_prefill(void* out, const void* query, const void* k_cache, const void* v_cache,
                                          const int32_t* block_tables, const int32_t* seq_lens,
                                          const int32_t* cu_seqlens_q, int num_tokens, int num_seqs, int num_heads,
                                          int kv_heads, int head_dim, int block_size, int max_blocks_per_seq,
                                          int max_seq_len, int window, float scale, const float* k_scale,
                                          const float* v_scale, qs_dtype dtype, qs_dtype kv_dtype, void* workspace,
                                          size_t workspace_bytes, void* stream) {
  if (cu_seqlens_q == nullptr)
    return qs::fail(QS_ERR_INVALID_ARGUMENT, "cu_seqlens_q (int32 [num_seqs + 1]) is required for multi-token attention");
  return qs::run_paged_attention(out, query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, num_tokens, num_seqs,
                 num_heads, kv_heads, head_dim, block_size, max_blocks_per_seq, max_seq_len, window, scale, k_scale,
                 v_scale, dtype, kv_dtype, workspace, workspace_bytes, stream);
}
