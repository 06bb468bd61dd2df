"""Reference paged attention. KV layout per layer: [2, num_blocks, block_size, kv_heads, head_size]; an FP8
cache keeps its per-token scales as [num_blocks, block_size, kv_heads] float32 (KVCacheQuant)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.attention import (PLAIN_ATTENTION, AttentionBackend, AttentionOptions, CommonAttentionMetadata,
                                     KVCacheQuant, apply_rope, per_token_fp8_scale, quantize_to_fp8)


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


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
           options: AttentionOptions) -> torch.Tensor:
    """softmax(q k^T * scale) v over [..., Hk, G, Lq, D] queries and [..., Hk, L, D] keys/values, with the
    options' soft-capping and sinks (the window is in `mask`, True where a key is visible), in float32."""
    scores = torch.matmul(query.float(), keys.float().unsqueeze(-3).transpose(-1, -2)) * scale
    if options.softcap is not None:
        scores = torch.tanh(scores / options.softcap) * options.softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if options.sinks is not None:
        num_kv_heads, group = query.shape[-4], query.shape[-3]
        sinks = options.sinks.float().view(num_kv_heads, group, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sinks], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if options.sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, values.float().unsqueeze(-3)).to(query.dtype)


def causal_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """[Lq, L] True where a query sees a key: not after it, and within the window (the `window` most recent
    keys, the query's own included)."""
    mask = key_positions[None, :] <= query_positions[:, None]
    if window is not None:
        mask &= key_positions[None, :] > query_positions[:, None] - window
    return mask


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    @staticmethod
    def kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def forward(query, key, value, kv_cache, metadata: CommonAttentionMetadata, scale, block_size, rope=None,
                kv_quant: KVCacheQuant | None = None, options: AttentionOptions = PLAIN_ATTENTION):
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
                                        k_scales, v_scales, options)
        starts, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        window = options.window
        num_heads, num_kv_heads = query.shape[1], key.shape[1]
        for seq in range(num_decodes, metadata.num_seqs):
            begin, end = starts[seq], starts[seq + 1]
            seq_len, query_len = lens[seq], end - begin
            if seq_len == query_len:  # nothing cached before this chunk: use the new keys directly
                keys, values, first = key[begin:end], value[begin:end], 0
            else:  # from the block holding the first key any of the chunk's queries sees
                first_key = 0 if window is None else max(seq_len - query_len - window + 1, 0)
                first_block, num_blocks = first_key // block_size, -(-seq_len // block_size)
                block_ids = metadata.block_table[seq, first_block:num_blocks]
                first = first_block * block_size
                keys = gather_context(key_cache, block_ids, seq_len - first, k_scales, query.dtype)
                values = gather_context(value_cache, block_ids, seq_len - first, v_scales, query.dtype)
            key_positions = torch.arange(first, seq_len, device=query.device)
            query_positions = torch.arange(seq_len - query_len, seq_len, device=query.device)
            if options.sinks is None and options.softcap is None:
                mask = (None if seq_len == query_len and window is None
                        else causal_mask(query_positions, key_positions, window))
                out[begin:end] = F.scaled_dot_product_attention(
                    query[begin:end].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                    attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True,
                ).transpose(0, 1)
                continue
            mask = causal_mask(query_positions, key_positions, window)
            grouped = query[begin:end].view(query_len, num_kv_heads, num_heads // num_kv_heads, -1).permute(1, 2, 0, 3)
            out[begin:end] = attend(grouped, keys.transpose(0, 1), values.transpose(0, 1), mask, scale,
                                    options).permute(2, 0, 1, 3).reshape(query_len, num_heads, -1)
        return out


def _decode(query, key_cache, value_cache, metadata, scale, block_size, k_scales=None, v_scales=None,
            options: AttentionOptions = PLAIN_ATTENTION):
    """One query token per sequence, batched: every context padded to the longest one and masked. The
    query heads that share a KV head go in as that head's query rows ([B, Hk, heads per KV head, D]), not
    through `enable_gqa`: on CPU, bf16 decode attention then runs 4-7x faster (docs/BENCHMARKS.md). With a
    window, each sequence reads only the blocks its window touches."""
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[-2]
    seq_lens_cpu = metadata.seq_lens_cpu[:num_seqs]
    seq_lens = metadata.seq_lens[:num_seqs].to(torch.int64)
    window = options.window
    if window is None:
        first_blocks = torch.zeros(num_seqs, dtype=torch.int64, device=query.device)
        num_blocks = -(-max(seq_lens_cpu) // block_size)
    else:  # blocks from the one holding the window's first key (seq_len - window) to the last
        first_blocks = (seq_lens - window).clamp(min=0) // block_size
        num_blocks = max(-(-n // block_size) - max(n - window, 0) // block_size for n in seq_lens_cpu)
    if window is None:
        block_ids = metadata.block_table[:num_seqs, :num_blocks]
    else:
        columns = first_blocks[:, None] + torch.arange(num_blocks, device=query.device)
        last_block = (seq_lens - 1) // block_size
        columns = torch.minimum(columns, last_block[:, None])  # past a sequence's end: masked below
        block_ids = metadata.block_table[:num_seqs].to(torch.int64).gather(1, columns)
    keys = _dequantized(gather_blocks(key_cache, block_ids), block_ids, k_scales, query.dtype)
    values = _dequantized(gather_blocks(value_cache, block_ids), block_ids, v_scales, query.dtype)
    length = num_blocks * block_size if window is not None else max(seq_lens_cpu)
    keys = keys.flatten(1, 2)[:, :length].transpose(1, 2)  # [B, Hk, L, D]
    values = values.flatten(1, 2)[:, :length].transpose(1, 2)
    positions = first_blocks[:, None] * block_size + torch.arange(length, device=query.device)  # [B, L]
    visible = positions < seq_lens[:, None]
    if window is not None:
        visible &= positions > seq_lens[:, None] - 1 - window
    grouped = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_size)
    if options.sinks is None and options.softcap is None:
        mask = None if window is None and min(seq_lens_cpu) == length else visible.view(num_seqs, 1, 1, length)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)  # [B, Hk, G, D]
    else:
        out = attend(grouped.unsqueeze(-2), keys, values, visible.view(num_seqs, 1, 1, 1, length), scale,
                     options).squeeze(-2)
    return out.reshape(num_seqs, num_heads, head_size)
