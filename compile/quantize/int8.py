"""Symmetric int8 with one scale per output channel (what DynamicQuantizeMatMul consumes)."""

from __future__ import annotations

import numpy as np


def quantize(w: np.ndarray, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """w → (q int8 same shape, scale float32), reducing over `axis` (the input dimension).

    For a MatMul weight [K, N] use axis=0 (scale [N]); for an embedding table [V, H] use axis=1 (scale [V]).
    """
    absmax = np.abs(w).max(axis=axis).astype(np.float32)
    scale = np.where(absmax > 0, absmax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / np.expand_dims(scale, axis)), -127, 127).astype(np.int8)
    return q, scale


def dequantize(q: np.ndarray, scale: np.ndarray, axis: int = 0) -> np.ndarray:
    return q.astype(np.float32) * np.expand_dims(scale, axis)
