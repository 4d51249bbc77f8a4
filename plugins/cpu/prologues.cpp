// What a linear may compute before it quantizes its input row (qs.Int4MatMul's `prologue`), so a decode step runs one
// op where it ran two: at batch 1 each op's dispatch costs more than its arithmetic (qwen2.5-0.5b int4: ~9.6 µs
// per SkipSimplifiedLayerNormalization, ~8.2 per SwiGLU, 48 and 24 of them a step). Each is bitwise the op it
// replaces, so folding changes no logit.
#include <algorithm>
#include <cmath>
#include <cstdint>

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
// without contraction, as that kernel is), then a division and a multiplication per element.
__attribute__((optimize("fp-contract=off")))
void qs_skip_rms_norm_row(const float* x, const float* skip, const float* gamma, int64_t k, float epsilon, float* sum,
                          float* out) {
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
