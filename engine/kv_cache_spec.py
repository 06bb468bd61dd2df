"""What each cache-keeping layer stores, declared per layer (`KVCacheLayer.cache_specs`), so that the runner,
not the layer or the attention backend, sizes and allocates memory.

Two pools:
- the **page pool** grows with cached tokens. A `PagedSpec` keeps one entry per token (full attention, an MLA
  latent, an indexer key), one per `ratio` tokens (a compressed cache), or only the entries of the last
  `window` tokens (a sliding window). Layers whose specs share (ratio, window) form a *group* and share one
  block table per request; a block of a group holds `block_size` entries (so `block_size * ratio` tokens).
  Sliding-window groups give back blocks that fall wholly outside every future query's window.
- the **state pool** grows with running requests. A `StateSpec` keeps one fixed-size tensor per running
  request (a recurrent state, a compressor's partial window); a request takes a slot at admission (zeroed
  by the runner) and gives it back at finish or preemption (preemption recomputes, so state is dropped).

At forward time a layer finds its group's block table and slots in the step metadata
(`CommonAttentionMetadata.groups[spec.group]`, a `CacheGroupMetadata`) and its requests' state slots in
`CommonAttentionMetadata.state_slots`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

FULL_GROUP = (1, None)  # (ratio, window) of caches with one entry for every token


@dataclass(frozen=True)
class PagedSpec:
    """Entries in the page pool. The cache tensor is [num_blocks, block_size, *entry_shape] in `dtype`, unless
    `layout` (an attention backend's) gives another shape with the same number of elements per block."""
    entry_shape: tuple[int, ...]
    dtype: torch.dtype | None = None  # None: the runner's KV dtype (the model's, or FP8 for kv_cache_dtype="fp8")
    ratio: int = 1                    # tokens per entry: entry e covers tokens [e * ratio, (e + 1) * ratio)
    window: int | None = None         # only the entries of the last `window` tokens (the query's included) are read
    kind: str = "attention"           # for start-up logs: attention, mla, indexer, sliding_window, compressed...
    layout: Callable[[int, int], tuple[int, ...]] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.ratio < 1:
            raise ValueError(f"a paged cache's ratio must be >= 1, got {self.ratio}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window must be >= 1 token, got {self.window}")

    @property
    def group(self) -> tuple[int, int | None]:
        return (self.ratio, self.window)

    @property
    def prefix_cacheable(self) -> bool:
        """Whether a cached prefix's entries are exactly what recomputing it would store: true of
        one-entry-per-token caches, sliding windows included (a window group's hit needs only the blocks its
        window reaches); a compressed entry at a block boundary may still be partial."""
        return self.ratio == 1

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        if self.layout is not None:
            return tuple(self.layout(num_blocks, block_size))
        return (num_blocks, block_size, *self.entry_shape)

    def bytes_per_block(self, block_size: int, default_dtype: torch.dtype) -> int:
        dtype = self.dtype or default_dtype
        return int(np.prod(self.shape(1, block_size))) * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class StateSpec:
    """One tensor of `shape` per running request, in the state pool (allocated [num_slots, *shape])."""
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None  # None: the model's dtype
    kind: str = "state"

    def bytes_per_slot(self, default_dtype: torch.dtype) -> int:
        dtype = self.dtype or default_dtype
        return int(np.prod(self.shape)) * torch.empty((), dtype=dtype).element_size()


CacheSpec = PagedSpec | StateSpec


@dataclass
class CacheGroupMetadata:
    """One paged group's view of a step: `block_table` [num_seqs, max_blocks] int32 (block ids of the group's
    pool; blocks a sliding window gave back keep their stale ids, and their entries may be another
    request's: read only inside the window), and
    `slot_mapping` [num_tokens] int64: for each of the step's tokens, the slot of the entry holding it (entry
    pos // ratio, slot = block_table[e // block_size] * block_size + e % block_size). `block_size` counts
    entries. Host copies for the torch reference."""
    ratio: int
    window: int | None
    block_size: int
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    block_table_cpu: np.ndarray


def entry_slots(block_table: torch.Tensor, entries: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of entry indices `entries` [..., K] of each row's sequence (block_table [rows, blocks],
    entries broadcast per row; a negative entry gives -1)."""
    valid = entries >= 0
    safe = entries.clamp(min=0)
    blocks = torch.gather(block_table.long(), 1, (safe // block_size).view(block_table.shape[0], -1)).view_as(safe)
    return torch.where(valid, blocks * block_size + safe % block_size, torch.full_like(safe, -1))


@dataclass(frozen=True)
class CacheGroupLayout:
    """One paged group as allocated: its (ratio, window), its blocks, the bytes one block takes on a rank,
    and the kinds of cache in it (for logs)."""
    ratio: int
    window: int | None
    num_blocks: int
    bytes_per_block: int = 0
    kinds: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[int, int | None]:
        return (self.ratio, self.window)

    @property
    def prefix_cacheable(self) -> bool:
        return self.ratio == 1


@dataclass(frozen=True)
class CacheLayout:
    """Both pools of a runner's caches, as the scheduler must know them: the paged groups (the first is the
    full group where the model has one) and the state slots (0: no state pool)."""
    block_size: int
    groups: tuple[CacheGroupLayout, ...]
    num_state_slots: int = 0
    state_bytes_per_slot: int = 0
    state_kinds: tuple[str, ...] = ()  # the kinds of per-request state (StateSpec.kind), for logs and checks

    @property
    def total_bytes(self) -> int:
        """What both pools take on a rank."""
        return sum(g.num_blocks * g.bytes_per_block for g in self.groups) + self.num_state_slots * self.state_bytes_per_slot

    @property
    def prefix_caching_blocker(self) -> str | None:
        """Why a cached prefix could not be reused exactly (every reason), or None. Groups of one entry per
        token, sliding windows included, cache their blocks by prefix (a window group's hit needs only the
        blocks its window reaches); a compressed group's or the state pool's contents are not a function of
        whole cached blocks."""
        reasons = []
        for group in self.groups:
            if not group.prefix_cacheable:
                reasons.append(f"its {'/'.join(group.kinds) or 'cache'} layers keep one entry per {group.ratio} "
                               "tokens (the entry at a cached prefix's end may be partial)")
        if self.num_state_slots:
            reasons.append("it keeps per-request state (recurrent state cannot be restored from a cached prefix)")
        return "; ".join(reasons) or None

    @classmethod
    def single(cls, num_blocks: int, block_size: int) -> "CacheLayout":
        """One full-attention group: what every model without other specs has."""
        return cls(block_size, (CacheGroupLayout(1, None, num_blocks),))


def group_blocks_for(key: tuple[int, int | None], num_token_blocks: int, block_size: int, max_num_seqs: int,
                     max_num_batched_tokens: int) -> int:
    """Blocks a group gets when the cache holds `num_token_blocks` blocks' worth of tokens: all of them for a
    full group; 1/ratio of them plus a partial block per running request for a compressed group; for a
    sliding window, what every running request's window plus one step's new tokens can occupy (never more
    than a full group's)."""
    ratio, window = key
    if window is not None:
        if ratio != 1:
            raise ValueError("a sliding window over compressed entries is not supported")
        per_request = -(-(window - 1) // block_size) + 2
        return max(1, min(num_token_blocks, max_num_seqs * per_request + -(-max_num_batched_tokens // block_size)))
    if ratio == 1:
        return num_token_blocks
    return max(1, min(num_token_blocks, -(-num_token_blocks // ratio) + max_num_seqs))
