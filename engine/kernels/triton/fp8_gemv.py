"""The FP8 weight-streaming GEMV of a single row (batch-1 decode) on the CUDA cores (quant.gemm_quantized's
path for FP8 weights at one row).

Why not the tensor cores at one row: an MMA pads the row to a 16-row tile, and that bf16 activation tile takes
as much shared memory per pipeline stage as the FP8 weight tile, halving the weight bytes in flight. Here the
activation slice is a broadcast vector in registers and only weights stream (straight into registers: Triton
pipelines through shared memory only loads that feed a dot); each program multiplies its [BLOCK_N, BLOCK_K] weight tile elementwise with it into a register accumulator and reduces
along K once, at the end. Block scales fold into the activation slice (one scale per 128 columns of a scale-
block row), so they cost nothing per weight.

Measured on an H100 at one row (`quant_gemm_bench`, Llama-3.1-8B projections, 2026-11-24), against the skinny
MMA kernel: fp8_block qkv 12.7 us (14.8), o 8.1 (9.9), gate_up 45-51 (53.7), down 24.0 (26.5); fp8_tensor
o 7.7 (9.6), gate_up 45.1 (48.1), qkv and down even. 2.0-2.6 TB/s: still short of bf16's MMA GEMV (2.7-2.9),
whose loads Triton pipelines through shared memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton import gemv, pdl

# Weight formats, as quant.METHOD_CODES numbers them.
_TENSOR = tl.constexpr(0)
_CHANNEL = tl.constexpr(1)
_BLOCK = tl.constexpr(2)


@triton.jit
def e4m3_to_f32_tiny(w):
    """e4m3 -> float32 times 2^-120, exact (subnormals become float32 subnormals): quant.e4m3_to_bf16's integer
    steps without its multiply, each 16-bit lane shifted into a 32-bit float (two integer operations a value,
    2.4 % faster than converting through bf16 here)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 lo, hi;
        prmt.b32 lo, $4, 0, 0x9180;
        prmt.b32 hi, $4, 0, 0xB3A2;
        shl.b32 $0, lo, 20;
        shl.b32 $1, lo, 4;
        shl.b32 $2, hi, 20;
        shl.b32 $3, hi, 4;
        and.b32 $0, $0, 0x87F00000;
        and.b32 $1, $1, 0x87F00000;
        and.b32 $2, $2, 0x87F00000;
        and.b32 $3, $3, 0x87F00000;
        }""", "=r,=r,=r,=r,r", [w.to(tl.uint8, bitcast=True)], dtype=tl.float32, is_pure=True, pack=4)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, w_scale_ptr, b_ptr, y_ptr, N, K, stride_wn, stride_wsn,
                     METHOD: tl.constexpr, BLOCK_SN: tl.constexpr, BLOCK_SK: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FAST_FP8: tl.constexpr, USE_PDL: tl.constexpr,
                     PREFETCH_LINES: tl.constexpr):
    """y[N] = x[K] . w[N, K] (+ bias): BLOCK_N outputs a program. With block scales BLOCK_SN % BLOCK_N == 0
    (a program's rows lie in one scale-block row)."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + tl.where(col_mask, cols, 0).to(tl.int64)[:, None] * stride_wn
    if USE_PDL:
        if PREFETCH_LINES > 0:
            # Before waiting on the previous kernel: the start of this program's weight rows into L2 (no kernel
            # writes weights, so reading them early cannot race).
            starts = tl.arange(0, PREFETCH_LINES) * 128
            gemv._prefetch_l2(tl.where(col_mask[:, None] & (starts < K)[None, :], w_rows + starts[None, :], w_ptr))
        pdl.enter()
    scale_row = w_scale_ptr + (pid * BLOCK_N // BLOCK_SN).to(tl.int64) * stride_wsn
    # With FAST_FP8 the weights are 2^-120 times their value: the activations take 2^64 (no overflow below
    # 2^63) and the sums 2^56, powers of two, so the result keeps its bits.
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = k + ks < K
        x = tl.load(x_ptr + k + ks, mask=k_mask, other=0.0).to(tl.float32)
        if METHOD == _BLOCK:
            x = x * tl.load(scale_row + (k + ks) // BLOCK_SK, mask=k_mask, other=0.0)
        w = tl.load(w_rows + k + ks[None, :], mask=k_mask[None, :], other=0.0)
        if FAST_FP8:
            acc += e4m3_to_f32_tiny(w) * (x * 18446744073709551616.0)[None, :]
        else:
            acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if FAST_FP8:
        y = y * 72057594037927936.0
    if METHOD == _TENSOR:
        y = y * tl.load(w_scale_ptr)
    elif METHOD == _CHANNEL:
        y = y * tl.load(w_scale_ptr + cols, mask=col_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=col_mask)


# Output features a program, K tile, warps (the loads go straight to registers: Triton does not pipeline loads
# that feed no dot, so num_stages changes nothing). Measured on an H100 (60 tilings, Llama-3.1-8B projections,
# 2026-11-24): 8 x 1024 with 4 warps is the fastest over the four projections for both FP8 schemes, each shape's
# own best within 5 %; 16 rows a program lose 1-7 %, two K tiles per iteration 1-4 %, bf16 conversion 2.4 %.
GEMV_TILES = dict(BLOCK_N=8, BLOCK_K=1024, num_stages=3, num_warps=4)


def takes(method: str, block: tuple[int, int], rows: int, tiles: dict | None = None) -> bool:
    """Whether the one-row GEMV serves this product: FP8 weights, one row, and block scales whose rows hold
    whole programs."""
    if rows != 1 or method not in ("fp8_tensor", "fp8_channel", "fp8_block"):
        return False
    return method != "fp8_block" or block[0] % (tiles or GEMV_TILES)["BLOCK_N"] == 0


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, method_code: int, block: tuple[int, int],
             bias: torch.Tensor | None, out: torch.Tensor, fast_fp8: bool, tiles: dict | None = None) -> None:
    """out[1, N] = x[1, K] weight[N, K]^T, scaled as the method says (+ bias)."""
    n, k = weight.shape
    tiles = dict(tiles or GEMV_TILES)
    pdl_options = pdl.launch_options(out)
    lines = gemv.prefetch_lines(n, k, 1, None, gemv.device_prefetch_bytes_per_row(out.device))
    _fp8_gemv_kernel[(triton.cdiv(n, tiles["BLOCK_N"]),)](
        x, weight, scale, bias if bias is not None else out, out, n, k, weight.stride(0),
        scale.stride(0) if scale.dim() == 2 else 0, METHOD=method_code, BLOCK_SN=block[0], BLOCK_SK=block[1],
        HAS_BIAS=bias is not None, FAST_FP8=fast_fp8, PREFETCH_LINES=lines, **tiles, **pdl_options)
