"""Paged attention in Triton: the KV-cache write (fused with the rotary embedding when the layer hands
over its rotation), a varlen flash-attention prefill that reads cached prefixes through the block table, and
the backend that also dispatches decodes to decode_attention.py (split-K; decode-only steps with a rotary
embedding in one fused launch).

KV layout per layer: [2, num_blocks, block_size, num_kv_heads, head_size] (keys, then values), the same
as the torch reference, so that each token's head vector is one contiguous row. An FP8 cache (KVCacheQuant)
is quantized by every kernel that writes it and dequantized by every kernel that reads it (common.py)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from engine.kernels.attention import (PLAIN_ATTENTION, AttentionBackend, AttentionOptions, CommonAttentionMetadata,
                                     KVCacheQuant, apply_rope)
from engine.kernels.triton import decode_attention, pdl, workspace
from engine.kernels.triton.common import (FP8_KV_DTYPE, interpreting, key_scores, kv_quant_args, paged_rows,
                                          rope_coefficients, rotated, soft_capped, store_kv_rows, weighted_values,
                                          with_sinks)

_LOG2E = 1.4426950408889634


@dataclass
class TritonAttentionMetadata(CommonAttentionMetadata):
    """The common metadata plus the launch-size facts the kernels need, computed once per step."""
    num_prefills: int = 0
    max_decode_seq_len: int = 0
    num_sms: int = 1  # streaming multiprocessors (compute units): split-K aims to fill them
    min_split_tokens: int = 64  # a decode split never covers fewer context tokens than this (one tile)
    # (num_kv_heads, block_n) -> (num_splits, min_tiles_per_split); filled by the first layer of a step.
    _decode_plans: dict = field(default_factory=dict, repr=False)


# ---- kernels ------------------------------------------------------------------------------------------

@triton.jit
def _cache_write_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
                        num_kv_heads, sk_t, sk_h, sv_t, sv_h,
                        HEAD_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, D_PAD: tl.constexpr,
                        KV_QUANT: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        pdl.enter()
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token
        return
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, D_PAD)[None, :]
    head_mask = heads < num_kv_heads
    mask = head_mask & (dims < HEAD_SIZE)
    rows = slot * num_kv_heads + heads
    k = tl.load(key_ptr + token * sk_t + heads * sk_h + dims, mask=mask)
    v = tl.load(value_ptr + token * sv_t + heads * sv_h + dims, mask=mask)
    store_kv_rows(k_cache_ptr, k_scale_ptr, rows, dims, k, head_mask, HEAD_SIZE, KV_QUANT)
    store_kv_rows(v_cache_ptr, v_scale_ptr, rows, dims, v, head_mask, HEAD_SIZE, KV_QUANT)


@triton.jit
def _rope_cache_write_kernel(pos_ptr, q_ptr, key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                             slot_ptr, table_ptr, num_heads, num_kv_heads, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h,
                             stride_table,
                             HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, HALF: tl.constexpr,
                             IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HK: tl.constexpr,
                             KV_QUANT: tl.constexpr, USE_PDL: tl.constexpr):
    """One token: rotate its query heads in place, rotate its key heads straight into the cache and copy its
    value heads there (the separate rotary and cache-write kernels in one launch)."""
    if USE_PDL:
        pdl.enter()
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(pos_ptr + token).to(tl.int64)
    dims = tl.arange(0, D_PAD)[None, :]
    cos, sin, partner, rotating = rope_coefficients(table_ptr, position, stride_table, dims,
                                                    q_ptr.dtype.element_ty, HALF, IS_NEOX)
    heads = tl.arange(0, BLOCK_H)[:, None]
    q_mask = (heads < num_heads) & (dims < HEAD_SIZE)
    q_rows = q_ptr + token * sq_t + heads * sq_h
    q = rotated(q_rows, dims, partner, rotating, q_mask, cos, sin)
    tl.store(q_rows + dims, q.to(q_ptr.dtype.element_ty), mask=q_mask)

    slot = tl.load(slot_ptr + token).to(tl.int64)  # negative: a padding token, nothing to store
    kv_heads = tl.arange(0, BLOCK_HK)[:, None]
    head_mask = kv_heads < tl.where(slot >= 0, num_kv_heads, 0)
    kv_mask = head_mask & (dims < HEAD_SIZE)
    rows = slot * num_kv_heads + kv_heads
    k = rotated(key_ptr + token * sk_t + kv_heads * sk_h, dims, partner, rotating, kv_mask, cos, sin)
    # Rounded to the activation dtype first (then quantized), exactly as the unfused path stores the rotated key.
    store_kv_rows(k_cache_ptr, k_scale_ptr, rows, dims, k.to(key_ptr.dtype.element_ty), head_mask, HEAD_SIZE,
                  KV_QUANT)
    v = tl.load(value_ptr + token * sv_t + kv_heads * sv_h + dims, mask=kv_mask)
    store_kv_rows(v_cache_ptr, v_scale_ptr, rows, dims, v, head_mask, HEAD_SIZE, KV_QUANT)


@triton.jit
def _prefill_tile(acc, m, l, q, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, seq, stride_bt,
                  sk_t, sk_h, sv_t, sv_h, kv_start, num_kv_heads, kv_head, start, seq_len, query_pos, dims, scale_log2,
                  lo, window, softcap_log2,
                  HEAD_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  PAGED: tl.constexpr, CAUSAL_MASK: tl.constexpr, KV_QUANT: tl.constexpr, UPCAST: tl.constexpr,
                  WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    """One tile of keys for a tile of queries; tokens before `lo` (the first key of the tile's earliest
    query's window) are neither read nor counted."""
    tokens = start + tl.arange(0, BLOCK_N)
    valid = (tokens < seq_len) & (tokens >= lo)
    if PAGED:
        rows = paged_rows(block_table_ptr, seq, stride_bt, tokens, valid, num_kv_heads, kv_head, PAGE_SIZE)
        k_offsets = (rows * HEAD_SIZE)[:, None]
        v_offsets = k_offsets
    else:  # no cache (profiling): this step's keys and values are the whole context
        rows = (kv_start + tokens).to(tl.int64)
        k_offsets = rows[:, None] * sk_t + kv_head * sk_h
        v_offsets = rows[:, None] * sv_t + kv_head * sv_h
    kv_mask = valid[:, None] & (dims < HEAD_SIZE)
    k = tl.load(k_ptr + k_offsets + dims, mask=kv_mask, other=0.0)
    s = key_scores(q, k, k_scale_ptr, rows, valid, scale_log2, KV_QUANT, UPCAST)
    if SOFTCAP:
        s = soft_capped(s, softcap_log2)
    if CAUSAL_MASK:
        visible = (tokens[None, :] <= query_pos[:, None]) & valid[None, :]
        if WINDOWED:  # the query's `window` most recent keys, its own included
            visible = visible & (tokens[None, :] > query_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_ref = m_new
    if WINDOWED:  # a row may see no key of a tile yet (its window starts later): no -inf - -inf
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_ref[:, None])
    alpha = tl.math.exp2(m - m_ref)
    v = tl.load(v_ptr + v_offsets + dims, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + weighted_values(p, v, v_scale_ptr, rows, valid, q.dtype, KV_QUANT, UPCAST)
    l = l * alpha + tl.sum(p, axis=1)
    return acc, m_new, l


@triton.jit(do_not_specialize=["first_seq", "stride_bt"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, out_ptr, query_start_ptr, seq_lens_ptr,
                    block_table_ptr, sinks_ptr, first_seq, num_kv_heads, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h,
                    stride_bt, scale_log2, window, softcap_log2,
                    GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    PAGED: tl.constexpr, KV_QUANT: tl.constexpr, UPCAST: tl.constexpr, WINDOWED: tl.constexpr,
                    SINKS: tl.constexpr, SOFTCAP: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        pdl.enter()
    # Heads vary fastest across the grid, so programs that share a KV head run together and share K/V in L2.
    head = tl.program_id(0)
    m_start = tl.program_id(1) * BLOCK_M
    seq = (first_seq + tl.program_id(2)).to(tl.int64)
    q_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - q_start
    if m_start >= query_len:  # the grid covers the longest query; shorter ones stop here
        return
    if PAGED:
        seq_len = tl.load(seq_lens_ptr + seq)
    else:
        seq_len = query_len
    context_len = seq_len - query_len  # cached tokens before this chunk: bottom-right causal alignment
    kv_head = head // GROUP
    rows = m_start + tl.arange(0, BLOCK_M)
    row_valid = rows < query_len
    dims = tl.arange(0, D_PAD)[None, :]
    q_rows = (q_start + rows).to(tl.int64)[:, None]
    q = tl.load(q_ptr + q_rows * sq_t + head * sq_h + dims, mask=row_valid[:, None] & (dims < HEAD_SIZE),
                other=0.0)
    query_pos = context_len + rows
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    if KV_QUANT == "tensor":  # the key scale joins the softmax scale, the value scale multiplies the output
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
    end = tl.minimum(seq_len, context_len + m_start + BLOCK_M)
    if WINDOWED:  # only the tiles from the earliest row's window on, every one masked
        lo = tl.maximum(context_len + m_start - window + 1, 0)
        for start in range(lo // BLOCK_N * BLOCK_N, end, BLOCK_N):
            acc, m, l = _prefill_tile(
                acc, m, l, q, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, seq, stride_bt,
                sk_t, sk_h, sv_t, sv_h, q_start, num_kv_heads, kv_head, start, seq_len, query_pos, dims, scale_log2,
                lo, window, softcap_log2, HEAD_SIZE, BLOCK_N, PAGE_SIZE, PAGED, True, KV_QUANT, UPCAST, True, SOFTCAP)
    else:
        # Keys before the tile's first query position are visible to every row: no mask there.
        unmasked_end = (context_len + m_start) // BLOCK_N * BLOCK_N
        for start in range(0, unmasked_end, BLOCK_N):
            acc, m, l = _prefill_tile(
                acc, m, l, q, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, seq, stride_bt,
                sk_t, sk_h, sv_t, sv_h, q_start, num_kv_heads, kv_head, start, seq_len, query_pos, dims, scale_log2,
                0, window, softcap_log2, HEAD_SIZE, BLOCK_N, PAGE_SIZE, PAGED, False, KV_QUANT, UPCAST, False, SOFTCAP)
        for start in range(unmasked_end, end, BLOCK_N):
            acc, m, l = _prefill_tile(
                acc, m, l, q, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, seq, stride_bt,
                sk_t, sk_h, sv_t, sv_h, q_start, num_kv_heads, kv_head, start, seq_len, query_pos, dims, scale_log2,
                0, window, softcap_log2, HEAD_SIZE, BLOCK_N, PAGE_SIZE, PAGED, True, KV_QUANT, UPCAST, False, SOFTCAP)
    if SINKS:
        heads = head + tl.zeros([BLOCK_M], tl.int32)
        acc, l = with_sinks(acc, m, l, sinks_ptr, heads, heads >= 0)
    out = acc / l[:, None]
    if KV_QUANT == "tensor":
        out = out * tl.load(v_scale_ptr)
    tl.store(out_ptr + q_rows * so_t + head * so_h + dims, out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & (dims < HEAD_SIZE))


# ---- the backend --------------------------------------------------------------------------------------

def _tile_sizes(head_size: int, element_size: int, fp8_cache: bool = False) -> tuple[int, int, int]:
    """(prefill BLOCK_M, BLOCK_N of both kernels, num_warps), chosen so that nothing spills to local memory
    on sm_90 (checked with ptxas): fp32 goes through FMA-based dots, which need far more registers, the more
    so on FP8 keys and values widened to fp32 (which still spill at head size 256)."""
    d_pad = triton.next_power_of_2(head_size)
    if element_size == 4:
        return (16 if fp8_cache else 64 if d_pad <= 64 else 32), 16, 8
    if d_pad <= 128:
        return 64, 64, 4
    if d_pad <= 256:
        return 64, 32, 8
    return 32, 32, 8  # 512-wide heads (Gemma 4's global layers): a [32, 512] fp32 accumulator; not yet timed


def _rope_and_cache_write(query, key, value, k_cache, v_cache, slot_mapping, rope, head_size, d_pad,
                          kv_quant: KVCacheQuant | None) -> None:
    positions, table, is_neox = rope
    rotary_dim = table.shape[-1]
    assert rotary_dim % 2 == 0 and rotary_dim <= head_size, (rotary_dim, head_size)
    table = table.contiguous()
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    block_h = triton.next_power_of_2(num_heads)
    quant, k_scale, v_scale = kv_quant_args(kv_quant, k_cache)
    _rope_cache_write_kernel[(query.shape[0],)](
        positions.contiguous(), query, key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping, table,
        num_heads, num_kv_heads, query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), table.stride(0),
        HEAD_SIZE=head_size, D_PAD=d_pad, HALF=rotary_dim // 2, IS_NEOX=is_neox,
        BLOCK_H=block_h, BLOCK_HK=triton.next_power_of_2(num_kv_heads), KV_QUANT=quant,
        num_warps=max(1, min(8, block_h * d_pad // 512)), **pdl.launch_options(query))


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    fp8_kv_dtype = FP8_KV_DTYPE

    @staticmethod
    def kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata, block_size: int) -> TritonAttentionMetadata:
        num_decodes = common.num_decodes
        values = {f.name: getattr(common, f.name) for f in dataclasses.fields(CommonAttentionMetadata)}
        return TritonAttentionMetadata(
            **values,
            num_prefills=common.num_seqs - num_decodes,
            max_decode_seq_len=max(common.seq_lens_cpu[:num_decodes], default=0),
            num_sms=workspace.num_sms(common.seq_lens.device),
        )

    @staticmethod
    def forward(query, key, value, kv_cache, metadata: TritonAttentionMetadata, scale, block_size, rope=None,
                kv_quant: KVCacheQuant | None = None, options: AttentionOptions = PLAIN_ATTENTION):
        num_tokens, num_heads, head_size = query.shape
        num_kv_heads = key.shape[1]
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        assert query.stride(-1) == key.stride(-1) == value.stride(-1) == 1, "head dimension must be contiguous"
        if not isinstance(metadata, TritonAttentionMetadata):
            metadata = TritonAttentionBackend.build_metadata(metadata, block_size)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if num_tokens == 0:
            return out
        d_pad = max(16, triton.next_power_of_2(head_size))
        group = num_heads // num_kv_heads
        block_m, block_n, num_warps = _tile_sizes(head_size, query.element_size(),
                                                  kv_quant is not None and kv_cache is not None)
        scale_log2 = scale * _LOG2E
        upcast = query.dtype == torch.bfloat16 and interpreting()
        if kv_cache is None:  # profiling: no cache, so nothing to quantize either
            assert metadata.num_decodes == 0, "decodes need a KV cache"
            query, key = apply_rope(query, key, rope)
            k_src, v_src = key, value
            quant, k_scale, v_scale = kv_quant_args(None, key)
        else:
            k_cache, v_cache = kv_cache[0], kv_cache[1]
            if rope is not None and not metadata.num_prefills and decode_attention.FUSED_DECODE:
                # A decode-only step (every CUDA-graph step): rotation, cache write and attention in one launch.
                decode_attention.fused_decode(query, key, value, k_cache, v_cache, out, metadata, rope, group,
                                              head_size, d_pad, block_n, num_warps, scale_log2, block_size, upcast,
                                              kv_quant, options=options)
                return out
            quant, k_scale, v_scale = kv_quant_args(kv_quant, k_cache)
            if rope is not None:  # one kernel: rotate queries in place, rotated keys and values to the cache
                _rope_and_cache_write(query, key, value, k_cache, v_cache, metadata.slot_mapping, rope,
                                      head_size, d_pad, kv_quant)
            else:
                block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // d_pad))
                _cache_write_kernel[(num_tokens, triton.cdiv(num_kv_heads, block_h))](
                    key, value, k_cache, v_cache, k_scale, v_scale, metadata.slot_mapping, num_kv_heads,
                    key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                    HEAD_SIZE=head_size, BLOCK_H=block_h, D_PAD=d_pad, KV_QUANT=quant, **pdl.launch_options(key))
            k_src, v_src = k_cache, v_cache
            if metadata.num_decodes:
                decode_attention.decode(query, k_cache, v_cache, out, metadata, num_kv_heads, group, head_size,
                                        d_pad, block_n, num_warps, scale_log2, block_size, upcast, kv_quant,
                                        options=options)
        if metadata.num_prefills:
            grid = (num_heads, triton.cdiv(metadata.max_query_len, block_m), metadata.num_prefills)
            extra = decode_attention.option_args(options, out)
            _prefill_kernel[grid](
                query, k_src, v_src, k_scale, v_scale, out, metadata.query_start_loc, metadata.seq_lens,
                metadata.block_table, extra["sinks"], metadata.num_decodes, num_kv_heads, query.stride(0),
                query.stride(1), k_src.stride(0), k_src.stride(1), v_src.stride(0), v_src.stride(1), out.stride(0),
                out.stride(1), metadata.block_table.stride(0), scale_log2, extra["window"], extra["softcap_log2"],
                GROUP=group, HEAD_SIZE=head_size, D_PAD=d_pad, BLOCK_M=block_m, BLOCK_N=block_n,
                PAGE_SIZE=block_size, PAGED=kv_cache is not None, KV_QUANT=quant, UPCAST=upcast, **extra["flags"],
                num_warps=num_warps, num_stages=2, **pdl.launch_options(query))
        return out
