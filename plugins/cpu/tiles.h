// Intel AMX int8 tiles for the prompt GEMMs of qs.Int8MatMul and qs.Int4MatMul.
//
// A tile dot product (TDPBUSD: unsigned × signed bytes, TDPBSSD: signed × signed) sums exactly into int32, as the
// vector kernels' vpdpbusd does, so a product on tiles is bitwise the product on vectors: the kernels keep every
// float operation of their epilogue in the same order, and batch invariance holds whichever path a row takes.
//
// Three modes (qs_tiles_mode): off (the vector kernels only), amx (tiles where the CPU has them and Linux grants
// their state: detected at run time, never assumed from the build), and emulated — the same tile kernels over a
// plain C++ model of the instructions, so a machine without AMX tests the tile kernels' layouts, blocking and
// epilogues bit for bit against the vector path. QS_CPU_TILES=auto|off|emulate picks the first mode; auto is amx
// where granted, else off. runtime._native.cpu_tiles(mode) changes it (tests, tools/bench_native.py).
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>

enum class QsTiles { kOff, kEmulated, kHardware };

QsTiles qs_tiles_mode();
// "auto" | "off" | "emulate" | "amx": sets the mode and returns nullptr, or returns why it cannot (amx not granted)
const char* qs_set_tiles_mode(const char* mode);
// why tiles are or are not granted on this machine (CPUID, XCR0, arch_prctl), in words
const char* qs_amx_status();
const char* qs_tiles_name(QsTiles mode);
// how many products ran on tiles (hardware or emulated) in this process: tests and benchmarks see the path taken
void qs_count_tile_product();
uint64_t qs_tile_products();

// Rows of x from which a product goes to the tiles: fewer rows (decode steps) stream weights, which vectors do.
// int8 products gain from one 16-row tile (0.48x the vector time at 16 rows on a Sapphire Rapids Xeon), and so do
// int4 ones with integer block scales (0.74-0.82x at 16 rows, 0.55-0.70x at 24, the 1.5B's products); with fp16
// block scales, whose per-block epilogue bounds them, only from two (0.99-1.24x at 16 and 24 rows, 0.79-0.92x at 32).
constexpr int64_t kTileMinRows = 16;
constexpr int64_t kInt4TileMinRows = 32;      // fp16 block scales

// The 64-byte LDTILECFG block: palette 1, then for each of the 8 tiles its bytes per row and its rows.
struct alignas(64) QsTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  QsTileConfig& tile(int t, int tile_rows, int bytes_per_row) {
    rows[t] = static_cast<uint8_t>(tile_rows);
    colsb[t] = static_cast<uint16_t>(bytes_per_row);
    return *this;
  }
};

#if defined(__x86_64__)
// The instructions themselves (assembled here whatever -march says; run only where qs_tiles_mode() is kHardware).
// Every access names "memory": a tile load must see the stores before it, a tile store must land before the loads
// after it.
struct HardwareTiles {
  static void begin(const QsTileConfig& config) { __asm__ volatile("ldtilecfg %0" ::"m"(config) : "memory"); }
  static void end() { __asm__ volatile("tilerelease" ::: "memory"); }
  template <int T>
  static void zero() { __asm__ volatile("tilezero %%tmm%c0" ::"i"(T)); }
  template <int T>
  static void load(const void* base, int64_t stride) {
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(T) : "memory");
  }
  template <int T>
  static void store(void* base, int64_t stride) {
    __asm__ volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride), "i"(T) : "memory");
  }
  // C += A · B, A unsigned bytes, B signed (TDPBUSD)
  template <int C, int A, int B>
  static void dot_us() { __asm__ volatile("tdpbusd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B)); }
  // C += A · B, both signed bytes (TDPBSSD)
  template <int C, int A, int B>
  static void dot_ss() { __asm__ volatile("tdpbssd %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B)); }
};
#endif

// The Intel SDM's definition of the same instructions over eight 1 KB arrays (one set per thread):
//     C.row[m].dword[n] += Σ_{k < A.colsb/4} Σ_{i<4} A.row[m].byte[4k+i] · B.row[k].byte[4n+i]
// in wrapping 32-bit arithmetic, rows past a tile's configured rows and bytes past its colsb left zero.
struct EmulatedTiles {
  struct State {
    QsTileConfig config;
    uint8_t tile[8][16][64];
  };
  static State& state() {
    thread_local State s;
    return s;
  }
  static void begin(const QsTileConfig& config) {
    state().config = config;
    std::memset(state().tile, 0, sizeof(state().tile));
  }
  static void end() { begin(QsTileConfig{}); }
  template <int T>
  static void zero() {
    std::memset(state().tile[T], 0, sizeof(state().tile[T]));
  }
  template <int T>
  static void load(const void* base, int64_t stride) {
    State& s = state();
    if (!s.config.rows[T] || s.config.rows[T] > 16 || s.config.colsb[T] > 64)
      throw std::logic_error("emulated tiles: a load into a tile the configuration does not hold");
    zero<T>();
    for (int r = 0; r < s.config.rows[T]; ++r)
      std::memcpy(s.tile[T][r], static_cast<const uint8_t*>(base) + r * stride, s.config.colsb[T]);
  }
  template <int T>
  static void store(void* base, int64_t stride) {
    State& s = state();
    for (int r = 0; r < s.config.rows[T]; ++r)
      std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.tile[T][r], s.config.colsb[T]);
  }
  template <int C, int A, int B>
  static void dot_us() { dot<C, A, B, false, true>(); }
  template <int C, int A, int B>
  static void dot_ss() { dot<C, A, B, true, true>(); }

 private:
  template <int C, int A, int B, bool a_signed, bool b_signed>
  static void dot() {
    State& s = state();
    const QsTileConfig& c = s.config;       // what the hardware refuses (#UD), refused here too
    if (!c.rows[C] || c.rows[A] != c.rows[C] || c.colsb[A] / 4 != c.rows[B] || c.colsb[B] != c.colsb[C] ||
        c.colsb[A] % 4 || c.colsb[C] % 4)
      throw std::logic_error("emulated tiles: a dot product of tiles whose shapes do not chain");
    for (int m = 0; m < s.config.rows[C]; ++m)
      for (int n = 0; n < s.config.colsb[C] / 4; ++n) {
        uint32_t sum;
        std::memcpy(&sum, &s.tile[C][m][4 * n], 4);
        for (int k = 0; k < s.config.colsb[A] / 4; ++k)
          for (int i = 0; i < 4; ++i) {
            const uint8_t a = s.tile[A][m][4 * k + i], b = s.tile[B][k][4 * n + i];
            const int32_t av = a_signed ? int32_t{static_cast<int8_t>(a)} : int32_t{a};
            const int32_t bv = b_signed ? int32_t{static_cast<int8_t>(b)} : int32_t{b};
            sum += static_cast<uint32_t>(av * bv);
          }
        std::memcpy(&s.tile[C][m][4 * n], &sum, 4);
      }
  }
};
