// Quicksilver's ONNX Runtime ops for cpu engines (domain "qs"), registered by RegisterCustomOps (register.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

const OrtCustomOp* qs_causal_attention_op();   // attention.cpp (float32 cache)
const OrtCustomOp* qs_causal_attention_f16_op();   // attention.cpp (float16 cache, same op name)
const OrtCustomOp* qs_row_quantize_op();       // row_quantize.cpp
const OrtCustomOp* qs_int8_matmul_op();        // int8_matmul.cpp
const OrtCustomOp* qs_packed_gather_op();      // int8_matmul.cpp
const OrtCustomOp* qs_int4_matmul_op();        // int4_matmul.cpp
const OrtCustomOp* qs_int4_gather_op();        // int4_matmul.cpp
const OrtCustomOp* qs_swiglu_op();             // swiglu.cpp

// A decode step streams every weight and its whole KV cache from memory once, and the hardware's own prefetchers left
// the core waiting on it (AMD EPYC Zen 4): one int4 linear of 1 MB over 64 distinct copies, 1 thread, read 11–12
// GB/s where numpy's sum reads ~24. Asking for the line kStreamAhead bytes ahead into L2 as each is consumed gives
// 21 GB/s (2 threads: 21–23 → 25–28; 512 B or 2 KB ahead into L1 gained nothing): the smollm2 int4 batch-1 decode
// step 0.85× the time with the linears asking, then 0.96× / 0.90× / 0.84× at 445 / 1,024 / 2,000 tokens of context
// with attention's keys and values too. With the weights on huge pages (runtime/backends/cpu/weights.py) asking
// 16 KiB ahead rather than 8 took a qwen2.5-0.5b int4 linear's batch-1 read from ~29 to ~32 GB/s of numpy's ~33
// (N = 9,728 and 19,456; 24 and 32 KiB were no better), and its decode step 0.88× the time (batch 4: 0.85×). The
// 16 KiB were measured on huge pages only; weights on 4 KiB pages (--no-huge-pages, no THP) ask as far.
// A prefetch never faults; the address is formed as an integer, so asking past the end of an array is harmless.
// Asks for every cache line of [data, data + bytes) `ahead` bytes on (one line by default; attention's KV asks less
// far: kKvStreamAhead in attention.cpp).
constexpr int64_t kStreamAhead = 16384;
inline void qs_stream_ahead(const void* data, size_t bytes = 1, int64_t ahead = kStreamAhead) {
#if defined(__x86_64__) || defined(__i386__)
  for (size_t at = 0; at < bytes; at += 64)
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(data) + at + ahead), _MM_HINT_T1);
#else
  (void)data;
  (void)bytes;
  (void)ahead;
#endif
}

// A thread's scratch of at least n elements, grown and never shrunk: a vector resized down and back up zeroes the
// regrown part, which the prompts' alternating K (1,536 and 8,960) paid on every product (1.5 % of a prefill).
template <class T>
T* qs_scratch(std::vector<T>& buffer, size_t n) {
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

// One row → uint8 (zero point 128) on its own scale max|x|/127; shared by RowQuantize, Int8MatMul and Int4MatMul.
void qs_quantize_row(const float* __restrict x, int64_t k, uint8_t* __restrict q, float* __restrict scale);

// The ops a linear may take in as its prologue (prologues.cpp), each a row at a time and bitwise the op it replaces:
// qs.SwiGLU's row, silu(gate) · up of x [2f] (gate | up) → out [f];
void qs_swiglu_row(const float* __restrict x, int64_t f, float* __restrict out);
// ONNX Runtime's SkipSimplifiedLayerNormalization's row: sum = x + skip (written where `sum` is not null),
// out = sum / sqrt(Σ sum² / k + epsilon) · gamma, the squares summed in order in float.
void qs_skip_rms_norm_row(const float* x, const float* skip, const float* gamma, int64_t k, float epsilon, float* sum,
                          float* out);

// What a linear (qs.Int4MatMul, qs.Int8MatMul) computes from its input before it quantizes a row, per its
// `prologue` attribute: 0 nothing (x [..., K]); 1 SwiGLU (x [..., 2K] is gate | up); 2 skip RMS norm (inputs
// `skip_input` and `skip_input` + 1 are skip [..., K] and gamma [K], attribute `epsilon`; output 1, where the graph
// asks for it, is x + skip).
struct QsPrologue {
  enum Kind : int64_t { kNone = 0, kSwiGLU = 1, kSkipRmsNorm = 2 };
  int64_t kind = kNone, k = 0;
  float epsilon = 0.0f;
  size_t skip_input = 0;          // the op's input index of skip; gamma's is the next
  const float* gamma = nullptr;   // a constant gamma (qs_constant_input); else read from the call

  QsPrologue(const Ort::ConstKernelInfo& info, int64_t k, size_t skip_input, const char* op);
  int64_t width() const { return kind == kSwiGLU ? 2 * k : k; }
};

// A call's rows: row(r) is what the product quantizes — x's row, or the prologue's, computed into a scratch row of
// the calling thread (valid until its next row()).
struct QsPrologueRows {
  const QsPrologue* prologue = nullptr;
  const float* x = nullptr;
  const float* skip = nullptr;
  const float* gamma = nullptr;
  float* residual = nullptr;

  const float* row(int64_t r) const;
};

// Checks x's shape against the prologue and binds the call's inputs; skip, gamma or the residual output where the
// prologue does not take them are refused too. Throws std::invalid_argument naming `op` on a mismatch.
QsPrologueRows qs_bind_prologue(const QsPrologue& prologue, Ort::KernelContext& ctx, const std::vector<int64_t>& x_shape,
                                const char* op);

// The optional bias [n] at input `index` (`constant` where the kernel took it when it was made, else the call's;
// nullptr where absent), and y[m, n] += bias after the product: the Add it replaces, one rounding after y's.
const float* qs_bias_input(Ort::KernelContext& ctx, size_t index, int64_t n, const char* op,
                           const float* constant = nullptr);

// Input `index` where the graph gives it as a constant initializer (a packed weight, a bias, a norm's gamma) of
// `count` elements: its data, taken when the kernel is made; nullptr where it is absent, not constant or of another
// size (Compute then reads and checks it on every call, and refuses a wrong size). Why: those checks are ONNX Runtime
// API calls (a shape object made and freed) that run on caches a decode step's weights have just flushed, ~0.5 µs
// each, a few per product and ~100 products a step.
const void* qs_constant_input(const Ort::ConstKernelInfo& info, size_t index, size_t count);

// A required input of `count` elements: `constant` where qs_constant_input took it, else the call's, checked
// (std::invalid_argument(error) on another size).
const void* qs_sized_input(Ort::KernelContext& ctx, size_t index, size_t count, const void* constant, const char* error);
void qs_add_bias(Ort::KernelContext& ctx, float* y, int64_t m, int64_t n, const float* bias);

// fn(row) for rows [0, rows), in tasks of `per_task` rows on ONNX Runtime's pool (inline when one task suffices:
// a decode step's few rows are not worth a dispatch). Rows are independent; each is computed the same way
// whichever task takes it.
template <typename F>
void qs_for_rows(Ort::KernelContext& ctx, int64_t rows, int64_t per_task, const F& fn) {
  struct Job {
    const F* fn;
    int64_t rows, per_task;
  } job{&fn, rows, per_task};
  auto task = [](void* user, size_t t) {
    const Job& j = *static_cast<const Job*>(user);
    int64_t end = std::min<int64_t>(j.rows, (static_cast<int64_t>(t) + 1) * j.per_task);
    for (int64_t row = static_cast<int64_t>(t) * j.per_task; row < end; ++row) (*j.fn)(row);
  };
  size_t tasks = static_cast<size_t>((rows + per_task - 1) / per_task);
  if (tasks == 1)
    task(&job, 0);
  else if (tasks > 1)
    ctx.ParallelFor(task, tasks, 0, &job);
}

// exp(x) for x <= 0 (softmax arguments after the max is subtracted; SwiGLU's exp(-|x|)): Cody-Waite range
// reduction and a degree-6 polynomial (Cephes expf), ~1 ulp; plain arithmetic on arrays so the compiler vectorises
// the loop. (The attention op's softmax_exp is the same arithmetic written out, every multiply-add fused.)
constexpr float kQsExpLog2e = 1.44269504088896341f, kQsExpRound = 12582912.0f;  // round(v·log2 e) by 1.5·2^23
constexpr float kQsExpLn2Hi = 0.693359375f, kQsExpLn2Lo = 2.12194440e-4f;      // ln 2 = Hi − Lo
constexpr float kQsExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline void qs_exp_inplace(float* x, int n) {
  for (int i = 0; i < n; ++i) {
    float v = std::max(x[i], -87.0f);
    float t = v * kQsExpLog2e + kQsExpRound;
    float k = t - kQsExpRound;
    float r = v - k * kQsExpLn2Hi + k * kQsExpLn2Lo;
    float p = kQsExpPoly[0];
    p = p * r + kQsExpPoly[1];
    p = p * r + kQsExpPoly[2];
    p = p * r + kQsExpPoly[3];
    p = p * r + kQsExpPoly[4];
    p = p * r + kQsExpPoly[5];
    p = p * r * r + r + 1.0f;
    int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    x[i] = p * scale;
  }
}
