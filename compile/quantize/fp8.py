"""float8 e4m3 (fn) weights with one float32 scale per output channel, one byte per weight."""

from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = 448.0


def quantize(w: np.ndarray, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """w → (q float8_e4m3fn same shape, scale float32), scale = absmax / 448 over `axis`."""
    absmax = np.abs(w).max(axis=axis).astype(np.float32)
    scale = np.where(absmax > 0, absmax / E4M3_MAX, 1.0).astype(np.float32)
    q = (w / np.expand_dims(scale, axis)).astype(np.float32).clip(-E4M3_MAX, E4M3_MAX).astype(E4M3)
    return q, scale


def dequantize(q: np.ndarray, scale: np.ndarray, axis: int = 0) -> np.ndarray:
    return q.astype(np.float32) * np.expand_dims(scale, axis)
