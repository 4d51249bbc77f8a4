// qs.SwiGLU: x [..., 2F] (gate | up, as the fused gate_up projection writes them) → silu(gate) · up [..., F].
//
// One op for the four a cpu MLP used between its two linears (Split, Sigmoid and Mul, which ONNX Runtime fuses
// into QuickGelu, and Mul): at batch 1 each op's dispatch costs more than its arithmetic (~9 µs a layer for the
// three, ~3 % of a smollm2 int8 decode step), and the gate and up halves are read once, not copied by Split.
// A row's result depends on that row alone (batch invariance): qs_swiglu_row (prologues.cpp), which qs.Int4MatMul
// also runs as its prologue where the compiler folds this op into the down projection.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "ops.h"

namespace {

constexpr int64_t kRowsPerTask = 8;

struct SwiGLUKernel {
  SwiGLUKernel(const OrtApi&, const OrtKernelInfo*) {}

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto x = ctx.GetInput(0);
    std::vector<int64_t> shape = x.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty() || shape.back() % 2) throw std::invalid_argument("qs.SwiGLU: the last dimension must be even (gate | up)");
    const int64_t f = shape.back() / 2;
    int64_t rows = 1;
    for (size_t d = 0; d + 1 < shape.size(); ++d) rows *= shape[d];
    shape.back() = f;
    const float* in = x.GetTensorData<float>();
    float* out = ctx.GetOutput(0, shape).GetTensorMutableData<float>();
    if (f == 0) return;
    qs_for_rows(ctx, rows, kRowsPerTask, [&](int64_t row) { qs_swiglu_row(in + row * 2 * f, f, out + row * f); });
  }
};

struct SwiGLUOp : Ort::CustomOpBase<SwiGLUOp, SwiGLUKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new SwiGLUKernel(api, info); }
  const char* GetName() const { return "SwiGLU"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

const OrtCustomOp* qs_swiglu_op() {
  static SwiGLUOp op;
  return &op;
}
