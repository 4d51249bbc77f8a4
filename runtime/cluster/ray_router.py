"""Ray Serve request routers for engine replicas (RequestRouterConfig.request_router_class).

PrefixAwareRouter ranks replicas with runtime.cluster.routing.PrefixAffinity (the policy and why: there);
RoundRobinRouter is the baseline the benchmark compares it with. Both rank single replicas: Serve takes the first
rank whose replica accepts (a replica at its max_ongoing_requests refuses, and the next rank is tried).

A request resubmitted because its replica was lost (runtime.cluster.remote) names that replica's actor in its
`avoid` argument: both routers rank it after every other replica, so the request goes to another where one has
room (Serve may not have noticed the loss yet).

Loads are Serve's own count of each replica's ongoing requests (its queue-length cache: updated when a request is
sent, when it finishes and by the replicas' answers), so no extra probing is done.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from .routing import PrefixAffinity

log = logging.getLogger("quicksilver.cluster")


def _keys(request: PendingRequest | None) -> list[int]:
    return list((request.kwargs or {}).get("prefix_keys") or []) if request is not None else []


def avoided_last(ranks: list[list[Any]], request: PendingRequest | None) -> list[list[Any]]:
    """`ranks` with the replica the request asks to avoid (its `avoid` kwarg: an actor id, hex) moved to a rank of
    its own, the last: taken only when no other replica accepts the request."""
    avoid = (request.kwargs or {}).get("avoid") if request is not None else None
    if avoid is None:
        return ranks
    lost = [r for rank in ranks for r in rank if r.actor_id.hex() == avoid]
    kept = [[r for r in rank if r.actor_id.hex() != avoid] for rank in ranks]
    return [rank for rank in kept if rank] + ([lost] if lost else [])


class PrefixAwareRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, saturated_at: int = 16, max_imbalance: int | None = None, capacity: int = 200_000,
                         **_: Any) -> None:
        self.policy = PrefixAffinity(capacity)
        self.saturated_at, self.max_imbalance = saturated_at, max_imbalance

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id: r for r in candidate_replicas}
        loads = {rid: self.replica_queue_len_cache.get(rid) for rid in by_id}
        ranks, why = self.policy.choose(_keys(pending_request), loads, self.saturated_at, self.max_imbalance)
        log.debug("route: %s", why)
        return avoided_last([[by_id[rid]] for rank in ranks for rid in rank], pending_request)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.policy.record(_keys(pending_request), replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id)


class RoundRobinRouter(FIFOMixin, RequestRouter):
    """Each request to the next replica in turn (the comparison baseline; not prefix-aware)."""

    def initialize_state(self, **_: Any) -> None:
        self.turn = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not ordered:
            return []
        first = self.turn % len(ordered)
        self.turn += 1
        return avoided_last([[r] for r in ordered[first:] + ordered[:first]], pending_request)
