"""Multi-head latent attention in Triton (engine/kernels/mla.py states the contracts; the torch reference is
engine/kernels/torch/mla.py): the latent-cache write, the absorbed decode, the expanded prefill and sparse
latent attention over listed entries (its kernel in mla_sparse.py, on this file's tile loop).

- Decode: q_latent = q_nope @ W_UK (a batched GEMM), then flash decoding over the paged latent cache as MQA:
  a program takes one sequence, a block of its heads (all of them up to 16, else blocks of 32) and one split
  of its context, so that each cache tile it loads serves every head of the block (keys: the whole entry;
  values: its latent part, the same tile); a second kernel merges the splits by their log-sum-exp; then
  @ W_UV. Lengths and block tables are read on the device only, and the split count depends on the host's
  longest context alone, so a decode step can be captured in a CUDA graph at max_model_len.
- Prefill (chunked over a cached prefix too): the context's latents, gathered from the cache through the
  block table, expand through kv_b_proj (one GEMM for every prefill of the step), then a varlen causal
  flash attention with qk head dim qk_nope + rope (the rope key shared by the heads, read once per token)
  and v head dim v_head_dim, bottom-right aligned.
- Sparse (mla_sparse.py): each query row over its own listed entries (-1 skipped), as the decode's MQA tile loop.
- FP8 caches (`kv_quant`, one per-tensor scale: engine/kernels/mla.py): the write quantizes as
  `stored_entries` does (a correctly rounded division, clamped, rounded to the cache's FP8 dtype); the
  decode and sparse kernels widen FP8 tiles exactly to the queries' dtype, fold the scale into the softmax
  scale (keys) and multiply each split's normalised output by it (values); the prefill dequantizes the
  gathered context (`read_entries`) before expanding it. The scale is read on the device (graph-safe).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.attention import KVCacheQuant, fp8_max
from engine.kernels.mla import MLAWeights, latent_scale, read_entries
from engine.kernels.triton import workspace
from engine.kernels.triton.activation_quant import round_to_e4m3
from engine.kernels.triton.common import dot, interpreting

LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
# Decode splits: at most MAX_SPLITS per sequence, none shorter than MIN_SPLIT_TOKENS (module-level so that tests
# and the benchmark can change them). Chosen by benchmarks/mla_decode_bench.py's sweep on an H100
# (docs/results/2026-11-24-mla/run2_bench.txt): short splits pay at batch 1, and cost nothing measurable at 64.
MAX_SPLITS = 128
MIN_SPLIT_TOKENS = 32
REDUCE_CHUNK = 32  # splits the reduction loads at once


def pad_dim(n: int) -> int:
    """A tile extent for n features: a power of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(n))


# ---- kernels ------------------------------------------------------------------------------------------

@triton.jit
def _stored(x, scale_ptr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr, ROUND_E4M3: tl.constexpr):
    """Values as the cache stores them (before the cast to its dtype): as they are, or x / scale (correctly
    rounded, as torch divides) clamped to the FP8 range; ROUND_E4M3 (the interpreter, whose narrowing
    rounds otherwise) rounds onto the e4m3 grid first, so that the cast is exact."""
    if QUANT:
        x = tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr)), -FP8_MAX), FP8_MAX)
        if ROUND_E4M3:
            x = round_to_e4m3(x)
    return x


@triton.jit
def _latent_write_kernel(latent_ptr, pe_ptr, cache_ptr, slot_ptr, scale_ptr, s_latent, s_pe, s_block, s_entry,
                         PAGE_SIZE: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
                         L_PAD: tl.constexpr, R_PAD: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
                         ROUND_E4M3: tl.constexpr):
    """One token's entry [latent | k_pe] at its slot (a negative slot: a padding token, nothing stored)."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        row = cache_ptr + (slot // PAGE_SIZE) * s_block + (slot % PAGE_SIZE) * s_entry
        dl = tl.arange(0, L_PAD)
        x = tl.load(latent_ptr + token * s_latent + dl, mask=dl < L)
        x = _stored(x, scale_ptr, QUANT, FP8_MAX, ROUND_E4M3)
        tl.store(row + dl, x.to(cache_ptr.dtype.element_ty), mask=dl < L)
        dr = tl.arange(0, R_PAD)
        y = tl.load(pe_ptr + token * s_pe + dr, mask=dr < R)
        y = _stored(y, scale_ptr, QUANT, FP8_MAX, ROUND_E4M3)
        tl.store(row + L + dr, y.to(cache_ptr.dtype.element_ty), mask=dr < R)


@triton.jit
def latent_tile(acc, m, l, q_lat, q_pe, entry_ptrs, valid, dl, dr, scale_log2,
                 L: tl.constexpr, R: tl.constexpr, UPCAST: tl.constexpr):
    """One tile of entries (pointers [BLOCK_N, 1] to their first element, `valid` [BLOCK_N]) into the online
    softmax of a block of heads: scores q_lat k_lat + q_pe k_pe, values k_lat. m and the scores are in log2
    units; a row whose scores are all masked keeps m = -inf, l = 0 and acc = 0. FP8 entries widen exactly to
    the queries' dtype (their scale is the caller's: in scale_log2, and on the finished output)."""
    k_lat = tl.load(entry_ptrs + dl[None, :], mask=valid[:, None] & (dl[None, :] < L), other=0.0).to(q_lat.dtype)
    k_pe = tl.load(entry_ptrs + L + dr[None, :], mask=valid[:, None] & (dr[None, :] < R), other=0.0).to(q_lat.dtype)
    s = dot(q_lat, tl.trans(k_lat), UPCAST) + dot(q_pe, tl.trans(k_pe), UPCAST)
    s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m - m_safe)
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.to(q_lat.dtype), k_lat, UPCAST)
    return acc, m_new, l


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_kernel(q_lat_ptr, q_pe_ptr, cache_ptr, kv_scale_ptr, out_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr,
                   block_table_ptr, num_heads, min_tiles, num_splits, sql_b, sql_h, sqp_b, sqp_h, s_block, s_entry,
                   so_b, so_h, stride_bt, scale_log2,
                   L: tl.constexpr, R: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   SINGLE_SPLIT: tl.constexpr, QUANT: tl.constexpr, UPCAST: tl.constexpr):
    """Program (sequence, head block, split): its split of the context, each sequence spreading its own
    context over the splits (at least `min_tiles` tiles each; splits past its end return at once). QUANT:
    an FP8 cache whose scale (at kv_scale_ptr) scales the scores and the split's output."""
    seq = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, num_splits), min_tiles)
    first = split * tiles_per_split * BLOCK_N
    if first < seq_len:
        end = tl.minimum(seq_len, first + tiles_per_split * BLOCK_N)
        head_mask = heads < num_heads
        dl = tl.arange(0, L_PAD)
        dr = tl.arange(0, R_PAD)
        q_lat = tl.load(q_lat_ptr + seq * sql_b + heads[:, None] * sql_h + dl[None, :],
                        mask=head_mask[:, None] & (dl[None, :] < L), other=0.0)
        q_pe = tl.load(q_pe_ptr + seq * sqp_b + heads[:, None] * sqp_h + dr[None, :],
                       mask=head_mask[:, None] & (dr[None, :] < R), other=0.0).to(q_lat.dtype)
        if QUANT:
            scale_log2 = scale_log2 * tl.load(kv_scale_ptr)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, L_PAD], tl.float32)
        for start in range(first, end, BLOCK_N):
            tokens = start + tl.arange(0, BLOCK_N)
            valid = tokens < end
            pages = tl.load(block_table_ptr + seq * stride_bt + tokens // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
            entry_ptrs = cache_ptr + (pages * s_block + (tokens % PAGE_SIZE) * s_entry)[:, None]
            acc, m, l = latent_tile(acc, m, l, q_lat, q_pe, entry_ptrs, valid, dl, dr, scale_log2, L, R, UPCAST)
        out = acc / l[:, None]
        if QUANT:
            out = out * tl.load(kv_scale_ptr)
        mask = head_mask[:, None] & (dl[None, :] < L)
        if SINGLE_SPLIT:
            tl.store(out_ptr + seq * so_b + heads[:, None] * so_h + dl[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=mask)
        else:
            rows = (seq * num_heads + heads) * num_splits + split  # [B, H, splits] partials
            tl.store(part_out_ptr + rows[:, None] * L + dl[None, :], out, mask=mask)
            tl.store(part_lse_ptr + rows, m + tl.math.log2(l), mask=head_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(part_out_ptr, part_lse_ptr, out_ptr, seq_lens_ptr, num_heads, min_tiles, num_splits,
                          so_b, so_h, L: tl.constexpr, BLOCK_L: tl.constexpr, SPLITS_PAD: tl.constexpr,
                          SPLIT_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (sequence, head, block of latent dims): the splits that sequence used, weighted by their
    log-sum-exp, SPLIT_CHUNK splits per load (independent loads in flight, not one split after another)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dl = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, num_splits), min_tiles)
    used = tl.cdiv(num_tiles, tiles_per_split)
    base = (seq * num_heads + head) * num_splits
    splits = tl.arange(0, SPLITS_PAD)
    top = tl.max(tl.load(part_lse_ptr + base + splits, mask=splits < used, other=float("-inf")), axis=0)
    total = tl.zeros([SPLIT_CHUNK], tl.float32)
    acc = tl.zeros([BLOCK_L], tl.float32)
    for first in range(0, used, SPLIT_CHUNK):
        chunk = first + tl.arange(0, SPLIT_CHUNK)
        weights = tl.math.exp2(tl.load(part_lse_ptr + base + chunk, mask=chunk < used, other=float("-inf")) - top)
        part = tl.load(part_out_ptr + (base + chunk)[:, None] * L + dl[None, :],
                       mask=(chunk < used)[:, None] & (dl[None, :] < L), other=0.0)
        acc += tl.sum(weights[:, None] * part, axis=0)
        total += weights
    out = acc / tl.sum(total, axis=0)
    tl.store(out_ptr + seq * so_b + head * so_h + dl, out.to(out_ptr.dtype.element_ty), mask=dl < L)


@triton.jit(do_not_specialize=["first_seq"])
def _prefill_kernel(q_nope_ptr, q_pe_ptr, kv_ptr, k_pe_ptr, out_ptr, query_start_ptr, seq_lens_ptr, kv_start_ptr,
                    first_seq, sqn_t, sqn_h, sqp_t, sqp_h, skv_t, skv_h, skp_t, so_t, so_h, scale_log2,
                    N: tl.constexpr, R: tl.constexpr, V: tl.constexpr, N_PAD: tl.constexpr, R_PAD: tl.constexpr,
                    V_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    """Program (head, query block, prefill): causal attention of the block's queries (the chunk's last
    positions) over the sequence's expanded context rows kv_start.. (k_nope | v per head, k_pe shared)."""
    head = tl.program_id(0)
    m_start = tl.program_id(1) * BLOCK_M
    prefill = tl.program_id(2)
    seq = first_seq + prefill
    q_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - q_start
    if m_start < query_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        kv_start = tl.load(kv_start_ptr + prefill).to(tl.int64)
        context_len = seq_len - query_len
        rows = m_start + tl.arange(0, BLOCK_M)
        row_valid = rows < query_len
        q_rows = (q_start + rows).to(tl.int64)[:, None]
        dn = tl.arange(0, N_PAD)[None, :]
        dr = tl.arange(0, R_PAD)[None, :]
        dv = tl.arange(0, V_PAD)[None, :]
        q_nope = tl.load(q_nope_ptr + q_rows * sqn_t + head * sqn_h + dn, mask=row_valid[:, None] & (dn < N),
                         other=0.0)
        q_pe = tl.load(q_pe_ptr + q_rows * sqp_t + head * sqp_h + dr, mask=row_valid[:, None] & (dr < R),
                       other=0.0).to(q_nope.dtype)
        query_pos = context_len + rows
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, V_PAD], tl.float32)
        end = tl.minimum(seq_len, context_len + m_start + BLOCK_M)
        for start in range(0, end, BLOCK_N):
            tokens = start + tl.arange(0, BLOCK_N)
            valid = tokens < end
            kv_rows = (kv_start + tokens)[:, None]
            kv_row_ptrs = kv_ptr + kv_rows * skv_t + head * skv_h
            k_nope = tl.load(kv_row_ptrs + dn, mask=valid[:, None] & (dn < N), other=0.0).to(q_nope.dtype)
            k_pe = tl.load(k_pe_ptr + kv_rows * skp_t + dr, mask=valid[:, None] & (dr < R),
                           other=0.0).to(q_nope.dtype)
            s = dot(q_nope, tl.trans(k_nope), UPCAST) + dot(q_pe, tl.trans(k_pe), UPCAST)
            visible = (tokens[None, :] <= query_pos[:, None]) & valid[None, :]
            s = tl.where(visible, s * scale_log2, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows see no key
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m - m_safe)
            v = tl.load(kv_row_ptrs + N + dv, mask=valid[:, None] & (dv < V), other=0.0).to(q_nope.dtype)
            acc = acc * alpha[:, None] + dot(p.to(q_nope.dtype), v, UPCAST)
            l = l * alpha + tl.sum(p, axis=1)
            m = m_new
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + q_rows * so_t + head * so_h + dv, out.to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None] & (dv < V))


# ---- launchers ----------------------------------------------------------------------------------------

def upcast(x: torch.Tensor) -> bool:
    """Half-precision dots go through fp32 under the interpreter (see common.dot)."""
    return x.dtype != torch.float32 and interpreting()


def quant_args(kv_quant: KVCacheQuant | None, kv_cache: torch.Tensor) -> tuple[bool, torch.Tensor]:
    """(QUANT, the scale [1]) of a launch on `kv_cache`; without quantization the cache stands in for the
    scale pointer, which is then never read."""
    if kv_quant is None:
        return False, kv_cache
    assert kv_cache.element_size() == 1 and kv_cache.dtype.is_floating_point, \
        f"an FP8 latent cache, not {kv_cache.dtype}"
    scale = latent_scale(kv_quant)
    assert scale.dtype == torch.float32 and scale.device == kv_cache.device, (scale.dtype, scale.device)
    return True, scale


def write_latent_cache(kv_cache: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor,
                       kv_quant: KVCacheQuant | None = None) -> None:
    """kv_cache [num_blocks, block_size, L + R] at `slots` (one per token; negative: nothing) <- [latent | k_pe],
    quantized with `kv_quant`'s per-tensor scale into an FP8 cache (as engine.kernels.mla.stored_entries)."""
    num_tokens, kv_lora_rank = latent.shape
    rope_dim = k_pe.shape[-1]
    assert kv_cache.shape[-1] == kv_lora_rank + rope_dim and kv_cache.stride(-1) == 1, kv_cache.shape
    assert latent.stride(-1) == 1 and k_pe.stride(-1) == 1, "the feature dimension must be contiguous"
    if num_tokens == 0:
        return
    quant, kv_scale = quant_args(kv_quant, kv_cache)
    _latent_write_kernel[(num_tokens,)](
        latent, k_pe, kv_cache, slots, kv_scale, latent.stride(0), k_pe.stride(0), kv_cache.stride(0),
        kv_cache.stride(1), PAGE_SIZE=kv_cache.shape[1], L=kv_lora_rank, R=rope_dim,
        L_PAD=triton.next_power_of_2(kv_lora_rank), R_PAD=triton.next_power_of_2(rope_dim), QUANT=quant,
        FP8_MAX=fp8_max(kv_cache.dtype) if quant else 0.0,
        ROUND_E4M3=quant and interpreting() and kv_cache.dtype == torch.float8_e4m3fn)


def decode_tiles(num_heads: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps) of the decode kernel."""
    if dtype == torch.float32:  # FMA dots: small tiles, or they spill
        return 16, 16, 4
    if num_heads <= 16:
        return 16, 32, 4
    return 32, 32, 8


def decode_splits(num_decodes: int, head_blocks: int, max_seq_len: int, block_n: int,
                  device: torch.device) -> tuple[int, int]:
    """(num_splits, min_tiles_per_split): enough programs to fill the GPU twice over at the longest context,
    no split shorter than MIN_SPLIT_TOKENS. Only host-side maxima go in (max_model_len under a CUDA graph)."""
    num_tiles = triton.cdiv(max(max_seq_len, 1), block_n)
    wanted = triton.cdiv(2 * workspace.num_sms(device), num_decodes * head_blocks)
    by_length = triton.cdiv(max_seq_len, MIN_SPLIT_TOKENS)
    splits = max(1, min(wanted, by_length, MAX_SPLITS, num_tiles))
    min_tiles = triton.cdiv(MIN_SPLIT_TOKENS, block_n)
    tiles_per_split = max(triton.cdiv(num_tiles, splits), min_tiles)
    return triton.cdiv(num_tiles, tiles_per_split), min_tiles


def decode_latent(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor,
                  block_table: torch.Tensor, max_seq_len: int, scale: float, out: torch.Tensor,
                  tiles: tuple[int, int, int, int] | None = None, kv_quant: KVCacheQuant | None = None) -> None:
    """out [B, H, L] (any strides, last dim contiguous) <- MQA of q_latent [B, H, L] and q_pe [B, H, R] over each
    sequence's first seq_lens[b] cache entries, read through block_table [B, max_blocks] (device tensors;
    `max_seq_len` only sizes the split count and may exceed every real length). `tiles`: (BLOCK_H, BLOCK_N,
    num_warps, num_stages) in place of the default (the benchmark's sweep). `kv_quant`: an FP8 cache."""
    num_seqs, num_heads, kv_lora_rank = q_latent.shape
    rope_dim = q_pe.shape[-1]
    assert kv_cache.shape[-1] == kv_lora_rank + rope_dim and kv_cache.stride(-1) == 1, kv_cache.shape
    assert q_latent.stride(-1) == q_pe.stride(-1) == out.stride(-1) == 1
    num_stages = 2
    if tiles is None:
        block_h, block_n, num_warps = decode_tiles(num_heads, q_latent.dtype)
    else:
        block_h, block_n, num_warps, num_stages = tiles
    head_blocks = triton.cdiv(num_heads, block_h)
    num_splits, min_tiles = decode_splits(num_seqs, head_blocks, max_seq_len, block_n, q_latent.device)
    single = num_splits == 1
    if single:
        part_out = part_lse = out  # unused
    else:
        part_out = torch.empty(num_seqs, num_heads, num_splits, kv_lora_rank, dtype=torch.float32,
                               device=q_latent.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q_latent.device)
    l_pad, r_pad = pad_dim(kv_lora_rank), pad_dim(rope_dim)
    quant, kv_scale = quant_args(kv_quant, kv_cache)
    _decode_kernel[(num_seqs, head_blocks, num_splits)](
        q_latent, q_pe, kv_cache, kv_scale, out, part_out, part_lse, seq_lens, block_table, num_heads, min_tiles,
        num_splits,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), kv_cache.stride(0),
        kv_cache.stride(1), out.stride(0), out.stride(1), block_table.stride(0), scale * LOG2E,
        L=kv_lora_rank, R=rope_dim, L_PAD=l_pad, R_PAD=r_pad, BLOCK_H=block_h, BLOCK_N=block_n,
        PAGE_SIZE=kv_cache.shape[1], SINGLE_SPLIT=single, QUANT=quant, UPCAST=upcast(q_latent), num_warps=num_warps,
        num_stages=num_stages)
    if not single:
        # two tile sizes in all (one per power of two was compiled on first use, mid-run)
        splits_pad = REDUCE_CHUNK if num_splits <= REDUCE_CHUNK else triton.next_power_of_2(MAX_SPLITS)
        block_l = min(128, triton.next_power_of_2(kv_lora_rank))
        _decode_reduce_kernel[(num_seqs, num_heads, triton.cdiv(kv_lora_rank, block_l))](
            part_out, part_lse, out, seq_lens, num_heads, min_tiles, num_splits, out.stride(0), out.stride(1),
            L=kv_lora_rank, BLOCK_L=block_l, SPLITS_PAD=splits_pad, SPLIT_CHUNK=min(splits_pad, REDUCE_CHUNK),
            BLOCK_N=block_n, num_warps=4)


def decode_absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, max_seq_len: int, weights: MLAWeights, scale: float,
                    tiles: tuple[int, int, int, int] | None = None,
                    kv_quant: KVCacheQuant | None = None) -> torch.Tensor:
    """One query token per sequence: q_nope [B, H, N] @ W_UK into latent space, MQA over the latent cache
    (decode_latent), @ W_UV -> [B, H, V]. Graph-safe: no host reads of device tensors."""
    num_seqs, num_heads, _ = q_nope.shape
    kv_lora_rank = weights.w_uk.shape[-1]
    q_latent = torch.bmm(q_nope.transpose(0, 1), weights.w_uk)  # [H, B, L]
    out_latent = q_nope.new_empty(num_heads, num_seqs, kv_lora_rank)
    decode_latent(q_latent.transpose(0, 1), q_pe, kv_cache, seq_lens, block_table, max_seq_len, scale,
                  out_latent.transpose(0, 1), tiles, kv_quant)
    return torch.bmm(out_latent, weights.w_uv.transpose(1, 2)).transpose(0, 1)  # [B, H, V]


def _context_slots(metadata, first: int, seq_lens: list[int], block_size: int, device) -> torch.Tensor:
    """Cache slots of positions 0..seq_len-1 of sequences first.., concatenated (int64, on the device)."""
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    starts = torch.cumsum(lens, 0) - lens
    seq = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), lens)
    positions = torch.arange(int(sum(seq_lens)), device=device) - starts[seq]
    pages = metadata.block_table[first + seq, positions // block_size].long()
    return pages * block_size + positions % block_size


def _own_entries_for_fresh_prefills(entries: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, metadata,
                                    first: int, query_lens: list[int], seq_lens: list[int]) -> None:
    """In the gathered contexts `entries` (the prefills' contexts one after another), replace those of prefills
    with no cached prefix by their own entries as computed (the cache holds them rounded to FP8)."""
    context_begin = 0
    for index, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        if query_len == seq_len:
            begin = metadata.query_start_loc_cpu[first + index]
            rows = slice(context_begin, context_begin + seq_len)
            kv_lora_rank = latent.shape[-1]
            entries[rows, :kv_lora_rank] = latent[begin:begin + seq_len]
            entries[rows, kv_lora_rank:] = k_pe[begin:begin + seq_len]
        context_begin += seq_len


def prefill_expanded(q_nope, q_pe, latent, k_pe, kv_cache, metadata, weights: MLAWeights, scale: float,
                     block_size: int, out: torch.Tensor, kv_quant: KVCacheQuant | None = None) -> None:
    """out rows of the metadata's prefills <- causal attention over their contexts expanded by kv_b_proj: the
    chunk's own entries where no prefill has a cached prefix, else every context entry gathered from the
    cache (written already; dequantized where it is FP8, except for the prefills with no cached prefix, which
    attend over their own entries as computed, as the reference does)."""
    first = metadata.num_decodes
    num_prefills = metadata.num_seqs - first
    token_begin = metadata.query_start_loc_cpu[first]
    query_lens = [metadata.query_start_loc_cpu[s + 1] - metadata.query_start_loc_cpu[s]
                  for s in range(first, metadata.num_seqs)]
    seq_lens = list(metadata.seq_lens_cpu[first:metadata.num_seqs])
    num_heads, nope = q_nope.shape[1], q_nope.shape[2]
    rope_dim, v_dim, kv_lora_rank = q_pe.shape[-1], weights.v_head_dim, latent.shape[-1]
    if kv_cache is None or seq_lens == query_lens:
        context_latent, context_pe = latent[token_begin:], k_pe[token_begin:]
    else:
        slots = _context_slots(metadata, first, seq_lens, block_size, q_nope.device)
        entries = read_entries(kv_cache.view(-1, kv_cache.shape[-1])[slots], kv_quant, q_nope.dtype)
        if kv_quant is not None:
            _own_entries_for_fresh_prefills(entries, latent, k_pe, metadata, first, query_lens, seq_lens)
        context_latent, context_pe = entries[:, :kv_lora_rank], entries[:, kv_lora_rank:]
    kv = weights.kv_b(context_latent).view(-1, num_heads, nope + v_dim)
    kv_starts = [0]
    for length in seq_lens[:-1]:
        kv_starts.append(kv_starts[-1] + length)
    kv_starts = torch.tensor(kv_starts, dtype=torch.int32).to(q_nope.device, non_blocking=True)
    assert q_nope.stride(-1) == q_pe.stride(-1) == kv.stride(-1) == context_pe.stride(-1) == out.stride(-1) == 1
    if q_nope.dtype == torch.float32:
        block_m, block_n, num_warps = 32, 16, 4
    else:
        block_m, block_n, num_warps = 64, 64 if nope + rope_dim <= 128 else 32, 8 if nope + v_dim > 256 else 4
    grid = (num_heads, triton.cdiv(max(query_lens), block_m), num_prefills)
    _prefill_kernel[grid](
        q_nope, q_pe, kv, context_pe, out, metadata.query_start_loc, metadata.seq_lens, kv_starts, first,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0), kv.stride(1),
        context_pe.stride(0), out.stride(0), out.stride(1), scale * LOG2E,
        N=nope, R=rope_dim, V=v_dim, N_PAD=pad_dim(nope), R_PAD=pad_dim(rope_dim), V_PAD=pad_dim(v_dim),
        BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=upcast(q_nope), num_warps=num_warps, num_stages=2)


def _decode_max_len(metadata, num_decodes: int) -> int:
    return max(metadata.seq_lens_cpu[:num_decodes])


def mla_attention(q_nope, q_pe, latent, k_pe, kv_cache, metadata, weights: MLAWeights, scale: float,
                  block_size: int, kv_quant: KVCacheQuant | None = None) -> torch.Tensor:
    """The `mla_attention` op (engine/kernels/mla.py): cache write, absorbed decode of the leading one-token
    sequences, expanded prefill of the rest. A decode-only step reads no device tensor on the host."""
    num_tokens, num_heads, _ = q_nope.shape
    if kv_cache is not None:
        assert kv_cache.shape[1] == block_size, (kv_cache.shape, block_size)
        write_latent_cache(kv_cache, latent, k_pe, metadata.slot_mapping, kv_quant)
    out = q_nope.new_empty(num_tokens, num_heads, weights.v_head_dim)
    num_decodes = metadata.num_decodes
    if num_decodes:
        assert kv_cache is not None, "decodes need a latent cache"
        out[:num_decodes] = decode_absorbed(
            q_nope[:num_decodes], q_pe[:num_decodes], kv_cache, metadata.seq_lens[:num_decodes],
            metadata.block_table[:num_decodes], _decode_max_len(metadata, num_decodes), weights, scale,
            kv_quant=kv_quant)
    if metadata.num_seqs > num_decodes:
        prefill_expanded(q_nope, q_pe, latent, k_pe, kv_cache, metadata, weights, scale, block_size, out, kv_quant)
    return out


mla_attention.cuda_graph_safe = True  # decode-only steps: device-side lengths and tables only
