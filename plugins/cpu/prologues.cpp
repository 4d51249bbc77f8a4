// What a linear may compute before it quantizes its input row (qs.Int4MatMul's `prologue`), so a decode step runs one
// op where it ran two: at batch 1 each op's dispatch costs more than its arithmetic (qwen2.5-0.5b int4: ~9.6 µs
// per SkipSimplifiedLayerNormalization, ~8.2 per SwiGLU, 48 and 24 of them a step). Each is bitwise the op it
// replaces, so folding changes no logit.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops.h"

namespace {
constexpr int kBlock = 256;            // elements per pass (the exp's scratch stays in L1)
}

// In a fixed order:   e = exp(-|g|),   sigmoid(g) = g ≥ 0 ? 1 / (1 + e) : e / (1 + e),   out = g · sigmoid(g) · u
void qs_swiglu_row(const float* __restrict x, int64_t f, float* __restrict out) {
  alignas(64) float e[kBlock];
  for (int64_t i0 = 0; i0 < f; i0 += kBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kBlock, f - i0));
    const float* g = x + i0;
    const float* u = x + f + i0;
    for (int i = 0; i < n; ++i) e[i] = -std::fabs(g[i]);
    qs_exp_inplace(e, n);
    for (int i = 0; i < n; ++i) {
      float s = (g[i] >= 0.0f ? 1.0f : e[i]) / (1.0f + e[i]);
      out[i0 + i] = g[i] * s * u[i];
    }
  }
}

// ONNX Runtime's float kernel (contrib_ops/cpu/skip_layer_norm.cc, ComputeJob) step for step: the sum of squares
// in element order, each square rounded before it is added (no fused multiply-add: this function is compiled
// without contraction, as that kernel is — GCC by the attribute, Clang by the pragma), then a division and a
// multiplication per element.
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
void qs_skip_rms_norm_row(const float* x, const float* skip, const float* gamma, int64_t k, float epsilon, float* sum,
                          float* out) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  float squares = 0.0f;
  for (int64_t h = 0; h < k; ++h) {
    const float v = x[h] + skip[h];
    if (sum != nullptr) sum[h] = v;
    out[h] = v;
    squares += v * v;
  }
  const float rms = std::sqrt(squares / static_cast<float>(k) + epsilon);
  for (int64_t h = 0; h < k; ++h) out[h] = out[h] / rms * gamma[h];
}

// Whether the node has the attribute, of any type (ONNX Runtime's API reads one type at a time).
static bool has_attribute(const Ort::ConstKernelInfo& info, const char* name) {
  auto read = [&](auto type) {
    try {
      info.GetAttribute<decltype(type)>(name);
      return true;
    } catch (const Ort::Exception&) {
      return false;
    }
  };
  return read(int64_t{}) || read(float{}) || read(std::string{});
}

const void* qs_constant_input(const Ort::ConstKernelInfo& info, size_t index, size_t count) {
  if (index >= info.GetInputCount()) return nullptr;
  int is_constant = 0;
  Ort::ConstValue value{nullptr};
  try {
    value = info.GetTensorConstantInput(index, &is_constant);
  } catch (const Ort::Exception&) {
    return nullptr;
  }
  if (!is_constant || value == nullptr || !value.IsTensor() || value.GetTensorTypeAndShapeInfo().GetElementCount() != count)
    return nullptr;
  return value.GetTensorRawData();
}

const void* qs_sized_input(Ort::KernelContext& ctx, size_t index, size_t count, const void* constant, const char* error) {
  if (constant != nullptr) return constant;
  auto value = ctx.GetInput(index);
  if (value == nullptr || value.GetTensorTypeAndShapeInfo().GetElementCount() != count) throw std::invalid_argument(error);
  return value.GetTensorRawData();
}

QsPrologue::QsPrologue(const Ort::ConstKernelInfo& info, int64_t k_, size_t skip_input_, const char* op)
    : k(k_), skip_input(skip_input_) {
  const std::string name(op);
  if (has_attribute(info, "prologue")) {    // absent in graphs without a prologue
    try {
      kind = info.GetAttribute<int64_t>("prologue");
    } catch (const Ort::Exception&) {
      throw std::invalid_argument(name + ": the prologue attribute must be an integer");
    }
  }
  if (kind < kNone || kind > kSkipRmsNorm)
    throw std::invalid_argument(name + ": prologue must be 0 (none), 1 (SwiGLU) or 2 (skip RMS norm)");
  if (kind == kSkipRmsNorm) {
    epsilon = info.GetAttribute<float>("epsilon");
    gamma = static_cast<const float*>(qs_constant_input(info, skip_input + 1, static_cast<size_t>(k)));
  }
}

// Row by row into a scratch row of the thread that quantizes it next (a whole step's rows staged at once were M × K
// floats kept per thread: ~300 MB for a 4,096-token step through an 18,944-wide down projection).
const float* QsPrologueRows::row(int64_t r) const {
  const int64_t k = prologue->k;
  if (prologue->kind == QsPrologue::kNone) return x + r * k;
  thread_local std::vector<float> staged;
  float* out = qs_scratch(staged, static_cast<size_t>(k));
  if (prologue->kind == QsPrologue::kSwiGLU)
    qs_swiglu_row(x + r * 2 * k, k, out);
  else
    qs_skip_rms_norm_row(x + r * k, skip + r * k, gamma, k, prologue->epsilon,
                         residual != nullptr ? residual + r * k : nullptr, out);
  return out;
}

QsPrologueRows qs_bind_prologue(const QsPrologue& prologue, Ort::KernelContext& ctx, const std::vector<int64_t>& x_shape,
                                const char* op) {
  const std::string name(op);
  const int64_t width = prologue.width();
  if (x_shape.empty() || x_shape.back() != width)
    throw std::invalid_argument(name + ": x's last dimension must be " +
                                (prologue.kind == QsPrologue::kSwiGLU ? "2K = " : "K = ") + std::to_string(width));
  QsPrologueRows rows;
  rows.prologue = &prologue;
  rows.x = ctx.GetInput(0).GetTensorData<float>();
  const size_t inputs = ctx.GetInputCount();
  auto input = [&](size_t i) { return inputs > i ? ctx.GetInput(i) : Ort::ConstValue{nullptr}; };
  auto skip = input(prologue.skip_input);
  auto gamma = prologue.gamma ? Ort::ConstValue{nullptr} : input(prologue.skip_input + 1);
  if (prologue.kind != QsPrologue::kSkipRmsNorm) {
    if (skip != nullptr || gamma != nullptr)
      throw std::invalid_argument(name + ": skip and gamma are the skip RMS norm's inputs (prologue 2)");
    if (ctx.GetOutputCount() > 1 && ctx.GetOutput(1, x_shape) != nullptr)
      throw std::invalid_argument(name + ": the residual output comes with the skip RMS norm (prologue 2)");
    return rows;
  }
  const bool gamma_ok = prologue.gamma != nullptr ||
                        (gamma != nullptr && gamma.GetTensorTypeAndShapeInfo().GetElementCount() == static_cast<size_t>(prologue.k));
  if (skip == nullptr || !gamma_ok || skip.GetTensorTypeAndShapeInfo().GetShape() != x_shape)
    throw std::invalid_argument(name + ": the skip RMS norm needs skip shaped as x and gamma of K values");
  rows.skip = skip.GetTensorData<float>();
  rows.gamma = prologue.gamma ? prologue.gamma : gamma.GetTensorData<float>();
  if (ctx.GetOutputCount() > 1) {
    auto residual = ctx.GetOutput(1, x_shape);
    if (residual != nullptr) rows.residual = residual.GetTensorMutableData<float>();
  }
  return rows;
}

const float* qs_bias_input(Ort::KernelContext& ctx, size_t index, int64_t n, const char* op, const float* constant) {
  if (constant != nullptr) return constant;
  if (ctx.GetInputCount() <= index) return nullptr;
  auto bias = ctx.GetInput(index);
  if (bias == nullptr) return nullptr;
  if (bias.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(n))
    throw std::invalid_argument(std::string(op) + ": the bias must hold N = " + std::to_string(n) + " values");
  return bias.GetTensorData<float>();
}

void qs_add_bias(Ort::KernelContext& ctx, float* y, int64_t m, int64_t n, const float* bias) {
  if (bias == nullptr) return;
  qs_for_rows(ctx, m, 64, [&](int64_t row) {
    float* out = y + row * n;
    for (int64_t j = 0; j < n; ++j) out[j] += bias[j];
  });
}
