"""Paged attention in Triton: the KV-cache write (fused with the rotary embedding when the layer hands
over its rotation), split-K paged decode with its reduction, and a
varlen flash-attention prefill that reads cached prefixes through the block table.

KV layout per layer: [2, num_blocks, block_size, num_kv_heads, head_size] (keys, then values), the same
as the torch reference, so that each token's head vector is one contiguous row."""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from engine.kernels.attention import AttentionBackend, CommonAttentionMetadata, apply_rope
from engine.kernels.triton import pdl
from engine.kernels.triton.common import dot, rope_coefficients, rotated

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64


@dataclass
class TritonAttentionMetadata(CommonAttentionMetadata):
    """The common metadata plus the launch-size facts the kernels need, computed once per step."""
    num_prefills: int = 0
    max_decode_seq_len: int = 0
    num_sms: int = 1  # streaming multiprocessors (compute units): split-K aims to fill them
    min_split_tokens: int = 64  # a decode split never covers fewer context tokens than this (one tile)
    # (num_kv_heads, block_n) -> (num_splits, tiles_per_split); filled by the first layer of a step.
    _decode_plans: dict = field(default_factory=dict, repr=False)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a small number keeps the split-K path exercised at test sizes


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ---- kernels ------------------------------------------------------------------------------------------

@triton.jit
def _cache_write_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_kv_heads,
                        sk_t, sk_h, sv_t, sv_h,
                        HEAD_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, D_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        pdl.enter()
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token
        return
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, D_PAD)[None, :]
    mask = (heads < num_kv_heads) & (dims < HEAD_SIZE)
    dest = slot * num_kv_heads * HEAD_SIZE + heads * HEAD_SIZE + dims
    k = tl.load(key_ptr + token * sk_t + heads * sk_h + dims, mask=mask)
    v = tl.load(value_ptr + token * sv_t + heads * sv_h + dims, mask=mask)
    tl.store(k_cache_ptr + dest, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dest, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_cache_write_kernel(pos_ptr, q_ptr, key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, table_ptr,
                             num_heads, num_kv_heads, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, stride_table,
                             HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, HALF: tl.constexpr,
                             IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HK: tl.constexpr, USE_PDL: tl.constexpr):
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
    kv_mask = (kv_heads < tl.where(slot >= 0, num_kv_heads, 0)) & (dims < HEAD_SIZE)
    dest = slot * num_kv_heads * HEAD_SIZE + kv_heads * HEAD_SIZE + dims
    k = rotated(key_ptr + token * sk_t + kv_heads * sk_h, dims, partner, rotating, kv_mask, cos, sin)
    # Rounded to the activation dtype first, exactly as the unfused path stores the rotated key.
    tl.store(k_cache_ptr + dest, k.to(key_ptr.dtype.element_ty).to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    v = tl.load(value_ptr + token * sv_t + kv_heads * sv_h + dims, mask=kv_mask)
    tl.store(v_cache_ptr + dest, v.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _paged_rows(block_table_ptr, seq, stride_bt, tokens, valid, num_kv_heads, kv_head,
                HEAD_SIZE: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Element offsets (int64) of each token's head vector in a [blocks, page, heads, dim] cache."""
    pages = tl.load(block_table_ptr + seq * stride_bt + tokens // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    slots = pages * PAGE_SIZE + tokens % PAGE_SIZE
    return (slots * num_kv_heads + kv_head) * HEAD_SIZE


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
                   seq_lens_ptr, block_table_ptr, num_kv_heads, tiles_per_split, num_splits,
                   sq_t, sq_h, so_t, so_h, stride_bt, scale_log2,
                   GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr,
                   BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
                   UPCAST: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        pdl.enter()
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, tl.cdiv(seq_len, BLOCK_N))
    if tile_begin >= tile_end:  # this split lies past the end of a shorter context
        return
    # All query heads that share this KV head are one [G_PAD, D] tile: K and V are read once for them.
    g = tl.arange(0, G_PAD)[:, None]
    dims = tl.arange(0, D_PAD)[None, :]
    heads = kv_head * GROUP + g
    q_mask = (g < GROUP) & (dims < HEAD_SIZE)
    q = tl.load(q_ptr + seq * sq_t + heads * sq_h + dims, mask=q_mask, other=0.0)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    for tile in range(tile_begin, tile_end):
        tokens = tile * BLOCK_N + offs
        valid = tokens < seq_len
        rows = _paged_rows(block_table_ptr, seq, stride_bt, tokens, valid, num_kv_heads, kv_head,
                           HEAD_SIZE, PAGE_SIZE)[:, None]
        kv_mask = valid[:, None] & (dims < HEAD_SIZE)
        k = tl.load(k_cache_ptr + rows + dims, mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k), UPCAST) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m - m_new)
        v = tl.load(v_cache_ptr + rows + dims, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, UPCAST)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    if SINGLE_SPLIT:
        out = acc / l[:, None]
        tl.store(out_ptr + seq * so_t + heads * so_h + dims, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # Partials are [seqs, heads, splits, D] and [seqs, heads, splits, 2] (max, sum), fp32.
        part = (seq * num_kv_heads * GROUP + heads) * num_splits + split
        tl.store(part_acc_ptr + part * HEAD_SIZE + dims, acc, mask=q_mask)
        tl.store(part_ml_ptr + part * 2, m[:, None], mask=g < GROUP)
        tl.store(part_ml_ptr + part * 2 + 1, l[:, None], mask=g < GROUP)


@triton.jit
def _decode_reduce_kernel(part_acc_ptr, part_ml_ptr, out_ptr, seq_lens_ptr, num_heads, tiles_per_split,
                          num_splits, so_t, so_h,
                          HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
                          BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        pdl.enter()
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    used = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), tiles_per_split)  # splits that saw any of this context
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, D_PAD)[None, :]
    part = (seq * num_heads + head) * num_splits + splits
    live = splits < used
    m = tl.load(part_ml_ptr + part * 2, mask=live, other=float("-inf"))
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=live, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_SIZE + dims, mask=live[:, None] & (dims < HEAD_SIZE),
                  other=0.0)
    weight = tl.math.exp2(m - tl.max(m, axis=0))
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
    dims = tl.arange(0, D_PAD)
    tl.store(out_ptr + seq * so_t + head * so_h + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_SIZE)


@triton.jit
def _prefill_tile(acc, m, l, q, k_ptr, v_ptr, block_table_ptr, seq, stride_bt, sk_t, sk_h, sv_t, sv_h,
                  kv_start, num_kv_heads, kv_head, start, seq_len, query_pos, dims, scale_log2,
                  HEAD_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  PAGED: tl.constexpr, CAUSAL_MASK: tl.constexpr, UPCAST: tl.constexpr):
    tokens = start + tl.arange(0, BLOCK_N)
    valid = tokens < seq_len
    if PAGED:
        rows = _paged_rows(block_table_ptr, seq, stride_bt, tokens, valid, num_kv_heads, kv_head,
                           HEAD_SIZE, PAGE_SIZE)[:, None]
        k_rows, v_rows = rows, rows
    else:  # no cache (profiling): this step's keys and values are the whole context
        token_rows = (kv_start + tokens).to(tl.int64)[:, None]
        k_rows = token_rows * sk_t + kv_head * sk_h
        v_rows = token_rows * sv_t + kv_head * sv_h
    kv_mask = valid[:, None] & (dims < HEAD_SIZE)
    k = tl.load(k_ptr + k_rows + dims, mask=kv_mask, other=0.0)
    s = dot(q, tl.trans(k), UPCAST) * scale_log2
    if CAUSAL_MASK:
        s = tl.where((tokens[None, :] <= query_pos[:, None]) & valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m - m_new)
    v = tl.load(v_ptr + v_rows + dims, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, UPCAST)
    l = l * alpha + tl.sum(p, axis=1)
    return acc, m_new, l


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, query_start_ptr, seq_lens_ptr, block_table_ptr,
                    first_seq, num_kv_heads, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, stride_bt,
                    scale_log2,
                    GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    PAGED: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr):
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
    # Keys before the tile's first query position are visible to every row: no mask there.
    unmasked_end = (context_len + m_start) // BLOCK_N * BLOCK_N
    end = tl.minimum(seq_len, context_len + m_start + BLOCK_M)
    for start in range(0, unmasked_end, BLOCK_N):
        acc, m, l = _prefill_tile(
            acc, m, l, q, k_ptr, v_ptr, block_table_ptr, seq, stride_bt, sk_t, sk_h, sv_t, sv_h, q_start,
            num_kv_heads, kv_head, start, seq_len, query_pos, dims, scale_log2,
            HEAD_SIZE, BLOCK_N, PAGE_SIZE, PAGED, False, UPCAST)
    for start in range(unmasked_end, end, BLOCK_N):
        acc, m, l = _prefill_tile(
            acc, m, l, q, k_ptr, v_ptr, block_table_ptr, seq, stride_bt, sk_t, sk_h, sv_t, sv_h, q_start,
            num_kv_heads, kv_head, start, seq_len, query_pos, dims, scale_log2,
            HEAD_SIZE, BLOCK_N, PAGE_SIZE, PAGED, True, UPCAST)
    out = acc / l[:, None]
    tl.store(out_ptr + q_rows * so_t + head * so_h + dims, out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & (dims < HEAD_SIZE))


# ---- the backend --------------------------------------------------------------------------------------

def _tile_sizes(head_size: int, element_size: int) -> tuple[int, int, int]:
    """(prefill BLOCK_M, BLOCK_N of both kernels, num_warps), chosen so that nothing spills to local memory
    on sm_90 (checked with ptxas): fp32 goes through FMA-based dots, which need far more registers."""
    d_pad = triton.next_power_of_2(head_size)
    if element_size == 4:
        return (64 if d_pad <= 64 else 32), 16, 8
    if d_pad <= 128:
        return 64, 64, 4
    return 64, 32, 8


def _rope_and_cache_write(query, key, value, k_cache, v_cache, slot_mapping, rope, head_size, d_pad) -> None:
    positions, table, is_neox = rope
    rotary_dim = table.shape[-1]
    assert rotary_dim % 2 == 0 and rotary_dim <= head_size, (rotary_dim, head_size)
    table = table.contiguous()
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    block_h = triton.next_power_of_2(num_heads)
    _rope_cache_write_kernel[(query.shape[0],)](
        positions.contiguous(), query, key, value, k_cache, v_cache, slot_mapping, table,
        num_heads, num_kv_heads, query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), table.stride(0),
        HEAD_SIZE=head_size, D_PAD=d_pad, HALF=rotary_dim // 2, IS_NEOX=is_neox,
        BLOCK_H=block_h, BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        num_warps=max(1, min(8, block_h * d_pad // 512)), **pdl.launch_options(query))


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

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
            num_sms=_num_sms(common.seq_lens.device),
        )

    @staticmethod
    def forward(query, key, value, kv_cache, metadata: TritonAttentionMetadata, scale, block_size, rope=None):
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
        block_m, block_n, num_warps = _tile_sizes(head_size, query.element_size())
        scale_log2 = scale * _LOG2E
        upcast = query.dtype == torch.bfloat16 and _interpreting()
        if kv_cache is None:
            assert metadata.num_decodes == 0, "decodes need a KV cache"
            query, key = apply_rope(query, key, rope)
            k_src, v_src = key, value
        else:
            k_cache, v_cache = kv_cache[0], kv_cache[1]
            if rope is not None:  # one kernel: rotate queries in place, rotated keys and values to the cache
                _rope_and_cache_write(query, key, value, k_cache, v_cache, metadata.slot_mapping, rope,
                                      head_size, d_pad)
            else:
                block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // d_pad))
                _cache_write_kernel[(num_tokens, triton.cdiv(num_kv_heads, block_h))](
                    key, value, k_cache, v_cache, metadata.slot_mapping, num_kv_heads,
                    key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                    HEAD_SIZE=head_size, BLOCK_H=block_h, D_PAD=d_pad, **pdl.launch_options(key))
            k_src, v_src = k_cache, v_cache
            if metadata.num_decodes:
                _decode(query, k_cache, v_cache, out, metadata, num_kv_heads, group, head_size, d_pad,
                        block_n, num_warps, scale_log2, block_size, upcast)
        if metadata.num_prefills:
            grid = (num_heads, triton.cdiv(metadata.max_query_len, block_m), metadata.num_prefills)
            _prefill_kernel[grid](
                query, k_src, v_src, out, metadata.query_start_loc, metadata.seq_lens, metadata.block_table,
                metadata.num_decodes, num_kv_heads, query.stride(0), query.stride(1),
                k_src.stride(0), k_src.stride(1), v_src.stride(0), v_src.stride(1), out.stride(0), out.stride(1),
                metadata.block_table.stride(0), scale_log2,
                GROUP=group, HEAD_SIZE=head_size, D_PAD=d_pad, BLOCK_M=block_m, BLOCK_N=block_n,
                PAGE_SIZE=block_size, PAGED=kv_cache is not None, UPCAST=upcast,
                num_warps=num_warps, num_stages=2, **pdl.launch_options(query))
        return out


def decode_plan(metadata: TritonAttentionMetadata, num_kv_heads: int, block_n: int) -> tuple[int, int]:
    """(num_splits, tiles_per_split) for this step's decodes: enough programs to fill the GPU twice over,
    but no split shorter than `min_split_tokens`."""
    key = (num_kv_heads, block_n)
    plan = metadata._decode_plans.get(key)
    if plan is None:
        num_tiles = triton.cdiv(metadata.max_decode_seq_len, block_n)
        wanted = triton.cdiv(2 * metadata.num_sms, metadata.num_decodes * num_kv_heads)
        by_length = triton.cdiv(metadata.max_decode_seq_len, metadata.min_split_tokens)
        splits = max(1, min(wanted, by_length, _MAX_SPLITS, num_tiles))
        tiles_per_split = triton.cdiv(num_tiles, splits)
        plan = metadata._decode_plans[key] = (triton.cdiv(num_tiles, tiles_per_split), tiles_per_split)
    return plan


def _decode(query, k_cache, v_cache, out, metadata, num_kv_heads, group, head_size, d_pad, block_n,
            num_warps, scale_log2, block_size, upcast, num_stages=2):
    num_decodes = metadata.num_decodes
    num_heads = num_kv_heads * group
    num_splits, tiles_per_split = decode_plan(metadata, num_kv_heads, block_n)
    single = num_splits == 1
    if single:
        part_acc = part_ml = out  # unused
    else:
        part_acc = torch.empty(num_decodes, num_heads, num_splits, head_size, dtype=torch.float32,
                               device=query.device)
        part_ml = torch.empty(num_decodes, num_heads, num_splits, 2, dtype=torch.float32, device=query.device)
    _decode_kernel[(num_decodes, num_kv_heads, num_splits)](
        query, k_cache, v_cache, out, part_acc, part_ml, metadata.seq_lens, metadata.block_table,
        num_kv_heads, tiles_per_split, num_splits, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        metadata.block_table.stride(0), scale_log2,
        GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), HEAD_SIZE=head_size, D_PAD=d_pad,
        BLOCK_N=block_n, PAGE_SIZE=block_size, SINGLE_SPLIT=single, UPCAST=upcast, num_warps=num_warps,
        num_stages=num_stages, **pdl.launch_options(query))
    if not single:
        _decode_reduce_kernel[(num_decodes, num_heads)](
            part_acc, part_ml, out, metadata.seq_lens, num_heads, tiles_per_split, num_splits,
            out.stride(0), out.stride(1),
            HEAD_SIZE=head_size, D_PAD=d_pad, SPLITS_PAD=triton.next_power_of_2(num_splits), BLOCK_N=block_n,
            num_warps=4, **pdl.launch_options(out))
