"""rope_cached_positions_2c_fwd_inplace: RoPE on q (input_x) and k (input_y) in place, sbhd layout.

input_x [s, b, h_x, d], input_y [s, b, h_y, d]; positions int64 [s, b] (stride(1) == 1); cos/sin
4-D [max_pos, 1, 1, f] read at positions * f, any of fp32/fp16/bf16. Rotated width r = 2f when
reuse_freqs_front_part (f = r/2 frequencies reused for both halves) else f. rotate_style 0 (NeoX)
pairs (i, i + r/2); 1 (GPT-J) pairs (2i, 2i + 1). out0 = x0*cos0 - x1*sin0, out1 = x1*cos1 + x0*sin1,
in float32. Positions outside [0, max_pos) leave their row unchanged; only the first
min(s, positions.size(0)) x min(b, positions.size(1)) rows are processed.

nope_first is emulated as the 0.1.7 kernel runs it: dims [d - r, r/2) are rotated (cos index
shifted by d - r), so with r < d almost nothing rotates - a real 0.1.7 bug; use nope_first=False.
"""
import torch
from torch import Tensor

from .._double.recording import recorded

__all__ = ["rope_cached_positions_2c_fwd_inplace"]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, rotate_style: int,
            reuse_freqs_front_part: bool, nope_first: bool) -> None:
    s = min(x.shape[0], positions.shape[0])
    b = min(x.shape[1], positions.shape[1])
    d, f = x.shape[3], cos.shape[3]
    rotated = 2 * f if reuse_freqs_front_part else f
    half = rotated // 2
    start = d - rotated if nope_first else 0
    dims = torch.arange(start, half)
    if dims.numel() == 0:
        return
    pos = positions[:s, :b]
    valid = (pos >= 0) & (pos < cos.shape[0])
    table_cos = cos.reshape(cos.shape[0], f).float()[pos.clamp(0, cos.shape[0] - 1)]  # [s, b, f]
    table_sin = sin.reshape(sin.shape[0], f).float()[pos.clamp(0, sin.shape[0] - 1)]
    freq = dims - start
    if rotate_style == 0:
        first, second = dims, dims + half
        other = freq if reuse_freqs_front_part else freq + half
        cos0, sin0 = table_cos[..., freq], table_sin[..., freq]
        cos1, sin1 = table_cos[..., other], table_sin[..., other]
    elif rotate_style == 1:
        first, second = 2 * dims, 2 * dims + 1
        idx0, idx1 = (freq, freq) if reuse_freqs_front_part else (2 * freq, 2 * freq + 1)
        cos0, sin0 = table_cos[..., idx0], table_sin[..., idx0]
        cos1, sin1 = table_cos[..., idx1], table_sin[..., idx1]
    else:
        raise RuntimeError(f"rope: unsupported rotate_style {rotate_style} (0 NeoX, 1 GPT-J)")
    view = x[:s, :b]
    x0, x1 = view[..., first].float(), view[..., second].float()
    cos0, sin0, cos1, sin1 = (t.unsqueeze(2) for t in (cos0, sin0, cos1, sin1))
    out0 = x0 * cos0 - x1 * sin0
    out1 = x1 * cos1 + x0 * sin1
    keep = ~valid.unsqueeze(-1).unsqueeze(-1)
    view[..., first] = torch.where(keep, x0, out0).to(x.dtype)
    view[..., second] = torch.where(keep, x1, out1).to(x.dtype)


@recorded()
def rope_cached_positions_2c_fwd_inplace(
    input_x: Tensor,
    input_y: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    rotate_style: int,
    reuse_freqs_front_part: bool,
    nope_first: bool,
) -> Tensor:
    for t in (input_x, input_y, cos, sin):
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise RuntimeError(f"rope: unsupported dtype {t.dtype}")
    if input_x.dim() != 4 or input_y.dim() != 4:
        raise RuntimeError("rope: inputs must be sbhd [s, b, h, d]")
    if cos.dim() != 4 or sin.dim() != 4:
        raise RuntimeError(f"rope: cos/sin must be [max_pos, 1, 1, f], got {tuple(cos.shape)}")
    if positions.dtype != torch.int64:
        raise RuntimeError(f"rope: expected scalar type Long for positions, got {positions.dtype}")
    assert positions.dim() == 2 and positions.stride(1) == 1, "positions must be [s, b] with stride(1) == 1"
    for x in (input_x, input_y):
        _rotate(x, cos, sin, positions, rotate_style, reuse_freqs_front_part, nope_first)
