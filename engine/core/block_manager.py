"""Paged KV-cache block manager with prefix caching.

Blocks are reference counted. A full block whose KV has been computed is registered under a chained hash
of its tokens (each hash covers every token before it), so later requests with the same prefix reuse it.
Freed blocks keep their hash and go to the tail of the free queue; allocation takes the head, so the
least recently freed cached block is evicted first.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from engine.core.request import Request


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


def hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
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
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids holding the longest cached prefix of the request (at least one token is left to
        compute, so the request still produces logits)."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, max_blocks)
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits

    def allocate(self, request: Request, num_new_tokens: int, cached_block_ids: list[int] = ()) -> bool:
        """Give the request enough blocks for its cached prefix plus `num_new_tokens` more tokens.
        Returns False (and changes nothing) if there are not enough free blocks."""
        num_tokens = request.num_computed_tokens + len(cached_block_ids) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(num_tokens) - len(request.block_ids) - len(cached_block_ids)
        reclaimed = sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)
        if num_new_blocks > self.num_free_blocks - reclaimed:
            return False
        for block_id in cached_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
        if cached_block_ids:
            request.block_ids.extend(cached_block_ids)
            request.num_cached_blocks = len(request.block_ids)
        for _ in range(max(num_new_blocks, 0)):
            request.block_ids.append(self._take_free_block())
        return True

    def free(self, request: Request) -> None:
        # Tail blocks first, so that a request's prefix is the last of it to be evicted.
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        request.block_ids = []
        request.num_cached_blocks = 0

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV is now in the cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if num_full <= request.num_cached_blocks:
            return
        self._extend_hashes(request, num_full)
        for index in range(request.num_cached_blocks, num_full):
            block = self.blocks[request.block_ids[index]]
            block_hash = request.block_hashes[index]
            if block.block_hash is None and block_hash not in self.cached_blocks:
                block.block_hash = block_hash
                self.cached_blocks[block_hash] = block.block_id
        request.num_cached_blocks = num_full

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block that no request uses. False if some are still in use."""
        if any(b.ref_count for b in self.blocks if b.block_hash is not None):
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
