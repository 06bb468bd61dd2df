"""silu_and_mul / gelu_tanh_and_mul: out[..., d] = act(input[..., :d]) * input[..., d:], in float32, fp16/bf16
only."""
import torch
from torch import Tensor

from .._double.recording import recorded

__all__ = ["silu_and_mul", "gelu_tanh_and_mul"]


def _act_and_mul(name: str, act, out: Tensor, input: Tensor) -> None:
    if input.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f'"act_and_mul_kernel" not implemented for {input.dtype} (fp16/bf16 only)')
    d = input.shape[-1] // 2
    if out.dtype != input.dtype or out.shape[-1] != d or out.numel() * 2 != input.numel():
        raise RuntimeError(f"{name}: out {tuple(out.shape)} {out.dtype} does not match input "
                           f"{tuple(input.shape)} {input.dtype}")
    x = input.float().reshape(-1, 2 * d)
    out.view(-1, d).copy_((act(x[:, :d]) * x[:, d:]).to(out.dtype))


@recorded()
def silu_and_mul(out: Tensor, input: Tensor) -> None:
    _act_and_mul("silu_and_mul", torch.nn.functional.silu, out, input)


@recorded()
def gelu_tanh_and_mul(out: Tensor, input: Tensor) -> None:
    _act_and_mul("gelu_tanh_and_mul", lambda x: torch.nn.functional.gelu(x, approximate="tanh"), out, input)
