// How qs.Int8MatMul and qs.Int4MatMul spread a product over ONNX Runtime's threads. The weight is packed in panels
// of 16 output channels; a task is (a group of panels, a block of up to 128 rows of x), numbered group-major so
// one group's weights come from memory once and serve every row block from cache; within a task a micro-kernel
// takes up to Rows rows × Panels panels at a time. Groups shrink (down to one panel) until there are enough tasks
// to keep every thread streaming at batch 1. Where a row lands changes nothing: its arithmetic is the kernel's.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "ops.h"

// A task's rows: a block of up to kRowBlock rows of x. Only its first rows ask for the weights ahead
// (qs_stream_ahead, ops.h): the rows after them find the panels in cache, where asking made the smollm2 int8
// prompt 1.10× the time (tools/bench_native.py).
constexpr int64_t kRowBlock = 128;
inline bool first_rows(int64_t row0) { return row0 % kRowBlock == 0; }

// The output [..., n] of a product over x [..., K]: its rows (all but the last dimension of x) and its data.
inline float* output_rows(Ort::KernelContext& ctx, std::vector<int64_t> x_shape, int64_t n, int64_t* rows) {
  *rows = 1;
  for (size_t d = 0; d + 1 < x_shape.size(); ++d) *rows *= x_shape[d];
  x_shape.back() = n;
  return ctx.GetOutput(0, x_shape).GetTensorMutableData<float>();
}

// Row(problem, row) for every row of a product, in tasks of 16 rows (one task runs on the calling thread): the
// kernels' per-row activation quantization.
template <class Problem, void (*Row)(const Problem&, int64_t)>
void for_each_row(Ort::KernelContext& ctx, const Problem& problem, int64_t rows) {
  constexpr int64_t kRowsPerTask = 16;
  struct Job {
    const Problem* problem;
    int64_t rows;
  } job{&problem, rows};
  auto task = [](void* user, size_t index) {
    const Job& j = *static_cast<const Job*>(user);
    const int64_t end = std::min<int64_t>(j.rows, (static_cast<int64_t>(index) + 1) * kRowsPerTask);
    for (int64_t row = static_cast<int64_t>(index) * kRowsPerTask; row < end; ++row) Row(*j.problem, row);
  };
  const size_t tasks = static_cast<size_t>((rows + kRowsPerTask - 1) / kRowsPerTask);
  if (tasks == 1)
    task(&job, 0);
  else
    ctx.ParallelFor(task, tasks, 0, &job);
}

// Micro<R, P>::run(problem, first row, first panel): R rows × P panels, 1 ≤ R ≤ Rows, 1 ≤ P ≤ Panels.
template <class Problem, template <int, int> class Micro, int Rows, int Panels>
class PanelGemm {
 public:
  static constexpr int64_t kPanel = 16;

  // m rows of x, n output channels; groups start at group_panels panels
  static void run(Ort::KernelContext& ctx, const Problem& problem, int64_t m, int64_t n, int64_t group_panels) {
    Job job{&problem, m, (n + kPanel - 1) / kPanel, group_panels, (m + kRowBlock - 1) / kRowBlock, 0};
    while (job.group > 1 && job.row_blocks * ((job.panels + job.group - 1) / job.group) < 8) job.group /= 2;
    job.groups = (job.panels + job.group - 1) / job.group;
    ctx.ParallelFor(task, static_cast<size_t>(job.row_blocks * job.groups), 0, &job);
  }

 private:
  using Fn = void (*)(const Problem&, int64_t, int64_t);

  struct Job {
    const Problem* problem;
    int64_t m, panels, group, row_blocks, groups;
  };

  template <int R, int... P>
  static constexpr std::array<Fn, Panels> row(std::integer_sequence<int, P...>) {
    return {&Micro<R, P + 1>::run...};
  }
  template <int... R>
  static constexpr std::array<std::array<Fn, Panels>, Rows> table(std::integer_sequence<int, R...>) {
    return {row<R + 1>(std::make_integer_sequence<int, Panels>{})...};
  }
  static constexpr std::array<std::array<Fn, Panels>, Rows> kMicro = table(std::make_integer_sequence<int, Rows>{});

  static void task(void* user, size_t index) {
    const Job& job = *static_cast<const Job*>(user);
    const int64_t group = static_cast<int64_t>(index) / job.row_blocks, block = static_cast<int64_t>(index) % job.row_blocks;
    const int64_t row_end = std::min(job.m, (block + 1) * kRowBlock);
    const int64_t panel_end = std::min(job.panels, (group + 1) * job.group);
    for (int64_t panel = group * job.group; panel < panel_end; panel += Panels) {
      const int np = static_cast<int>(std::min<int64_t>(Panels, panel_end - panel));
      for (int64_t row = block * kRowBlock; row < row_end; row += Rows) {
        const int nr = static_cast<int>(std::min<int64_t>(Rows, row_end - row));
        kMicro[nr - 1][np - 1](*job.problem, row, panel);
      }
    }
  }
};
