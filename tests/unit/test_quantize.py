"""Quantize/dequantize round trips per scheme, the int4 packing layout, and AWQ's guarantee."""

import numpy as np
import pytest

from compile.quantize import awq, fp8, int4, int8

RNG = np.random.default_rng(0)
W = (RNG.standard_normal((256, 96)) * 0.02).astype(np.float32)   # [K, N]


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_int8_per_channel_round_trip():
    q, scale = int8.quantize(W)
    assert q.dtype == np.int8 and scale.shape == (96,)
    assert np.abs(int8.dequantize(q, scale) - W).max() <= scale.max() / 2 + 1e-9   # half a step at most
    assert rel_err(int8.dequantize(q, scale), W) < 0.01
    q_rows, s_rows = int8.quantize(W, axis=1)
    assert s_rows.shape == (256,) and rel_err(int8.dequantize(q_rows, s_rows, axis=1), W) < 0.01


@pytest.mark.parametrize("block", [16, 32, 64, 128])
def test_int4_blockwise_round_trip(block):
    packed, scales = int4.quantize(W, block)
    assert packed.dtype == np.uint8 and packed.shape == (96, 256 // block, block // 2)
    assert scales.shape == (96 * 256 // block,)
    back = int4.dequantize(packed, scales, 256)
    step = np.repeat(scales.reshape(96, -1), block, axis=1).T        # [K, N] step per element
    assert np.all(np.abs(back - W) <= step / 2 + 1e-7)
    assert rel_err(back, W) < 0.12


def test_int4_nibble_order():
    """Element 2i is the low nibble, 2i+1 the high one (MatMulNBits' layout)."""
    w = np.zeros((16, 1), np.float32)
    w[0, 0], w[1, 0] = 7.0, -7.0            # scale = 1 → q = 15 and 1
    packed, scales = int4.quantize(w, 16)
    assert scales[0] == 1.0 and packed[0, 0, 0] == (15 | (1 << 4))


def test_fp8_round_trip_and_one_byte_per_weight():
    q, scale = fp8.quantize(W)
    assert q.dtype.itemsize == 1 and str(q.dtype) == "float8_e4m3fn"
    assert rel_err(fp8.dequantize(q, scale), W) < 0.04
    assert np.isfinite(fp8.dequantize(q, scale)).all()


def test_bad_block_sizes():
    with pytest.raises(ValueError, match="power of two"):
        int4.check_block_size(256, 48)
    with pytest.raises(ValueError, match="does not divide"):
        int4.check_block_size(96, 64)


def test_awq_scale_never_worse_than_rounding():
    x = RNG.standard_normal((128, 256)).astype(np.float32)
    x[:, :8] *= 30                            # a few salient input channels, as in real activations
    s, alpha = awq.search_scale(x, W, 32)
    plain = x @ int4.dequantize(*int4.quantize(W, 32), 256)
    scaled = x @ (int4.dequantize(*int4.quantize(W * s[:, None], 32), 256) / s[:, None])
    exact = x @ W
    assert np.mean((scaled - exact) ** 2) <= np.mean((plain - exact) ** 2)
    assert alpha > 0, "salient channels should make a non-zero alpha win"
