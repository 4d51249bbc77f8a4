// Whether this process may use AMX tiles, and which tile mode the int8/int4 products run in (tiles.h).
#include "tiles.h"

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

// CPUID, XCR0 and the kernel's permission, in that order; the first that fails says why.
std::string probe_amx() {
#if defined(__x86_64__) && defined(__linux__)
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return "no CPUID leaf 7";
  if (!(d & (1u << 24)) || !(d & (1u << 25))) return "this CPU has no AMX-TILE/AMX-INT8 (CPUID.7.0:EDX bits 24, 25)";
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return "the OS has not enabled XSAVE (OSXSAVE)";
  // CPUID.1D.1: EAX bytes per tile (31:16), EBX tile names (31:16) and bytes per row (15:0), ECX rows (15:0)
  if (!__get_cpuid_count(0x1d, 1, &a, &b, &c, &d) || (a >> 16) < 1024 || (b >> 16) < 8 || (b & 0xffff) < 64 ||
      (c & 0xffff) < 16)
    return "AMX palette 1 is smaller than 8 tiles of 16 rows × 64 bytes (CPUID.1D.1)";
  // ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): Linux ≥ 5.16 hands out tile data per process
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0)
    return "Linux refused the tile data permission (arch_prctl ARCH_REQ_XCOMP_PERM: " + std::string(std::strerror(errno)) +
           ")";
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return "XCR0 does not enable the tile state (bits 17, 18)";
  return "";
#else
  return "AMX needs x86-64 Linux";
#endif
}

const std::string& amx_refusal() {
  static const std::string why = probe_amx();       // once per process: the permission is per process
  return why;
}

// Tiles need the AVX-512 epilogues the kernels are built with (every AMX CPU has AVX-512).
#if defined(__AVX512BW__)
constexpr bool kBuiltForTiles = true;
#else
constexpr bool kBuiltForTiles = false;
#endif

QsTiles auto_mode() { return amx_refusal().empty() ? QsTiles::kHardware : QsTiles::kOff; }

QsTiles initial_mode() {
  const char* env = std::getenv("QS_CPU_TILES");
  const std::string want = env && *env ? env : "auto";
  if (want == "off" || !kBuiltForTiles) return QsTiles::kOff;
  if (want == "emulate") return QsTiles::kEmulated;
  return auto_mode();                 // auto, amx, or anything else
}

std::atomic<uint64_t> tile_products{0};

std::atomic<QsTiles>& mode() {
  static std::atomic<QsTiles> m{initial_mode()};
  return m;
}

}  // namespace

void qs_count_tile_product() { tile_products.fetch_add(1, std::memory_order_relaxed); }
uint64_t qs_tile_products() { return tile_products.load(std::memory_order_relaxed); }

QsTiles qs_tiles_mode() { return mode().load(std::memory_order_relaxed); }

const char* qs_tiles_name(QsTiles m) {
  return m == QsTiles::kHardware ? "amx" : m == QsTiles::kEmulated ? "emulate" : "off";
}

const char* qs_amx_status() { return amx_refusal().empty() ? "granted" : amx_refusal().c_str(); }

const char* qs_set_tiles_mode(const char* name) {
  const std::string want = name;
  if (want != "off" && !kBuiltForTiles) return "the cpu ops were built without AVX-512, which the tile kernels need";
  if (want == "off") {
    mode() = QsTiles::kOff;
  } else if (want == "emulate") {
    mode() = QsTiles::kEmulated;
  } else if (want == "amx") {
    if (!amx_refusal().empty()) return amx_refusal().c_str();
    mode() = QsTiles::kHardware;
  } else if (want == "auto") {
    mode() = auto_mode();
  } else {
    return "the tile mode must be auto, off, emulate or amx";
  }
  return nullptr;
}
