"""Prefix-aware replica choice: a conversation's next turn goes to the replica that holds its history; any other
prompt (a new user, even behind a system prompt every user shares) to the replica that was given the least, so users
spread evenly over the replicas' caches. The rules, with their overrides for load, are PrefixAffinity.choose's.

This is the policy alone, with no Ray in it (runtime.cluster.ray_router wraps it as a Ray Serve request router),
so it can be tested as a function. The keys are the KV cache's own chained block hashes (runtime.kv.hashing) of
the prompt's token ids: a key names a whole prefix, so the longest key a replica holds is the longest prefix it
was given — what its prefix cache (and retained slots) most likely still hold. That is the approach of
vLLM's prefix-aware Ray Serve router and SGLang's cache-aware router (which places prompts that match little on the
replica with the smallest tree), on block hashes instead of a text tree.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Hashable, Mapping, Sequence

from ..kv.hashing import hash_blocks

MAX_BLOCKS = 1024         # prompt blocks hashed for routing (16K tokens at block 16): a shared prefix must end inside
BRANCH = -1               # PrefixAffinity.after: prompts went on from this key in more than one way (keys are >= 0)


def prefix_keys(token_ids: Sequence[int], block_size: int, max_blocks: int = MAX_BLOCKS) -> list[int]:
    """Chained keys of the prompt's first full blocks (at most `max_blocks`), the prefix cache's own keys."""
    return hash_blocks(list(token_ids[:block_size * max_blocks]), block_size)


class PrefixAffinity:
    """Which replicas each prefix key was routed to (a bounded LRU map of key → replicas, most recent last), the key
    that came after each one in the prompts routed (or BRANCH), and how many keys each replica holds (its share of
    what was routed: the cache it was given)."""

    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        self.holders: OrderedDict[int, dict[Hashable, None]] = OrderedDict()
        self.after: dict[int, int] = {}
        self.sizes: Counter[Hashable] = Counter()

    def choose(self, keys: Sequence[int], loads: Mapping[Hashable, int | None], saturated_at: int,
               max_imbalance: int | None = None) -> tuple[list[list[Hashable]], str]:
        """Ranked replicas for a request (best first) and why.

        keys: the request's prefix keys (prefix_keys); loads: every candidate replica → requests it holds (None:
        unknown, taken as 0). A prompt that continues an earlier one (see `continues`) goes first to the replicas
        that took its longest prefix, the least loaded of them ahead, unless that one is saturated (holds
        `saturated_at`: the request would queue behind a full batch) or holds `max_imbalance` more than the
        least-loaded replica (default: a quarter of saturated_at, at least 2): then to the least-loaded replica. Any
        other prompt goes to the replica holding the fewest keys among those with room and fewer than
        `max_imbalance` requests more than the least loaded: following a prefix every user shares would send every
        new user to the first replica that took it (one replica took 87 % of bench_replicas' requests).
        """
        if not loads:
            return [], "no replica"
        if max_imbalance is None:
            max_imbalance = max(2, saturated_at // 4)
        load = {r: v or 0 for r, v in loads.items()}
        by_load = sorted(load, key=lambda r: (load[r], _rendezvous(keys, r)))
        least = load[by_load[0]]
        if not keys:
            return [by_load], "no full block: least loaded"
        why = "no prefix match"
        for depth in range(len(keys), 0, -1):
            holders = self.holders.get(keys[depth - 1])     # looked up once a key: a new prompt walks all of them
            held = [r for r in by_load if r in holders] if holders else []
            if not held:
                continue
            if not self.continues(keys[depth - 1]):
                why = f"branches off a shared prefix ({depth} blocks)"
                break
            best = held[0]
            if load[best] >= saturated_at:
                return [by_load], f"prefix holders saturated ({load[best]} requests): least loaded"
            if load[best] - least >= max_imbalance:
                return [by_load], f"prefix holders busier by {load[best] - least}: least loaded"
            return [held, [r for r in by_load if r not in held]], f"continues a prompt ({depth} blocks)"
        room = [r for r in by_load if load[r] < saturated_at and load[r] - least < max_imbalance]
        room.sort(key=lambda r: self.sizes[r])          # stable: equal sizes stay in load order
        return [room + [r for r in by_load if r not in room]], f"{why}: least cached"

    def continues(self, key: int) -> bool:
        """Whether a prompt whose longest routed prefix ends at `key` continues an earlier prompt: no routed prompt
        went on past `key` (it was their end: the prompt is their next turn, however long the answer between), or
        only by one block no prompt went past (their last block, which the next turn's text re-tokenizes). Else
        earlier prompts went on from `key` in other ways: it ends a prefix they share, and this prompt branches off
        it too."""
        after = self.after.get(key)
        return after is None or (after != BRANCH and after not in self.after)

    def record(self, keys: Sequence[int], replica: Hashable) -> None:
        """The request with these keys went to `replica`: it now holds every prefix of it."""
        for i, key in enumerate(keys):
            held = self.holders.setdefault(key, {})
            if replica in held:
                del held[replica]                       # re-added below: most recent last
            else:
                self.sizes[replica] += 1
            held[replica] = None
            self.holders.move_to_end(key)
            if i + 1 < len(keys) and self.after.setdefault(key, keys[i + 1]) != keys[i + 1]:
                self.after[key] = BRANCH
        while len(self.holders) > self.capacity:
            key, held = self.holders.popitem(last=False)
            self.after.pop(key, None)
            for r in held:
                self.sizes[r] -= 1

    def forget(self, replica: Hashable) -> None:
        """A replica is gone: it holds nothing (its replacement starts with an empty cache)."""
        for key in list(self.holders):
            held = self.holders[key]
            held.pop(replica, None)
            if not held:
                del self.holders[key]
                self.after.pop(key, None)
        self.sizes.pop(replica, None)


def _rendezvous(keys: Sequence[int], replica: Hashable) -> int:
    """Highest-random-weight tie-break: equal loads go to the replica the prompt's deepest key scores highest. Not
    the first key: prompts that share a system prompt share their first keys, and every new user went to one replica
    (2.5x the other's steps in bench_replicas' workload)."""
    digest = hashlib.blake2b(f"{keys[-1] if keys else 0}:{replica}".encode(), digest_size=8).digest()
    return -int.from_bytes(digest, "little")
