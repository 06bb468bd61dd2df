"""Inverses of AITER's preshuffled layouts, so the double computes on the logical tensors.

A caller that forgets to shuffle gets the same wrong numbers from the double as from the GPU.
"""
from __future__ import annotations

import torch


def unshuffle_weight(x: torch.Tensor, layout=(16, 16), use_int4: bool = False) -> torch.Tensor:
    """Inverse of aiter.ops.shuffle.shuffle_weight: [..., N, K] shuffled -> logical, same dtype."""
    x_type = x.dtype
    if x_type == getattr(torch, "float4_e2m1fn_x2", None):
        x = x.view(torch.uint8)
    block_n, block_k = layout[0], layout[1] * 2
    pack = 16 // x.element_size() if not use_int4 else 32
    n, k = x.shape[-2], x.shape[-1]
    assert n % block_n == 0 and k % block_k == 0, f"shape {tuple(x.shape)} does not tile by {layout}"
    tiles = x.contiguous().view(-1, n // block_n, k // block_k, block_k // pack, block_n, pack)
    return tiles.permute(0, 1, 4, 2, 3, 5).contiguous().view(x.shape).view(x_type)


def unshuffle_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Inverse of aiter.utility.fp4_utils.e8m0_shuffle on its padded [M/256*256, K/8*8] output."""
    rows, cols = scale.shape
    assert rows % 32 == 0 and cols % 8 == 0, f"{tuple(scale.shape)} is not an e8m0_shuffle output"
    tiles = scale.view(torch.uint8).contiguous().view(rows // 32, cols // 8, 4, 16, 2, 2)
    return tiles.permute(0, 5, 3, 1, 4, 2).contiguous().view(rows, cols)


def blockscale_weight(w: torch.Tensor, w_scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """[N, K] values times a [ceil(N/block), ceil(K/block)] block scale -> float32 [N, K]."""
    n, k = w.shape
    full = w_scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)
    return w.float() * full[:n, :k]


def key_cache_tokens(key_cache: torch.Tensor) -> torch.Tensor:
    """[nblk, Hk, D/x, bs, x] -> [nblk, Hk, bs, D]."""
    nblk, heads, d_outer, bs, x = key_cache.shape
    return key_cache.permute(0, 1, 3, 2, 4).reshape(nblk, heads, bs, d_outer * x)


def value_cache_tokens(value_cache: torch.Tensor, asm_layout: bool) -> torch.Tensor:
    """[nblk, Hk, bs/x, D, x] (asm) or [nblk, Hk, D, bs] -> [nblk, Hk, bs, D]."""
    if asm_layout:
        nblk, heads, bs_outer, d, x = value_cache.shape
        return value_cache.permute(0, 1, 2, 4, 3).reshape(nblk, heads, bs_outer * x, d)
    return value_cache.transpose(2, 3)
