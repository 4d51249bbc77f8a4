"""Rotary position embedding frequencies, with the llama3 and linear scalings (shared by graph and reference)."""

from __future__ import annotations

import math

import numpy as np


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """[head_dim // 2] float64 inverse frequencies after scaling, as transformers computes them."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return np.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r}")


def cos_sin_cache(head_dim: int, theta: float, scaling: dict | None, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables, each [max_len, head_dim // 2] float32, as GroupQueryAttention expects."""
    freqs = np.outer(np.arange(max_len, dtype=np.float64), inv_frequencies(head_dim, theta, scaling))
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)
