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
#include "tiles.h"

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

// The tasks of a product: (a group of panels, a block of up to row_block rows: kRowBlock unless a tile kernel asks
// for more), group-major. Groups start at group_panels panels and halve until there are tasks enough to keep every
// thread streaming at batch 1.
struct PanelTasks {
  static constexpr int64_t kPanel = 16;
  int64_t m, panels, group, row_block, row_blocks, groups;

  PanelTasks(int64_t rows, int64_t n, int64_t group_panels, int64_t rows_per_block = kRowBlock)
      : m(rows), panels((n + kPanel - 1) / kPanel), group(group_panels), row_block(rows_per_block),
        row_blocks((rows + rows_per_block - 1) / rows_per_block) {
    while (group > 1 && row_blocks * ((panels + group - 1) / group) < 8) group /= 2;
    groups = (panels + group - 1) / group;
  }
  size_t count() const { return static_cast<size_t>(row_blocks * groups); }
  // task → rows [row_begin, row_end) and panels [panel_begin, panel_end)
  void bounds(size_t index, int64_t* row_begin, int64_t* row_end, int64_t* panel_begin, int64_t* panel_end) const {
    const int64_t g = static_cast<int64_t>(index) / row_blocks, block = static_cast<int64_t>(index) % row_blocks;
    *row_begin = block * row_block;
    *row_end = std::min(m, (block + 1) * row_block);
    *panel_begin = g * group;
    *panel_end = std::min(panels, (g + 1) * group);
  }
};

// Micro<R, P>::run(problem, first row, first panel): R rows × P panels, 1 ≤ R ≤ Rows, 1 ≤ P ≤ Panels.
template <class Problem, template <int, int> class Micro, int Rows, int Panels>
class PanelGemm {
 public:
  static constexpr int64_t kPanel = PanelTasks::kPanel;

  // m rows of x, n output channels; groups start at group_panels panels
  static void run(Ort::KernelContext& ctx, const Problem& problem, int64_t m, int64_t n, int64_t group_panels) {
    Job job{&problem, PanelTasks(m, n, group_panels)};
    ctx.ParallelFor(task, job.tasks.count(), 0, &job);
  }

 private:
  using Fn = void (*)(const Problem&, int64_t, int64_t);

  struct Job {
    const Problem* problem;
    PanelTasks tasks;
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
    int64_t row_begin, row_end, panel_begin, panel_end;
    job.tasks.bounds(index, &row_begin, &row_end, &panel_begin, &panel_end);
    for (int64_t panel = panel_begin; panel < panel_end; panel += Panels) {
      const int np = static_cast<int>(std::min<int64_t>(Panels, panel_end - panel));
      for (int64_t row = row_begin; row < row_end; row += Rows) {
        const int nr = static_cast<int>(std::min<int64_t>(Rows, row_end - row));
        kMicro[nr - 1][np - 1](*job.problem, row, panel);
      }
    }
  }
};

// Rows of x are padded with zero rows to a multiple of this for the tile kernels (two 16-row tiles).
constexpr int64_t kTileCallRows = 32;

// The first 64-byte boundary at or after `data` (of a buffer allocated 64 bytes longer): a tile row that straddles
// two cache lines loads 1.3x slower from L1, and worse beyond it.
template <class T>
T* aligned64(T* data) {
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(data) + 63) & ~uintptr_t{63});
}

#if defined(__x86_64__)
// The same tasks on AMX tiles, hardware or emulated (tiles.h), of Kernel::kTaskRows rows: Kernel::config() once per
// task (the tile registers are per thread), then Kernel::run(problem, first row, rows ≤ Kernel::kCallRows, first
// panel, panels ≤ Kernel::kCallPanels) over the task, then the tiles released.
template <class Problem, class Kernel>
class TileGemm {
 public:
  static void run(Ort::KernelContext& ctx, QsTiles mode, const Problem& problem, int64_t m, int64_t n,
                  int64_t group_panels) {
    qs_count_tile_product();
    Job job{&problem, PanelTasks(m, n, group_panels, Kernel::kTaskRows)};
    ctx.ParallelFor(mode == QsTiles::kHardware ? task<HardwareTiles> : task<EmulatedTiles>, job.tasks.count(), 0,
                    &job);
  }

 private:
  struct Job {
    const Problem* problem;
    PanelTasks tasks;
  };

  template <class Tiles>
  static void task(void* user, size_t index) {
    const Job& job = *static_cast<const Job*>(user);
    int64_t row_begin, row_end, panel_begin, panel_end;
    job.tasks.bounds(index, &row_begin, &row_end, &panel_begin, &panel_end);
    Tiles::begin(Kernel::config());
    for (int64_t panel = panel_begin; panel < panel_end; panel += Kernel::kCallPanels) {
      const int np = static_cast<int>(std::min<int64_t>(Kernel::kCallPanels, panel_end - panel));
      for (int64_t row = row_begin; row < row_end; row += Kernel::kCallRows)
        Kernel::template run<Tiles>(*job.problem, row,
                                    static_cast<int>(std::min<int64_t>(Kernel::kCallRows, row_end - row)), panel, np);
    }
    Tiles::end();
  }
};
#endif
