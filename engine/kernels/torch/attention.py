"""Reference paged attention. KV layout per layer: [2, num_blocks, block_size, kv_heads, head_size]; an FP8
cache keeps its per-token scales as [num_blocks, block_size, kv_heads] float32 (KVCacheQuant)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.attention import (AttentionBackend, CommonAttentionMetadata, KVCacheQuant, apply_rope,
                                     per_token_fp8_scale, quantize_to_fp8)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache[block_ids] for a [..., n] index: index_select copies whole contiguous blocks, far cheaper on
    CPU than general advanced indexing."""
    return cache.index_select(0, block_ids.reshape(-1)).view(*block_ids.shape, *cache.shape[1:])


def gather_context(cache: torch.Tensor, block_ids: torch.Tensor, length: int,
                   scales: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The first `length` tokens of one sequence's keys or values: [length, kv_heads, head_size]
    (dequantized to `dtype` when the cache is FP8 with `scales`)."""
    return _dequantized(gather_blocks(cache, block_ids), block_ids, scales, dtype).flatten(0, 1)[:length]


def _dequantized(blocks: torch.Tensor, block_ids: torch.Tensor, scales: torch.Tensor | None,
                 dtype: torch.dtype | None) -> torch.Tensor:
    """Gathered cache blocks [..., block_size, Hk, D] in the activations' dtype: FP8 values times their
    per-tensor scale ([1]) or per-token scales ([num_blocks, block_size, Hk], gathered like the blocks)."""
    if scales is None:
        return blocks
    if scales.numel() == 1:
        return (blocks.float() * scales).to(dtype)
    return (blocks.float() * gather_blocks(scales, block_ids)[..., None]).to(dtype)


def write_cache(cache: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor | None) -> None:
    """Store [T, Hk, D] at cache slots: as they are, or quantized to the cache's FP8 dtype with a
    per-tensor scale ([1]) or new per-token scales (stored at the same slots of `scales`)."""
    num_kv_heads, head_size = cache.shape[-2:]
    rows = cache.view(-1, num_kv_heads, head_size)
    if scales is None:
        rows[slots] = values
        return
    if scales.numel() != 1:
        token_scales = per_token_fp8_scale(values, cache.dtype)
        scales.view(-1, num_kv_heads)[slots] = token_scales
        rows[slots] = quantize_to_fp8(values, token_scales[..., None], cache.dtype)
    else:
        rows[slots] = quantize_to_fp8(values, scales, cache.dtype)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    @staticmethod
    def kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def forward(query, key, value, kv_cache, metadata: CommonAttentionMetadata, scale, block_size, rope=None,
                kv_quant: KVCacheQuant | None = None):
        query, key = apply_rope(query, key, rope)
        k_scales = v_scales = None
        if kv_cache is None:  # profiling pass before the cache exists: plain causal prefills
            key_cache = value_cache = None
        else:
            key_cache, value_cache = kv_cache[0], kv_cache[1]
            if kv_quant is not None:
                k_scales, v_scales = kv_quant.k_scale, kv_quant.v_scale
            write_cache(key_cache, key, metadata.slot_mapping, k_scales)
            write_cache(value_cache, value, metadata.slot_mapping, v_scales)

        out = torch.empty_like(query)
        num_decodes = metadata.num_decodes
        if num_decodes:
            out[:num_decodes] = _decode(query[:num_decodes], key_cache, value_cache, metadata, scale, block_size,
                                        k_scales, v_scales)
        starts, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        for seq in range(num_decodes, metadata.num_seqs):
            begin, end = starts[seq], starts[seq + 1]
            seq_len, query_len = lens[seq], end - begin
            if seq_len == query_len:  # nothing cached before this chunk: use the new keys directly
                keys, values = key[begin:end], value[begin:end]
                mask = None
            else:
                num_blocks = -(-seq_len // block_size)
                block_ids = metadata.block_table[seq, :num_blocks]
                keys = gather_context(key_cache, block_ids, seq_len, k_scales, query.dtype)
                values = gather_context(value_cache, block_ids, seq_len, v_scales, query.dtype)
                positions = torch.arange(seq_len - query_len, seq_len, device=query.device)
                mask = torch.arange(seq_len, device=query.device)[None, :] <= positions[:, None]
            out[begin:end] = F.scaled_dot_product_attention(
                query[begin:end].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True,
            ).transpose(0, 1)
        return out


def _decode(query, key_cache, value_cache, metadata, scale, block_size, k_scales=None, v_scales=None):
    """One query token per sequence, batched: every context padded to the longest one and masked. The
    query heads that share a KV head go in as that head's query rows ([B, Hk, heads per KV head, D]), not
    through `enable_gqa`: on CPU, bf16 decode attention then runs 4-7x faster (docs/BENCHMARKS.md)."""
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[-2]
    seq_lens_cpu = metadata.seq_lens_cpu[:num_seqs]
    max_len = max(seq_lens_cpu)
    num_blocks = -(-max_len // block_size)
    block_ids = metadata.block_table[:num_seqs, :num_blocks]
    keys = _dequantized(gather_blocks(key_cache, block_ids), block_ids, k_scales, query.dtype)
    values = _dequantized(gather_blocks(value_cache, block_ids), block_ids, v_scales, query.dtype)
    keys = keys.flatten(1, 2)[:, :max_len].transpose(1, 2)  # [B, Hk, L, D]
    values = values.flatten(1, 2)[:, :max_len].transpose(1, 2)
    mask = None
    if min(seq_lens_cpu) != max_len:
        positions = torch.arange(max_len, device=query.device)
        mask = (positions[None, :] < metadata.seq_lens[:num_seqs, None]).view(num_seqs, 1, 1, max_len)
    grouped = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_size)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)  # [B, Hk, G, D]
    return out.reshape(num_seqs, num_heads, head_size)
