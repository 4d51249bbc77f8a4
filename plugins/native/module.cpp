// runtime._native: the C++ half of the runtime (hot loops that Python would run per token).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "block_hash.h"
#ifdef QS_CPU_OPS
#include "tiles.h"
#endif

namespace py = pybind11;

namespace {

using Tokens = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

uint64_t py_hash_block(uint64_t parent, Tokens tokens) {
  if (tokens.ndim() != 1) throw py::value_error("tokens must be 1-D");
  return qs::hash_block(parent, tokens.data(), static_cast<size_t>(tokens.shape(0)));
}

py::array_t<uint64_t> py_hash_blocks(Tokens tokens, size_t block_size, uint64_t parent) {
  if (tokens.ndim() != 1) throw py::value_error("tokens must be 1-D");
  if (block_size == 0) throw py::value_error("block_size must be positive");
  const size_t n = static_cast<size_t>(tokens.shape(0));
  py::array_t<uint64_t> out(static_cast<py::ssize_t>(n / block_size));
  {
    py::gil_scoped_release release;
    qs::hash_blocks(parent, tokens.data(), n, block_size, out.mutable_data());
  }
  return out;
}

#ifdef QS_CPU_OPS
std::string py_cpu_tiles(std::optional<std::string> mode) {
  if (mode) {
    if (const char* why = qs_set_tiles_mode(mode->c_str())) throw py::value_error(std::string("cpu_tiles: ") + why);
  }
  return qs_tiles_name(qs_tiles_mode());
}
#endif

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "Quicksilver runtime native helpers";
  m.def("hash_block", &py_hash_block, py::arg("parent"), py::arg("tokens"),
        "Chained hash of one block of token ids onto the parent block's key.");
  // ONNX Runtime loads this module's file as a custom-op library (RegisterCustomOps, plugins/cpu/register.cpp)
#ifdef QS_CPU_OPS
  m.attr("cpu_ops") = true;
#else
  m.attr("cpu_ops") = false;
#endif
  // the widest integer dot-product instructions the cpu ops were compiled for (-march=native at build time)
#if defined(__AVX512VNNI__)
  m.attr("cpu_isa") = "avx512vnni";
#elif defined(__AVX512BW__)
  m.attr("cpu_isa") = "avx512bw";
#elif defined(__AVX2__)
  m.attr("cpu_isa") = "avx2";
#else
  m.attr("cpu_isa") = "generic";
#endif
  // whether qs.CausalAttention's bf16 products (--attention-products bf16) run on vdpbf16ps, not its scalar emulation
#if defined(__AVX512BF16__)
  m.attr("cpu_bf16") = true;
#else
  m.attr("cpu_bf16") = false;
#endif
#ifdef QS_CPU_OPS
  m.def("cpu_tiles", &py_cpu_tiles, py::arg("mode") = py::none(),
        "The tile mode of the int8/int4 prompt products (off, amx, emulate); with a mode (auto, off, emulate, amx), "
        "set it first. ValueError where it cannot be had (amx where the CPU or Linux does not grant tiles).");
  m.def("cpu_tile_products", &qs_tile_products, "How many int8/int4 products this process ran on tiles.");
  m.def("amx_status", [] { return std::string(qs_amx_status()); },
        "'granted', or why this process may not use AMX tiles (CPUID, XCR0, arch_prctl).");
#endif
  m.def("hash_blocks", &py_hash_blocks, py::arg("tokens"), py::arg("block_size"), py::arg("parent") = 0,
        "Keys [len(tokens) // block_size] (uint64) of the full blocks of tokens.");
}
