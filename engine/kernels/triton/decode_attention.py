"""Paged decode attention in Triton (one query token per sequence): split-K over the context with a separate
reduction, and for decode-only steps with a rotary embedding one fused launch that also rotates the query,
writes the new key and value into the cache and reduces the splits.

KV layout per layer: [2, num_blocks, block_size, num_kv_heads, head_size], as in attention.py; an FP8 cache
is read (and by the fused kernel written) through common.py."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.attention import PLAIN_ATTENTION, AttentionOptions, KVCacheQuant
from engine.kernels.triton import pdl, workspace
from engine.kernels.triton.common import (LOG2E, key_scores, kv_quant_args, paged_rows, rope_coefficients, rotated,
                                          soft_capped, store_kv_rows, weighted_values, with_sinks)

# Decode-only steps with a rotary embedding run as one kernel; off, they run the rotary cache write, the
# split-K decode and its reduction as three (benchmarks/kernel_variants.py times both in one run).
FUSED_DECODE = True
_MAX_SPLITS = 64
# Arguments that change from step to step (the split count, the block table's width, the index of the first
# prefill) are not specialized by Triton (`do_not_specialize`, here and in attention.py): each divisibility
# class would be compiled on its first use, seconds each, in the middle of a served step (a GPU run's step
# loop spent 28 % of its time compiling such variants: docs/BENCHMARKS.md).


@triton.jit
def _attend_tiles(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, seq, stride_bt, seq_len,
                  num_kv_heads, kv_head, tile_begin, tile_end, dims, scale_log2, lo, softcap_log2,
                  G_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, KV_QUANT: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr):
    """Online softmax (exp2) of a GQA group's queries over the context tiles [tile_begin, tile_end):
    the unnormalised output (dequantized), the running max and the running sum. Tokens before `lo` (a
    window's first key) are neither read nor counted; `SOFTCAP`: scores pass through softcap_log2 *
    tanh(s / softcap_log2) (the cap in the log2 domain)."""
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    if KV_QUANT == "tensor":  # the key scale joins the softmax scale, the value scale multiplies the sum
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
    for tile in range(tile_begin, tile_end):
        tokens = tile * BLOCK_N + offs
        valid = (tokens < seq_len) & (tokens >= lo)
        rows = paged_rows(block_table_ptr, seq, stride_bt, tokens, valid, num_kv_heads, kv_head, PAGE_SIZE)
        offsets = (rows * HEAD_SIZE)[:, None]
        kv_mask = valid[:, None] & (dims < HEAD_SIZE)
        k = tl.load(k_cache_ptr + offsets + dims, mask=kv_mask, other=0.0)
        s = key_scores(q, k, k_scale_ptr, rows, valid, scale_log2, KV_QUANT, UPCAST)
        if SOFTCAP:
            s = soft_capped(s, softcap_log2)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m - m_new)
        v = tl.load(v_cache_ptr + offsets + dims, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + weighted_values(p, v, v_scale_ptr, rows, valid, q.dtype, KV_QUANT, UPCAST)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    if KV_QUANT == "tensor":
        acc = acc * tl.load(v_scale_ptr)
    return acc, m, l


@triton.jit
def _store_normalised(out_rows, acc, m, l, sinks_ptr, first_head, mask, GROUP: tl.constexpr, G_PAD: tl.constexpr,
                      SINKS: tl.constexpr):
    """The output of a GQA group whose whole context one program attended: acc / l, the heads' sinks in l."""
    if SINKS:
        rows = tl.arange(0, G_PAD)
        acc, l = with_sinks(acc, m, l, sinks_ptr, first_head + rows, rows < GROUP)
    tl.store(out_rows, (acc / l[:, None]).to(out_rows.dtype.element_ty), mask=mask)


@triton.jit
def _visible_tiles(seq_len, window, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr):
    """(first visible token, first tile, number of tiles) of the query at position seq_len - 1: the whole
    context, or with a window only the tiles holding its `window` most recent keys."""
    if WINDOWED:
        lo = tl.maximum(seq_len - window, 0)
    else:
        lo = seq_len * 0
    first_tile = lo // BLOCK_N
    return lo, first_tile, tl.cdiv(seq_len, BLOCK_N) - first_tile


@triton.jit
def _tiles_per_split(num_tiles, num_splits, min_tiles_per_split):
    """Each sequence's own split length: its context spread over the planned splits, but no split shorter
    than the minimum. The plan's split count comes from the longest context the launch may see (for a CUDA
    graph, the model's whole length); a shorter context gets shorter splits, so its few tiles still go to
    many programs, and a graph replay groups the partial sums as an eager step of that length would."""
    return tl.maximum(tl.cdiv(num_tiles, num_splits), min_tiles_per_split)


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
                   seq_lens_ptr, block_table_ptr, sinks_ptr, num_kv_heads, min_tiles_per_split, num_splits,
                   sq_t, sq_h, so_t, so_h, stride_bt, scale_log2, window, softcap_log2,
                   GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr,
                   BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
                   KV_QUANT: tl.constexpr, UPCAST: tl.constexpr, WINDOWED: tl.constexpr, SINKS: tl.constexpr,
                   SOFTCAP: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        pdl.enter()
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo, first_tile, num_tiles = _visible_tiles(seq_len, window, BLOCK_N, WINDOWED)
    tiles_per_split = _tiles_per_split(num_tiles, num_splits, min_tiles_per_split)
    tile_begin = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, first_tile + num_tiles)
    if tile_begin >= tile_end:  # this split lies past the end of a shorter context
        return
    # All query heads that share this KV head are one [G_PAD, D] tile: K and V are read once for them.
    g = tl.arange(0, G_PAD)[:, None]
    dims = tl.arange(0, D_PAD)[None, :]
    heads = kv_head * GROUP + g
    q_mask = (g < GROUP) & (dims < HEAD_SIZE)
    q = tl.load(q_ptr + seq * sq_t + heads * sq_h + dims, mask=q_mask, other=0.0)
    acc, m, l = _attend_tiles(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, seq, stride_bt,
                              seq_len, num_kv_heads, kv_head, tile_begin, tile_end, dims, scale_log2, lo,
                              softcap_log2, G_PAD, HEAD_SIZE, D_PAD, BLOCK_N, PAGE_SIZE, KV_QUANT, UPCAST, SOFTCAP)
    if SINGLE_SPLIT:
        _store_normalised(out_ptr + seq * so_t + heads * so_h + dims, acc, m, l, sinks_ptr, kv_head * GROUP, q_mask,
                          GROUP, G_PAD, SINKS)
    else:
        # Partials are [seqs, heads, splits, D] and [seqs, heads, splits, 2] (max, sum), fp32.
        part = (seq * num_kv_heads * GROUP + heads) * num_splits + split
        tl.store(part_acc_ptr + part * HEAD_SIZE + dims, acc, mask=q_mask)
        tl.store(part_ml_ptr + part * 2, m[:, None], mask=g < GROUP)
        tl.store(part_ml_ptr + part * 2 + 1, l[:, None], mask=g < GROUP)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(part_acc_ptr, part_ml_ptr, out_ptr, seq_lens_ptr, sinks_ptr, num_heads, min_tiles_per_split,
                          num_splits, so_t, so_h, window,
                          HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
                          BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr, SINKS: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        pdl.enter()
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = _visible_tiles(seq_len, window, BLOCK_N, WINDOWED)[2]
    used = tl.cdiv(num_tiles, _tiles_per_split(num_tiles, num_splits, min_tiles_per_split))  # splits with work
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, D_PAD)[None, :]
    part = (seq * num_heads + head) * num_splits + splits
    live = splits < used
    m = tl.load(part_ml_ptr + part * 2, mask=live, other=float("-inf"))
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=live, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_SIZE + dims, mask=live[:, None] & (dims < HEAD_SIZE),
                  other=0.0)
    m_max = tl.max(m, axis=0)
    if SINKS:  # the head's sink joins the denominator once, here, not once per split
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        m_max = tl.maximum(m_max, sink)
    weight = tl.math.exp2(m - m_max)
    denominator = tl.sum(l * weight, axis=0)
    if SINKS:
        denominator += tl.math.exp2(sink - m_max)
    out = tl.sum(acc * weight[:, None], axis=0) / denominator
    dims = tl.arange(0, D_PAD)
    tl.store(out_ptr + seq * so_t + head * so_h + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_SIZE)


@triton.jit
def _combine_splits(part_acc_ptr, part_ml_ptr, first_head, used, num_splits, sinks_ptr, sink_head,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr,
                    SPLIT_CHUNK: tl.constexpr, SINKS: tl.constexpr):
    """The normalised output [GROUP_PAD, D_PAD] of a GQA group from its `used` splits' partials, combined
    online over chunks of splits (a whole [group, splits, D] tile would not fit in registers). The partials
    were written by other programs: read from L2 (.cg), never from this multiprocessor's L1, which is not
    coherent with their stores."""
    # Padding rows repeat the group's last head: no out-of-range reads, no -inf - -inf.
    g = tl.minimum(tl.arange(0, GROUP_PAD), GROUP - 1)[:, None, None]
    chunk = tl.arange(0, SPLIT_CHUNK)[None, :, None]
    dims = tl.arange(0, D_PAD)[None, None, :]
    m = tl.full([GROUP_PAD, 1], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD, 1], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for start in range(0, used, SPLIT_CHUNK):
        splits = start + chunk
        part = (first_head + g) * num_splits + splits
        live = splits < used
        m_split = tl.load(part_ml_ptr + part * 2, mask=live, other=float("-inf"), cache_modifier=".cg")
        l_split = tl.load(part_ml_ptr + part * 2 + 1, mask=live, other=0.0, cache_modifier=".cg")
        acc_split = tl.load(part_acc_ptr + part * HEAD_SIZE + dims, mask=live & (dims < HEAD_SIZE), other=0.0,
                            cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(m_split, axis=1))
        weight = tl.math.exp2(m_split - tl.expand_dims(m_new, 1))
        alpha = tl.math.exp2(m - m_new)
        acc = acc * alpha + tl.sum(acc_split * weight, axis=1)
        l = l * alpha + tl.sum(l_split * weight, axis=1)
        m = m_new
    if SINKS:  # counted once, after every split
        heads = sink_head + tl.minimum(tl.arange(0, GROUP_PAD), GROUP - 1)
        acc, l_sunk = with_sinks(acc, tl.reshape(m, [GROUP_PAD]), tl.reshape(l, [GROUP_PAD]), sinks_ptr, heads,
                                 heads >= 0)
        l = tl.reshape(l_sunk, [GROUP_PAD, 1])  # one return: the compiler also walks code after a returning branch
    return acc / l


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _fused_decode_kernel(pos_ptr, q_ptr, key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                         out_ptr, slot_ptr, table_ptr, seq_lens_ptr, block_table_ptr, part_acc_ptr, part_ml_ptr,
                         counter_ptr, sinks_ptr, num_kv_heads, min_tiles_per_split, num_splits,
                         sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, stride_bt, stride_table, scale_log2,
                         window, softcap_log2,
                         GROUP: tl.constexpr, G_PAD: tl.constexpr, GROUP_PAD: tl.constexpr,
                         HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr,
                         BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
                         SPLIT_CHUNK: tl.constexpr, KV_QUANT: tl.constexpr, UPCAST: tl.constexpr,
                         WINDOWED: tl.constexpr, SINKS: tl.constexpr, SOFTCAP: tl.constexpr,
                         USE_PDL: tl.constexpr):
    """One decode step of one layer: rotary embedding, KV-cache write, split-K attention and the reduction
    of the splits, for grid (sequences, KV heads, splits)."""
    if USE_PDL:
        pdl.enter()
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo, first_tile, num_tiles = _visible_tiles(seq_len, window, BLOCK_N, WINDOWED)
    tiles_per_split = _tiles_per_split(num_tiles, num_splits, min_tiles_per_split)
    tile_begin = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, first_tile + num_tiles)
    if tile_begin >= tile_end:  # this split lies past the end of a shorter context
        return
    g = tl.arange(0, G_PAD)[:, None]
    dims = tl.arange(0, D_PAD)[None, :]
    heads = kv_head * GROUP + g
    q_mask = (g < GROUP) & (dims < HEAD_SIZE)
    cos, sin, partner, rotating = rope_coefficients(table_ptr, tl.load(pos_ptr + seq).to(tl.int64), stride_table,
                                                    dims, q_ptr.dtype.element_ty, HALF, IS_NEOX)
    # Rounded to the activation dtype, as the unfused path stores the rotated query before attending.
    q = rotated(q_ptr + seq * sq_t + heads * sq_h, dims, partner, rotating, q_mask, cos, sin)
    q = q.to(q_ptr.dtype.element_ty)

    slot = tl.load(slot_ptr + seq).to(tl.int64)  # negative: a padding row, nothing to store
    if (tile_end == first_tile + num_tiles) & (slot >= 0):  # this split's last tile holds the new token
        row_mask = dims < HEAD_SIZE
        row = slot * num_kv_heads + kv_head + tl.zeros([1, 1], tl.int64)
        k = rotated(key_ptr + seq * sk_t + kv_head * sk_h, dims, partner, rotating, row_mask, cos, sin)
        store_kv_rows(k_cache_ptr, k_scale_ptr, row, dims, k.to(key_ptr.dtype.element_ty), row >= 0, HEAD_SIZE,
                      KV_QUANT)
        v = tl.load(value_ptr + seq * sv_t + kv_head * sv_h + dims, mask=row_mask)
        store_kv_rows(v_cache_ptr, v_scale_ptr, row, dims, v, row >= 0, HEAD_SIZE, KV_QUANT)
        # The last tile reads this row (and its scales) back through the cache, by other threads than those
        # that stored it: a CTA barrier makes the block's global stores visible to all its threads. Substituting
        # the registers instead would cost a select on every K and V tile of every program (which tile is last is
        # not known at compile time); the barrier costs one program per sequence and KV head a single bar.sync.
        tl.debug_barrier()

    acc, m, l = _attend_tiles(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, seq, stride_bt,
                              seq_len, num_kv_heads, kv_head, tile_begin, tile_end, dims, scale_log2, lo,
                              softcap_log2, G_PAD, HEAD_SIZE, D_PAD, BLOCK_N, PAGE_SIZE, KV_QUANT, UPCAST, SOFTCAP)
    out_rows = out_ptr + seq * so_t + heads * so_h + dims
    used = tl.cdiv(num_tiles, tiles_per_split)  # splits with work
    if SINGLE_SPLIT:
        _store_normalised(out_rows, acc, m, l, sinks_ptr, kv_head * GROUP, q_mask, GROUP, G_PAD, SINKS)
    elif used == 1:
        _store_normalised(out_rows, acc, m, l, sinks_ptr, kv_head * GROUP, q_mask, GROUP, G_PAD, SINKS)
    else:
        first_head = (seq * num_kv_heads + kv_head) * GROUP
        part = (first_head + g) * num_splits + split
        tl.store(part_acc_ptr + part * HEAD_SIZE + dims, acc, mask=q_mask)
        tl.store(part_ml_ptr + part * 2, m[:, None], mask=g < GROUP)
        tl.store(part_ml_ptr + part * 2 + 1, l[:, None], mask=g < GROUP)
        # The split that arrives last combines them all. Ordering: the barrier orders every thread's
        # partial stores before the single thread that issues the atomic; its release at GPU scope then
        # publishes them with the count, and the acquire of whichever program reads used - 1 makes them
        # visible to it (the result reaches its other threads through shared memory and a barrier; their
        # loads go to L2). The same counter serves every layer: the last split resets it, and the next
        # launch starts only after this one has finished (stream order, or pdl.enter's wait).
        tl.debug_barrier()
        counter = counter_ptr + seq * num_kv_heads + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == used - 1:
            out = _combine_splits(part_acc_ptr, part_ml_ptr, first_head, used, num_splits, sinks_ptr,
                                  kv_head * GROUP, GROUP, GROUP_PAD, HEAD_SIZE, D_PAD, SPLIT_CHUNK, SINKS)
            rows = tl.arange(0, GROUP_PAD)[:, None]
            tl.store(out_ptr + seq * so_t + (kv_head * GROUP + rows) * so_h + dims,
                     out.to(out_ptr.dtype.element_ty), mask=(rows < GROUP) & (dims < HEAD_SIZE))
            tl.store(counter, 0)


# ---- launchers ----------------------------------------------------------------------------------------

def option_args(options: AttentionOptions, like: torch.Tensor) -> dict:
    """The kernels' arguments for a layer's options: the sinks (any tensor when there are none), the window
    (0: none), the soft cap in the log2 domain (0: none), and the constexprs that compile each in."""
    return dict(sinks=options.sinks if options.sinks is not None else like,
                window=options.window or 0,
                softcap_log2=(options.softcap or 0.0) * LOG2E.value,
                flags=dict(WINDOWED=options.window is not None, SINKS=options.sinks is not None,
                           SOFTCAP=options.softcap is not None))


def decode_plan(metadata, num_kv_heads: int, block_n: int, window: int | None = None) -> tuple[int, int]:
    """(num_splits, min_tiles_per_split) for this step's decodes: enough programs to fill the GPU twice over
    at the longest context (a window's tiles where the layer has one), but no split shorter than
    `min_split_tokens`. Each sequence then spreads its own context over the splits on the device
    (`_tiles_per_split`)."""
    key = (num_kv_heads, block_n, window)
    plan = metadata._decode_plans.get(key)
    if plan is None:
        length = metadata.max_decode_seq_len
        if window is not None:  # at most the window plus the tile its first key starts in
            length = min(length, window + block_n)
        num_tiles = triton.cdiv(length, block_n)
        wanted = triton.cdiv(2 * metadata.num_sms, metadata.num_decodes * num_kv_heads)
        by_length = triton.cdiv(length, metadata.min_split_tokens)
        splits = max(1, min(wanted, by_length, _MAX_SPLITS, num_tiles))
        min_tiles = triton.cdiv(metadata.min_split_tokens, block_n)
        tiles_per_split = max(triton.cdiv(num_tiles, splits), min_tiles)
        plan = metadata._decode_plans[key] = (triton.cdiv(num_tiles, tiles_per_split), min_tiles)
    return plan


def splits_pad(num_splits: int) -> int:
    """The reduction's split tile: 8 up to 8 splits, else room for _MAX_SPLITS; two compiled variants in all
    (a size per power of two compiled up to seven while a server ran, each compile taking seconds)."""
    return 8 if num_splits <= 8 else triton.next_power_of_2(_MAX_SPLITS)


def _partials(num_decodes: int, num_heads: int, num_splits: int, head_size: int, device):
    """Each split's unnormalised output and its (max, sum), fp32."""
    return (torch.empty(num_decodes, num_heads, num_splits, head_size, dtype=torch.float32, device=device),
            torch.empty(num_decodes, num_heads, num_splits, 2, dtype=torch.float32, device=device))


def decode(query, k_cache, v_cache, out, metadata, num_kv_heads, group, head_size, d_pad, block_n, num_warps,
           scale_log2, block_size, upcast, kv_quant: KVCacheQuant | None = None, num_stages=2,
           options: AttentionOptions = PLAIN_ATTENTION):
    """Split-K decode of the cached context (this step's keys and values already written; a window's
    tiles only), then the reduction of the splits as a second kernel (which adds the sinks)."""
    num_decodes = metadata.num_decodes
    num_heads = num_kv_heads * group
    num_splits, min_tiles = decode_plan(metadata, num_kv_heads, block_n, options.window)
    extra = option_args(options, out)
    single = num_splits == 1
    if single:
        part_acc = part_ml = out  # unused
    else:
        part_acc, part_ml = _partials(num_decodes, num_heads, num_splits, head_size, query.device)
    quant, k_scale, v_scale = kv_quant_args(kv_quant, k_cache)
    _decode_kernel[(num_decodes, num_kv_heads, num_splits)](
        query, k_cache, v_cache, k_scale, v_scale, out, part_acc, part_ml, metadata.seq_lens, metadata.block_table,
        extra["sinks"], num_kv_heads, min_tiles, num_splits, query.stride(0), query.stride(1), out.stride(0),
        out.stride(1), metadata.block_table.stride(0), scale_log2, extra["window"], extra["softcap_log2"],
        GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), HEAD_SIZE=head_size, D_PAD=d_pad,
        BLOCK_N=block_n, PAGE_SIZE=block_size, SINGLE_SPLIT=single, KV_QUANT=quant, UPCAST=upcast,
        **extra["flags"], num_warps=num_warps, num_stages=num_stages, **pdl.launch_options(query))
    if not single:
        _decode_reduce_kernel[(num_decodes, num_heads)](
            part_acc, part_ml, out, metadata.seq_lens, extra["sinks"], num_heads, min_tiles, num_splits,
            out.stride(0), out.stride(1), extra["window"],
            HEAD_SIZE=head_size, D_PAD=d_pad, SPLITS_PAD=splits_pad(num_splits), BLOCK_N=block_n,
            WINDOWED=extra["flags"]["WINDOWED"], SINKS=extra["flags"]["SINKS"],
            num_warps=4, **pdl.launch_options(out))


def fused_decode(query, key, value, k_cache, v_cache, out, metadata, rope, group, head_size, d_pad, block_n,
                 num_warps, scale_log2, block_size, upcast, kv_quant: KVCacheQuant | None = None, num_stages=2,
                 options: AttentionOptions = PLAIN_ATTENTION):
    """A decode-only step in one launch: queries rotated in registers (the query tensor is left as it is),
    rotated keys and values written to the cache at `slot_mapping`, split-K attention and its reduction."""
    positions, table, is_neox = rope
    rotary_dim = table.shape[-1]
    assert rotary_dim % 2 == 0 and rotary_dim <= head_size, (rotary_dim, head_size)
    table = table.contiguous()
    num_decodes, num_kv_heads = metadata.num_decodes, key.shape[1]
    num_splits, min_tiles = decode_plan(metadata, num_kv_heads, block_n, options.window)
    extra = option_args(options, out)
    single = num_splits == 1
    group_pad = triton.next_power_of_2(group)
    if single:
        part_acc = part_ml = counters = out  # unused
    else:
        part_acc, part_ml = _partials(num_decodes, num_kv_heads * group, num_splits, head_size, query.device)
        counters = workspace.arrival_counters(query.device, num_decodes * num_kv_heads)
    # The last split combines chunks of splits at about the registers of one decode tile.
    split_chunk = max(1, min(triton.next_power_of_2(num_splits), 4096 // (group_pad * d_pad)))
    quant, k_scale, v_scale = kv_quant_args(kv_quant, k_cache)
    _fused_decode_kernel[(num_decodes, num_kv_heads, num_splits)](
        positions.contiguous(), query, key, value, k_cache, v_cache, k_scale, v_scale, out, metadata.slot_mapping,
        table, metadata.seq_lens, metadata.block_table, part_acc, part_ml, counters, extra["sinks"],
        num_kv_heads, min_tiles, num_splits, query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), out.stride(0), out.stride(1), metadata.block_table.stride(0),
        table.stride(0), scale_log2, extra["window"], extra["softcap_log2"],
        GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), GROUP_PAD=group_pad, HEAD_SIZE=head_size,
        D_PAD=d_pad, HALF=rotary_dim // 2, IS_NEOX=is_neox, BLOCK_N=block_n, PAGE_SIZE=block_size,
        SINGLE_SPLIT=single, SPLIT_CHUNK=split_chunk, KV_QUANT=quant, UPCAST=upcast, **extra["flags"],
        num_warps=num_warps,
        num_stages=num_stages, **pdl.launch_options(query))
