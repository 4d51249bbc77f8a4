"""Quicksilver's own ONNX Runtime ops for cpu engines (plugins/cpu), compiled into `runtime._native`.

ONNX Runtime loads that module's file as a custom-op library: `register(so)` adds the `qs` domain to a session:
qs.CausalAttention (the decode-friendly replacement of com.microsoft.GroupQueryAttention), qs.Int8MatMul and
qs.Int4MatMul (whole batch-invariant int8 / block-wise int4 linears on weights packed for them), qs.PackedGather
and qs.Int4Gather (embedding rows from those packed tables), qs.SwiGLU (the MLP's activation in one op), and
qs.RowQuantize (which engines built before qs.Int8MatMul use). The ops are built when ONNX Runtime's API headers
were found at install time (CMakeLists.txt); `available()` says whether this install has them, and the compiler
emits them only then (`compile build --kernels`).
"""

from __future__ import annotations

import onnxruntime as ort

DOMAIN = "qs"
ATTENTION = "CausalAttention"


def library() -> str | None:
    """Path of the library that registers the `qs` ops, or None when this install was built without them."""
    try:
        from . import _native
    except ImportError:
        return None
    return _native.__file__ if getattr(_native, "cpu_ops", False) else None


def available() -> bool:
    return library() is not None


def isa() -> str:
    """The instruction set the ops were compiled for: avx512vnni, avx512bw, avx2 or generic ("" without ops)."""
    if not available():
        return ""
    from . import _native

    return getattr(_native, "cpu_isa", "generic")


def bf16_products() -> bool:
    """Whether qs.CausalAttention's bf16 products (engines built with --attention-products bf16) run on the CPU's
    bf16 dot-product instruction (AVX512-BF16) rather than the op's slow scalar emulation."""
    if not available():
        return False
    from . import _native

    return bool(getattr(_native, "cpu_bf16", False))


def describe() -> str:
    """For the startup log: the instruction set the ops were built for, and whether prompt products run on AMX tiles
    (and if not, why: plugins/cpu/tiles.cpp), as llama.cpp prints its system info."""
    if not available():
        return "none (built without ONNX Runtime's headers)"
    from . import _native

    mode, why = _native.cpu_tiles(), _native.amx_status()
    tiles = {"amx": "on", "emulate": "emulated (QS_CPU_TILES=emulate)"}.get(
        mode, f"off ({'QS_CPU_TILES=off' if why == 'granted' else why})")
    return f"{isa()}, AMX tiles {tiles}, bf16 products {'on' if bf16_products() else 'emulated'}"


class Unavailable(RuntimeError):
    """The graph uses the qs ops and this install has none."""


def register(so: ort.SessionOptions) -> None:
    """Add the `qs` domain to `so`; raises Unavailable with what to do when this install lacks it."""
    path = library()
    if path is None:
        raise Unavailable(
            "this engine uses Quicksilver's cpu ops (qs.CausalAttention, qs.Int8MatMul, ...), and this install was "
            "built without them (ONNX Runtime's headers were not found at build time): reinstall from a full "
            "checkout (plugins/cpu/onnxruntime) or with -C cmake.define.QS_ORT_INCLUDE_DIR=DIR, or rebuild the engine "
            "with `compile build ... --kernels ort`")
    so.register_custom_ops_library(path)
