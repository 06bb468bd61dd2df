"""Triton device function for int4_group weights (engine/kernels/quant.py: uint8 [N, K/2], two codes q + 8 per
byte with the even k in the low nibble, one scale per row and group of g columns), shared by the quantized GEMM
(quant.py) and the quantized experts (moe_quant.py).

A K tile is taken one group at a time (or one part of a group, where the tile is narrower): the even columns
multiply the low nibbles and the odd columns the high ones, so the packed bytes are used where they lie, with no
interleaving of unpacked values in registers. The codes enter the dot as their integer values q, exact in the
activations' dtype, and the group's product is scaled once, in float32, by the group's scales: the result is
the product with the dequantized weight to float32 rounding. Groups are powers of two of at least 32 columns
(16 per half: the least K of a tensor-core dot); `check_group` says so at preparation.
"""
from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.triton.common import dot

MIN_GROUP = 32


def check_group(group: int) -> None:
    if group < MIN_GROUP or group & (group - 1):
        raise ValueError(f"the Triton int4 kernels take groups of a power of two of at least {MIN_GROUP} columns, "
                         f"not {group}")


@triton.jit
def accumulate_int4(acc, a_rows, row_mask, w_cols, s_cols, col_mask, k, K, GROUP: tl.constexpr,
                    BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a[:, k:k+BLOCK_K] @ W[k:k+BLOCK_K, cols] for one K tile (k a multiple of BLOCK_K, K of GROUP).
    a_rows: [BM, 1] pointers to each activation row; row_mask [BM]; w_cols: [1, BN] pointers to each output
    feature's packed row; s_cols: [1, BN] to its scales (any float dtype); col_mask [BN]."""
    SUB: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K  # columns under one scale
    half = tl.arange(0, SUB // 2)
    for step in tl.static_range(BLOCK_K // SUB):
        start = k + step * SUB
        even = start + 2 * half
        in_k = even < K
        a_mask = row_mask[:, None] & in_k[None, :]
        a_even = tl.load(a_rows + even[None, :], mask=a_mask, other=0.0)
        a_odd = tl.load(a_rows + even[None, :] + 1, mask=a_mask, other=0.0)
        codes = tl.load(w_cols + (start // 2 + half)[:, None], mask=in_k[:, None] & col_mask[None, :], other=0x88)
        low = ((codes & 15).to(tl.float32) - 8.0).to(a_even.dtype)  # q, exact in any float dtype
        high = ((codes >> 4).to(tl.float32) - 8.0).to(a_even.dtype)
        # past K (the last tile's sub-tiles) the product is zero: any of the row's scales will do
        scale = tl.load(s_cols + tl.minimum(start, K - 1) // GROUP, mask=col_mask[None, :], other=0.0)
        acc = acc + (dot(a_even, low, UPCAST) + dot(a_odd, high, UPCAST)) * scale.to(tl.float32)
    return acc
