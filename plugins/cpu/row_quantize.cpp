// qs.RowQuantize: x [..., K] float → (uint8 x_q [..., K], float scale [..., 1]), each row on its own scale:
//
//     scale = max|x_row| · (1/127),   x_q = saturate(round_half_even(x / scale) + 128)
//
// which is what the batch-invariant int8 linears fed MatMulIntegerToFloat through four ONNX Runtime ops (Abs,
// ReduceMax, Mul, QuantizeLinear with zero point 128), bit for bit (tests/unit/test_cpu_ops.py). One op instead
// of four per linear: 121 linears make a smollm2 decode step, and at batch 1 each op's dispatch costs more than
// its arithmetic. An all-zero row gets scale 0 and x_q = 128 (its product is scaled to 0 either way).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "ops.h"

namespace {

constexpr int kLanes = 16;
constexpr int64_t kRowsPerTask = 16;

}  // namespace

void qs_quantize_row(const float* __restrict x, int64_t k, uint8_t* __restrict q, float* __restrict scale) {
  alignas(64) float lane[kLanes] = {};
  int64_t i = 0;
#if defined(__AVX512F__)
  // The same maxima one register at a time (GCC left the loop scalar: vmaxps may not stand for std::max as far as
  // it knows, but max_ps(v, m) is (v > m) ? v : m, which is std::max(m, v) for every input, NaN included).
  static_assert(kLanes == 16, "one 512-bit register of lanes");
  __m512 m = _mm512_setzero_ps();
  for (; i + kLanes <= k; i += kLanes) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), m);
  _mm512_store_ps(lane, m);
#endif
  for (; i + kLanes <= k; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] = std::max(lane[l], std::fabs(x[i + l]));
  for (int l = 0; i < k; ++i, ++l) lane[l] = std::max(lane[l], std::fabs(x[i]));
  float amax = lane[0];
  for (int l = 1; l < kLanes; ++l) amax = std::max(amax, lane[l]);
  const float s = amax * (1.0f / 127.0f);
  *scale = s;
  if (s == 0.0f) {
    std::fill(q, q + k, uint8_t{128});
    return;
  }
  for (int64_t j = 0; j < k; ++j) {
    float v = std::nearbyint(x[j] / s) + 128.0f;
    q[j] = static_cast<uint8_t>(std::min(255.0f, std::max(0.0f, v)));
  }
}

namespace {

struct RowQuantizeKernel {
  RowQuantizeKernel(const OrtApi&, const OrtKernelInfo*) {}

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto x = ctx.GetInput(0);
    std::vector<int64_t> shape = x.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty()) throw std::invalid_argument("qs.RowQuantize: x must have at least one dimension");
    std::vector<int64_t> scale_shape = shape;
    scale_shape.back() = 1;
    const int64_t k = shape.back();
    int64_t rows = 1;
    for (size_t d = 0; d + 1 < shape.size(); ++d) rows *= shape[d];
    const float* in = x.GetTensorData<float>();
    uint8_t* q = ctx.GetOutput(0, shape).GetTensorMutableData<uint8_t>();
    float* scale = ctx.GetOutput(1, scale_shape).GetTensorMutableData<float>();
    if (k == 0) return;
    qs_for_rows(ctx, rows, kRowsPerTask,
                [&](int64_t row) { qs_quantize_row(in + row * k, k, q + row * k, scale + row); });
  }
};

struct RowQuantizeOp : Ort::CustomOpBase<RowQuantizeOp, RowQuantizeKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new RowQuantizeKernel(api, info); }
  const char* GetName() const { return "RowQuantize"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t i) const {
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
};

}  // namespace

const OrtCustomOp* qs_row_quantize_op() {
  static RowQuantizeOp op;
  return &op;
}
