"""CK RMSNorm on 2-D fp16/bf16 rows: y = x * rsqrt(mean(x^2) + eps) * weight, in float32.

use_model_sensitive_rmsnorm=1 (T5-like) rounds the normalised x to the input dtype before the weight.
rmsnorm2d_fwd_with_add writes residual_out = input + residual_in (rounded) and normalises the
unrounded float32 sum into out; both outputs in place, returns None.
"""
import torch
from torch import Tensor

from .._double.recording import recorded

__all__ = ["rmsnorm2d_fwd", "rmsnorm2d_fwd_with_add"]


def _check(name: str, input: Tensor) -> None:
    if input.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("ck rmsnorm2d only support fp16 and bf16 data type")
    if input.dim() != 2:  # the kernel takes stride(0) as the row stride
        raise RuntimeError(f"{name}: input must be 2-D [m, n], got {tuple(input.shape)}")


def _normalise(x: Tensor, weight: Tensor, epsilon: float, model_sensitive: int, dtype: torch.dtype) -> Tensor:
    normed = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    if model_sensitive:
        normed = normed.to(dtype).float()
    return (normed * weight.float().reshape(1, -1)).to(dtype)


@recorded()
def rmsnorm2d_fwd(
    input: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float,
    use_model_sensitive_rmsnorm: int = 0,
) -> Tensor:
    _check("rmsnorm2d_fwd", input)
    return _normalise(input.float(), weight, epsilon, use_model_sensitive_rmsnorm, input.dtype)


@recorded()
def rmsnorm2d_fwd_with_add(
    out: Tensor,
    input: Tensor,
    residual_in: Tensor,
    residual_out: Tensor,
    weight: Tensor,
    epsilon: float,
    use_model_sensitive_rmsnorm: int = 0,
) -> None:
    _check("rmsnorm2d_fwd_with_add", input)
    total = input.float() + residual_in.float()
    residual_out.copy_(total.to(residual_out.dtype))
    out.copy_(_normalise(total, weight, epsilon, use_model_sensitive_rmsnorm, out.dtype))
