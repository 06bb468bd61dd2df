"""The activation quantizers of the Triton quantized GEMMs and experts (quant.py, moe_quant.py): FP8 per
tensor, per token or per token and K-block, and MXFP4 per 1 x 32, each rounding exactly as the reference's
fake quantization (engine/kernels/quant.py) does, so that the W8A8 and w4a4 products equal the reference's."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.quant import FP8_DTYPE, MXFP4_GROUP, QuantizedWeight, divide, fp8_max

FP8_LIMIT = tl.constexpr(fp8_max())
# How the GEMM and expert kernels receive activations (their ACT argument).
ACT_NONE = tl.constexpr(0)   # unquantized (bf16 / fp16 / fp32)
ACT_FP8 = tl.constexpr(1)    # e4m3 with fp32 scales
ACT_MXFP4 = tl.constexpr(2)  # packed e2m1 with e8m0 scales per 32


@triton.jit
def round_to_e4m3(v):
    """v (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still in float32, so that its
    conversion is exact. Torch's conversion rounds so; the interpreter's does not (ties away, and values that
    round up into the next binade come out an exponent low), and the few extra instructions are nothing
    beside this kernel's memory traffic, so every device takes this one path."""
    magnitude = tl.abs(v)
    exponent = tl.maximum(((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # subnormals: 2^-6
    magic = ((exponent + 20 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(exponent + 20): its ulp is the step
    rounded = (magnitude + magic) - magic
    return tl.where(v < 0, -rounded, rounded)


@triton.jit
def _quantize_fp8_kernel(x_ptr, q_ptr, s_ptr, given_ptr, K, group, stride_xm, stride_qm, stride_sm,
                         SCALE_FROM: tl.constexpr, BLOCK: tl.constexpr):
    """Row program_id(0), group program_id(1) of `group` columns -> e4m3, as fake_quantize_fp8 rounds: scale
    s = max(amax / 448, 1e-12) of the group's own values (SCALE_FROM 0, stored to s[row, group]), the scale
    at given_ptr (1: static), or from the tensor's amax at given_ptr (2). Both divisions are div_rn: Triton's
    `/` on float32 compiles to the approximate div.full.f32 on NVIDIA GPUs (an ulp off at times, enough to
    move a scale or an e4m3 rounding), while the reference divides correctly rounded."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    start = g * group
    end = tl.minimum(start + group, K)
    offsets = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    if SCALE_FROM == 0:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(start, end, BLOCK):
            x = tl.load(x_row + k + offsets, mask=k + offsets < end, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_LIMIT), 1e-12)
        tl.store(s_ptr + row * stride_sm + g, scale)
    elif SCALE_FROM == 1:
        scale = tl.load(given_ptr)
    else:
        scale = tl.maximum(tl.math.div_rn(tl.load(given_ptr), FP8_LIMIT), 1e-12)
    for k in range(start, end, BLOCK):
        x = tl.load(x_row + k + offsets, mask=k + offsets < end, other=0.0).to(tl.float32)
        q = round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -FP8_LIMIT, FP8_LIMIT))
        tl.store(q_ptr + row * stride_qm + k + offsets, q.to(q_ptr.dtype.element_ty), mask=k + offsets < end)


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, M, K, stride_xm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + k + ks[None, :],
                    mask=(rows < M)[:, None] & (k + ks < K)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    tl.atomic_max(amax_ptr, tl.max(tl.max(amax, axis=1), axis=0), sem="relaxed")


@triton.jit
def _quantize_mxfp4_kernel(x_ptr, q_ptr, s_ptr, num_groups, stride_xm, stride_qm, stride_sm,
                           GROUPS: tl.constexpr):
    """GROUPS groups of 32 values of row program_id(0) -> packed e2m1 and e8m0 scales, by quantize_e2m1's
    rule: shared exponent floor(log2(amax)) - 2, each value rounded to the nearest e2m1 (ties to the even
    code), saturated at 6."""
    row = tl.program_id(0).to(tl.int64)
    group_ids = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    mask = (group_ids < num_groups)[:, None]
    x = tl.load(x_ptr + row * stride_xm + group_ids[:, None] * 32 + tl.arange(0, 32)[None, :], mask=mask,
                other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    # floor(log2(amax)) from the exponent field (a subnormal or zero amax gives -127, as the reference's clamp)
    exponent = tl.minimum(tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 129, -127), 127)
    exponent = tl.where(amax > 0, exponent, -127)
    scaled = tl.abs(x) * ((127 - exponent) << 23).to(tl.float32, bitcast=True)[:, None]  # x / 2^exponent
    # nearest of 0, .5, 1, 1.5, 2, 3, 4, 6; at a midpoint the even code (strict > where the lower code is even)
    code = ((scaled > 0.25).to(tl.int32) + (scaled >= 0.75).to(tl.int32) + (scaled > 1.25).to(tl.int32)
            + (scaled >= 1.75).to(tl.int32) + (scaled > 2.5).to(tl.int32) + (scaled >= 3.5).to(tl.int32)
            + (scaled > 5.0).to(tl.int32))
    code = code | tl.where(x < 0, 8, 0)
    low, high = tl.split(tl.reshape(code, (GROUPS, 16, 2)))
    tl.store(q_ptr + row * stride_qm + group_ids[:, None] * 16 + tl.arange(0, 16)[None, :],
             (low | (high << 4)).to(tl.uint8), mask=mask)
    tl.store(s_ptr + row * stride_sm + group_ids, (exponent + 127).to(tl.uint8), mask=group_ids < num_groups)


def quantize_fp8(x: torch.Tensor, group: int | None, static_scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales): per tensor ([1]: the static scale, or dynamic from the amax)
    with group None, else per row and `group` columns ([M, ceil(K / group)]; group = K: per token)."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    if group is None:
        if static_scale is not None:
            scale, scale_from = static_scale.float().reshape(1), 1
        else:
            scale, scale_from = torch.zeros(1, dtype=torch.float32, device=x.device), 2
            if m:
                _amax_kernel[(triton.cdiv(m, 16),)](x, scale, m, k, x.stride(0), BLOCK_M=16, BLOCK_K=256)
        if m:
            block = min(1024, triton.next_power_of_2(k))
            _quantize_fp8_kernel[(m, 1)](x, q, q, scale, k, k, x.stride(0), q.stride(0), 0, SCALE_FROM=scale_from,
                                         BLOCK=block, num_warps=4)
        if scale_from == 2:  # the amax became the scale inside the kernel; the GEMM needs the scale itself
            scale = divide(scale, fp8_max()).clamp_(min=1e-12)
        return q, scale
    num_groups = triton.cdiv(k, group)
    scales = torch.empty(m, num_groups, dtype=torch.float32, device=x.device)
    if m:
        block = min(1024, triton.next_power_of_2(group))
        _quantize_fp8_kernel[(m, num_groups)](x, q, scales, scales, k, group, x.stride(0), q.stride(0),
                                              scales.stride(0), SCALE_FROM=0, BLOCK=block,
                                              num_warps=4 if block >= 512 else 1)
    return q, scales


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % 32 == 0) -> (packed e2m1 uint8 [M, K/2], e8m0 uint8 [M, K/32]), as quantize_e2m1."""
    m, k = x.shape
    num_groups = k // MXFP4_GROUP
    q = torch.empty(m, k // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(m, num_groups, dtype=torch.uint8, device=x.device)
    if m:
        groups = min(32, triton.next_power_of_2(num_groups))
        _quantize_mxfp4_kernel[(m, triton.cdiv(num_groups, groups))](x, q, scales, num_groups, x.stride(0),
                                                                     q.stride(0), scales.stride(0), GROUPS=groups)
    return q, scales


def quantize_activations(rows: torch.Tensor, qw: QuantizedWeight, fp8: bool, tensor_per_token: bool = False):
    """(activations, their scales or None, ACT code) as the kernels read them for the product with qw: MXFP4
    for the w4a4 scheme; with `fp8`, FP8 as the scheme says (per tensor, per token, per token and K-block;
    per token for fp8_tensor too with `tensor_per_token`); else unquantized."""
    scheme = qw.scheme
    if scheme.activation == "mxfp4":
        return (*quantize_mxfp4(rows), ACT_MXFP4.value)
    if not fp8 or scheme.method == "mxfp4":
        return rows, None, ACT_NONE.value
    if scheme.method == "fp8_tensor" and not tensor_per_token:
        static = qw.input_scale if scheme.activation == "static" else None
        return (*quantize_fp8(rows, None, static), ACT_FP8.value)
    return (*quantize_fp8(rows, scheme.block[1] if scheme.method == "fp8_block" else rows.shape[1]), ACT_FP8.value)
