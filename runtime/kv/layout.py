"""What every backend's KV bookkeeping shares: the KV shape of a model, and the prefix cache's counters."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class KVLayout:
    """The KV shape of one model: the target, or the draft that speculates for it."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "float32"        # int8: an engine built with --kv-cache int8

    @classmethod
    def from_manifest(cls, kv: dict) -> "KVLayout":
        """The layout an engine's manifest records (its `kv_cache` section)."""
        return cls(kv["num_layers"], kv["num_kv_heads"], kv["head_dim"], kv["dtype"])

    @property
    def token_bytes(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * np.dtype(self.dtype).itemsize


@dataclass
class CacheStats:
    queries: int = 0          # prompt tokens looked up in the prefix cache
    hits: int = 0             # of which served from it
