"""The attention-backend contract: each backend declares its KV-cache layout, turns the step's common
metadata into what its kernels need, and runs paged attention (cache write included)."""
from __future__ import annotations

from abc import ABC, abstractmethod
import dataclasses
from dataclasses import dataclass, field

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
    # Every paged cache group's block table and slots ((ratio, window) -> engine.kv_cache_spec.
    # CacheGroupMetadata; `block_table` / `slot_mapping` above are the full group's, or the first group's
    # where there is none), and each sequence's state-pool slot ([num_seqs] int64; None without a state pool).
    groups: dict = field(default_factory=dict)
    state_slots: torch.Tensor | None = None
    state_slots_cpu: list[int] = field(default_factory=list)
    # Per group key: this metadata with the group's block table and slots (`for_group`), made once a step.
    _group_views: dict = field(default_factory=dict, repr=False)

    def for_group(self, key: tuple[int, int | None]):
        """This step's metadata as a layer of cache group `key` reads it: the same batch, with that group's
        block table and slot mapping (the metadata itself for the group it already carries). Built once
        per step and group, then shared by every layer of the group."""
        if not self.groups:  # a pass without a cache (profiling, a cache-less prefill): no tables to read
            return self
        group = self.groups.get(key)
        if group is None:
            raise KeyError(f"the step has no paged cache group {key} (groups: {sorted(self.groups, key=str)}): "
                           "a layer's cache spec and its attention options disagree")
        if group.block_table is self.block_table and group.slot_mapping is self.slot_mapping:
            return self
        view = self._group_views.get(key)
        if view is None:
            view = dataclasses.replace(self, block_table=group.block_table, slot_mapping=group.slot_mapping,
                                       _group_views={})
            self._group_views[key] = view
        return view


Rope = tuple  # (positions [T], cos_sin_cache [max_position, rotary_dim], is_neox)


@dataclass(eq=False)
class AttentionOptions:
    """What a layer's attention does beyond softmax(q k^T * scale) v, typed once per layer (a family sets
    the fields it needs; the defaults are plain causal attention).

    - `window`: a query sees only the `window` most recent keys, itself included (transformers'
      convention: key position > query position - window). The layer's cache is then a window group's,
      and kernels read only the blocks inside the window.
    - `sinks`: float32 [num_heads], one learned logit per query head that joins every softmax's
      denominator (gpt-oss): out = sum_j exp(s_j - m) v_j / (exp(sink - m) + sum_j exp(s_j - m)). A
      split-K decode counts it once, in the reduction.
    - `softcap`: scores (after `scale`) become softcap * tanh(scores / softcap) (Gemma 2)."""
    window: int | None = None
    sinks: torch.Tensor | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window must be >= 1 token, got {self.window}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"logit soft-capping needs a positive cap, got {self.softcap}")

    @property
    def is_plain(self) -> bool:
        return self.window is None and self.sinks is None and self.softcap is None

    @property
    def cache_group(self) -> tuple[int, int | None]:
        """The (ratio, window) of the paged group whose block table and slots the layer reads."""
        return (1, self.window)


PLAIN_ATTENTION = AttentionOptions()

KV_SCALE_GRANULARITIES = ("tensor", "token")
FP8_KV_MIN_SCALE = 1e-6 / 448.0  # a per-token scale never drops below this (an all-zero head vector)


@dataclass
class KVCacheQuant:
    """The scales of one layer's FP8 KV cache (`kv_cache_dtype="fp8"`). The cache stores
    q = clamp(x / scale, -fp8_max, fp8_max) rounded to the cache's FP8 dtype; attention reads q * scale.

    - "tensor": one scale for all keys and one for all values: `k_scale`, `v_scale` are float32 [1] (from the
      checkpoint's k_scale / v_scale, else 1.0).
    - "token": dynamic, per token and KV head: scale = max(amax(|x|) over head_size / fp8_max,
      FP8_KV_MIN_SCALE), written by the cache write beside the values, in float32 tensors of the attention
      backend's `kv_scale_shape` (by default [num_blocks, block_size, num_kv_heads], indexed by cache slot
      like the cache itself)."""
    granularity: str
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    @property
    def per_token(self) -> bool:
        return self.granularity == "token"


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def quantize_to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x / scale clamped to the FP8 range and rounded to `dtype` (scale broadcasts against x)."""
    limit = fp8_max(dtype)
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


def per_token_fp8_scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D] -> [...] float32: the dynamic per-token (and head) scale KVCacheQuant describes."""
    amax = x.float().abs().amax(dim=-1)
    # A tensor divisor: CUDA torch multiplies by the reciprocal of a Python number (an ulp off at times).
    return (amax / torch.full((), fp8_max(dtype), device=x.device)).clamp(min=FP8_KV_MIN_SCALE)


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
    # The FP8 format of an FP8 KV cache on this backend (see kv_fp8_dtype), and the scales it can read.
    fp8_kv_dtype: torch.dtype = torch.float8_e4m3fn
    kv_scale_granularities: tuple[str, ...] = KV_SCALE_GRANULARITIES

    @classmethod
    def kv_fp8_dtype(cls) -> torch.dtype:
        """The FP8 format of an FP8 KV cache (AITER on MI300X: float8_e4m3fnuz)."""
        return cls.fp8_kv_dtype

    @staticmethod
    @abstractmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache (keys and values together)."""

    @staticmethod
    def kv_scale_shape(num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, ...]:
        """Shape of one layer's per-token key scales (and of its value scales) in an FP8 cache."""
        return (num_blocks, block_size, num_kv_heads)

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata, block_size: int):
        """Per-step metadata shared by all layers; by default the common metadata itself."""
        return common

    @staticmethod
    @abstractmethod
    def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata, scale: float, block_size: int, rope: Rope | None = None,
                kv_quant: KVCacheQuant | None = None,
                options: AttentionOptions = PLAIN_ATTENTION) -> torch.Tensor:
        """Rotate queries and keys by `rope` when given (a backend may fuse this into its cache write; the
        rest call `apply_rope`), write this step's keys/values into the cache, then attend. query [T, H, D],
        key/value [T, Hk, D]; returns [T, H, D]. With `kv_quant` the cache is FP8 (`fp8_kv_dtype`): keys and
        values are quantized as they are written and dequantized as they are read; this step's own keys of a
        prefill are read back from the cache, or used unquantized where that is exactly what is cached.
        `options` (window, sinks, soft-capping): `metadata` is then already the layer's cache group's
        (`CommonAttentionMetadata.for_group`)."""
