"""Serve's request routing for the atom-ray deployment: Serve's power of two choices, except that a
request that continues another replica's stream after its engine failed (`resume_stream`, sent by
deployments/replica_failover.py) never goes back to the replica it comes from.

Two differences from Serve's default router (`PowerOfTwoChoicesRequestRouter`), both for that exclusion:
- a request that names `avoid_replica` chooses among the other replicas only (none: routing waits, and the
  caller's own time-out ends the try);
- each routing task serves the request it was started for. The default router's FIFO mixin hands a replica
  found for one request to the oldest one waiting, which could send a continuation back to its own replica;
  without it, requests are still routed as soon as a replica has room, only not strictly in arrival order.
"""
from __future__ import annotations

import random

from ray.serve.request_router import LocalityMixin, MultiplexMixin, PendingRequest, RequestRouter, RunningReplica

AVOID_REPLICA = "avoid_replica"  # the keyword argument that names the replica (its tag) a request must avoid
ROUTER_CLASS = "deployments.replica_router:ReplicaFailoverRouter"


def replica_to_avoid(pending_request: PendingRequest | None) -> str | None:
    return pending_request.kwargs.get(AVOID_REPLICA) if pending_request is not None else None


class ReplicaFailoverRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Two random replicas among the eligible ones (the router then takes the one with the shorter
        queue); eligible as in Serve's router (same node first where asked, multiplexed models), or, for a
        continuation, every replica but the one it comes from."""
        avoid = replica_to_avoid(pending_request)
        if avoid is not None:
            # Back off between tries: with no other replica the router would otherwise retry without a pause.
            pending_request.routing_context.should_backoff = True
            eligible = {replica.replica_id for replica in candidate_replicas if replica.replica_id.unique_id != avoid}
        elif pending_request is not None and pending_request.metadata.multiplexed_model_id:
            eligible = self.apply_multiplex_routing(pending_request=pending_request)
        else:
            eligible = self.apply_locality_routing(pending_request=pending_request)
        chosen = [replica for replica in candidate_replicas if replica.replica_id in eligible]
        return [random.sample(chosen, min(2, len(chosen)))] if chosen else []
