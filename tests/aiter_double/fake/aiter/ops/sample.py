"""mixed_sample_outer_exponential: one token per row, in place into out (int32 [M]).

temperatures fp32 [M]: 0 -> argmax(input[m]); otherwise argmax(softmax(input[m] / max(T, 1e-5)) /
(exponentials[m] + eps)), the exponential-race form of sampling. exponentials fp32 is read at row
stride exponentials.stride(0): give [M, V], or a [1, V] row expanded to [M, V] (stride 0).
"""
import torch
from torch import Tensor

from .._double.recording import recorded

__all__ = ["mixed_sample_outer_exponential"]


@recorded()
def mixed_sample_outer_exponential(
    out: Tensor,
    input: Tensor,
    exponentials: Tensor,
    temperatures: Tensor,
    eps: float = 1e-10,
) -> None:
    if out.dtype != torch.int32 or exponentials.dtype != torch.float32 or temperatures.dtype != torch.float32:
        raise RuntimeError("mixed_sample_outer_exponential: out int32, exponentials and temperatures fp32")
    rows, vocab = input.shape
    if rows == 0:
        return
    if exponentials.shape[-1] != vocab or (exponentials.shape[0] != rows and exponentials.stride(0) != 0):
        raise RuntimeError(f"exponentials must be [M, V] (or expanded with stride 0), got {tuple(exponentials.shape)} "
                           f"stride {exponentials.stride()} for input {tuple(input.shape)}")
    noise = exponentials.expand(rows, vocab).float()
    logits = input.float()
    temperature = temperatures.float().reshape(rows, 1)
    scaled = logits / temperature.clamp_min(1e-5)
    probs = torch.exp(scaled - scaled.amax(dim=-1, keepdim=True))
    sampled = (probs / (noise + eps)).argmax(dim=-1)
    greedy = logits.argmax(dim=-1)
    out.copy_(torch.where(temperature.squeeze(1) == 0, greedy, sampled).to(torch.int32))
