// How qs.Int8MatMul and qs.Int4MatMul spread a product over ONNX Runtime's threads. The weight is packed in panels
// of 16 output channels; a task is (a group of panels, a block of up to 128 rows of x), numbered group-major so
// one group's weights come from memory once and serve every row block from cache; within a task a micro-kernel
// takes up to Rows rows × Panels panels at a time. Groups shrink (down to one panel) until there are enough tasks
// to keep every thread streaming at batch 1. Where a row lands changes nothing: its arithmetic is the kernel's.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
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

// Rows of activations as ChunkedTiles reads them: `steps` 64-k steps a row, 16 rows' steps making a 1 KB tile,
// one 16-row tile's steps in K order; rows to a multiple of 32.
template <class T>
struct TiledRows {
  T* data;
  int64_t steps;

  T* row(int64_t r) const { return data + r / 16 * steps * 1024 + r % 16 * 64; }     // its steps 1 KB apart
  T* tile(int64_t r16) const { return data + r16 * steps * 1024; }                    // of the 16 rows from r16·16
  // a row's `steps` · 64 bytes from a contiguous copy
  void scatter(int64_t r, const T* from) const {
    T* to = row(r);
    for (int64_t s = 0; s < steps; ++s) std::memcpy(to + s * 1024, from + s * 64, 64);
  }
  // rows [m, rows) zero
  void zero_rows(int64_t m, int64_t rows) const {
    for (int64_t r = m; r < rows; ++r)
      for (int64_t s = 0; s < steps; ++s) std::memset(row(r) + s * 1024, 0, 64);
  }
  // per thread: room for `rows` rows, 64-byte aligned
  static TiledRows scratch(int64_t rows, int64_t steps) {
    thread_local std::vector<T> storage;
    return {aligned64(qs_scratch(storage, static_cast<size_t>(rows * steps * 64 + 64))), steps};
  }
};

#if defined(__x86_64__)
// The tile loop of both integer prompt products (qs.Int8MatMul, and qs.Int4MatMul with integer scales), blocked as a
// GEMM is for its caches. A task is a group of up to kGroupPanels panels and up to kTaskRows rows, its rows'
// activations packed as whole tiles (TiledRows: per 16 rows and 64-k step one contiguous 1 KB tile; strided rows
// from a [M, K] copy spent most of the products' time waiting on their loads, two cache lines a row where
// unaligned, 16 pages a tile, and the down projection's 4 MB from L3 for every pair of panels). K goes a chunk of
// kChunkSteps steps at a time: per pair of panels (its chunk stays in L1) every 32 rows (the chunk of the task's
// rows stays in L2, shared by the group's panels), two row tiles × two panels in four C tiles, taken from and put
// back to the task's int32 sums [pair][row][32 channels] between chunks.
struct ChunkedTiles {
  // 8 panels: as fast as 16 in the 1.5B's int4 products and half the L2 (4: the down projection's 1.25x the time)
  static constexpr int64_t kTaskRows = 512, kGroupPanels = 8;
  static constexpr int64_t kCallRows = kTaskRows, kCallPanels = kGroupPanels;   // TileGemm: a call is its whole task
  // 512 k: a pair's chunk (16 KB) stays in L1 beside 32 rows' (16 KB); 1,024 k took 1.2x the time in the int4
  // products, although the C tiles then go to memory and back half as often (~20 cycles a tile each way)
  static constexpr int64_t kChunkSteps = 8;

  // C 0–3: rows 0–15 | 16–31 × panel 0 | 1; A 4, 5: rows 0–15 | 16–31 of x; B 6, 7: panel 0 | 1
  static QsTileConfig config() {
    QsTileConfig c;
    for (int t = 0; t < 8; ++t) c.tile(t, 16, 64);
    return c;
  }

  // The task's sums: [pairs][tile_rows][32] int32, per thread.
  static int32_t* sums(int np, int64_t tile_rows) {
    thread_local std::vector<int32_t> storage;
    return aligned64(qs_scratch(storage, static_cast<size_t>((np + 1) / 2 * tile_rows * 32 + 16)));
  }

  // One chunk of `sn` steps into `sums` (from zero where `first`): A row tile t's first step at a + t·a_tile (then
  // 1 KB a step), panel q's at b[q] (the same). TDPBUSD where the activations are unsigned, else TDPBSSD.
  template <class Tiles, bool kUnsignedA>
  static void add(int nr, int np, int64_t sn, bool first, int64_t tile_rows, int32_t* sums, const void* a,
                  int64_t a_tile, const int8_t* const* b) {
    for (int pair = 0; pair < (np + 1) / 2; ++pair) {
      const int8_t* b0 = b[2 * pair];
      const bool two_panels = 2 * pair + 1 < np;
      const int8_t* b1 = two_panels ? b[2 * pair + 1] : b0;
      for (int r0 = 0; r0 < nr; r0 += 32) {
        int32_t* c = sums + (pair * tile_rows + r0) * 32;
        const uint8_t* a0 = static_cast<const uint8_t*>(a) + r0 / 16 * a_tile;
        const uint8_t* a1 = a0 + a_tile;
        const bool two_rows = r0 + 16 < nr;
        if (first) {
          Tiles::template zero<0>();
          Tiles::template zero<1>();
          Tiles::template zero<2>();
          Tiles::template zero<3>();
        } else {
          Tiles::template load<0>(c, 128);
          Tiles::template load<1>(c + 16, 128);
          Tiles::template load<2>(c + 16 * 32, 128);
          Tiles::template load<3>(c + 16 * 32 + 16, 128);
        }
        for (int64_t s = 0; s < sn; ++s) {
          Tiles::template load<4>(a0 + s * 1024, 64);
          Tiles::template load<6>(b0 + s * 1024, 64);
          dot<Tiles, kUnsignedA, 0, 4, 6>();
          if (two_panels) {
            Tiles::template load<7>(b1 + s * 1024, 64);
            dot<Tiles, kUnsignedA, 1, 4, 7>();
          }
          if (two_rows) {
            Tiles::template load<5>(a1 + s * 1024, 64);
            dot<Tiles, kUnsignedA, 2, 5, 6>();
            if (two_panels) dot<Tiles, kUnsignedA, 3, 5, 7>();
          }
        }
        Tiles::template store<0>(c, 128);
        Tiles::template store<1>(c + 16, 128);
        Tiles::template store<2>(c + 16 * 32, 128);
        Tiles::template store<3>(c + 16 * 32 + 16, 128);
      }
    }
  }

  // Row r's sums of panel q of the task, once every chunk is in.
  static const int32_t* row_sums(const int32_t* sums, int64_t tile_rows, int r, int q) {
    return sums + ((q / 2) * tile_rows + r) * 32 + 16 * (q % 2);
  }

 private:
  template <class Tiles, bool kUnsignedA, int C, int A, int B>
  static void dot() {
    if (kUnsignedA)
      Tiles::template dot_us<C, A, B>();
    else
      Tiles::template dot_ss<C, A, B>();
  }
};

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

// A prompt product on tiles from the start: Row quantizes each row of x into `xt` (`steps` 64-k steps a row), the
// padding rows to a multiple of 32 are zeroed, then Kernel (a ChunkedTiles) runs its tasks.
template <class Problem, class Kernel, void (*Row)(const Problem&, int64_t), class T>
void quantize_and_run_on_tiles(Ort::KernelContext& ctx, QsTiles mode, Problem& p, TiledRows<T>& xt, int64_t steps) {
  const int64_t rows = (p.m + kTileCallRows - 1) / kTileCallRows * kTileCallRows;
  xt = TiledRows<T>::scratch(rows, steps);
  for_each_row<Problem, Row>(ctx, p, p.m);
  xt.zero_rows(p.m, rows);
  TileGemm<Problem, Kernel>::run(ctx, mode, p, p.m, p.n, Kernel::kGroupPanels);
}
#endif
