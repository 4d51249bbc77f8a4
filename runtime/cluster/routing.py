"""Prefix-aware replica choice: send a request to a replica that took its longest prefix before (the least loaded
of them) when that prefix is at least `min_match` of the prompt, unless that replica is saturated or holds
`max_imbalance` more requests than the least-loaded one; a new prompt (or one whose held prefix is shorter: a new
user behind a system prompt every user shares) goes to the replica that has taken the least (the fewest prefix
keys), among those not far busier than the least loaded — so users spread evenly over the replicas' caches, and each
user's later turns follow. Ties are broken by load, then by rendezvous hashing on the prompt's deepest key.

This is the policy alone, with no Ray in it (runtime.cluster.ray_router wraps it as a Ray Serve request router),
so it can be tested as a function. The keys are the KV cache's own chained block hashes (runtime.kv.hashing) of
the prompt's token ids: a key names a whole prefix, so the longest key a replica holds is the longest prefix it
was given — what its prefix cache (and retained slots) most likely still hold. That is the approach of
vLLM's prefix-aware Ray Serve router and SGLang's cache-aware router (its cache_threshold and smallest-tree
placement), on block hashes instead of a text tree.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Hashable, Mapping, Sequence

from ..kv.hashing import hash_blocks

MAX_BLOCKS = 1024         # prompt blocks hashed for routing (16K tokens at block 16): the match is a share of them
MIN_MATCH = 0.5           # the share of a prompt's blocks a held prefix must cover to be followed (SGLang's default)


def prefix_keys(token_ids: Sequence[int], block_size: int, max_blocks: int = MAX_BLOCKS) -> list[int]:
    """Chained keys of the prompt's first full blocks (at most `max_blocks`), the prefix cache's own keys."""
    return hash_blocks(list(token_ids[:block_size * max_blocks]), block_size)


class PrefixAffinity:
    """Which replicas each prefix key was routed to (a bounded LRU map of key → replicas, most recent last), and how
    many keys each replica holds (its share of what was routed: the cache it was given). Every replica that took a
    prefix may still hold it; a user's own history belongs to one."""

    def __init__(self, capacity: int = 200_000, min_match: float = MIN_MATCH):
        self.capacity, self.min_match = capacity, min_match
        self.holders: OrderedDict[int, dict[Hashable, None]] = OrderedDict()
        self.sizes: Counter[Hashable] = Counter()

    def choose(self, keys: Sequence[int], loads: Mapping[Hashable, int | None], saturated_at: int,
               max_imbalance: int | None = None) -> tuple[list[list[Hashable]], str]:
        """Ranked replicas for a request (best first) and why.

        keys: the request's prefix keys (prefix_keys); loads: every candidate replica → requests it holds (None:
        unknown, taken as 0). When some replicas took a prefix of it covering at least `min_match` of its keys,
        those that took the longest come first, the least loaded of them ahead, unless that one is saturated (holds
        `saturated_at`: the request would queue behind a full batch) or holds `max_imbalance` more than the
        least-loaded replica (default: a quarter of saturated_at, at least 2): then the least-loaded replica. Any
        other prompt goes to the replica holding the fewest keys among those with room and within `max_imbalance`
        of the least loaded: a prefix every user shares is held by the first replica that took it, and following
        it would send every new user there (one replica took 87 % of bench_replicas' requests).
        """
        if not loads:
            return [], "no replica"
        if max_imbalance is None:
            max_imbalance = max(2, saturated_at // 4)
        load = {r: v or 0 for r, v in loads.items()}
        by_load = sorted(load, key=lambda r: (load[r], _rendezvous(keys, r)))
        least = load[by_load[0]]
        why = "no prefix match"
        for depth in range(len(keys), 0, -1):
            held = [r for r in by_load if r in self.holders.get(keys[depth - 1], ())]
            if not held:
                continue
            if depth < self.min_match * len(keys):
                why = f"prefix match too short ({depth} of {len(keys)} blocks)"
                break
            best = held[0]
            if load[best] >= saturated_at:
                return [by_load], f"prefix holders saturated ({load[best]} requests): least loaded"
            if load[best] - least >= max_imbalance:
                return [by_load], f"prefix holders busier by {load[best] - least}: least loaded"
            return [held, [r for r in by_load if r not in held]], f"prefix match ({depth} blocks)"
        room = [r for r in by_load if load[r] < saturated_at and load[r] - least < max_imbalance]
        room.sort(key=lambda r: self.sizes[r])          # stable: equal sizes stay in load order
        return [room + [r for r in by_load if r not in room]], f"{why}: least cached"

    def record(self, keys: Sequence[int], replica: Hashable) -> None:
        """The request with these keys went to `replica`: it now holds every prefix of it."""
        for key in keys:
            held = self.holders.setdefault(key, {})
            if replica in held:
                del held[replica]                       # re-added below: most recent last
            else:
                self.sizes[replica] += 1
            held[replica] = None
            self.holders.move_to_end(key)
        while len(self.holders) > self.capacity:
            for r in self.holders.popitem(last=False)[1]:
                self.sizes[r] -= 1

    def forget(self, replica: Hashable) -> None:
        """A replica is gone: it holds nothing (its replacement starts with an empty cache)."""
        for key in list(self.holders):
            held = self.holders[key]
            held.pop(replica, None)
            if not held:
                del self.holders[key]
        self.sizes.pop(replica, None)


def _rendezvous(keys: Sequence[int], replica: Hashable) -> int:
    """Highest-random-weight tie-break: equal loads go to the replica the prompt's deepest key scores highest. Not
    the first key: prompts that share a system prompt share their first keys, and every new user went to one replica
    (2.5x the other's steps in bench_replicas' workload)."""
    digest = hashlib.blake2b(f"{keys[-1] if keys else 0}:{replica}".encode(), digest_size=8).digest()
    return -int.from_bytes(digest, "little")
