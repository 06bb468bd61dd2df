"""silu_and_mul: out[..., d] = silu(input[..., :d]) * input[..., d:], in float32, fp16/bf16 only."""
import torch
from torch import Tensor

from .._double.recording import recorded

__all__ = ["silu_and_mul"]


@recorded()
def silu_and_mul(out: Tensor, input: Tensor) -> None:
    if input.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f'"act_and_mul_kernel" not implemented for {input.dtype} (fp16/bf16 only)')
    d = input.shape[-1] // 2
    if out.dtype != input.dtype or out.shape[-1] != d or out.numel() * 2 != input.numel():
        raise RuntimeError(f"silu_and_mul: out {tuple(out.shape)} {out.dtype} does not match input "
                           f"{tuple(input.shape)} {input.dtype}")
    x = input.float().reshape(-1, 2 * d)
    result = torch.nn.functional.silu(x[:, :d]) * x[:, d:]
    out.view(-1, d).copy_(result.to(out.dtype))
