"""Sparse latent attention in Triton (DeepSeek-V3.2's and GLM-5's DSA layers; the contract: engine/kernels/mla.py,
`mla_sparse_attention`): each query row attends over its own listed cache entries (-1 skipped) with the tile loop
of the latent decode (mla.py), keys the whole entry and values its latent part; FP8 caches as there."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.attention import KVCacheQuant
from engine.kernels.triton.mla import LOG2E, decode_tiles, latent_tile, pad_dim, quant_args, upcast


@triton.jit
def _sparse_kernel(q_ptr, cache_ptr, kv_scale_ptr, slots_ptr, out_ptr, lse_ptr, num_heads, top_k, sq_t, sq_h, ss_t,
                   s_entry, so_t, so_h, slse_t, scale_log2,
                   VD: tl.constexpr, R: tl.constexpr, VD_PAD: tl.constexpr, R_PAD: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr, UPCAST: tl.constexpr):
    """Program (query row, head block): the row's listed entries in tiles; keys are whole entries (VD value
    dims, then R more), values their first VD dims. QUANT: an FP8 cache, as in _decode_kernel."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    dl = tl.arange(0, VD_PAD)
    dr = tl.arange(0, R_PAD)
    q_rows = q_ptr + token * sq_t + heads[:, None] * sq_h
    q_lat = tl.load(q_rows + dl[None, :], mask=head_mask[:, None] & (dl[None, :] < VD), other=0.0)
    q_pe = tl.load(q_rows + VD + dr[None, :], mask=head_mask[:, None] & (dr[None, :] < R),
                   other=0.0).to(q_lat.dtype)
    if QUANT:
        scale_log2 = scale_log2 * tl.load(kv_scale_ptr)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, VD_PAD], tl.float32)
    for start in range(0, top_k, BLOCK_N):
        index = start + tl.arange(0, BLOCK_N)
        slots = tl.load(slots_ptr + token * ss_t + index, mask=index < top_k, other=-1).to(tl.int64)
        valid = slots >= 0
        entry_ptrs = cache_ptr + (tl.where(valid, slots, 0) * s_entry)[:, None]
        acc, m, l = latent_tile(acc, m, l, q_lat, q_pe, entry_ptrs, valid, dl, dr, scale_log2, VD, R, UPCAST)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    if QUANT:
        out = out * tl.load(kv_scale_ptr)
    tl.store(out_ptr + token * so_t + heads[:, None] * so_h + dl[None, :], out.to(out_ptr.dtype.element_ty),
             mask=head_mask[:, None] & (dl[None, :] < VD))
    lse = tl.where(l > 0, (m + tl.math.log2(tl.where(l > 0, l, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + token * slse_t + heads, lse, mask=head_mask)


def mla_sparse_attention(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, scale: float,
                         v_dim: int, kv_quant: KVCacheQuant | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The `mla_sparse_attention` op (engine/kernels/mla.py): q [T, H, D] over the entries at slots [T, K]
    (-1: none) of kv_cache viewed as [-1, D] (FP8 with `kv_quant`) -> (out [T, H, v_dim] in q's dtype,
    lse [T, H] fp32)."""
    num_tokens, num_heads, dim = q.shape
    if kv_cache.shape[-1] != dim:
        raise ValueError(f"queries have {dim} features but cache entries {kv_cache.shape[-1]}")
    if not 0 < v_dim <= dim:
        raise ValueError(f"v_dim {v_dim} must be in 1..{dim}")
    if slots.dim() != 2 or slots.shape[0] != num_tokens:
        raise ValueError(f"slots must be [{num_tokens}, K], not {list(slots.shape)}")
    entries = kv_cache.view(-1, dim)
    q = q if q.stride(-1) == 1 else q.contiguous()
    slots = slots if slots.stride(-1) == 1 else slots.contiguous()
    out = q.new_empty(num_tokens, num_heads, v_dim)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    if num_tokens == 0:
        return out, lse
    block_h, block_n, num_warps = decode_tiles(num_heads, q.dtype)
    rope_dim = dim - v_dim
    quant, kv_scale = quant_args(kv_quant, kv_cache)
    _sparse_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        q, entries, kv_scale, slots, out, lse, num_heads, slots.shape[1], q.stride(0), q.stride(1), slots.stride(0),
        entries.stride(0), out.stride(0), out.stride(1), lse.stride(0), scale * LOG2E,
        VD=v_dim, R=rope_dim, VD_PAD=pad_dim(v_dim), R_PAD=pad_dim(max(rope_dim, 1)), BLOCK_H=block_h, BLOCK_N=block_n,
        QUANT=quant, UPCAST=upcast(q), num_warps=num_warps, num_stages=2)
    return out, lse
