"""Cases for attention with options (sliding window, sinks, soft-capping): a paged batch whose blocks lie
scattered over the cache, with the blocks a window group has given back poisoned (NaN, or an id past the
pool), and the dense reference each backend is held to, written independently of every backend."""
from __future__ import annotations

import math

import torch

from engine.kernels.attention import AttentionOptions, CommonAttentionMetadata


def paged_batch(seqs: list[tuple[int, int]], block_size: int, num_blocks: int, window: int | None,
                device="cpu", generator: torch.Generator | None = None):
    """seqs: (cached tokens, new tokens) per sequence, decodes first. Returns (metadata, dropped): a window
    group's table keeps the ids of the blocks it gave back (those wholly before the window of the step's
    first query), which here point at blocks no other live entry uses; `dropped` lists those ids, for the
    caller to poison."""
    free = torch.randperm(num_blocks, generator=generator).tolist()
    starts, seq_lens, computed, tables, slots, dropped = [0], [], [], [], [], []
    for cached, new in seqs:
        total = cached + new
        blocks = [free.pop() for _ in range(-(-total // block_size))]
        if window is not None:  # the block manager's release: blocks before the first query's window
            first_needed = max(cached - window + 1, 0) // block_size
            dropped.extend(blocks[:first_needed])
        tables.append(blocks)
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(cached, total))
        starts.append(starts[-1] + new)
        seq_lens.append(total)
        computed.append(cached)
    table = torch.zeros(len(seqs), max(len(b) for b in tables), dtype=torch.int32)
    for row, blocks in enumerate(tables):
        table[row, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    num_decodes = 0
    while num_decodes < len(seqs) and seqs[num_decodes][1] == 1:
        num_decodes += 1
    metadata = CommonAttentionMetadata(
        num_seqs=len(seqs), num_decodes=num_decodes, num_tokens=starts[-1],
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(new for _, new in seqs), max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens, num_computed_tokens_cpu=computed)
    return metadata, dropped


def dense_reference(query, keys, values, query_positions, scale, options: AttentionOptions):
    """One sequence in float64: query [Lq, H, D], keys/values [L, Hk, D] of positions 0..L-1."""
    num_heads, num_kv_heads = query.shape[1], keys.shape[1]
    group = num_heads // num_kv_heads
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * scale
    if options.softcap is not None:
        scores = torch.tanh(scores / options.softcap) * options.softcap
    key_positions = torch.arange(keys.shape[0])
    visible = key_positions[None, :] <= query_positions[:, None]
    if options.window is not None:
        visible &= query_positions[:, None] - key_positions[None, :] < options.window
    scores = scores.masked_fill(~visible, -math.inf)
    if options.sinks is not None:
        sinks = options.sinks.double().view(num_heads, 1, 1).expand(num_heads, scores.shape[1], 1)
        scores = torch.cat([scores, sinks], dim=-1)
    probs = scores.softmax(-1)
    if options.sinks is not None:
        probs = probs[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)
