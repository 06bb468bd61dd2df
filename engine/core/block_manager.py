"""Paged KV-cache block managers with prefix caching, and the manager of every cache pool a model has.

Blocks are reference counted. A full block whose KV has been computed is registered under a chained hash
of its tokens (each hash covers every token before it), so later requests with the same prefix reuse it.
Freed blocks keep their hash and go to the tail of the free queue; allocation takes the head, so the
least recently freed cached block is evicted first.

A model's caches form groups (engine/kv_cache_spec.py): one BlockManager per paged group (its entries per
token `1 / ratio`, its sliding window), plus a slot pool for per-request state. `KVCacheManager` admits a
request only when every group has its blocks and, if the model keeps state, a slot is free.

Every group of one entry per token caches its own blocks under the same hashes. A sliding-window group's
blocks that fall out of a request's window go to its free queue still cached, like a finished request's.
A prefix hit of n blocks counts only if every group holds every block a query from token n * block_size
on reads: a full group all n, a window group the last ones its window reaches (`find_prefix_hit`).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from engine.core.request import GroupBlocks, Request
from engine.kv_cache_spec import CacheLayout


UNTAKEN_BLOCK = 0  # table entry for a block a window's prefix hit does not reach (stale: never read)


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


def hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


class BlockManager:
    """The blocks of one paged cache group: `ratio` tokens per entry, `block_size` entries per block; with a
    `window`, only the last `window` tokens' entries are kept (blocks wholly before the window of the next
    query are given back, still cached). Prefix caching needs ratio 1. `group` indexes `Request.groups`."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, ratio: int = 1,
                 window: int | None = None, group: int = 0) -> None:
        assert num_blocks > 0 and block_size > 0 and ratio >= 1
        assert not (enable_prefix_caching and ratio != 1), "prefix caching needs one entry per token"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ratio, self.window, self.group = ratio, window, group
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block id -> None, ordered from next-to-evict (head) to most recently freed (tail).
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold the entries of the first `num_tokens` tokens (released ones counted)."""
        return -(-(-(-num_tokens // self.ratio)) // self.block_size)

    def _blocks(self, request: Request) -> GroupBlocks:
        while len(request.groups) <= self.group:
            request.groups.append(GroupBlocks())
        return request.groups[self.group]

    def num_new_blocks(self, request: Request, num_new_tokens: int, cached_block_ids=()) -> int:
        """Free blocks that `allocate` would take (after a window's release)."""
        blocks = self._blocks(request)
        num_tokens = request.num_computed_tokens + len(cached_block_ids) * self.block_size + num_new_tokens
        needed = self.blocks_needed(num_tokens) - len(blocks.block_ids) - len(cached_block_ids)
        reclaimed = sum(1 for b in cached_block_ids if b is not None and self.blocks[b].ref_count == 0)
        return max(needed, 0) + reclaimed - self._releasable(request, blocks)

    def first_block_read(self, num_tokens: int) -> int:
        """The first block any query from position `num_tokens` on reads: 0, or for a window the block of
        the first query's first key (position num_tokens reads positions > num_tokens - window)."""
        if self.window is None:
            return 0
        return max(num_tokens - self.window + 1, 0) // self.block_size

    def _releasable(self, request: Request, blocks: GroupBlocks) -> int:
        """Leading blocks no query from this step on reads."""
        first_needed = self.first_block_read(request.num_computed_tokens)
        return max(min(first_needed, len(blocks.block_ids)) - blocks.num_released, 0)

    def _release_outside_window(self, request: Request, blocks: GroupBlocks) -> None:
        """Give back the blocks the window left behind; those computed are registered first, so that they
        stay cached (evictable) and a later request with the same prefix may still find them."""
        releasable = self._releasable(request, blocks)
        if not releasable:
            return
        self.cache_computed_blocks(request)
        for index in range(blocks.num_released, blocks.num_released + releasable):
            self._unref(blocks.block_ids[index])
        blocks.num_released += releasable

    def find_cached_prefix(self, request: Request) -> list[int | None]:
        """This group's blocks for the request's longest cached prefix (at least one token is left to
        compute, so the request still produces logits); None for leading blocks a window does not reach."""
        hit = find_prefix_hit([self], request)[0]
        if self.enable_prefix_caching and request.sampling_params.prompt_logprobs is None:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(hit) * self.block_size
        return hit

    def lookup(self, request: Request, num_blocks: int) -> list[int | None]:
        """The cached block of each of the request's first `num_blocks` full blocks (None: not cached); a
        full group stops at its first miss, since no hit reaches past it."""
        self._extend_hashes(request, num_blocks)
        found = []
        for block_hash in request.block_hashes[:num_blocks]:
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None and self.window is None:
                break
            found.append(block_id)
        return found

    def last_missing(self, found: list[int | None], num_blocks: int) -> int:
        """The last block a hit of `num_blocks` blocks needs from this group and `found` lacks, or -1. A full
        group's `found` (from `lookup`) has no gaps."""
        if self.window is None:
            return -1
        for index in range(num_blocks - 1, self.first_block_read(num_blocks * self.block_size) - 1, -1):
            if found[index] is None:
                return index
        return -1

    def allocate(self, request: Request, num_new_tokens: int, cached_block_ids: list[int | None] = ()) -> bool:
        """Give the request enough blocks for its cached prefix plus `num_new_tokens` more tokens (a window
        first gives back the blocks it no longer reads). `cached_block_ids` (at admission only) is this
        group's part of a prefix hit; its leading None are blocks a window does not reach, which the
        request does not take (stale entries, as if released). Returns False (and takes nothing) if there
        are not enough free blocks."""
        blocks = self._blocks(request)
        if self.num_new_blocks(request, num_new_tokens, cached_block_ids) > self.num_free_blocks:
            return False
        self._release_outside_window(request, blocks)
        num_tokens = request.num_computed_tokens + len(cached_block_ids) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(num_tokens) - len(blocks.block_ids) - len(cached_block_ids)
        if cached_block_ids:
            assert not blocks.block_ids, "a prefix hit is taken only at admission"
            for block_id in cached_block_ids:
                if block_id is None:
                    assert blocks.num_released == len(blocks.block_ids), "untaken blocks lead a hit"
                    blocks.block_ids.append(UNTAKEN_BLOCK)
                    blocks.num_released += 1
                    continue
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free_queue[block_id]
                block.ref_count += 1
                blocks.block_ids.append(block_id)
            blocks.num_cached = len(blocks.block_ids)
        for _ in range(max(num_new_blocks, 0)):
            blocks.block_ids.append(self._take_free_block())
        return True

    def free(self, request: Request) -> None:
        # Tail blocks first, so that a request's prefix is the last of it to be evicted.
        blocks = self._blocks(request)
        for block_id in reversed(blocks.block_ids[blocks.num_released:]):
            self._unref(block_id)
        blocks.block_ids.clear()
        blocks.num_released = blocks.num_cached = 0

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self.free_queue[block_id] = None

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV is now in the cache (computed tokens whose ids are
        still on their way, in a step launched ahead, wait: a block's hash needs all its tokens)."""
        if not self.enable_prefix_caching:
            return
        blocks = self._blocks(request)
        num_computed = min(request.num_computed_tokens, request.num_tokens)
        num_full = min(num_computed // self.block_size, len(blocks.block_ids))
        if num_full <= blocks.num_cached:
            return
        self._extend_hashes(request, num_full)
        for index in range(max(blocks.num_cached, blocks.num_released), num_full):
            block = self.blocks[blocks.block_ids[index]]
            block_hash = request.block_hashes[index]
            if block.block_hash is None and block_hash not in self.cached_blocks:
                block.block_hash = block_hash
                self.cached_blocks[block_hash] = block.block_id
        blocks.num_cached = num_full

    @property
    def cached_blocks_in_use(self) -> bool:
        return any(b.ref_count for b in self.blocks if b.block_hash is not None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block that no request uses. False if some are still in use."""
        if self.cached_blocks_in_use:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) == block_id:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _extend_hashes(self, request: Request, num_blocks: int) -> None:
        hashes, size, tokens = request.block_hashes, self.block_size, request.token_ids
        while len(hashes) < num_blocks:
            index = len(hashes)
            parent = hashes[-1] if hashes else b""
            hashes.append(hash_block(parent, tokens[index * size:(index + 1) * size]))


def find_prefix_hit(managers: list[BlockManager], request: Request) -> list[list[int | None]]:
    """Each group's blocks for the request's longest prefix that every group can serve exactly: n blocks
    (leaving a token to compute) such that each full group holds all n and each window group the blocks
    its window reaches from token n * block_size on (the others None: not taken). From the full groups'
    longest hit, n walks down past the last block some window group lacks (a hit ending after a missing
    block its window reaches cannot count). Nothing with prompt logprobs: they need every position."""
    first = managers[0]
    if not first.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
        return [[] for _ in managers]
    max_blocks = (request.num_tokens - 1) // first.block_size
    found = [manager.lookup(request, max_blocks) for manager in managers]
    num_blocks = min(len(ids) for ids in found)
    while num_blocks:
        missing = max(manager.last_missing(ids, num_blocks) for manager, ids in zip(managers, found))
        if missing < 0:
            break
        num_blocks = missing
    hits = []
    for manager, ids in zip(managers, found):
        start = manager.first_block_read(num_blocks * manager.block_size)
        hits.append([None] * start + ids[start:num_blocks])
    return hits


@dataclass(frozen=True)
class PrefixHit:
    """A request's prefix-cache hit over every paged group: `len(hit)` leading blocks' KV is reused; each
    group's list has one entry per block (None: a block its window does not reach, not taken)."""
    group_block_ids: tuple[list[int | None], ...]

    def __len__(self) -> int:
        return len(self.group_block_ids[0])


class SlotPool:
    """The state pool's slots: one per running request of a model that keeps per-request state."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def take(self) -> int:
        return self.free_slots.pop()

    def give_back(self, slot: int) -> None:
        assert slot not in self.free_slots, f"state slot {slot} freed twice"
        self.free_slots.append(slot)


class KVCacheManager:
    """Every pool of one engine's caches behind the block manager's interface: one BlockManager per paged
    group (each caching its own blocks, where the layout allows prefix caching) and the state slots. A
    request is admitted (`allocate`) only if every group has its blocks and a state slot is free; `free`
    gives all back. Block counts and usage sum over the groups; a prefix hit counts once."""

    def __init__(self, layout: CacheLayout, enable_prefix_caching: bool = True) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        prefix = enable_prefix_caching and layout.prefix_caching_blocker is None
        self.managers = [BlockManager(g.num_blocks, layout.block_size, prefix, g.ratio, g.window, i)
                         for i, g in enumerate(layout.groups)]
        self.slots = SlotPool(layout.num_state_slots) if layout.num_state_slots else None
        # One full-attention group and no state: a running request's next tokens often fit in the blocks it
        # holds, which `allocate` then confirms without the general bookkeeping (every decode step, every
        # request: the scheduler's largest cost at large batches).
        self._plain = len(self.managers) == 1 and self.managers[0].window is None and self.slots is None
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def main(self) -> BlockManager:
        return self.managers[0]

    @property
    def enable_prefix_caching(self) -> bool:
        return self.main.enable_prefix_caching

    @property
    def num_blocks(self) -> int:
        return sum(m.num_blocks for m in self.managers)

    @property
    def num_free_blocks(self) -> int:
        return sum(m.num_free_blocks for m in self.managers)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def find_cached_prefix(self, request: Request) -> PrefixHit:
        hit = PrefixHit(tuple(find_prefix_hit(self.managers, request)))
        if self.enable_prefix_caching and request.sampling_params.prompt_logprobs is None:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(hit) * self.block_size
        return hit

    def allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Blocks in every group for `hit` (at admission) and `num_new_tokens` more tokens, and a state slot;
        False (and nothing taken) where one group or the slots fall short."""
        if self._plain and hit is None and request.groups:
            main = self.managers[0]
            if main.blocks_needed(request.num_computed_tokens + num_new_tokens) <= len(request.groups[0].block_ids):
                return True
        if self.slots is not None and request.state_slot is None and not self.slots.num_free:
            return False
        cached = hit.group_block_ids if hit else [()] * len(self.managers)
        for manager, group_cached in zip(self.managers, cached):
            if manager.num_new_blocks(request, num_new_tokens, group_cached) > manager.num_free_blocks:
                return False
        for manager, group_cached in zip(self.managers, cached):
            taken = manager.allocate(request, num_new_tokens, group_cached)
            assert taken, "a group refused blocks it had just counted as free"
        if self.slots is not None and request.state_slot is None:
            request.state_slot = self.slots.take()
        return True

    def free(self, request: Request) -> None:
        for manager in self.managers:
            manager.free(request)
        if self.slots is not None and request.state_slot is not None:
            self.slots.give_back(request.state_slot)
            request.state_slot = None

    def cache_computed_blocks(self, request: Request) -> None:
        for manager in self.managers:
            manager.cache_computed_blocks(request)

    def reset_prefix_cache(self) -> bool:
        """Forget every group's cached blocks, unless a request still uses some (then False, nothing lost)."""
        if any(manager.cached_blocks_in_use for manager in self.managers):
            return False
        return all([manager.reset_prefix_cache() for manager in self.managers])

    def stats(self) -> dict:
        """Both pools, for metrics: per-group blocks and the state slots."""
        out = {"kv_cache_groups": [
            {"ratio": m.ratio, "window": m.window, "num_blocks": m.num_blocks, "num_free_blocks": m.num_free_blocks}
            for m in self.managers]}
        total = self.slots.num_slots if self.slots is not None else 0
        free = self.slots.num_free if self.slots is not None else 0
        out.update(num_state_slots=total, num_free_state_slots=free,
                   state_slot_usage=1.0 - free / total if total else 0.0)
        return out
