"""topk_softmax: softmax routing (csrc/kernels/topk_softmax_kernels.cu).

gating_output [T, E] fp32/fp16/bf16 -> in place: topk_weights fp32 [T, k] (softmax probabilities of
the k largest, in descending order; divided by their sum when need_renorm), topk_indices int32
[T, k], token_expert_indices int32 [T, k] = k_index * T + t.
"""
import torch
from torch import Tensor

from .._double.recording import recorded

__all__ = ["topk_softmax"]


@recorded()
def topk_softmax(
    topk_weights: Tensor,
    topk_indices: Tensor,
    token_expert_indices: Tensor,
    gating_output: Tensor,
    need_renorm: bool,
) -> None:
    dtypes = (topk_weights.dtype, topk_indices.dtype, token_expert_indices.dtype)
    if dtypes != (torch.float32, torch.int32, torch.int32):
        raise RuntimeError("topk_softmax: topk_weights must be fp32, topk_indices and token_expert_indices int32")
    if gating_output.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise RuntimeError(f'"topk_softmax" not implemented for {gating_output.dtype}')
    num_experts = gating_output.shape[-1]
    probs = gating_output.reshape(-1, num_experts).float().softmax(dim=-1)
    tokens, k = probs.shape[0], topk_weights.shape[-1]
    weights, ids = probs.topk(k, dim=-1)
    if need_renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    topk_weights.copy_(weights)
    topk_indices.copy_(ids.to(torch.int32))
    source_rows = torch.arange(k).unsqueeze(0) * tokens + torch.arange(tokens).unsqueeze(1)
    token_expert_indices.copy_(source_rows.to(torch.int32))
