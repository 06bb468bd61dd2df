"""FP8/INT8 GEMMs (CK kernels in the real aiter): Y[M, N] = (XQ * x_scale) @ (WQ * w_scale)^T.

- gemm_a8w8: WQ [N, K] plain; x_scale [M, 1], w_scale [N, 1] fp32 (read by row index, so a [1]
  per-tensor scale is not accepted); optional bias [N] of the output dtype added after scaling.
- gemm_a8w8_bpreshuffle: WQ fp8 preshuffled by shuffle_weight(w, (16, 16)); no bias.
- gemm_a8w8_blockscale_bpreshuffle: 128x128 blocks; WQ preshuffled; w_scale [ceil(N/128),
  ceil(K/128)] row-major; x_scale [M, ceil(K/128)] stored column-major (flat index g*M + m), as
  get_hip_quant(per_1x128)(x, quant_dtype=fp8, transpose_scale=True) writes it.
Accumulation in float32, one rounding to `dtype`.
"""
from typing import Optional

import torch
from torch import Tensor

from ..jit.utils.chip_info import get_gfx
from ..utility import dtypes
from .._double.layouts import blockscale_weight, unshuffle_weight
from .._double.recording import recorded

__all__ = ["gemm_a8w8", "gemm_a8w8_bpreshuffle", "gemm_a8w8_blockscale_bpreshuffle"]


def _check_operands(XQ: Tensor, WQ: Tensor, dtype: torch.dtype) -> None:
    if XQ.dtype not in (dtypes.fp8, dtypes.i8) or XQ.dtype != WQ.dtype:
        raise RuntimeError(
            f"Weights and activations should both be int8/fp8 (fp8 is {dtypes.fp8} on {get_gfx()}); "
            f"got XQ {XQ.dtype}, WQ {WQ.dtype}")
    if dtype not in (dtypes.bf16, dtypes.fp16):
        raise RuntimeError(f"Unsupported scales/output dtype! ({dtype})")
    if XQ.dim() != 2 or WQ.dim() != 2 or XQ.shape[1] != WQ.shape[1]:
        raise RuntimeError(f"gemm shapes: XQ {tuple(XQ.shape)} and WQ {tuple(WQ.shape)} are not [M, K], [N, K]")


def _rowwise(XQ: Tensor, WQ: Tensor, x_scale: Tensor, w_scale: Tensor) -> Tensor:
    m, n = XQ.shape[0], WQ.shape[0]
    if x_scale.numel() != m or w_scale.numel() != n:
        raise RuntimeError(
            f"row-wise scales must be x_scale [M, 1] and w_scale [N, 1]; got {tuple(x_scale.shape)}, "
            f"{tuple(w_scale.shape)} for M={m}, N={n}")
    acc = XQ.float() @ WQ.float().t()
    return acc * w_scale.float().reshape(1, n) * x_scale.float().reshape(m, 1)


@recorded()
def gemm_a8w8(
    XQ: Tensor,
    WQ: Tensor,
    x_scale: Tensor,
    w_scale: Tensor,
    bias: Optional[Tensor] = None,
    dtype: torch.dtype = dtypes.bf16,
    splitK: Optional[int] = None,
) -> Tensor:
    _check_operands(XQ, WQ, dtype)
    out = _rowwise(XQ, WQ, x_scale, w_scale)
    if bias is not None:
        if bias.dtype != dtype:
            raise RuntimeError("Out amd bias should have the same dtype!")
        out = out + bias.float().reshape(1, -1)
    return out.to(dtype)


@recorded()
def gemm_a8w8_bpreshuffle(
    XQ: Tensor,
    WQ: Tensor,
    x_scale: Tensor,
    w_scale: Tensor,
    bias: Optional[Tensor] = None,
    dtype: torch.dtype = dtypes.bf16,
    check: bool = False,
) -> Tensor:
    assert dtype in [torch.bfloat16, torch.float16], f"Output {dtype=} is currently not supported in gemm_a8w8"
    assert WQ.dtype == dtypes.fp8, "gemm_a8w8_bpreshuffle only support fp8 now"
    assert bias is None, "gemm_a8w8_bpreshuffle does not support bias now"
    _check_operands(XQ, WQ, dtype)
    return _rowwise(XQ, unshuffle_weight(WQ, (16, 16)), x_scale, w_scale).to(dtype)


@recorded()
def gemm_a8w8_blockscale_bpreshuffle(
    XQ: Tensor,
    WQ: Tensor,
    x_scale: Tensor,
    w_scale: Tensor,
    dtype: torch.dtype = dtypes.bf16,
) -> Tensor:
    assert dtype in [dtypes.bf16, dtypes.fp16], f"Output {dtype=} is currently not supported in gemm_a8w8"
    _check_operands(XQ, WQ, dtype)
    m, k = XQ.shape
    n = WQ.shape[0]
    k_blocks, n_blocks = -(-k // 128), -(-n // 128)
    if x_scale.numel() != m * k_blocks or tuple(w_scale.shape) != (n_blocks, k_blocks):
        raise RuntimeError(
            f"block scales must be x_scale [M, K/128] = [{m}, {k_blocks}] (column-major) and w_scale "
            f"[N/128, K/128] = [{n_blocks}, {k_blocks}]; got {tuple(x_scale.shape)}, {tuple(w_scale.shape)}")
    x_blocks = x_scale.float().contiguous().view(-1).view(k_blocks, m).t()
    x = XQ.float() * x_blocks.repeat_interleave(128, 1)[:, :k]
    w = blockscale_weight(unshuffle_weight(WQ, (16, 16)), w_scale)
    return (x @ w.t()).to(dtype)
