"""The attention layer: a dispatcher over the active attention backend, holding this layer's KV cache; and
the contract of every layer that keeps entries in the paged KV cache (`KVCacheLayer`)."""
from __future__ import annotations

import torch
from torch import nn

from engine.forward_context import get_forward_context
from engine.kernels import active_backend
from engine.kernels.attention import KV_SCALE_GRANULARITIES, PLAIN_ATTENTION, AttentionOptions, KVCacheQuant
from engine.kv_cache_spec import CacheSpec, PagedSpec


class KVCacheLayer(nn.Module):
    """A layer that keeps caches: per-token (or per-`ratio`-token) entries in the page pool, per-request state
    in the state pool (engine/kv_cache_spec.py). It declares them in `cache_specs()` (name -> spec); the
    runner groups layers by spec, sizes both pools, allocates every tensor and binds them with
    `bind_caches` (name -> tensor: [num_blocks of the spec's group, ...] for a PagedSpec, [num_slots, *shape]
    for a StateSpec); nothing else decides a layout. The cache named "kv" is also `kv_cache`. FP8 caches:
    a layer that supports them (`supports_fp8_kv_cache`) keeps its "kv" cache in the runner's FP8 dtype,
    with per-token scales of `kv_scale_shape`."""
    kv_cache: torch.Tensor | None = None
    kv_quant: KVCacheQuant | None = None
    caches: dict[str, torch.Tensor] | None = None
    supports_fp8_kv_cache = True  # whether the layer can keep an FP8 cache (KVCacheQuant)
    fp8_kv_scale_granularities: tuple[str, ...] = KV_SCALE_GRANULARITIES  # the KVCacheQuant kinds it can read
    supports_cuda_graphs = True   # whether its decode step can be captured (with a backend that can)

    def cache_specs(self) -> dict[str, CacheSpec]:
        raise NotImplementedError

    def bind_caches(self, caches: dict[str, torch.Tensor]) -> None:
        self.caches = caches
        self.kv_cache = caches.get("kv")

    def kv_scale_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of the per-token key scales (and of the value scales) of an FP8 cache."""
        raise NotImplementedError


class Attention(KVCacheLayer):
    """Multi-head / grouped-query attention; the cache layout is the attention backend's. `options`: a
    sliding window (the layer's cache is then that window's group, whose block table and slots it reads
    from the step's metadata), soft-capping; `num_sinks` > 0 adds the learned per-head sinks as the
    parameter `sinks` (gpt-oss's `self_attn.sinks`, loaded by the model's weight names)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 options: AttentionOptions = PLAIN_ATTENTION, sinks: bool = False) -> None:
        super().__init__()
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = scale
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32), requires_grad=False)
            self.sinks.weight_loader = self._sinks_loader
            options = AttentionOptions(options.window, self.sinks, options.softcap)
        self.options = options
        self.backend = active_backend().attention  # its layout is the "kv" cache's; the runner binds it
        # Per-tensor FP8 KV-cache scales from a checkpoint that has them (k_scale / v_scale), else 1.0.
        self.k_scale = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)
        self.v_scale = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)
        self.checkpoint_kv_scales = False
        for param in (self.k_scale, self.v_scale):
            param.weight_loader = self._kv_scale_loader
            param.check_loaded = lambda param, shards: None  # optional

    def cache_specs(self) -> dict[str, CacheSpec]:
        def layout(num_blocks: int, block_size: int) -> tuple[int, ...]:
            return self.backend.kv_cache_shape(num_blocks, block_size, self.num_kv_heads, self.head_size)
        window = self.options.window
        return {"kv": PagedSpec((2, self.num_kv_heads, self.head_size), layout=layout, window=window,
                                kind="sliding_window" if window else "attention")}

    def _sinks_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """The checkpoint's sinks of every head (a TP rank keeps its own heads')."""
        from engine.parallel import get_parallel_state
        state = get_parallel_state()
        if loaded.numel() != self.num_heads * state.tp_size:
            raise ValueError(f"attention sinks: expected {self.num_heads * state.tp_size} (one per head), "
                             f"got shape {tuple(loaded.shape)}")
        param.data.copy_(loaded.float().reshape(state.tp_size, self.num_heads)[state.tp_rank])

    def kv_scale_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return self.backend.kv_scale_shape(num_blocks, block_size, self.num_kv_heads)

    def _kv_scale_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.numel() != 1:
            raise ValueError(f"a per-tensor KV-cache scale must be one number, got shape {tuple(loaded.shape)}")
        param.data.copy_(loaded.float().reshape(1))
        self.checkpoint_kv_scales = True

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rope=None) -> torch.Tensor:
        """rope: (positions, cos_sin_cache, is_neox) to rotate queries and keys first (see
        RotaryEmbedding.rope_args); the backend may fuse the rotation into its KV-cache write."""
        context = get_forward_context()
        if context.pieces is not None:  # capturing prompt-step graphs: this call runs eagerly between two
            return context.pieces.split(self, query, key, value, rope)
        metadata = context.attn_metadata
        if metadata is None:  # a lockstep dummy step: nothing to attend to, nothing to cache
            return query.new_zeros(query.shape[0], self.num_heads * self.head_size)
        options = self.options
        if options.window is not None:
            metadata = metadata.for_group(options.cache_group)
        extra = {} if options is PLAIN_ATTENTION else {"options": options}
        out = self.backend.forward(
            query.view(-1, self.num_heads, self.head_size),
            key.view(-1, self.num_kv_heads, self.head_size),
            value.view(-1, self.num_kv_heads, self.head_size),
            self.kv_cache, metadata, self.scale, context.block_size, rope, kv_quant=self.kv_quant, **extra)
        return out.view(-1, self.num_heads * self.head_size)


class SharedKVAttention(Attention):
    """Attention over another layer's KV cache (KV sharing between layers: Gemma 4 E2B/E4B's last layers
    reuse the keys and values of an earlier layer of their type). It declares no cache, so the runner
    allocates nothing for it; each step it reads `source`'s cache, cache group and FP8 scales. Its caller
    passes the keys and values the source computed this step (before rotation, rotated here by the same
    table): the backend contract has no read-only path, so the backend writes them again to the same slots,
    the bytes the source wrote, into memory that is the source's."""

    def __init__(self, source: Attention, num_heads: int, scale: float) -> None:
        super().__init__(num_heads, source.head_size, scale, source.num_kv_heads, source.options)
        self._source = (source,)  # in a tuple, not a submodule: its parameters stay where the model holds them

    @property
    def source(self) -> Attention:
        return self._source[0]

    @property
    def checkpoint_kv_scales(self) -> bool:
        """The source's: the FP8 scales this layer reads are the source's."""
        return self.source.checkpoint_kv_scales

    @checkpoint_kv_scales.setter
    def checkpoint_kv_scales(self, value: bool) -> None:
        pass  # Attention.__init__ and the k/v scale loader set it: a shared layer has no scales of its own

    def cache_specs(self) -> dict[str, CacheSpec]:
        return {}

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rope=None) -> torch.Tensor:
        source = self.source
        self.kv_cache, self.kv_quant = source.kv_cache, source.kv_quant
        return super().forward(query, key, value, rope)
