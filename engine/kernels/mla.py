"""Multi-head latent attention's dispatch point (DeepSeek-V2/V3, Kimi-K2): the latent-cache write, prefill
over expanded keys and values, and decode with the absorbed weights, behind one function (the backends'
`mla_attention` op); and sparse latent attention over listed entries (`mla_sparse_attention`).

Cache layout, per layer: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], one entry per token
(the normalised latent, then the rotated shared rope key), the same on every TP rank.

FP8 latent caches (`kv_cache_dtype="fp8"`): the entries are stored as FP8 (the runner's FP8 dtype) with ONE
per-tensor float32 scale per layer, `KVCacheQuant("tensor", scale, scale)` (the entry is key and value at
once, so the key and value scales are the same tensor): written as `stored_entries` quantizes, read as
`read_entries` dequantizes. A prefill chunk with no cached prefix attends over its own entries as computed,
as the MHA backends do; cached context (later chunks, decodes, sparse attention) is read dequantized."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.kernels.attention import KVCacheQuant, quantize_to_fp8


@dataclass
class MLAWeights:
    """What MLA attention needs of the layer's `kv_b_proj` ([H * (qk_nope + v), kv_lora_rank] on this rank):
    `kv_b` runs the projection (quantized or not) for the prefill's expansion; `w_uk` [H, qk_nope, L] and
    `w_uv` [H, v, L] are its per-head key and value halves, full precision in the activations' dtype (strided
    views allowed), for the absorbed decode."""
    kv_b: Callable[[torch.Tensor], torch.Tensor]
    w_uk: torch.Tensor
    w_uv: torch.Tensor

    @property
    def qk_nope_head_dim(self) -> int:
        return self.w_uk.shape[1]

    @property
    def v_head_dim(self) -> int:
        return self.w_uv.shape[1]


def stored_entries(entries: torch.Tensor, kv_cache: torch.Tensor, kv_quant: KVCacheQuant | None) -> torch.Tensor:
    """Latent entries [..., L + R] as `kv_cache` stores them: in its dtype, or, with `kv_quant` (per-tensor),
    quantized to its FP8 dtype (quantize_to_fp8 with the layer's scale)."""
    if kv_quant is None:
        return entries.to(kv_cache.dtype)
    return quantize_to_fp8(entries, latent_scale(kv_quant), kv_cache.dtype)


def read_entries(entries: torch.Tensor, kv_quant: KVCacheQuant | None, dtype: torch.dtype) -> torch.Tensor:
    """Cached entries in the queries' `dtype`: as they are, or FP8 values times the layer's scale (in float32,
    then rounded to `dtype`)."""
    if kv_quant is None:
        return entries.to(dtype)
    return (entries.float() * latent_scale(kv_quant)).to(dtype)


def latent_scale(kv_quant: KVCacheQuant) -> torch.Tensor:
    """The one float32 scale [1] of an FP8 latent cache (per-tensor only: a latent entry is key and value)."""
    assert not kv_quant.per_token and kv_quant.k_scale.numel() == 1, "latent caches take per-tensor scales"
    return kv_quant.k_scale


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                  kv_cache: torch.Tensor | None, metadata, weights: MLAWeights, scale: float,
                  block_size: int, kv_quant: KVCacheQuant | None = None) -> torch.Tensor:
    """Write this step's entries (latent [T, L] normalised, k_pe [T, R] rotated) at their cache slots, then
    attend: q_nope [T, H, qk_nope], q_pe [T, H, R] (rotated) -> [T, H, v]. Decodes (the metadata's leading
    one-token sequences) attend in latent space; prefill chunks over keys and values expanded from the
    cached latents, causally, bottom-right aligned. `kv_cache` None: the profiling pass (no cache yet,
    prefills only). `kv_quant`: the cache is FP8 with a per-tensor scale (module docstring). The active
    backend's `mla_attention` op."""
    from engine.kernels import ops
    return ops.mla_attention(q_nope, q_pe, latent, k_pe, kv_cache, metadata, weights, scale, block_size,
                             kv_quant=kv_quant)


def mla_sparse_attention(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, scale: float,
                         v_dim: int, kv_quant: KVCacheQuant | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse latent attention (DeepSeek-V3.2's selected keys, DeepSeek-V4's window and compressed scopes):
    query row t (q [T, H, D]) attends, as one KV head shared by its H heads, to the cache entries at
    `slots[t]` ([T, K] slot ids into `kv_cache` viewed as [-1, D]; -1 marks no entry). Keys are whole entries,
    values their first `v_dim` dims. Returns out [T, H, v_dim] (q's dtype) and lse [T, H] (float32, the
    log-sum-exp of the scaled scores: scopes computed apart merge by it); a row with no entry gives zeros and
    -inf. `kv_quant`: the cache is FP8 with a per-tensor scale, entries read dequantized. The active backend's
    `mla_sparse_attention` op."""
    from engine.kernels import ops
    return ops.mla_sparse_attention(q, kv_cache, slots, scale, v_dim, kv_quant=kv_quant)
