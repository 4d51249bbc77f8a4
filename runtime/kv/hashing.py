"""Chained block hashes for automatic prefix caching (pure Python truth + the native fast path).

key(block i) = H(key(block i-1), token ids of block i), with H a splitmix64-based mix over 64-bit words.
The native version in `runtime._native` is the one used at run time; this module's Python version is
its specification and the fallback when the extension is absent.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_M = (1 << 64) - 1
SEED = 0x51ED270B27A3B4C5
GOLDEN = 0x9E3779B97F4A7C15

try:
    from runtime import _native
except ImportError:  # pragma: no cover - only when the package was not built
    _native = None


def _splitmix64(x: int) -> int:
    x = (x + GOLDEN) & _M
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M
    return x ^ (x >> 31)


def hash_block_py(parent: int, tokens: Sequence[int]) -> int:
    h = _splitmix64(parent ^ SEED) ^ ((len(tokens) * GOLDEN) & _M)
    for t in tokens:
        h = _splitmix64(h ^ (int(t) & 0xFFFFFFFF))
    return h


def hash_blocks_py(tokens: Sequence[int], block_size: int, parent: int = 0) -> list[int]:
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block_py(parent, tokens[start:start + block_size])
        keys.append(parent)
    return keys


def hash_blocks(tokens: Sequence[int] | np.ndarray, block_size: int, parent: int = 0) -> list[int]:
    """Keys of the full blocks of `tokens` (a trailing partial block has no key)."""
    if _native is None:
        return hash_blocks_py(list(tokens), block_size, parent)
    return _native.hash_blocks(np.asarray(tokens, dtype=np.int64), block_size, parent).tolist()


def extend_keys(keys: list[int], ids: Sequence[int], block_size: int) -> list[int]:
    """Append to `keys` (the chained keys of the first len(keys) full blocks of `ids`) the keys of its later
    full blocks, hashing only what is new; returns `keys`."""
    full = len(ids) // block_size
    if len(keys) < full:
        keys.extend(hash_blocks(ids[len(keys) * block_size:full * block_size], block_size, keys[-1] if keys else 0))
    return keys
