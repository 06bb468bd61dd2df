"""MXFP4 helpers of aiter.utility.fp4_utils: e2m1 packing (even element in the low nibble) and
e8m0 scales (code c means 2**(c - 127)), plus the scale shuffle the asm GEMM/MoE kernels read."""
import torch

from . import dtypes
from .._double import numerics
from .._double.recording import recorded


@recorded()
def f32_to_mxfp4(x):
    """float values (already divided by their scale) -> packed fp4x2, round to nearest even."""
    return numerics.pack_fp4(numerics.fp4_codes(x.float())).view(dtypes.fp4x2)


@recorded()
def mxfp4_to_f32(x):
    """packed fp4x2 [..., n] -> float32 [..., 2n]."""
    return numerics.unpack_fp4(x)


@recorded()
def f32_to_e8m0(x):
    """float32 scale -> e8m0 code: its exponent, rounded up when the mantissa is >= 1.5."""
    bits = x.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    round_up = ((bits & 0x400000) != 0) & (((bits & 0x3FFFFF) != 0) | (exponent > 0))
    exponent = torch.where((exponent != 0xFF) & round_up, exponent + 1, exponent)
    return exponent.to(torch.uint8).view(dtypes.fp8_e8m0)


@recorded()
def e8m0_to_f32(scale_e8m0_biased):
    return numerics.e8m0_to_float(scale_e8m0_biased)


@recorded()
def e8m0_shuffle(scale):
    """[M, K/32] e8m0 -> [ceil(M/256)*256, ceil(K/32/8)*8]: padded, then each 32x8 tile stored as
    [x/32, y/8, y%4, x%16, (y%8)/4, (x%32)/16] (row x, column y). float32 scales pass through."""
    if scale is None:
        return scale
    if scale.dtype == torch.float32:
        return scale
    assert scale.ndim == 2, "scale must be a 2D tensor"
    m, n = scale.shape
    padded = torch.empty(((m + 255) // 256 * 256, (n + 7) // 8 * 8), dtype=scale.dtype, device=scale.device)
    padded[:m, :n] = scale
    sm, sn = padded.shape
    tiles = padded.view(sm // 32, 2, 16, sn // 8, 2, 4)
    return tiles.permute(0, 3, 5, 2, 4, 1).contiguous().view(sm, sn)
