"""Block-wise 4-bit weights in MatMulNBits' layout.

A MatMul weight W [K, N] is cut along K into blocks of `block_size`; each (column, block) gets one
scale (symmetric: q = round(w / scale) + 8 in [0, 15], scale = absmax / 7.5 rounded so ±absmax fits).
Storage: packed uint8 [N, K / block_size, block_size / 2] (element 2i in the low nibble) and scales
[N * K / block_size] float32; the zero point is the implicit 8.
"""

from __future__ import annotations

import numpy as np


def check_block_size(k: int, block_size: int) -> None:
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"int4 block size must be a power of two ≥ 16, not {block_size}")
    if k % block_size:
        raise ValueError(f"int4 block size {block_size} does not divide the input dimension {k}; "
                         "choose a block size that divides every hidden/intermediate size (e.g. 32)")


def quantize(w: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """w [K, N] float → (packed uint8 [N, K/bs, bs/2], scales float32 [N*K/bs])."""
    k, n = w.shape
    check_block_size(k, block_size)
    blocks = w.T.reshape(n, k // block_size, block_size).astype(np.float32)   # [N, nb, bs]
    absmax = np.abs(blocks).max(-1)
    scale = np.where(absmax > 0, absmax / 7.0, 1.0).astype(np.float32)        # [N, nb]
    q = (np.clip(np.rint(blocks / scale[..., None]), -8, 7) + 8).astype(np.uint8)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return np.ascontiguousarray(packed), scale.reshape(-1)


def dequantize(packed: np.ndarray, scales: np.ndarray, k: int) -> np.ndarray:
    """Inverse of quantize: → float32 [K, N]."""
    n, nb, half = packed.shape
    q = np.empty((n, nb, half * 2), np.int16)
    q[..., 0::2], q[..., 1::2] = packed & 0x0F, packed >> 4
    w = (q - 8).astype(np.float32) * scales.reshape(n, nb)[..., None]
    return w.reshape(n, k).T
