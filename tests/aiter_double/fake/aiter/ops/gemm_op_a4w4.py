"""MXFP4 GEMM (asm kernels, gfx950 only): out[:M] = alpha * dequant(A) @ dequant(B)^T (+ beta * bias).

A [M, K/2] fp4x2 (or uint8), B [N, K/2] fp4x2 preshuffled by shuffle_weight(B, (16, 16)) when
bpreshuffle (the default); A_scale and B_scale are e8m0 in e8m0_shuffle layout, padded to
[ceil(rows/256)*256, ceil(K/32/8)*8] (get_hip_quant(per_1x32)(x, shuffle=True) for A). `out` is a
caller-allocated bf16 [M_pad, N] with M_pad a multiple of 32 (M = A.shape[0] <= M_pad); rows past M
are left as they were. `bias` is the C term, read as [M, N] with out's row stride (the Python
comment's "[1, N]" would be read out of bounds). Returns `out`. Raises on gfx942, as the real wrapper does.
"""
from typing import Optional

import torch
from torch import Tensor

from ..jit.utils.chip_info import get_gfx
from ..utility import dtypes
from .._double import numerics
from .._double.layouts import unshuffle_e8m0, unshuffle_weight
from .._double.recording import recorded

__all__ = ["gemm_a4w4"]


@recorded()
def gemm_a4w4(
    A: Tensor,  # A:[M, K/2] f4x2
    B: Tensor,  # B:[N, K/2] f4x2
    A_scale: Tensor,  # A_scale:[M, K/32] e8m0 paded
    B_scale: Tensor,  # B_scale:[N, K/32] e8m0 paded
    out: Tensor,  # Out:[M, N] bf16
    bias: Optional[Tensor] = None,  # bias:[1, N] f32
    alpha: Optional[float] = 1.0,
    beta: Optional[float] = 0.0,
    bpreshuffle: Optional[bool] = True,
) -> torch.Tensor:
    m, n, k = A.shape[0], B.shape[0], A.shape[-1] * 2
    gfx_arch = get_gfx()
    if gfx_arch in ["gfx942"]:
        raise RuntimeError(f"A4W4 GEMM kernel is not supported on gfx942, but got {gfx_arch}!")
    assert out.shape[0] % 32 == 0, "Dim0 of gemm_a4w4_asm output needs to be padded to multiples of 32!"
    if out.dtype != torch.bfloat16:
        raise RuntimeError("gemm_a4w4_asm only support BFloat16 output now!")
    for name, t in (("A", A), ("B", B)):
        if t.dtype not in (dtypes.fp4x2, torch.uint8):
            raise RuntimeError(f"gemm_a4w4_asm Unsupported input_type: {name} is {t.dtype}, expected fp4x2")
    if B.shape[1] != A.shape[1] or out.shape[0] < m or out.shape[1] != n:
        raise RuntimeError(f"gemm_a4w4 shapes: A {tuple(A.shape)}, B {tuple(B.shape)}, out {tuple(out.shape)}")
    for name, scale in (("A_scale", A_scale), ("B_scale", B_scale)):
        if scale.dim() != 2 or scale.element_size() != 1:
            raise RuntimeError(f"gemm_a4w4: {name} must be 2-D e8m0 in e8m0_shuffle layout, got {tuple(scale.shape)}")
    weight = unshuffle_weight(B, (16, 16)) if bpreshuffle else B
    a = numerics.mxfp4_dequantize(A, unshuffle_e8m0(A_scale))
    b = numerics.mxfp4_dequantize(weight, unshuffle_e8m0(B_scale))
    result = alpha * (a @ b.t())
    if bias is not None:  # the kernel reads it as the C matrix, row stride = out.stride(0)
        if bias.numel() < m * n:
            raise RuntimeError(f"gemm_a4w4 reads bias as C [M, N]; got {tuple(bias.shape)} for M={m}, N={n}")
        result = result + beta * bias.float().reshape(-1, n)[:m]
    out[:m] = result.to(out.dtype)
    return out
