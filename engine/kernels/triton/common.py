"""Triton device functions that several kernel files share: the matrix product every kernel uses, the
rotary-embedding arithmetic of the rotary kernel and of the kernels it is fused into, and the paged KV-cache
addressing of the prefill and decode attention kernels."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:  # only under the interpreter, whose dot multiplies half-precision bit patterns as integers
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif a.dtype == tl.float32:  # full precision, not TF32: fp32 runs are the accuracy reference
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def rope_coefficients(table_ptr, position, stride_table, dims, dtype, HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """Per feature d of a head: out[d] = x[d] * cos[d] + x[partner[d]] * sin[d] (sin carries the sign);
    features past the rotary dimensions keep cos 1, sin 0. The table is rounded to the activation dtype
    first, as the torch reference does."""
    if IS_NEOX:
        freq = tl.where(dims < HALF, dims, dims - HALF)
        partner = tl.where(dims < HALF, dims + HALF, dims - HALF)
        sign = tl.where(dims < HALF, -1.0, 1.0)
    else:
        freq = dims // 2
        partner = dims + 1 - 2 * (dims % 2)
        sign = tl.where(dims % 2 == 0, -1.0, 1.0)
    rotating = dims < 2 * HALF
    row = table_ptr + position * stride_table
    cos = tl.load(row + freq, mask=rotating, other=1.0).to(dtype).to(tl.float32)
    sin = tl.load(row + HALF + freq, mask=rotating, other=0.0).to(dtype).to(tl.float32) * sign
    return cos, sin, partner, rotating


@triton.jit
def rotated(ptr, dims, partner, rotating, mask, cos, sin):
    """The rotated features (fp32) of the head rows at `ptr`, where `mask`. The explicit fma keeps the
    compiler from contracting the sum either way round: every kernel that rotates gets the same bits."""
    x = tl.load(ptr + dims, mask=mask, other=0.0)
    x_partner = tl.load(ptr + partner, mask=mask & rotating, other=0.0)
    return tl.fma(x.to(tl.float32), cos, x_partner.to(tl.float32) * sin)


@triton.jit
def paged_rows(block_table_ptr, seq, stride_bt, tokens, valid, num_kv_heads, kv_head,
               HEAD_SIZE: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Element offsets (int64) of each token's head vector in a [blocks, page, heads, dim] cache."""
    pages = tl.load(block_table_ptr + seq * stride_bt + tokens // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    slots = pages * PAGE_SIZE + tokens % PAGE_SIZE
    return (slots * num_kv_heads + kv_head) * HEAD_SIZE
