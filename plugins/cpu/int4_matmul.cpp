// qs.Int4MatMul: y = x @ W for a block-wise 4-bit weight (blocks of 32 along K, one fp16 scale per block and
// output channel, symmetric: w = s · (u − 8), u ∈ [0, 15]), with the activations quantized row by row:
//
//     x [..., K] float ─▶ per row: a = max|x|/127, x_q = round(x / a) ∈ [−127, 127]            (int8)
//                     ─▶ per block b: t_b[n] = Σ_{k∈b} x_q[k] · (u[k, n] − 8)                 exact int32
//                     ─▶ y[n] = (Σ_b float(t_b[n]) · s_b[n]) · a, the blocks summed in order    [..., N]
//
// At batch 1 a decode step is a stream of weights: 4.5 bits a weight instead of int8's 8 is ~0.56× the bytes.
// The nibbles feed vpdpbusd as its unsigned operand and the activations as its signed one, so
// Σ x_q·(u − 8) = Σ x_q·u − 8·Σ_{k∈b} x_q, with the activations' block sums taken once per row.
//
// Layout (compile/quantize/int4.py `pack_panels`): panels of 16 output channels; per block, four 64-byte chunks
// (chunk c: byte 4·ch + j holds u at k = 8c + j in its low nibble and k = 8c + 4 + j in its high one), then the
// block's 16 scales as fp16: 288 bytes a block, the panel's blocks in K order.
//
// With integer scales (attribute int_scales = 1, compile/quantize/int4.py `pack_panels_int`) a block's scale is a
// multiplier m ∈ 1..16 of one float scale S per channel, w = S · m · (u − 8), and the sums stay integers:
//
//                     ─▶ y[n] = float(Σ_b m_b[n] · t_b[n]) · S[n] · a                            exact int32 sum
//
// (u − 8)·m fits int8, so on AMX tiles a row's product is one int32 sum over all of K, as the int8 kernel's is,
// where fp16 block scales take every block out of the tiles (below). A block's bytes are
// then its nibbles and its 16 multipliers (272), and a panel ends in its 16 channel scales as float32. The integer
// sum is the same whatever the order, so every path gives the same bits by construction.
//
// Every output is one row's blocks in K order, with a fixed sequence of operations whatever M, the task split or
// the thread: a row's result never depends on the rows beside it.
//
// The op may also take in the small ops around a linear (a batch-1 decode step paid more for their dispatch than for
// their arithmetic), each bitwise the op it replaces (QsPrologue in ops.h, prologues.cpp): a bias [N] (input 2),
// and SwiGLU or a skip RMS norm (skip and gamma: inputs 3 and 4; the residual x + skip: output 1) as its prologue.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "ops.h"
#include "panel_gemm.h"

namespace {

constexpr int64_t kPanel = 16, kBlock = 32, kBlockBytes = 4 * 64 + kPanel * 2;
constexpr int64_t kIntBlockBytes = 4 * 64 + kPanel;     // integer scales: the nibbles, then 16 multipliers
// The packing's contract (pack_panels_int): m ∈ 1..16 and u ∈ 0..15, so (u − 8)·m ∈ [−128, 112] is an int8 (the tile
// kernel's byte products are exact only then) and a block adds at most 16·32·127·8 to a row's int32 sum: K up to
// 4,096 blocks cannot overflow it.
constexpr int64_t kMaxIntScalesK = 4096 * kBlock;

// Bytes of a panel of `blocks` blocks: fp16 block scales, or integer ones (and the 16 channel scales at its end).
inline int64_t panel_bytes_of(int64_t blocks, bool int_scales) {
  return int_scales ? blocks * kIntBlockBytes + kPanel * 4 : blocks * kBlockBytes;
}

struct Problem {
  QsPrologueRows x;        // the rows the product quantizes: the input's, or its prologue's
  const uint8_t* w;
  float* y;
  int8_t* xq;              // [M, K] (tiles: rows to a multiple of 32, zero)
  TiledRows<int8_t> xt;    // tiles with integer scales: x_q as whole tiles (quantize_tiles)
  int32_t* xsum8;          // [M, K/32]: 8 · Σ_{k∈b} x_q
  float* x_scale;          // [M]
  int64_t m, k, n, blocks, panels;
  bool int_scales;         // multipliers of a channel scale (pack_panels_int), not fp16 block scales
  int64_t panel_bytes;
};

// Integer scales: the 16 float32 channel scales S at the end of a panel.
inline const uint8_t* channel_scales(const Problem& p, int64_t panel) {
  return p.w + panel * p.panel_bytes + p.blocks * kIntBlockBytes;
}

#if defined(__F16C__)
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
inline float half_to_float(uint16_t h) {        // IEEE binary16 → binary32, exactly (every half is a float)
  const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  float magnitude;
  if (exponent == 0)
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);                 // zero and subnormals
  else if (exponent == 31)
    magnitude = mantissa ? NAN : INFINITY;
  else
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400), static_cast<int>(exponent) - 25);
  uint32_t bits;
  std::memcpy(&bits, &magnitude, 4);
  bits |= sign;
  std::memcpy(&magnitude, &bits, 4);
  return magnitude;
}
#endif

#if defined(__AVX512BW__)
constexpr int kRows = 4, kPanels = 2;

// t += Σ over 4 k of u · x for 16 channels: VNNI in one instruction, else pairs in int16 (15·127·2 < 2^15) then int32
inline __m512i dot4(__m512i t, __m512i u, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(t, u, x);
#else
  return _mm512_add_epi32(t, _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), _mm512_set1_epi16(1)));
#endif
}

// t[r][q] = Σ over block b of u · x_q for R rows and the P panels' blocks at block[q] (both packings' nibbles are
// laid out alike), asking for them ahead where `ahead`.
template <int R, int P>
inline void block_dots(const Problem& p, int64_t row0, int64_t b, const uint8_t* const (&block)[P], int64_t bytes,
                       bool ahead, __m512i (&t)[R][P]) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q) t[r][q] = _mm512_setzero_si512();
  if (ahead)
    for (int q = 0; q < P; ++q) qs_stream_ahead(block[q], bytes);
  for (int c = 0; c < 4; ++c) {
    __m512i lo[P], hi[P];
    for (int q = 0; q < P; ++q) {
      const __m512i v = _mm512_loadu_si512(block[q] + c * 64);
      lo[q] = _mm512_and_si512(v, low);
      hi[q] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = p.xq + (row0 + r) * p.k + b * kBlock + 8 * c;
      int32_t first, second;
      std::memcpy(&first, xr, 4);
      std::memcpy(&second, xr + 4, 4);
      const __m512i x0 = _mm512_set1_epi32(first), x1 = _mm512_set1_epi32(second);
      for (int q = 0; q < P; ++q) t[r][q] = dot4(dot4(t[r][q], lo[q], x0), hi[q], x1);
    }
  }
}

template <int R, int P>
void micro(const Problem& p, int64_t row0, int64_t panel0) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q) acc[r][q] = _mm512_setzero_ps();
  const bool ahead = first_rows(row0);
  for (int64_t b = 0; b < p.blocks; ++b) {
    const uint8_t* block[P];
    for (int q = 0; q < P; ++q) block[q] = p.w + (panel0 + q) * p.panel_bytes + b * kBlockBytes;
    __m512i t[R][P];
    block_dots<R, P>(p, row0, b, block, kBlockBytes, ahead, t);
    __m512 scale[P];
    for (int q = 0; q < P; ++q)
      scale[q] = _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(block[q] + 256)));
    for (int r = 0; r < R; ++r) {
      const __m512i corr = _mm512_set1_epi32(p.xsum8[(row0 + r) * p.blocks + b]);
      for (int q = 0; q < P; ++q)
        acc[r][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(t[r][q], corr)), scale[q], acc[r][q]);
    }
  }
  for (int q = 0; q < P; ++q) {
    const int64_t col0 = (panel0 + q) * kPanel, valid = std::min<int64_t>(kPanel, p.n - col0);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(p.y + (row0 + r) * p.n + col0, mask,
                            _mm512_mul_ps(acc[r][q], _mm512_set1_ps(p.x_scale[row0 + r])));
  }
}

// Integer scales, every path's finish: y[row, the panel's channels] = (float(sum) · S) · a.
inline void store_int_sums(const Problem& p, int64_t row, int64_t panel, __m512i sum) {
  const int64_t col0 = panel * kPanel, valid = std::min<int64_t>(kPanel, p.n - col0);
  const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(channel_scales(p, panel)));
  _mm512_mask_storeu_ps(p.y + row * p.n + col0, static_cast<__mmask16>((1u << valid) - 1),
                        _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), scale), _mm512_set1_ps(p.x_scale[row])));
}

// Integer scales: a block's sums less 8·Σx_q times its multipliers, added in int32 (the sum fits int16: 32·127·8,
// so vpmaddwd against m in the low half of each lane is the product in one instruction); the float work once a row.
template <int R, int P>
void micro_int(const Problem& p, int64_t row0, int64_t panel0) {
  __m512i acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q) acc[r][q] = _mm512_setzero_si512();
  const bool ahead = first_rows(row0);
  for (int64_t b = 0; b < p.blocks; ++b) {
    const uint8_t* block[P];
    for (int q = 0; q < P; ++q) block[q] = p.w + (panel0 + q) * p.panel_bytes + b * kIntBlockBytes;
    __m512i t[R][P];
    block_dots<R, P>(p, row0, b, block, kIntBlockBytes, ahead, t);
    __m512i mult[P];
    for (int q = 0; q < P; ++q)
      mult[q] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block[q] + 256)));
    for (int r = 0; r < R; ++r) {
      const __m512i corr = _mm512_set1_epi32(p.xsum8[(row0 + r) * p.blocks + b]);
      for (int q = 0; q < P; ++q)
        acc[r][q] = _mm512_add_epi32(acc[r][q], _mm512_madd_epi16(_mm512_sub_epi32(t[r][q], corr), mult[q]));
    }
  }
  for (int q = 0; q < P; ++q)
    for (int r = 0; r < R; ++r) store_int_sums(p, row0 + r, panel0 + q, acc[r][q]);
}

// Integer scales on AMX tiles: ChunkedTiles (panel_gemm.h) over the activations as tiles (quantize_tiles) and, per
// chunk of K, the group's blocks in it unpacked into int8 weights (u − 8)·m in the [k/4][channel][4] rows TDPBSSD
// reads (two blocks a step; an odd last block padded with zero weights), each block once per task; then the vector
// kernel's float finish. The integer sums are the vector kernel's exactly.
struct TileKernelInt : ChunkedTiles {
  // (u − 8)·m of one block (32 k × 16 channels) into 8 rows of 64 bytes
  static void unpack_block(const uint8_t* block, int8_t* out) {
    const __m512i low = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
    const __m512i pairs = _mm512_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8, 7, 7, 6, 6, 5,
                                           5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);   // 16-bit lane i: channel i / 2
    const __m512i m = _mm512_permutexvar_epi16(
        pairs, _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 256)))));
    const __mmask64 odd = 0xAAAAAAAAAAAAAAAAull;
    auto times_m = [&](__m512i v) {            // bytes × m, each product within int8 (mod 256 is exact)
      const __m512i even = _mm512_mullo_epi16(v, m);
      const __m512i high = _mm512_slli_epi16(_mm512_mullo_epi16(_mm512_srai_epi16(v, 8), m), 8);
      return _mm512_mask_blend_epi8(odd, even, high);
    };
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(block + c * 64);
      _mm512_storeu_si512(out + 2 * c * 64, times_m(_mm512_sub_epi8(_mm512_and_si512(v, low), eight)));
      _mm512_storeu_si512(out + (2 * c + 1) * 64,
                          times_m(_mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), eight)));
    }
  }

  template <class Tiles>
  static void run(const Problem& p, int64_t row_begin, int nr, int64_t panel0, int np) {
    const int64_t steps = (p.blocks + 1) / 2, tile_rows = (nr + 31) / 32 * 32;
    thread_local std::vector<int8_t> chunk_storage;       // [panel][step of the chunk][16 × 64]
    int8_t* chunk = aligned64(qs_scratch(chunk_storage, static_cast<size_t>(np * kChunkSteps * 1024 + 64)));
    int32_t* sums = ChunkedTiles::sums(np, tile_rows);
    const int8_t* b[kGroupPanels];
    for (int q = 0; q < np; ++q) b[q] = chunk + q * kChunkSteps * 1024;
    for (int64_t s0 = 0; s0 < steps; s0 += kChunkSteps) {
      const int64_t sn = std::min(kChunkSteps, steps - s0), b_end = std::min(p.blocks, 2 * (s0 + sn));
      for (int q = 0; q < np; ++q) {
        int8_t* out = chunk + q * kChunkSteps * 1024;
        const uint8_t* w = p.w + (panel0 + q) * p.panel_bytes;
        for (int64_t blk = 2 * s0; blk < b_end; ++blk) unpack_block(w + blk * kIntBlockBytes, out + (blk - 2 * s0) * 512);
        if (b_end % 2) std::memset(out + (b_end - 2 * s0) * 512, 0, 512);   // the pad block
      }
      ChunkedTiles::add<Tiles, false>(nr, np, sn, s0 == 0, tile_rows, sums, p.xt.tile(row_begin / 16) + s0 * 1024,
                                      steps * 1024, b);
    }
    for (int r = 0; r < nr; ++r)            // the vector kernel's finish, a row's channels of the group in one run
      for (int q = 0; q < np; ++q)
        store_int_sums(p, row_begin + r, panel0 + q, _mm512_load_si512(ChunkedTiles::row_sums(sums, tile_rows, r, q)));
  }
};

// On AMX tiles (tiles.h): every block (32 k) has its own scales, so a tile step is one block and its sums leave the
// tiles for the float epilogue — a conversion and a multiply-add per block, row and channel, the vector kernel's —
// after every product. So the kernel keeps that epilogue's accumulators in registers:
//   - a task's panel at a time, its blocks unpacked once into a thread-local copy that serves every row of the task:
//     the nibbles less 8, signed (chunk c's low nibbles are k = 8c..8c+3, its high ones 8c+4..8c+7, for 16
//     channels: the [k/4][channel][4] rows TDPBSSD reads);
//   - 16 rows at a time, their 16 accumulators (one panel each) in registers; the blocks two a step into a pair of
//     C tiles, the pairs alternating (1.25x faster than one pair in program order).
// A tile sum is Σ x_q·(u − 8) = t_b − 8·Σ x_q exactly, the vector kernel's integer before its conversion, and the
// epilogue is the vector kernel's multiply-add in the same block order: the same bits whichever path a row takes.
// On a Sapphire Rapids host a block's tile work (~24 cycles with its store) and its epilogue (~18) did not overlap,
// which bounds this format near 165 MACs a cycle. Tried and slower: x copied into A-tile order, a three-stage
// pipeline of products, stores and epilogues, software prefetch, forced inlining.
struct TileKernel {
  static constexpr int64_t kTaskRows = kRowBlock, kCallRows = kRowBlock, kCallPanels = 1;
  static constexpr int64_t kUnpackedBlock = 8 * 64;            // a block's B tile: 8 rows (k/4) × 16 channels × 4

  // C 0, 1 | 2, 3: two blocks' sums of 16 rows × 16 channels, pairs alternating; A 4, 5: 16 rows of x, one block
  // (32 bytes) each; B 6, 7: that block's weights
  static QsTileConfig config() {
    QsTileConfig c;
    for (int t = 0; t < 4; ++t) c.tile(t, 16, 64);
    return c.tile(4, 16, 32).tile(5, 16, 32).tile(6, 8, 64).tile(7, 8, 64);
  }

  template <class Tiles>
  static void run(const Problem& p, int64_t row_begin, int nr, int64_t panel, int) {
    const uint8_t* w = p.w + panel * p.panel_bytes;
    thread_local std::vector<int8_t> unpacked_storage;
    int8_t* unpacked = qs_scratch(unpacked_storage, static_cast<size_t>(p.blocks * kUnpackedBlock));
    const __m512i low = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
    for (int64_t b = 0; b < p.blocks; ++b)
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(w + b * kBlockBytes + c * 64);
        int8_t* out = unpacked + b * kUnpackedBlock + 2 * c * 64;
        _mm512_storeu_si512(out, _mm512_sub_epi8(_mm512_and_si512(v, low), eight));
        _mm512_storeu_si512(out + 64, _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), eight));
      }
    const int64_t col0 = panel * kPanel, valid = std::min<int64_t>(kPanel, p.n - col0);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    for (int64_t row0 = row_begin; row0 < row_begin + nr; row0 += 16) {
      const Rows16 rows{p, p.xq + row0 * p.k, unpacked, w};
      __m512 acc[16];
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
      rows.dots<Tiles, 0, 1>(0);
      for (int64_t b = 0; b < p.blocks; b += 4) {
        if (b + 2 < p.blocks) rows.dots<Tiles, 2, 3>(b + 2);
        rows.finish<Tiles, 0, 1>(b, acc);
        if (b + 2 < p.blocks) {
          if (b + 4 < p.blocks) rows.dots<Tiles, 0, 1>(b + 4);
          rows.finish<Tiles, 2, 3>(b + 2, acc);
        }
      }
      const int rows_here = static_cast<int>(std::min<int64_t>(16, row_begin + nr - row0));
      for (int r = 0; r < rows_here; ++r)
        _mm512_mask_storeu_ps(p.y + (row0 + r) * p.n + col0, mask,
                              _mm512_mul_ps(acc[r], _mm512_set1_ps(p.x_scale[row0 + r])));
    }
  }

 private:
  struct Rows16 {
    const Problem& p;
    const int8_t* x;            // the 16 rows' quantized activations (zero rows past m)
    const int8_t* unpacked;     // the panel's blocks, unpacked
    const uint8_t* w;           // the panel's packed blocks (their scales)

    // blocks b and b + 1 (where there is one) into C tiles C0, C1
    template <class Tiles, int C0, int C1>
    void dots(int64_t b) const {
      Tiles::template zero<C0>();
      Tiles::template load<4>(x + b * kBlock, p.k);
      Tiles::template load<6>(unpacked + b * kUnpackedBlock, 64);
      Tiles::template dot_ss<C0, 4, 6>();
      if (b + 1 < p.blocks) {
        Tiles::template zero<C1>();
        Tiles::template load<5>(x + (b + 1) * kBlock, p.k);
        Tiles::template load<7>(unpacked + (b + 1) * kUnpackedBlock, 64);
        Tiles::template dot_ss<C1, 5, 7>();
      }
    }

    // the sums of blocks b and b + 1 from C0, C1 into the rows' accumulators, block by block
    template <class Tiles, int C0, int C1>
    void finish(int64_t b, __m512 (&acc)[16]) const {
      alignas(64) int32_t sums[2][16][16];
      const int blocks = b + 1 < p.blocks ? 2 : 1;
      Tiles::template store<C0>(&sums[0][0][0], 64);
      if (blocks > 1) Tiles::template store<C1>(&sums[1][0][0], 64);
      for (int j = 0; j < blocks; ++j) {
        const __m512 scale =
            _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (b + j) * kBlockBytes + 256)));
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r)
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[j][r])), scale, acc[r]);
      }
    }
  };
};

#else
constexpr int kRows = 1, kPanels = 1;

// t[ch] = Σ over a block of u · x_q for a panel's 16 channels (the block's nibbles at `w`, its 32 activations at x).
inline void block_sums(const uint8_t* w, const int8_t* x, int32_t* t) {
  for (int ch = 0; ch < kPanel; ++ch) t[ch] = 0;
  for (int c = 0; c < 4; ++c)
    for (int ch = 0; ch < kPanel; ++ch)
      for (int j = 0; j < 4; ++j) {
        const uint8_t byte = w[c * 64 + ch * 4 + j];
        t[ch] += int32_t{static_cast<uint8_t>(byte & 0x0F)} * x[8 * c + j] +
                 int32_t{static_cast<uint8_t>(byte >> 4)} * x[8 * c + 4 + j];
      }
}

// Integer scales, one row and panel: the AVX-512 kernel's integers and float finish.
inline void micro_int_row(const Problem& p, int64_t row, int64_t panel) {
  const uint8_t* w = p.w + panel * p.panel_bytes;
  const int8_t* x = p.xq + row * p.k;
  int32_t acc[kPanel] = {};
  for (int64_t b = 0; b < p.blocks; ++b, w += kIntBlockBytes) {
    int32_t t[kPanel];
    block_sums(w, x + b * kBlock, t);
    for (int ch = 0; ch < kPanel; ++ch) acc[ch] += (t[ch] - p.xsum8[row * p.blocks + b]) * int32_t{w[256 + ch]};
  }
  const int64_t col0 = panel * kPanel, valid = std::min<int64_t>(kPanel, p.n - col0);
  for (int64_t ch = 0; ch < valid; ++ch) {
    float scale;
    std::memcpy(&scale, channel_scales(p, panel) + 4 * ch, 4);
    p.y[row * p.n + col0 + ch] = static_cast<float>(acc[ch]) * scale * p.x_scale[row];
  }
}

template <int R, int P>
void micro_int(const Problem& p, int64_t row0, int64_t panel0) {
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q) micro_int_row(p, row0 + r, panel0 + q);
}

// Portable (and AVX2 through the compiler's vectoriser): the same integer sums and the same float operations in
// the same order as the AVX-512 kernel (one fused multiply-add per block), so results agree across machines too.
template <int R, int P>
void micro(const Problem& p, int64_t row0, int64_t panel0) {
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q) {
      const uint8_t* w = p.w + (panel0 + q) * p.panel_bytes;
      const int8_t* x = p.xq + (row0 + r) * p.k;
      float acc[kPanel] = {};
      for (int64_t b = 0; b < p.blocks; ++b, w += kBlockBytes) {
        int32_t t[kPanel];
        block_sums(w, x + b * kBlock, t);
        for (int ch = 0; ch < kPanel; ++ch) {
          uint16_t h;
          std::memcpy(&h, w + 256 + 2 * ch, 2);
          acc[ch] = std::fma(static_cast<float>(t[ch] - p.xsum8[(row0 + r) * p.blocks + b]), half_to_float(h), acc[ch]);
        }
      }
      const int64_t col0 = (panel0 + q) * kPanel, valid = std::min<int64_t>(kPanel, p.n - col0);
      for (int64_t ch = 0; ch < valid; ++ch) p.y[(row0 + r) * p.n + col0 + ch] = acc[ch] * p.x_scale[row0 + r];
    }
}
#endif

template <int R, int P>
struct Micro {
  static void run(const Problem& p, int64_t row0, int64_t panel0) {
    if (p.int_scales) return micro_int<R, P>(p, row0, panel0);
    micro<R, P>(p, row0, panel0);
  }
};

// Row → int8 on max|x|/127: qs_quantize_row's values (zero point 128) flipped to signed in place, and 8 × each
// block's sum. (Locals and restrict: a store through int8_t* may alias anything, so these loops re-read p.k and
// p.blocks after every byte and stayed scalar — 17 % of a 445-token smollm2 prefill.)
void quantize(const Problem& p, int64_t row) {
  const int64_t k = p.k, blocks = p.blocks;
  int8_t* __restrict q = p.xq + row * k;
  uint8_t* __restrict u = reinterpret_cast<uint8_t*>(q);
  qs_quantize_row(p.x.row(row), k, u, p.x_scale + row);
  for (int64_t i = 0; i < k; ++i) u[i] ^= 0x80;                  // u − 128 as a signed byte
  int32_t* __restrict sums = p.xsum8 + row * blocks;
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t sum = 0;
    for (int64_t i = 0; i < kBlock; ++i) sum += q[b * kBlock + i];
    sums[b] = 8 * sum;
  }
}

#if defined(__AVX512BW__)
// Integer scales on tiles: the row quantized as `quantize` does, into the tiles' layout (ChunkedTiles), an odd last
// block's half step zero. (No block sums: signed weights need no correction.)
void quantize_tiles(const Problem& p, int64_t row) {
  const int64_t k = p.k, bytes = p.xt.steps * 64;
  thread_local std::vector<uint8_t> storage;
  uint8_t* __restrict u = qs_scratch(storage, static_cast<size_t>(bytes));
  qs_quantize_row(p.x.row(row), k, u, p.x_scale + row);
  for (int64_t i = 0; i < k; ++i) u[i] ^= 0x80;                  // u − 128 as a signed byte
  std::fill(u + k, u + bytes, uint8_t{0});
  p.xt.scatter(row, reinterpret_cast<const int8_t*>(u));
}
#endif

// The optional attribute int_scales (absent in engines built before it: 0): which of the two packings the weight has.
inline bool int_scales_of(const OrtKernelInfo* info, const char* op) {
  Ort::ConstKernelInfo ki(info);
  int64_t value = 0;
  try {
    value = ki.GetAttribute<int64_t>("int_scales");
  } catch (const Ort::Exception&) {
    value = 0;
  }
  if (value != 0 && value != 1) throw std::invalid_argument(std::string(op) + ": int_scales must be 0 or 1");
  return value == 1;
}

struct Int4MatMulKernel {
  int64_t k, n;
  bool int_scales;
  QsPrologue prologue;
  size_t weight_bytes;                         // the packed weight's: ceil(N/16) panels
  const uint8_t* constant_weight = nullptr;   // qs_constant_input: checked once, when the kernel is made
  const float* constant_bias = nullptr;

  Int4MatMulKernel(const OrtApi&, const OrtKernelInfo* info)
      : k(Ort::ConstKernelInfo(info).GetAttribute<int64_t>("K")),
        n(Ort::ConstKernelInfo(info).GetAttribute<int64_t>("N")),
        int_scales(int_scales_of(info, "qs.Int4MatMul")),
        prologue(Ort::ConstKernelInfo(info), k, 3, "qs.Int4MatMul") {
    if (k <= 0 || n <= 0 || k % kBlock)
      throw std::invalid_argument("qs.Int4MatMul: K must be a positive multiple of 32 and N positive");
    if (int_scales && k > kMaxIntScalesK)
      throw std::invalid_argument("qs.Int4MatMul: with int_scales K must be at most 131072 (the int32 sums)");
    Ort::ConstKernelInfo ki(info);
    weight_bytes = static_cast<size_t>((n + kPanel - 1) / kPanel * panel_bytes_of(k / kBlock, int_scales));
    constant_weight = static_cast<const uint8_t*>(qs_constant_input(ki, 1, weight_bytes));
    constant_bias = static_cast<const float*>(qs_constant_input(ki, 2, static_cast<size_t>(n)));
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    std::vector<int64_t> shape = ctx.GetInput(0).GetTensorTypeAndShapeInfo().GetShape();
    Problem p{};
    p.x = qs_bind_prologue(prologue, ctx, shape, "qs.Int4MatMul");
    p.k = k;
    p.n = n;
    p.blocks = k / kBlock;
    p.panels = (n + kPanel - 1) / kPanel;
    p.int_scales = int_scales;
    p.panel_bytes = panel_bytes_of(p.blocks, int_scales);
    p.w = static_cast<const uint8_t*>(qs_sized_input(
        ctx, 1, weight_bytes, constant_weight,
        int_scales ? "qs.Int4MatMul: the packed weight must hold ceil(N/16) panels of K/32 blocks of 272 bytes and 16 "
                     "float scales"
                   : "qs.Int4MatMul: the packed weight must hold ceil(N/16) panels of K/32 blocks of 288 bytes"));
    const float* bias = qs_bias_input(ctx, 2, n, "qs.Int4MatMul", constant_bias);
    p.y = output_rows(ctx, shape, n, &p.m);
    if (p.m == 0) return;

    const QsTiles tiles = p.m >= (int_scales ? kTileMinRows : kInt4TileMinRows) ? qs_tiles_mode() : QsTiles::kOff;
    thread_local std::vector<float> x_scale;
    p.x_scale = qs_scratch(x_scale, static_cast<size_t>(p.m));
#if defined(__AVX512BW__)           // (elsewhere the mode is always off: tiles.cpp)
    if (tiles != QsTiles::kOff && p.int_scales) {
      quantize_and_run_on_tiles<Problem, TileKernelInt, quantize_tiles>(ctx, tiles, p, p.xt, (p.blocks + 1) / 2);
      qs_add_bias(ctx, p.y, p.m, n, bias);
      return;
    }
#endif
    const int64_t rows = tiles == QsTiles::kOff ? p.m : (p.m + kTileCallRows - 1) / kTileCallRows * kTileCallRows;
    thread_local std::vector<int8_t> xq;
    thread_local std::vector<int32_t> xsum8;
    p.xq = aligned64(qs_scratch(xq, static_cast<size_t>(rows * p.k + 128)));
    std::fill(p.xq + p.m * p.k, p.xq + rows * p.k + 64, int8_t{0});   // (a tile step of 64 k past an odd last block)
    p.xsum8 = qs_scratch(xsum8, static_cast<size_t>(p.m * p.blocks));
    for_each_row<Problem, quantize>(ctx, p, p.m);
    if (tiles == QsTiles::kOff)
      PanelGemm<Problem, Micro, kRows, kPanels>::run(ctx, p, p.m, p.n, 2 * kPanels);
#if defined(__AVX512BW__)
    else
      TileGemm<Problem, TileKernel>::run(ctx, tiles, p, p.m, p.n, 2 * kPanels);
#endif
    qs_add_bias(ctx, p.y, p.m, n, bias);
  }
};

struct Int4MatMulOp : Ort::CustomOpBase<Int4MatMulOp, Int4MatMulKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new Int4MatMulKernel(api, info); }
  const char* GetName() const { return "Int4MatMul"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  // x, the packed weight; then optional: bias, skip, gamma
  size_t GetInputTypeCount() const { return 5; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i < 2 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  // y; then optional: the residual sum (skip RMS norm)
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return i == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
};

// qs.Int4Gather: rows of a table packed for qs.Int4MatMul (pack_panels of the table transposed: K = H, N = V), so
// a tied int4 embedding is stored once for the lookup and the LM head:
//     ids [...] int64, packed uint8 [ceil(V/16), H/32 · 288]  →  out [..., H] float,  out[..., h] = float(u − 8) · s
// (with int_scales: [ceil(V/16), H/32 · 272 + 64], out[..., h] = float((u − 8) · m) · S)
struct Int4GatherKernel {
  int64_t k, vocab;
  bool int_scales;

  Int4GatherKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    k = ki.GetAttribute<int64_t>("K");
    vocab = ki.GetAttribute<int64_t>("N");
    int_scales = int_scales_of(info, "qs.Int4Gather");
    if (k <= 0 || k % kBlock || vocab <= 0)
      throw std::invalid_argument("qs.Int4Gather: K must be a positive multiple of 32 and N positive");
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto ids = ctx.GetInput(0);
    auto packed = ctx.GetInput(1);
    const int64_t blocks = k / kBlock, panel_bytes = panel_bytes_of(blocks, int_scales);
    const int64_t block_bytes = int_scales ? kIntBlockBytes : kBlockBytes;
    if (packed.GetTensorTypeAndShapeInfo().GetElementCount() !=
        static_cast<size_t>((vocab + kPanel - 1) / kPanel * panel_bytes))
      throw std::invalid_argument(int_scales ? "qs.Int4Gather: the packed table must hold ceil(N/16) panels of K/32 "
                                               "blocks of 272 bytes and 16 float scales"
                                             : "qs.Int4Gather: the packed table must hold ceil(N/16) panels of K/32 "
                                               "blocks of 288 bytes");
    std::vector<int64_t> shape = ids.GetTensorTypeAndShapeInfo().GetShape();
    const size_t count = ids.GetTensorTypeAndShapeInfo().GetElementCount();
    shape.push_back(k);
    float* out = ctx.GetOutput(0, shape).GetTensorMutableData<float>();
    const int64_t* id = ids.GetTensorData<int64_t>();
    const uint8_t* table = packed.GetTensorData<uint8_t>();
    for (size_t i = 0; i < count; ++i, out += k) {
      const int64_t t = id[i];
      if (t < 0 || t >= vocab)
        throw std::out_of_range("qs.Int4Gather: token id " + std::to_string(t) + " outside the vocabulary");
      const int64_t ch = t % kPanel;
      const uint8_t* panel = table + (t / kPanel) * panel_bytes;
      float channel_scale = 0.0f;
      if (int_scales) std::memcpy(&channel_scale, panel + blocks * kIntBlockBytes + 4 * ch, 4);
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = panel + b * block_bytes;
        float s = channel_scale;
        int m = 1;
        if (int_scales) {
          m = block[256 + ch];
        } else {
          uint16_t h;
          std::memcpy(&h, block + 256 + 2 * ch, 2);
          s = half_to_float(h);
        }
        for (int64_t kk = 0; kk < kBlock; ++kk) {      // k = 8c + 4·nibble + j
          const uint8_t byte = block[(kk / 8) * 64 + ch * 4 + kk % 4];
          const int u = (kk % 8) < 4 ? (byte & 0x0F) : (byte >> 4);
          out[b * kBlock + kk] = static_cast<float>((u - 8) * m) * s;
        }
      }
    }
  }
};

struct Int4GatherOp : Ort::CustomOpBase<Int4GatherOp, Int4GatherKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new Int4GatherKernel(api, info); }
  const char* GetName() const { return "Int4Gather"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* qs_int4_gather_op() {
  static Int4GatherOp op;
  return &op;
}

const OrtCustomOp* qs_int4_matmul_op() {
  static Int4MatMulOp op;
  return &op;
}
