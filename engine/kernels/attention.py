"""The attention-backend contract: each backend declares its KV-cache layout, turns the step's common
metadata into what its kernels need, and runs paged attention (cache write included)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class CommonAttentionMetadata:
    """One step's batch, sequences ordered decodes first (one query token each), then prefills."""
    num_seqs: int
    num_decodes: int  # leading sequences with exactly one query token
    num_tokens: int
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, on the device
    seq_lens: torch.Tensor  # [num_seqs] int32: context length including this step's tokens
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot for each new token
    max_query_len: int
    max_seq_len: int
    # Host copies, for backends that loop on the host (the torch reference) or size launch grids.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    num_computed_tokens_cpu: list[int]


Rope = tuple  # (positions [T], cos_sin_cache [max_position, rotary_dim], is_neox)


def apply_rope(query: torch.Tensor, key: torch.Tensor, rope: Rope | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding through the active backend's op: what a backend that cannot fuse it does."""
    if rope is None:
        return query, key
    from engine.kernels import ops  # the dispatch table, filled once the engine chose its backend
    positions, cos_sin_cache, is_neox = rope
    return ops.rotary_embedding(positions, query, key, cos_sin_cache, is_neox)


class AttentionBackend(ABC):
    name: str = ""
    # Whether a decode step can be captured in a CUDA graph: launches must depend only on device tensors
    # and on metadata captured at max_model_len.
    supports_cuda_graphs: bool = False

    @staticmethod
    @abstractmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache (keys and values together)."""

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata, block_size: int):
        """Per-step metadata shared by all layers; by default the common metadata itself."""
        return common

    @staticmethod
    @abstractmethod
    def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata, scale: float, block_size: int, rope: Rope | None = None) -> torch.Tensor:
        """Rotate queries and keys by `rope` when given (a backend may fuse this into its cache write; the
        rest call `apply_rope`), write this step's keys/values into the cache, then attend. query [T, H, D],
        key/value [T, Hk, D]; returns [T, H, D]."""
