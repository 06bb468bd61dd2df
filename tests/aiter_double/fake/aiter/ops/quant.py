"""Dynamic quantisation, aiter.get_hip_quant(QuantType) and the HIP functions it returns.

Scale layouts (quant_kernels.cu):
- per_Tensor: scale [1] = amax(x) / dtype_max over the whole tensor;
- per_Token: scale [..., 1] per row; rows of 32/64/128 columns take the grouped kernel (amax floor 1e-10);
- per_1x128 (per_group_quant_hip, group 128): scale [..., K/128]; with transpose_scale=True the same
  [M, K/128] tensor holds the scales column-major, element (m, g) at flat index g*M + m, which is
  what gemm_a8w8_blockscale_bpreshuffle reads;
- per_1x32: fp4x2 [m, n/2] with e8m0 scales [m, n/32], or with shuffle=True [ceil(m/256)*256,
  ceil(n/32/8)*8] in e8m0_shuffle order (padding left unwritten as on the GPU: here 127, i.e. 1.0).
"""
import functools
from typing import Optional

import torch

from .enum import QuantType
from ..utility import dtypes, fp4_utils
from .._double import numerics
from .._double.recording import recorded

__all__ = ["get_hip_quant", "per_token_quant_hip", "per_group_quant_hip", "per_1x32_f4_quant_hip",
           "per_tensor_quant_hip"]


@recorded()
@functools.lru_cache()
def get_hip_quant(qType):
    tmp = {
        QuantType.No.value: lambda *a, **k: (a[0], None),
        QuantType.per_Tensor.value: per_tensor_quant_hip,
        QuantType.per_Token.value: per_token_quant_hip,
        QuantType.per_1x32.value: per_1x32_f4_quant_hip,
        QuantType.per_1x128.value: functools.partial(per_group_quant_hip, group_size=128),
    }

    def raise_NotImplementedError(*a, **k):
        raise NotImplementedError(f"unsupported quant type {qType=}")

    return tmp.get(qType.value, raise_NotImplementedError)


def _check_input(x: torch.Tensor, quant_dtype: torch.dtype) -> None:
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"dynamic quant: input dtype {x.dtype} not supported (fp16/bf16 only)")
    if not x.is_contiguous():
        raise RuntimeError("dynamic quant: input must be contiguous")
    if quant_dtype not in (dtypes.fp8, dtypes.i8):
        raise RuntimeError(f"dynamic quant: not support output type: {quant_dtype} (arch fp8 is {dtypes.fp8})")


def _valid_rows(rows: int, num_rows: Optional[torch.Tensor], num_rows_factor: int) -> int:
    return rows if num_rows is None else min(rows, int(num_rows.reshape(-1)[0]) * num_rows_factor)


@recorded()
def per_token_quant_hip(
    x,
    scale=None,
    quant_dtype=dtypes.i8,
    num_rows: Optional[torch.tensor] = None,
    num_rows_factor=1,
):
    if scale is not None:
        raise ValueError("unsupported: static per token quant")
    _check_input(x, quant_dtype)
    cols = x.shape[-1]
    flat = x.reshape(-1, cols)
    valid = _valid_rows(flat.shape[0], num_rows, num_rows_factor)
    y = torch.zeros(flat.shape, dtype=quant_dtype, device=x.device)
    scale = torch.ones(flat.shape[0], 1, dtype=dtypes.fp32, device=x.device)
    floor = 1e-10 if cols in (32, 64, 128) else 0.0
    y[:valid], scale[:valid] = numerics.quantize_rows(flat[:valid], quant_dtype, floor)
    return y.view(x.shape), scale.view(*x.shape[:-1], 1)


@recorded()
def per_group_quant_hip(
    x,
    scale=None,
    quant_dtype=dtypes.i8,
    group_size=128,
    transpose_scale=False,
    num_rows: Optional[torch.tensor] = None,
    num_rows_factor=1,
):
    if scale is not None:
        raise ValueError("unsupported: static per token quant")
    assert group_size in [32, 64, 128], f"unsupported group size {group_size=}, only support [32, 64, 128]"
    _check_input(x, quant_dtype)
    cols = x.shape[-1]
    rows = x.numel() // cols
    groups = x.reshape(rows, cols // group_size, group_size)
    valid = _valid_rows(rows, num_rows, num_rows_factor)
    y = torch.zeros(groups.shape, dtype=quant_dtype, device=x.device)
    group_scale = torch.ones(rows, cols // group_size, dtype=dtypes.fp32, device=x.device)
    q, s = numerics.quantize_rows(groups[:valid], quant_dtype, 1e-10)
    y[:valid], group_scale[:valid] = q, s.squeeze(-1)
    if transpose_scale:
        group_scale = group_scale.t().contiguous()
    return y.view(x.shape), group_scale.view(*x.shape[:-1], cols // group_size)


@recorded()
def per_1x32_f4_quant_hip(
    x,
    scale=None,
    quant_dtype=dtypes.fp4x2,
    shuffle=False,
    num_rows: Optional[torch.tensor] = None,
    num_rows_factor=1,
):
    m, n = x.shape
    assert quant_dtype == dtypes.fp4x2
    assert n % 2 == 0
    if scale is not None:
        raise ValueError("unsupported: static per token quant")
    if dtypes.fp8 == torch.float8_e4m3fnuz:
        # The real kernel silently writes zeros there (ck_tile's fp4 convert is gfx950-only).
        raise RuntimeError("MXFP4 quant needs gfx950: on gfx942 the real kernel writes all-zero values")
    assert n % 32 == 0, f"per_1x32 quant needs a multiple of 32 columns, got {n}"
    valid = _valid_rows(m, num_rows, num_rows_factor)
    packed = torch.zeros(m, n // 2, dtype=torch.uint8, device=x.device)
    codes = torch.full((m, n // 32), 127, dtype=torch.uint8, device=x.device)
    packed[:valid], codes[:valid] = numerics.mxfp4_quantize(x[:valid])
    if shuffle:
        padded = torch.full(((m + 255) // 256 * 256, (n // 32 + 7) // 8 * 8), 127, dtype=torch.uint8)
        padded[:m, : n // 32] = codes
        codes = fp4_utils.e8m0_shuffle(padded.to(x.device))
    return packed.view(quant_dtype), codes.view(dtypes.fp8_e8m0)


@recorded()
def per_tensor_quant_hip(
    x,
    scale=None,
    quant_dtype=dtypes.i8,
    num_rows: Optional[torch.tensor] = None,
    num_rows_factor=1,
):
    assert num_rows is None, "num_rows is not supported for per_tensor_quant_hip"
    if quant_dtype not in [dtypes.fp8, dtypes.i8]:
        raise ValueError(f"unsupported: {quant_dtype=}")
    _check_input(x, quant_dtype)
    xf = x.float()
    if scale is None:
        scale = (xf.abs().amax() * numerics.inverted_max(quant_dtype)).reshape(1)
    y = numerics.convert(xf * (1.0 / scale.float().reshape(-1)[0]), quant_dtype)
    return y, scale.view(1)
