"""Prefix-aware replica choice: send a request where its prompt's first blocks were last sent, unless that replica
is saturated; otherwise to the least-loaded replica (ties broken by rendezvous hashing on the first block, so
distinct new prefixes spread over equally loaded replicas instead of piling onto the first).

This is the policy alone, with no Ray in it (runtime.cluster.ray_router wraps it as a Ray Serve request router),
so it can be tested as a function. The keys are the KV cache's own chained block hashes (runtime.kv.hashing) of
the prompt's token ids: a key names a whole prefix, so the longest key a replica owns is the longest prefix it
was last given — what its prefix cache (and retained slots) most likely still hold. That is the approach of
vLLM's prefix-aware Ray Serve router and SGLang's cache-aware router, on block hashes instead of a text tree.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence

from ..kv.hashing import hash_blocks

MAX_BLOCKS = 64           # prompt blocks hashed for routing: a 1k-token prefix at block 16 tells enough


def prefix_keys(token_ids: Sequence[int], block_size: int, max_blocks: int = MAX_BLOCKS) -> list[int]:
    """Chained keys of the prompt's first full blocks (at most `max_blocks`), the prefix cache's own keys."""
    return hash_blocks(list(token_ids[:block_size * max_blocks]), block_size)


class PrefixAffinity:
    """Which replica each prefix key was last routed to, as a bounded LRU map."""

    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        self.owner: OrderedDict[int, Hashable] = OrderedDict()

    def choose(self, keys: Sequence[int], loads: Mapping[Hashable, int | None],
               saturated_at: int) -> tuple[list[list[Hashable]], str]:
        """Ranked replicas for a request (best first) and why.

        keys: the request's prefix keys (prefix_keys); loads: every candidate replica → requests it holds (None:
        unknown, taken as 0); saturated_at: a replica holding this many is not given a prefix match (it would
        queue the request behind a full batch), the least-loaded replica takes it instead.
        """
        if not loads:
            return [], "no replica"
        by_load = sorted(loads, key=lambda r: (loads[r] or 0, _rendezvous(keys, r)))
        for depth in range(len(keys), 0, -1):
            replica = self.owner.get(keys[depth - 1])
            if replica is None or replica not in loads:
                continue
            if (loads[replica] or 0) >= saturated_at:
                return [by_load], f"prefix owner saturated ({loads[replica]} requests): least loaded"
            return [[replica], [r for r in by_load if r != replica]], f"prefix match ({depth} blocks)"
        return [by_load], "no prefix match: least loaded"

    def record(self, keys: Sequence[int], replica: Hashable) -> None:
        """The request with these keys went to `replica`: every prefix of it now points there."""
        for key in keys:
            self.owner[key] = replica
            self.owner.move_to_end(key)
        while len(self.owner) > self.capacity:
            self.owner.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """A replica is gone: its prefixes belong to nobody (its replacement starts with an empty cache)."""
        for key in [k for k, r in self.owner.items() if r == replica]:
            del self.owner[key]


def _rendezvous(keys: Sequence[int], replica: Hashable) -> int:
    """Highest-random-weight tie-break: equal loads go to the replica a new prefix's first key scores highest."""
    digest = hashlib.blake2b(f"{keys[0] if keys else 0}:{replica}".encode(), digest_size=8).digest()
    return -int.from_bytes(digest, "little")
