"""Paged attention on AITER, as ATOM's MHA backend runs it: the cache in AITER's shuffled layout, written by
`reshape_and_cache` (or `reshape_and_cache_with_pertoken_quant` for an FP8 cache), decodes through the
assembly kernel `pa_fwd_asm`, prefills through `flash_attn_varlen_func`.

Layout of one layer's cache, x = 16 bytes / element size (8 for bf16, 16 for fp8):
  keys   [num_blocks, Hk, D / x, block_size, x]
  values [num_blocks, Hk, block_size / x, D, x]
allocated as [2, num_blocks, Hk, D * block_size] and viewed per step. An FP8 cache keeps per-token, per-head
scales [num_blocks, Hk, block_size] (float32). The start-up check (engine/kernels/aiter/__init__.declines)
sends models outside pa_fwd_asm's limits (head size 128, 16-token blocks) to the Triton backend.

A prefill whose sequence has no cached prefix attends over its own keys and values directly; one with a
cached prefix (chunked prefill, prefix caching) gathers its context from the cache into contiguous
[tokens, Hk, D] first (dequantized if FP8), then runs the same varlen kernel.
"""
from __future__ import annotations

import math

import torch

from engine.kernels.attention import (PLAIN_ATTENTION, AttentionBackend, AttentionOptions, CommonAttentionMetadata,
                                     KVCacheQuant, apply_rope)


def cache_views(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int, block_size: int):
    """(keys, values) of one layer's cache in AITER's 5-D shuffled layouts."""
    x = 16 // kv_cache.element_size()
    num_blocks = kv_cache.shape[1]
    keys = kv_cache[0].view(num_blocks, num_kv_heads, head_size // x, block_size, x)
    values = kv_cache[1].view(num_blocks, num_kv_heads, block_size // x, head_size, x)
    return keys, values


def gather_context(keys: torch.Tensor, values: torch.Tensor, scales: KVCacheQuant | None, block_ids: torch.Tensor,
                   length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first `length` cached keys and values as contiguous [length, Hk, D] in `dtype`."""
    num_blocks, num_kv_heads, _, block_size, x = keys.shape
    head_size = values.shape[3]
    k = keys.index_select(0, block_ids)  # [n, Hk, D/x, bs, x]
    v = values.index_select(0, block_ids)  # [n, Hk, bs/x, D, x]
    k = k.permute(0, 3, 1, 2, 4).reshape(-1, num_kv_heads, head_size)
    v = v.permute(0, 2, 4, 1, 3).reshape(-1, num_kv_heads, head_size)
    if scales is not None:
        k_scale = scales.k_scale.index_select(0, block_ids).permute(0, 2, 1).reshape(-1, num_kv_heads, 1)
        v_scale = scales.v_scale.index_select(0, block_ids).permute(0, 2, 1).reshape(-1, num_kv_heads, 1)
        k, v = k.float() * k_scale, v.float() * v_scale
    return k[:length].to(dtype), v[:length].to(dtype)


class AiterAttentionBackend(AttentionBackend):
    name = "aiter"
    kernel = ("aiter.reshape_and_cache[_with_pertoken_quant] + aiter.pa_fwd_asm (decode) + "
              "aiter.flash_attn_varlen_func (prefill)")
    supports_cuda_graphs = False  # prefills and cached-prefix gathers loop on the host
    kv_scale_granularities = ("token",)  # pa_fwd_asm reads per-token FP8 scales

    @staticmethod
    def kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
        return (2, num_blocks, num_kv_heads, head_size * block_size)

    @staticmethod
    def kv_scale_shape(num_blocks, block_size, num_kv_heads):
        return (num_blocks, num_kv_heads, block_size)

    @classmethod
    def kv_fp8_dtype(cls) -> torch.dtype:
        from engine.kernels.aiter.quant import aiter_fp8_dtype
        return aiter_fp8_dtype()

    @staticmethod
    def forward(query, key, value, kv_cache, metadata: CommonAttentionMetadata, scale, block_size, rope=None,
                kv_quant: KVCacheQuant | None = None, options: AttentionOptions = PLAIN_ATTENTION):
        if not options.is_plain:  # `declines` sends such models to Triton at start-up; this is a guard
            raise NotImplementedError("the aiter attention backend has no sliding window, sinks or soft-capping "
                                      "(pa_fwd_asm and the mapped prefill kernel take neither); such layers run "
                                      "on the Triton backend")
        import aiter
        query, key = apply_rope(query, key, rope)
        num_tokens, num_heads, head_size = query.shape
        num_kv_heads = key.shape[1]
        out = torch.empty_like(query)
        if kv_cache is None:  # profiling pass: causal prefills over this step's own keys and values
            return _prefill(query, key, value, None, None, metadata, scale, block_size, out, kv_quant)
        keys, values = cache_views(kv_cache, num_kv_heads, head_size, block_size)
        if kv_quant is None:
            aiter.reshape_and_cache(key, value, keys, values, metadata.slot_mapping, "auto", asm_layout=True)
        else:
            assert kv_quant.per_token, "AITER's FP8 cache is per-token (declines() routes per-tensor elsewhere)"
            aiter.reshape_and_cache_with_pertoken_quant(key, value, keys, values, kv_quant.k_scale,
                                                        kv_quant.v_scale, metadata.slot_mapping, True)
        num_decodes = metadata.num_decodes
        if num_decodes:
            q = query[:num_decodes]
            if not math.isclose(scale, head_size ** -0.5):  # pa_fwd_asm scales by 1/sqrt(D) itself
                q = q * (scale * math.sqrt(head_size))
            k_scales = v_scales = None
            if kv_quant is not None:
                k_scales, v_scales = kv_quant.k_scale, kv_quant.v_scale
            block_table = metadata.block_table[:num_decodes]
            out[:num_decodes] = aiter.pa_fwd_asm(q.contiguous(), keys, values, block_table,
                                                 metadata.seq_lens[:num_decodes], block_table.stride(0),
                                                 K_QScale=k_scales, V_QScale=v_scales)
        if metadata.num_seqs > num_decodes:
            _prefill(query, key, value, keys, values, metadata, scale, block_size, out, kv_quant)
        return out


def _prefill(query, key, value, keys, values, metadata, scale, block_size, out, kv_quant):
    """The prefill sequences (those after the decodes) through flash_attn_varlen_func."""
    import aiter
    first = metadata.num_decodes
    starts, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    begin = starts[first]
    seqs = range(first, metadata.num_seqs)
    query_lens = [starts[s + 1] - starts[s] for s in seqs]
    with_context = keys is not None and any(lens[s] != q for s, q in zip(seqs, query_lens))
    q = query[begin:starts[-1]]
    cu_q = metadata.query_start_loc[first:] - begin
    if with_context:  # each sequence's whole context, from the cache (this step's tokens included)
        k_parts, v_parts = [], []
        for s in seqs:
            block_ids = metadata.block_table[s, :-(-lens[s] // block_size)]
            k, v = gather_context(keys, values, kv_quant, block_ids, lens[s], query.dtype)
            k_parts.append(k)
            v_parts.append(v)
        k, v = torch.cat(k_parts), torch.cat(v_parts)
        seq_lens = [lens[s] for s in seqs]
        cu_k = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32, device=q.device)
        max_k = max(seq_lens)
    else:
        k, v = key[begin:starts[-1]], value[begin:starts[-1]]
        cu_k, max_k = cu_q, max(query_lens)
    result = aiter.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(query_lens), max_k, softmax_scale=scale,
                                          causal=True)
    out[begin:starts[-1]] = result[0] if isinstance(result, tuple) else result
    return out
