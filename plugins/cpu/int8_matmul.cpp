// qs.Int8MatMul: y = x @ W for an int8 weight, with the activations quantized row by row, in one op:
//
//     x [..., K] float ─▶ per row: scale a = max|x|/127, x_q = round(x / a) + 128         (qs.RowQuantize)
//                     ─▶ acc[n] = Σ_k (x_q[k] − 128) · W[k, n]     exact int32
//                     ─▶ y[n] = (float(acc[n]) · w_scale[n]) · a                           [..., N]
//
// which is bit for bit what RowQuantize + MatMulIntegerToFloat computed (ONNX Runtime scales by the weight's
// channel scale first, then by the row's; tests/unit/test_cpu_ops.py checks every bit). Two ops were 242 of a
// smollm2 decode step's ~420 dispatches; and at batch 1 the step streams 134 MB of int8 weights, which MLAS's
// M=1 path read at ~15.7 GB/s on a 2-core Xeon where this kernel reads them at ~20 GB/s (and faster since it asks
// for them ahead: qs_stream_ahead in ops.h).
//
// The weight comes packed by the compiler (compile/quantize/int8.py `pack_panels`): panels of 16 output
// channels, each K rounded up to 4 and stored as [K/4][16 channels][4 k] int8, so one 64-byte load holds four
// k of sixteen channels — what vpmaddubsw (u8 × s8 → pairs summed in int16) and vpmaddwd (→ int32) consume.
// The 7-bit weights (±63) keep those int16 pair sums exact (255·63·2 < 2^15). `w_zsum` holds 128·Σ_k W[k, n],
// so the zero point 128 comes off once per output instead of once per product.
//
// Every output is one row's dot product with one channel in the same order whatever M, the task split or the
// thread, and the integer sum is exact anyway: a row's result never depends on the rows beside it.
//
// Like qs.Int4MatMul it may take in the ops around it (QsPrologue in ops.h, each bitwise the op it replaces): a bias
// (input 4), SwiGLU or a skip RMS norm (skip and gamma: inputs 5 and 6; the residual: output 1) as its prologue.
#include <algorithm>
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

constexpr int64_t kPanel = 16;        // output channels per packed panel
constexpr int kMaxRows = 4;           // rows of x per micro-kernel call
constexpr int kMaxPanels = 4;         // panels per micro-kernel call

struct Problem {
  QsPrologueRows x;         // the rows the product quantizes: the input's, or its prologue's
  const int8_t* w;          // [panels][K4/4][16][4]
  const float* w_scale;     // [N]
  const int32_t* w_zsum;    // [N]
  float* y;                 // [M, N]
  uint8_t* xq;              // [M, K4] (the vector kernels)
  TiledRows<uint8_t> xt;    // tiles: x_q as whole tiles, lda bytes a row (quantize_tiles)
  float* x_scale;           // [M]
  int64_t m, k, k4, lda, n, panels;
};

// Out = (float(acc − zsum) · w_scale) · a, for `valid` channels of one panel (ONNX Runtime's order of the two
// scalings; no add, so nothing a compiler could fuse into an FMA).
inline void finish(const int32_t* acc, const Problem& p, int64_t row, int64_t col0) {
  const int64_t valid = std::min<int64_t>(kPanel, p.n - col0);
  const float a = p.x_scale[row];
  float* out = p.y + row * p.n + col0;
  for (int64_t c = 0; c < valid; ++c) {
    float v = static_cast<float>(acc[c] - p.w_zsum[col0 + c]) * p.w_scale[col0 + c];
    out[c] = v * a;
  }
}

#if defined(__AVX512BW__)

template <int R, int P>
void micro(const Problem& p, int64_t row0, int64_t panel0) {
  const int64_t steps = p.k4 / 4, panel_bytes = p.k4 * kPanel;
  const int8_t* w0 = p.w + panel0 * panel_bytes;
  const uint8_t* a0 = p.xq + row0 * p.lda;
  [[maybe_unused]] const __m512i ones = _mm512_set1_epi16(1);
  __m512i acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q) acc[r][q] = _mm512_setzero_si512();
  const bool ahead = first_rows(row0);
  for (int64_t s = 0; s < steps; ++s) {
    __m512i b[P];
    for (int q = 0; q < P; ++q) {
      if (ahead) qs_stream_ahead(w0 + q * panel_bytes + s * 64);
      b[q] = _mm512_loadu_si512(w0 + q * panel_bytes + s * 64);
    }
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, a0 + r * p.lda + 4 * s, 4);
      const __m512i a = _mm512_set1_epi32(four);
      for (int q = 0; q < P; ++q)
#if defined(__AVX512VNNI__)
        acc[r][q] = _mm512_dpbusd_epi32(acc[r][q], a, b[q]);     // the same exact sums in one instruction
#else
        acc[r][q] = _mm512_add_epi32(acc[r][q], _mm512_madd_epi16(_mm512_maddubs_epi16(a, b[q]), ones));
#endif
    }
  }
  for (int q = 0; q < P; ++q) {            // finish() sixteen channels at a time, the same operations
    const int64_t col0 = (panel0 + q) * kPanel, valid = std::min<int64_t>(kPanel, p.n - col0);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    const __m512i zsum = _mm512_maskz_loadu_epi32(mask, p.w_zsum + col0);
    const __m512 scale = _mm512_maskz_loadu_ps(mask, p.w_scale + col0);
    for (int r = 0; r < R; ++r) {
      __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][q], zsum)), scale);
      _mm512_mask_storeu_ps(p.y + (row0 + r) * p.n + col0, mask, _mm512_mul_ps(v, _mm512_set1_ps(p.x_scale[row0 + r])));
    }
  }
}

// On AMX tiles: ChunkedTiles (panel_gemm.h) over the activations as tiles (quantize_tiles, unsigned, zero point
// 128) and the weight's panels as packed — [16 (k/4)][16 channels][4 k] a 64-k step is the layout TDPBUSD reads, 1 KB
// a step — so the sums are the vector kernel's exact int32 sums, finished by the same vector code.
struct TileKernel : ChunkedTiles {
  template <class Tiles>
  static void run(const Problem& p, int64_t row_begin, int nr, int64_t panel0, int np) {
    const int64_t steps = p.lda / 64, tile_rows = (nr + 31) / 32 * 32, panel_bytes = p.k4 * kPanel;
    int32_t* sums = ChunkedTiles::sums(np, tile_rows);
    // one block of 32 rows (a verification's or a short prompt's) takes K whole: its rows stay in L1 anyway, and
    // putting the C tiles back every chunk made 16 rows of the down projection 1.1x the time
    const int64_t chunk = nr <= 32 ? steps : kChunkSteps;
    const uint8_t* a = p.xt.tile(row_begin / 16);
    const int8_t* b[kGroupPanels];
    for (int64_t s0 = 0; s0 < steps; s0 += chunk) {
      const int64_t sn = std::min(chunk, steps - s0);
      const bool part_step = (s0 + sn) * 64 > p.k4;       // K4 not a multiple of 64: the last step is a part one
      for (int q = 0; q < np; ++q) b[q] = p.w + (panel0 + q) * panel_bytes + s0 * 1024;
      if (sn > 1 || !part_step)
        ChunkedTiles::add<Tiles, true>(nr, np, sn - part_step, s0 == 0, tile_rows, sums, a + s0 * 1024,
                                       steps * 1024, b);
      if (part_step) {                                     // from a copy, zero past K4 (the panels end there)
        thread_local std::vector<int8_t> tail_storage;
        int8_t* tail = aligned64(qs_scratch(tail_storage, static_cast<size_t>(np * 1024 + 64)));
        const int64_t last = s0 + sn - 1, bytes = (p.k4 - last * 64) * kPanel;
        for (int q = 0; q < np; ++q) {
          std::memcpy(tail + q * 1024, b[q] + (sn - 1) * 1024, static_cast<size_t>(bytes));
          std::memset(tail + q * 1024 + bytes, 0, static_cast<size_t>(1024 - bytes));
          b[q] = tail + q * 1024;
        }
        ChunkedTiles::add<Tiles, true>(nr, np, 1, last == 0, tile_rows, sums, a + last * 1024, steps * 1024, b);
      }
    }
    for (int r = 0; r < nr; ++r) {          // the vector kernel's finish, operation for operation
      const int64_t row = row_begin + r;
      for (int q = 0; q < np; ++q) {
        const int64_t col0 = (panel0 + q) * kPanel, valid = std::min<int64_t>(kPanel, p.n - col0);
        const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
        const __m512i zsum = _mm512_maskz_loadu_epi32(mask, p.w_zsum + col0);
        const __m512 scale = _mm512_maskz_loadu_ps(mask, p.w_scale + col0);
        const __m512i sum = _mm512_load_si512(ChunkedTiles::row_sums(sums, tile_rows, r, q));
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum, zsum)), scale);
        _mm512_mask_storeu_ps(p.y + row * p.n + col0, mask, _mm512_mul_ps(v, _mm512_set1_ps(p.x_scale[row])));
      }
    }
  }
};

#elif defined(__AVX2__)

// A panel is two 256-bit halves (8 channels each); R rows × P panels × 2 halves of accumulators fit the 16
// ymm registers only for R·P ≤ 4, so the AVX2 kernel is called with at most 2 × 2.
template <int R, int P>
void micro(const Problem& p, int64_t row0, int64_t panel0) {
  static_assert(R * P <= 4, "R·P·2 accumulators, P·2 weights and the row must fit 16 ymm registers");
  const int64_t steps = p.k4 / 4, panel_bytes = p.k4 * kPanel;
  const int8_t* w0 = p.w + panel0 * panel_bytes;
  const uint8_t* a0 = p.xq + row0 * p.lda;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[R][P][2];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q) acc[r][q][0] = acc[r][q][1] = _mm256_setzero_si256();
  for (int64_t s = 0; s < steps; ++s) {
    __m256i b[P][2];
    for (int q = 0; q < P; ++q)
      for (int h = 0; h < 2; ++h)
        b[q][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + q * panel_bytes + s * 64 + h * 32));
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, a0 + r * p.lda + 4 * s, 4);
      const __m256i a = _mm256_set1_epi32(four);
      for (int q = 0; q < P; ++q)
        for (int h = 0; h < 2; ++h)
          acc[r][q][h] = _mm256_add_epi32(acc[r][q][h], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b[q][h]), ones));
    }
  }
  alignas(32) int32_t lanes[kPanel];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[r][q][0]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes + 8), acc[r][q][1]);
      finish(lanes, p, row0 + r, (panel0 + q) * kPanel);
    }
}

#else

template <int R, int P>
void micro(const Problem& p, int64_t row0, int64_t panel0) {
  const int64_t steps = p.k4 / 4, panel_bytes = p.k4 * kPanel;
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q) {
      const int8_t* w = p.w + (panel0 + q) * panel_bytes;
      const uint8_t* a = p.xq + (row0 + r) * p.lda;
      int32_t lanes[kPanel] = {};
      for (int64_t s = 0; s < steps; ++s)
        for (int c = 0; c < kPanel; ++c)
          for (int j = 0; j < 4; ++j) lanes[c] += int32_t{a[4 * s + j]} * int32_t{w[s * 64 + c * 4 + j]};
      finish(lanes, p, row0 + r, (panel0 + q) * kPanel);
    }
}

#endif

#if defined(__AVX512BW__) || !defined(__AVX2__)
constexpr int kRowsPerCall = kMaxRows, kPanelsPerCall = kMaxPanels;
#else
constexpr int kRowsPerCall = 2, kPanelsPerCall = 2;
#endif

template <int R, int P>
struct Micro {
  static void run(const Problem& p, int64_t row0, int64_t panel0) { micro<R, P>(p, row0, panel0); }
};

void quantize(const Problem& p, int64_t row) {
  uint8_t* q = p.xq + row * p.lda;
  qs_quantize_row(p.x.row(row), p.k, q, p.x_scale + row);
  std::fill(q + p.k, q + p.k4, uint8_t{128});     // meets the packed weight's zero rows
}

#if defined(__AVX512BW__)
// The same row into the tiles' layout (ChunkedTiles), lda bytes: a tile step past K4 zero (× zero weights).
void quantize_tiles(const Problem& p, int64_t row) {
  thread_local std::vector<uint8_t> storage;
  uint8_t* q = qs_scratch(storage, static_cast<size_t>(p.lda));
  qs_quantize_row(p.x.row(row), p.k, q, p.x_scale + row);
  std::fill(q + p.k, q + p.k4, uint8_t{128});
  std::fill(q + p.k4, q + p.lda, uint8_t{0});
  p.xt.scatter(row, q);
}
#endif

struct Int8MatMulKernel {
  int64_t k, n;
  QsPrologue prologue;
  size_t weight_size;                          // the packed weight's: ceil(N/16)·16 × ceil(K/4)·4
  const int8_t* constant_weight = nullptr;    // qs_constant_input: checked once, when the kernel is made
  const float* constant_w_scale = nullptr;
  const int32_t* constant_w_zsum = nullptr;
  const float* constant_bias = nullptr;
  std::string scales_error;                    // made once: Compute builds no string

  Int8MatMulKernel(const OrtApi&, const OrtKernelInfo* info)
      : k(Ort::ConstKernelInfo(info).GetAttribute<int64_t>("K")),
        n(Ort::ConstKernelInfo(info).GetAttribute<int64_t>("N")),
        prologue(Ort::ConstKernelInfo(info), k, 5, "qs.Int8MatMul") {
    if (k <= 0 || n <= 0) throw std::invalid_argument("qs.Int8MatMul: attributes K and N must be positive");
    Ort::ConstKernelInfo ki(info);
    weight_size = static_cast<size_t>((n + kPanel - 1) / kPanel * kPanel * ((k + 3) / 4 * 4));
    constant_weight = static_cast<const int8_t*>(qs_constant_input(ki, 1, weight_size));
    constant_w_scale = static_cast<const float*>(qs_constant_input(ki, 2, static_cast<size_t>(n)));
    constant_w_zsum = static_cast<const int32_t*>(qs_constant_input(ki, 3, static_cast<size_t>(n)));
    constant_bias = static_cast<const float*>(qs_constant_input(ki, 4, static_cast<size_t>(n)));
    scales_error = "qs.Int8MatMul: w_scale and w_zsum must hold N = " + std::to_string(n) + " values";
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    std::vector<int64_t> shape = ctx.GetInput(0).GetTensorTypeAndShapeInfo().GetShape();
    Problem p{};
    p.x = qs_bind_prologue(prologue, ctx, shape, "qs.Int8MatMul");
    p.k = k;
    p.n = n;
    p.k4 = (k + 3) / 4 * 4;
    p.panels = (n + kPanel - 1) / kPanel;
    p.w = static_cast<const int8_t*>(qs_sized_input(
        ctx, 1, weight_size, constant_weight,
        "qs.Int8MatMul: the packed weight must hold ceil(N/16)·16 × ceil(K/4)·4 values"));
    const float* bias = qs_bias_input(ctx, 4, n, "qs.Int8MatMul", constant_bias);
    p.y = output_rows(ctx, shape, n, &p.m);
    if (p.m == 0) return;
    const size_t nn = static_cast<size_t>(n);
    p.w_scale = static_cast<const float*>(qs_sized_input(ctx, 2, nn, constant_w_scale, scales_error.c_str()));
    p.w_zsum = static_cast<const int32_t*>(qs_sized_input(ctx, 3, nn, constant_w_zsum, scales_error.c_str()));

    thread_local std::vector<float> x_scale;
    p.x_scale = qs_scratch(x_scale, static_cast<size_t>(p.m));
    [[maybe_unused]] const QsTiles tiles = p.m >= kTileMinRows ? qs_tiles_mode() : QsTiles::kOff;
#if defined(__AVX512BW__)           // (elsewhere the mode is always off: tiles.cpp)
    if (tiles != QsTiles::kOff) {
      p.lda = (p.k4 + 63) / 64 * 64;                  // whole tile steps
      quantize_and_run_on_tiles<Problem, TileKernel, quantize_tiles>(ctx, tiles, p, p.xt, p.lda / 64);
      qs_add_bias(ctx, p.y, p.m, n, bias);
      return;
    }
#endif
    p.lda = p.k4;
    thread_local std::vector<uint8_t> xq;
    p.xq = qs_scratch(xq, static_cast<size_t>(p.m * p.lda));
    for_each_row<Problem, quantize>(ctx, p, p.m);
    PanelGemm<Problem, Micro, kRowsPerCall, kPanelsPerCall>::run(ctx, p, p.m, p.n, kPanelsPerCall);
    qs_add_bias(ctx, p.y, p.m, n, bias);
  }
};

struct Int8MatMulOp : Ort::CustomOpBase<Int8MatMulOp, Int8MatMulKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new Int8MatMulKernel(api, info); }
  const char* GetName() const { return "Int8MatMul"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  // x, the packed weight, w_scale, w_zsum; then optional: bias, skip, gamma
  size_t GetInputTypeCount() const { return 7; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8
                  : i == 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i < 4 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  // y; then optional: the residual sum (skip RMS norm)
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return i == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
};

}  // namespace

const OrtCustomOp* qs_int8_matmul_op() {
  static Int8MatMulOp op;
  return &op;
}

// qs.PackedGather: rows of an int8 table that is packed for qs.Int8MatMul, so a tied embedding is stored once
// and serves both the lookup and the LM head (x @ table.T):
//
//     ids [...] int64, packed [panels, ceil(H/4)·64] int8 (pack_panels of the table transposed: K = H, N = V),
//     scale [V] float  →  out [..., H] float,   out[..., h] = float(table[id, h]) · scale[id]
//
// — the product the Gather → Transpose → Cast → Mul lookup computed, one rounding, bit for bit.
namespace {

struct PackedGatherKernel {
  int64_t k;

  PackedGatherKernel(const OrtApi&, const OrtKernelInfo* info) {
    k = Ort::ConstKernelInfo(info).GetAttribute<int64_t>("K");
    if (k <= 0) throw std::invalid_argument("qs.PackedGather: attribute K must be positive");
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto ids = ctx.GetInput(0);
    auto packed = ctx.GetInput(1);
    auto scale = ctx.GetInput(2);
    std::vector<int64_t> shape = ids.GetTensorTypeAndShapeInfo().GetShape();
    const int64_t vocab = static_cast<int64_t>(scale.GetTensorTypeAndShapeInfo().GetElementCount());
    const int64_t k4 = (k + 3) / 4 * 4, panel_bytes = k4 * kPanel;
    if (packed.GetTensorTypeAndShapeInfo().GetElementCount() !=
        static_cast<size_t>((vocab + kPanel - 1) / kPanel * panel_bytes))
      throw std::invalid_argument("qs.PackedGather: the packed table must hold ceil(V/16)·16 × ceil(K/4)·4 values");
    const size_t count = ids.GetTensorTypeAndShapeInfo().GetElementCount();
    shape.push_back(k);
    float* out = ctx.GetOutput(0, shape).GetTensorMutableData<float>();
    const int64_t* id = ids.GetTensorData<int64_t>();
    const int8_t* table = packed.GetTensorData<int8_t>();
    const float* s = scale.GetTensorData<float>();
    for (size_t i = 0; i < count; ++i, out += k) {
      const int64_t t = id[i];
      if (t < 0 || t >= vocab)
        throw std::out_of_range("qs.PackedGather: token id " + std::to_string(t) + " outside the vocabulary");
      const int8_t* panel = table + (t / kPanel) * panel_bytes + (t % kPanel) * 4;
      for (int64_t h = 0; h < k; ++h) out[h] = static_cast<float>(panel[(h / 4) * 64 + h % 4]) * s[t];
    }
  }
};

struct PackedGatherOp : Ort::CustomOpBase<PackedGatherOp, PackedGatherKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new PackedGatherKernel(api, info); }
  const char* GetName() const { return "PackedGather"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    static constexpr ONNXTensorElementDataType types[] = {
        ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
    return types[i];
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* qs_packed_gather_op() {
  static PackedGatherOp op;
  return &op;
}
