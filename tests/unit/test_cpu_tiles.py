"""qs.Int8MatMul and qs.Int4MatMul on AMX tiles (plugins/cpu/tiles.h) against their vector kernels, bit for bit.

Integer tile sums are exact, and the tile kernels finish with the vector kernels' float operations in the same order,
so a product on tiles must equal the product on vectors in every bit, whatever the shape: that is what keeps batch
invariance when a prompt's rows go to tiles and a decode step's row does not. On a machine without AMX the tile
kernels run over `emulate`, a C++ model of the instructions (the SDM's definition), which checks their layouts,
blocking, padding and epilogues; where the CPU has AMX and Linux grants it, the same tests run on the hardware.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from compile.quantize import int4, int8
from runtime import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="this install was built without the qs ops")

if cpu_ops.available():
    from runtime import _native

    TILE_MODES = ["emulate"] + (["amx"] if _native.amx_status() == "granted" else [])
    BUILT_FOR_TILES = _native.cpu_isa.startswith("avx512")
else:
    TILE_MODES, BUILT_FOR_TILES = [], False

needs_tile_build = pytest.mark.skipif(not BUILT_FOR_TILES, reason="the tile kernels need an AVX-512 build")


@contextlib.contextmanager
def tiles(mode: str):
    before = _native.cpu_tiles()
    _native.cpu_tiles(mode)
    try:
        yield
    finally:
        _native.cpu_tiles(before)


def _session(node, inits, k: int, threads: int):
    import onnxruntime as ort

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])
    model = helper.make_model(
        helper.make_graph([node], "g", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(cpu_ops.DOMAIN, 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    cpu_ops.register(so)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _tiles_against_vectors(session, x: np.ndarray, mode: str, min_rows: int) -> None:
    with tiles("off"):
        want = session.run(None, {"x": x})[0]
    before = _native.cpu_tile_products()
    with tiles(mode):
        got = session.run(None, {"x": x})[0]
    assert _native.cpu_tile_products() == before + (1 if len(x) >= min_rows else 0)   # fewer rows stay on vectors
    assert got.shape == want.shape
    mismatched = np.flatnonzero((got.view(np.uint32) != want.view(np.uint32)).any(axis=1))
    assert mismatched.size == 0, f"rows {mismatched.tolist()} differ on tiles"


@needs_tile_build
@pytest.mark.parametrize("mode", TILE_MODES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.sampled_from([1, 33, 64, 100, 576, 1000, 1050, 1100]), n=st.sampled_from([1, 17, 32, 33, 100, 300]),
       rows=st.sampled_from([15, 16, 17, 31, 32, 33, 63, 129, 200, 530]), threads=st.sampled_from([1, 2]),
       seed=st.integers(0, 2**31))
@example(k=1100, n=1000, rows=530, threads=2, seed=0)      # every boundary at once: chunks, groups of 8, tasks
def test_int8_matmul_on_tiles_is_the_vector_kernel_bit_for_bit(mode, k, n, rows, threads, seed):
    """K off the 64-byte tile step (a part step from a zero-padded copy; 1,000 and 1,100 in the second and third
    chunk of 8 steps, 1,050 in a third chunk of one part step), N off the 32-channel pair of panels and the groups
    (1,000: 63 panels, eight groups of up to 8; 300: groups halved to 4 or 2 for tasks enough), rows off the 16-row
    tile and the 32-row block, across the 512-row tasks (530); the extreme weights ±63."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-int8.WEIGHT_LEVELS, int8.WEIGHT_LEVELS + 1, (k, n), dtype=np.int8)
    q[0, :] = int8.WEIGHT_LEVELS
    packed, zsum = int8.pack_panels(q)
    scale = (rng.random(n) * 1e-2 + 1e-4).astype(np.float32)
    session = _session(helper.make_node("Int8MatMul", ["x", "w", "s", "z"], ["y"], domain=cpu_ops.DOMAIN, K=k, N=n),
                       [numpy_helper.from_array(packed, "w"), numpy_helper.from_array(scale, "s"),
                        numpy_helper.from_array(zsum, "z")], k, threads)
    x = (rng.standard_normal((rows, k)) * rng.random((rows, 1)) * 10).astype(np.float32)
    x[0, 0] = np.abs(x[0]).max() * 2                   # quantizes to 255
    _tiles_against_vectors(session, x, mode, min_rows=16)


@needs_tile_build
@pytest.mark.parametrize("mode", TILE_MODES)
@pytest.mark.parametrize("int_scales", [False, True])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.sampled_from([32, 64, 96, 128, 160, 544, 576, 1056]), n=st.sampled_from([1, 15, 17, 33, 100, 300]),
       rows=st.sampled_from([15, 16, 31, 32, 33, 47, 64, 129, 160, 530]), threads=st.sampled_from([1, 2]),
       seed=st.integers(0, 2**31))
@example(k=1056, n=1000, rows=530, threads=2, seed=0)      # every boundary at once: chunks, groups of 8, tasks
def test_int4_matmul_on_tiles_is_the_vector_kernel_bit_for_bit(mode, int_scales, k, n, rows, threads, seed):
    """fp16 block scales: one block (32 k) a tile step with its own scales; integer ones: two blocks a step into int32
    sums carried from chunk to chunk of K (8 steps: 544 and 1,056 end in a part chunk with an odd last block), tasks
    of up to 512 rows (530: a second one) and 8 panels (1,000 channels: eight groups, the last of 7). K of one to
    five, 17, 18 and 33 blocks (odd and even counts of the kernels' block pairs), the rest as for int8; weights at the
    ends of the nibble range (fp16 scales: u = 0 and 15; integer ones, symmetric: 1 and 15, multipliers 16 and the
    small ones of the pushed-down blocks) and an all-zero channel."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32)
    w[:, 0] = 0
    w[0, :] = np.abs(w).max() * 4                      # u = 15 in the first block, the others pushed toward 8
    if n > 1:
        w[1, 1:] = -np.abs(w).max()                    # u = 0
    packed = int4.pack_panels_int(w) if int_scales else int4.pack_panels(w)
    session = _session(helper.make_node("Int4MatMul", ["x", "w"], ["y"], domain=cpu_ops.DOMAIN, K=k, N=n,
                                        int_scales=int(int_scales)),
                       [numpy_helper.from_array(packed, "w")], k, threads)
    x = (rng.standard_normal((rows, k)) * rng.random((rows, 1)) * 10).astype(np.float32)
    _tiles_against_vectors(session, x, mode, min_rows=16 if int_scales else 32)   # fp16 scales: two row tiles or none


@needs_tile_build
@pytest.mark.parametrize("mode", TILE_MODES)
@pytest.mark.parametrize("checkpoint_name,precision", [("llama", "int8"), ("qwen2", "int4")])
def test_a_prompt_on_tiles_gives_the_vector_logits(engine, mode, checkpoint_name, precision):
    """A whole engine — its folds (bias, SwiGLU, skip RMS norm) and LM head included — prefilled on tiles: every
    logit bitwise the vector path's, and the products did go to tiles."""
    from runtime.stepper import open_stepper

    steps = open_stepper(engine(checkpoint_name, precision), 96)
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, 200, 70)]
    with tiles("off"):
        want = steps.prefill(prompt)
    before = _native.cpu_tile_products()
    with tiles(mode):
        got = steps.prefill(prompt)
    assert _native.cpu_tile_products() > before
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_amx_is_refused_with_the_reason_where_not_granted():
    status = _native.amx_status()
    if status == "granted":
        pytest.skip("this machine grants AMX tiles")
    before = _native.cpu_tiles()
    with pytest.raises(ValueError, match="cpu_tiles: .*(AMX|XSAVE|XCR0|Linux|x86-64)"):
        _native.cpu_tiles("amx")
    assert _native.cpu_tiles() == before
    with tiles("auto"):
        assert _native.cpu_tiles() == "off"
    with pytest.raises(ValueError, match="auto, off, emulate or amx"):
        _native.cpu_tiles("fast")


def _cpu_flags() -> set[str]:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    return set()


def _linux_at_least(major: int, minor: int) -> bool:
    numbers = [int(part) for part in os.uname().release.split("-")[0].split(".")[:2] if part.isdigit()]
    return sys.platform == "linux" and tuple(numbers) >= (major, minor)


@needs_tile_build
@pytest.mark.skipif(not {"amx_tile", "amx_int8"} <= _cpu_flags() or not _linux_at_least(5, 16),
                    reason="Linux lists no AMX-TILE/AMX-INT8 here (or is older than 5.16, which grants tile data)")
def test_amx_is_granted_where_linux_lists_it():
    """Where Linux lists AMX-TILE and AMX-INT8, the probe (CPUID leaves 7 and 0x1D, XCR0, arch_prctl) grants the
    tiles: a probe that misreads a CPUID field (it once took the 8 tile names for a 16-row minimum) would keep every
    Sapphire Rapids host on the vector kernels without a word."""
    assert _native.amx_status() == "granted"
    with tiles("auto"):
        assert _native.cpu_tiles() == "amx"


@pytest.mark.parametrize("setting,expected", [("off", "off"), ("emulate", "emulate"), ("auto", None), ("", None)])
def test_the_environment_picks_the_first_mode(setting, expected):
    """QS_CPU_TILES: auto (or unset) is amx where granted, else off; emulate needs an AVX-512 build."""
    if expected is None:
        expected = "amx" if _native.amx_status() == "granted" else "off"
    if expected == "emulate" and not BUILT_FOR_TILES:
        expected = "off"
    env = {**os.environ, "QS_CPU_TILES": setting}
    out = subprocess.run([sys.executable, "-c", "from runtime import _native; print(_native.cpu_tiles())"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected


def test_the_startup_line_says_whether_prompts_run_on_tiles_and_why_not():
    """`runtime serve` logs cpu_ops.describe(): the ops' instruction set, the tile mode with its reason, and
    whether attention's bf16 products (--attention-products bf16) run on the CPU's instruction."""
    granted = _native.amx_status() == "granted"
    bf16 = f", bf16 products {'on' if _native.cpu_bf16 else 'emulated'}"
    with tiles("off"):
        line = cpu_ops.describe()
        assert line.startswith(_native.cpu_isa + ", AMX tiles off (") and line.endswith(bf16)
        assert ("QS_CPU_TILES=off" if granted else _native.amx_status()) in line
    if BUILT_FOR_TILES:
        with tiles("emulate"):
            assert cpu_ops.describe() == f"{_native.cpu_isa}, AMX tiles emulated (QS_CPU_TILES=emulate){bf16}"
