"""Symmetric int8 with one scale per output channel (the weights of the row-quantized int8 MatMul)."""

from __future__ import annotations

import numpy as np

# The CPU graph's int8 weights use 7 bits of magnitude (±63): MLAS's u8·s8 kernel on AVX2 without VNNI sums
# pairs of products in int16, and 255·63·2 = 32,130 cannot saturate, so the integer product is exact. With ±127
# it saturates on rows that use the full activation range (measured: 0.19 vs 0.016 max logit error on a test
# model; on the bundled target -0.18 % perplexity, top-1 98.6 % with ±63 vs +0.01 %, 98.4 % with ±127).
WEIGHT_LEVELS = 63


def quantize(w: np.ndarray, axis: int = 0, levels: int = 127) -> tuple[np.ndarray, np.ndarray]:
    """w → (q int8 same shape, in [-levels, levels], scale float32), reducing over `axis` (the input dimension).

    For a MatMul weight [K, N] use axis=0 (scale [N]); for an embedding table [V, H] use axis=1 (scale [V]).
    """
    absmax = np.abs(w).max(axis=axis).astype(np.float32)
    scale = np.where(absmax > 0, absmax / levels, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / np.expand_dims(scale, axis)), -levels, levels).astype(np.int8)
    return q, scale


def dequantize(q: np.ndarray, scale: np.ndarray, axis: int = 0) -> np.ndarray:
    return q.astype(np.float32) * np.expand_dims(scale, axis)


PANEL = 16      # output channels per panel of qs.Int8MatMul's packed weight


def pack_panels(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A [K, N] int8 weight in qs.Int8MatMul's layout (plugins/cpu/int8_matmul.cpp): panels of 16 output channels,
    each [ceil(K/4)][16 channels][4 k], so one 64-byte load feeds vpmaddubsw four k of sixteen channels; K and N
    are zero-padded. Also 128·Σ_k q[k, n] (int32 [N]), the zero point's share of each output, taken off once.

    Returns (packed [panels, ceil(K/4)·4·16] int8, zsum [N] int32).
    """
    k, n = q.shape
    k4, panels = -(-k // 4) * 4, -(-n // PANEL)
    padded = np.zeros((k4, panels * PANEL), np.int8)
    padded[:k, :n] = q
    packed = padded.reshape(k4 // 4, 4, panels, PANEL).transpose(2, 0, 3, 1).reshape(panels, k4 * PANEL)
    zsum = 128 * q.astype(np.int32).sum(axis=0, dtype=np.int32)
    return np.ascontiguousarray(packed), zsum.astype(np.int32)
