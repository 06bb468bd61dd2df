"""Which DP rank takes a request, and which rank each live request is on.

Routing: among the ranks that serve, the one with the least outstanding work (unfinished requests, then
their tokens), except that a prompt whose first blocks this router sent to some rank before goes back to
that rank (whose prefix cache likely still holds them) unless that rank is busier than the least busy by
more than AFFINITY_SLACK requests. The memory of which prefixes went where is bounded (least recently used
forgotten first). A request whose rank failed is detached (on no rank) until it is sent to another.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

AFFINITY_BLOCKS = 4  # prefixes of up to this many full KV blocks are remembered
AFFINITY_SLACK = 4  # outstanding requests by which an affine rank may exceed the least busy one
AFFINITY_MEMORY = 65536  # prefixes remembered
DETACHED = -1  # rank_of for a request between a failed rank and the next


class DPRouter:
    def __init__(self, size: int, block_size: int) -> None:
        self.size, self.block_size = size, block_size
        self.rank_of: dict[str, int] = {}  # request id -> DP rank (DETACHED: being moved)
        self.num_tokens: dict[str, int] = {}  # request id -> the tokens its rank prefills for it
        self.outstanding = [0] * size
        self.outstanding_tokens = [0] * size
        self.routed = [0] * size
        self.affinity_routed = 0
        self._prefixes: OrderedDict[bytes, int] = OrderedDict()

    def route(self, token_ids: list[int] | None, serving: list[bool]) -> int | None:
        """The rank for a prompt among those `serving`; None when none serves."""
        live = [dp for dp in range(self.size) if serving[dp]]
        if not live:
            return None
        least = min(live, key=lambda dp: (self.outstanding[dp], self.outstanding_tokens[dp], dp))
        keys = self._prefix_keys(token_ids) if token_ids else []
        chosen = least
        for key in keys:
            dp = self._prefixes.get(key)
            if dp is not None and serving[dp] and self.outstanding[dp] - self.outstanding[least] <= AFFINITY_SLACK:
                chosen = dp
                if dp != least:
                    self.affinity_routed += 1
                break
        for key in keys:
            self._prefixes[key] = chosen
            self._prefixes.move_to_end(key)
        while len(self._prefixes) > AFFINITY_MEMORY:
            self._prefixes.popitem(last=False)
        return chosen

    def assign(self, request_id: str, dp: int, num_tokens: int) -> None:
        self.release(request_id)
        self.rank_of[request_id] = dp
        self.num_tokens[request_id] = num_tokens
        self.outstanding[dp] += 1
        self.outstanding_tokens[dp] += num_tokens
        self.routed[dp] += 1

    def release(self, request_id: str) -> None:
        """The request is on no rank any more (finished, aborted, refused)."""
        dp = self.rank_of.pop(request_id, None)
        num_tokens = self.num_tokens.pop(request_id, 0)
        if dp is not None and dp != DETACHED:
            self.outstanding[dp] -= 1
            self.outstanding_tokens[dp] -= num_tokens

    def detach(self, dp: int) -> list[str]:
        """Rank `dp` failed: its requests, each now on no rank (DETACHED) until assigned again."""
        moved = [request_id for request_id, rank in self.rank_of.items() if rank == dp]
        for request_id in moved:
            self.rank_of[request_id] = DETACHED
        self.outstanding[dp] = self.outstanding_tokens[dp] = 0
        self._prefixes = OrderedDict((key, rank) for key, rank in self._prefixes.items() if rank != dp)
        return moved

    def _prefix_keys(self, token_ids: list[int]) -> list[bytes]:
        """Keys of the prompt's first 1..AFFINITY_BLOCKS full blocks, longest first."""
        size = self.block_size
        blocks = min(AFFINITY_BLOCKS, len(token_ids) // size)
        digest = hashlib.blake2b(digest_size=16)
        keys = []
        for block in range(blocks):
            digest.update(repr(token_ids[block * size:(block + 1) * size]).encode())
            keys.append(digest.copy().digest())
        return keys[::-1]
