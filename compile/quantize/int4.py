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


PANEL, BLOCK = 16, 32                       # qs.Int4MatMul: output channels per panel, K per block
BLOCK_BYTES = 4 * 64 + PANEL * 2            # a block of a panel: 32 k × 16 channels of nibbles, then 16 fp16 scales


def _panel_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [K, N] → its 32-k blocks of 16-channel panels [K/32, 32, ceil(N/16), 16] (N padded with zero channels) and
    each block's largest magnitude per channel [K/32, P, 16]."""
    k, n = w.shape
    if k % BLOCK:
        raise ValueError(f"qs.Int4MatMul needs K divisible by {BLOCK}, not {k}")
    panels = -(-n // PANEL)
    padded = np.zeros((k, panels * PANEL), np.float32)
    padded[:, :n] = w
    blocks = padded.reshape(k // BLOCK, BLOCK, panels, PANEL)
    return blocks, np.abs(blocks).max(axis=1)


def _panel_nibbles(u: np.ndarray, nb: int, panels: int) -> np.ndarray:
    """u [nb, 32, P, 16] (values 0..15) → each panel's blocks of four 64-byte chunks [P, nb, 256]: chunk c holds at
    byte 4·ch + j the u of k = 8c + j (low nibble) and k = 8c + 4 + j (high nibble)."""
    u = u.reshape(nb, 4, 2, 4, panels, PANEL).transpose(4, 0, 1, 5, 3, 2)             # [P, nb, c, ch, j, h]
    return (u[..., 0] | (u[..., 1] << 4)).reshape(panels, nb, 256)


def _panel_u(cells: np.ndarray, k: int) -> np.ndarray:
    """Inverse of _panel_nibbles: the u of every weight [K, P · 16] from cells [P, nb, ≥ 256] (a block's nibbles first)."""
    panels, nb = cells.shape[:2]
    nibbles = cells[..., :256].reshape(panels, nb, 4, PANEL, 4)                          # [P, nb, c, ch, j]
    u = np.stack([nibbles & 0x0F, nibbles >> 4], axis=-1)                                # [P, nb, c, ch, j, h]
    return u.transpose(1, 2, 5, 4, 0, 3).reshape(k, panels * PANEL)                     # k = 8c + 4h + j


def pack_panels(w: np.ndarray) -> np.ndarray:
    """w [K, N] float → qs.Int4MatMul's weight (plugins/cpu/int4_matmul.cpp): uint8 [ceil(N/16), K/32 · 288].

    Per (32-k block, channel): scale = absmax / 7 rounded to fp16 (within its normal range), u = round(w / scale) + 8
    clipped to [0, 15].
    Per panel of 16 channels and block: four 64-byte chunks, chunk c holding at byte 4·ch + j the u of k = 8c + j
    (low nibble) and k = 8c + 4 + j (high nibble), then the 16 scales as fp16. N is padded with zero channels.
    """
    blocks, absmax = _panel_blocks(w)                                                  # [nb, 32, P, 16], [nb, P, 16]
    nb, panels = blocks.shape[0], blocks.shape[2]
    # fp16 range: a block too large for it would scale by inf, one too small by 0
    scale = np.where(absmax > 0, np.clip(absmax / 7.0, 2.0 ** -14, 65504.0), 1.0).astype(np.float16)
    u = (np.clip(np.rint(blocks / scale.astype(np.float32)[:, None]), -8, 7) + 8).astype(np.uint8)
    # k within a block = 8c + 4h + j  (c: chunk, h: nibble, j: lane)
    nibbles = _panel_nibbles(u, nb, panels)
    scales = scale.transpose(1, 0, 2).reshape(panels, nb, PANEL).view(np.uint8)         # [P, nb, 32] bytes
    return np.ascontiguousarray(np.concatenate([nibbles, scales], axis=2).reshape(panels, nb * BLOCK_BYTES))


def unpack_panels(packed: np.ndarray, k: int, n: int) -> np.ndarray:
    """Inverse of pack_panels: the dequantized weight float32 [K, N] (for tests and the reference)."""
    panels, nb = packed.shape[0], k // BLOCK
    cells = packed.reshape(panels, nb, BLOCK_BYTES)
    u = _panel_u(cells, k).astype(np.float32)
    scale = np.ascontiguousarray(cells[..., 256:]).view(np.float16).astype(np.float32)  # [P, nb, 16]
    scale = np.repeat(scale.transpose(1, 0, 2).reshape(nb, panels * PANEL), BLOCK, axis=0)
    return ((u - 8) * scale)[:, :n]


INT_BLOCK_BYTES = 4 * 64 + PANEL            # …, or with integer scales: the nibbles, then 16 multipliers (bytes)
MAX_MULTIPLIER = 16                         # (u − 8) · m stays within int8 for m ≤ 16


def pack_panels_int(w: np.ndarray) -> np.ndarray:
    """w [K, N] float → qs.Int4MatMul's weight with integer block scales (`int_scales`): uint8 [ceil(N/16),
    K/32 · 272 + 64].

    Per channel one float32 scale S = max|w| / (7 · 16); per (32-k block, channel) an integer multiplier m in 1..16
    (the smallest with max|block| ≤ 7 · m · S) and u = round(w / (m · S)) + 8 clipped to [0, 15]: w ≈ (u − 8) · m · S.
    (u − 8) · m fits int8, so a product sums exactly in int32 over all of K — on AMX tiles in one accumulator, as the
    int8 kernel does — where an fp16 scale per block makes every block leave the integers.
    Per panel: its blocks (four 64-byte chunks of nibbles as in pack_panels, then the 16 multipliers as bytes), then
    the 16 channel scales as float32. N is padded with zero channels.
    """
    blocks, absmax = _panel_blocks(w)                                                  # [nb, 32, P, 16], [nb, P, 16]
    nb, panels = blocks.shape[0], blocks.shape[2]
    top = absmax.max(axis=0)                                                           # [P, 16]
    scale = np.where(top > 0, top / (7.0 * MAX_MULTIPLIER), 1.0).astype(np.float32)
    # (a ratio a rounding above an integer j takes j: its largest value then rounds to 7 · (1 + 1e-6) → 7)
    m = np.clip(np.ceil(absmax / (7.0 * scale) * (1 - 1e-6)), 1, MAX_MULTIPLIER).astype(np.uint8)   # [nb, P, 16]
    step = m.astype(np.float32) * scale
    u = (np.clip(np.rint(blocks / step[:, None]), -8, 7) + 8).astype(np.uint8)
    nibbles = _panel_nibbles(u, nb, panels)
    cells = np.concatenate([nibbles, m.transpose(1, 0, 2)], axis=2).reshape(panels, nb * INT_BLOCK_BYTES)
    return np.ascontiguousarray(np.concatenate([cells, scale.view(np.uint8).reshape(panels, 4 * PANEL)], axis=1))


def unpack_panels_int(packed: np.ndarray, k: int, n: int) -> np.ndarray:
    """Inverse of pack_panels_int: the dequantized weight float32 [K, N], (u − 8) · m · S."""
    panels, nb = packed.shape[0], k // BLOCK
    cells = packed[:, :nb * INT_BLOCK_BYTES].reshape(panels, nb, INT_BLOCK_BYTES)
    u = _panel_u(cells, k).astype(np.int32)
    m = np.repeat(cells[..., 256:].transpose(1, 0, 2).reshape(nb, panels * PANEL), BLOCK, axis=0).astype(np.int32)
    scale = np.ascontiguousarray(packed[:, nb * INT_BLOCK_BYTES:]).view(np.float32).reshape(panels * PANEL)
    return ((u - 8) * m).astype(np.float32)[:, :n] * scale[:n]
