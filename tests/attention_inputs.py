"""Inputs of the paged-attention kernel tests: random tensors on the test device, rotary tables, and batches
of sequences whose blocks lie scattered over the cache."""
from __future__ import annotations

import torch

from triton_device import DEVICE  # (skips the importing module without Triton)

from engine.kernels.attention import CommonAttentionMetadata
from windowed_attention import paged_batch


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def cos_sin_table(max_position: int, rotary_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)


def make_batch(seqs: list[tuple[int, int]], block_size: int, num_blocks: int) -> CommonAttentionMetadata:
    """seqs: (cached tokens, new tokens) per sequence, decodes (one new token) first. Blocks are
    scattered at random over the cache, as the block manager would leave them after a while."""
    metadata, _ = paged_batch(seqs, block_size, num_blocks, None, device=DEVICE)
    assert metadata.num_decodes == sum(1 for _, new in seqs if new == 1), "decodes go first"
    return metadata


def qkv_views(num_tokens, num_heads, num_kv_heads, head_size, dtype):
    """query/key/value as the model hands them over: strided views of one fused projection output."""
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    qkv = randn(num_tokens, q_size + 2 * kv_size, dtype=dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (q.reshape(-1, num_heads, head_size), k.reshape(-1, num_kv_heads, head_size),
            v.reshape(-1, num_kv_heads, head_size))
