"""Number formats and the quantisation formulas of AITER's HIP kernels, in float32 torch.

Formulas follow aiter_meta/csrc/kernels/quant_kernels.cu and cache_kernels.cu of 0.1.7:
- fp8/int8 dynamic scales are `amax * (1 / dtype_max)` and the stored value is `x * (1 / scale)`;
- MXFP4 groups of 32 get an e8m0 scale of `round_pow2(amax) / 4` (mantissa >= 1.5 rounds up) and
  values are rounded to nearest-even on the e2m1 grid.
"""
from __future__ import annotations

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP4_TABLE = torch.tensor(FP4_VALUES + tuple(-v for v in FP4_VALUES), dtype=torch.float32)


def dtype_max(dtype: torch.dtype) -> float:
    if dtype.is_floating_point:
        return float(torch.finfo(dtype).max)
    return float(torch.iinfo(dtype).max)


def inverted_max(dtype: torch.dtype) -> torch.Tensor:
    """`1. / max` as the kernels compute it: in double, then rounded to float32."""
    return torch.tensor(1.0 / dtype_max(dtype), dtype=torch.float32)


def convert(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 -> a narrow type the way ck_tile's type_convert stores it (saturating; int8 truncates)."""
    limit = dtype_max(dtype)
    if dtype.is_floating_point:
        return x.clamp(-limit, limit).to(dtype)
    return torch.trunc(x.clamp(-limit - 1, limit)).to(dtype)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype, amax_floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic quantisation of each last-dim row: returns (q, scale[..., 1]).

    amax_floor is 1e-10 in the grouped kernel (rows of 32/64/128) and 0 in the per-token one, where
    an all-zero row therefore gives scale 0 and NaN values, as on the GPU.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(amax_floor)
    scale = amax * inverted_max(dtype)
    return convert(xf * (1.0 / scale), dtype), scale


# ---------------------------------------------------------------- MXFP4 (e2m1 values, e8m0 scales)

def e8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """e8m0 byte -> float32 scale 2**(code - 127); 0xFF is NaN."""
    codes = codes.view(torch.uint8).to(torch.int32)
    scale = torch.exp2((codes - 127).float())
    return torch.where(codes == 255, torch.full_like(scale, float("nan")), scale)


def mx_scale_codes(amax: torch.Tensor) -> torch.Tensor:
    """e8m0 code of a 1x32 group with absolute maximum `amax` (float32): exponent of
    round_pow2(amax) / 4, where round_pow2 keeps the exponent unless the mantissa is >= 1.5."""
    bits = amax.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    round_up = ((bits & 0x400000) != 0) & (((bits & 0x3FFFFF) != 0) | (exponent != 0))
    exponent = torch.where((exponent != 0xFF) & round_up, exponent + 1, exponent)
    codes = torch.where(exponent == 0xFF, exponent, (exponent - 2).clamp_min(0))
    return codes.to(torch.uint8)


def fp4_codes(values: torch.Tensor) -> torch.Tensor:
    """float32 -> 4-bit e2m1 codes (uint8, sign in bit 3), round to nearest even, saturating at 6.

    Between two grid values the midpoint goes to the even code: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0,
    1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0.
    """
    m = values.abs()
    code = ((m > 0.25).to(torch.uint8) + (m >= 0.75) + (m > 1.25) + (m >= 1.75) + (m > 2.5) + (m >= 3.5)
            + (m > 5.0))
    sign = (values < 0) & (code != 0)
    return code | (sign.to(torch.uint8) << 3)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes -> [..., n] bytes; the even element goes in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] packed fp4x2 bytes -> [..., 2n] float32 values."""
    packed = packed.view(torch.uint8)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    return _FP4_TABLE.to(packed.device)[codes.long()]


def mxfp4_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[m, n] -> (packed uint8 [m, n/2], e8m0 codes uint8 [m, n/32]), as the 1x32 HIP kernel."""
    m, n = x.shape
    groups = x.float().reshape(m, n // 32, 32)
    codes = mx_scale_codes(groups.abs().amax(dim=-1).clamp_min(1e-10))
    scaled = groups / e8m0_to_float(codes).unsqueeze(-1)
    return pack_fp4(fp4_codes(scaled).reshape(m, n)), codes


def mxfp4_dequantize(packed: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """packed [r, k/2] with e8m0 codes [r, >= k/32] -> float32 [r, k]."""
    values = unpack_fp4(packed)
    r, k = values.shape
    scales = e8m0_to_float(codes[:r, : k // 32])
    return (values.reshape(r, k // 32, 32) * scales.unsqueeze(-1)).reshape(r, k)
