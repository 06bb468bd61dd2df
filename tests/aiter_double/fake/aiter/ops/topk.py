"""Grouped routing (csrc/kernels/topk_softmax_kernels_group.cu); outputs written in place:
topk_weights fp32 [T, k], topk_ids int32 [T, k], descending by selection score.

grouped_topk: scores = softmax (is_softmax) or sigmoid of the gating; a group's score is its max;
the topk_group best groups stay, the k best experts of those are picked.
biased_grouped_topk (DeepSeek-V3): scores = sigmoid(gating) + correction_bias (same dtype as the
gating); a group's score is the sum of its two best biased scores; experts are picked by biased score
but weighted by the unbiased sigmoid.
Both: weight = score * routed_scaling_factor / sum(scores) with need_renorm, else
score * routed_scaling_factor. num_expert_group must be 1, 2, 4 or 8.
"""
import torch

from ..jit.utils.chip_info import get_cu_num
from .._double.recording import recorded

__all__ = ["grouped_topk", "biased_grouped_topk"]


def _route(scores: torch.Tensor, choice: torch.Tensor, topk_weights, topk_ids, num_expert_group: int,
           topk_group: int, group_score: str, need_renorm: bool, routed_scaling_factor: float) -> None:
    if num_expert_group not in (1, 2, 4, 8):
        raise RuntimeError(f"Unsupported num_expert_group: {num_expert_group}")
    if topk_ids.stride(0) != topk_weights.stride(0):
        raise RuntimeError("topk_ids.stride(0) == topk_weights.stride(0)")
    tokens, experts = choice.shape
    grouped = choice.view(tokens, num_expert_group, experts // num_expert_group)
    if group_score == "max":
        groups = grouped.amax(dim=-1)
    else:
        groups = grouped.topk(2, dim=-1).values.sum(dim=-1)
    kept = groups.topk(topk_group, dim=-1).indices
    group_mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, kept, True)
    masked = choice.masked_fill(~group_mask.repeat_interleave(experts // num_expert_group, dim=1), float("-inf"))
    ids = masked.topk(topk_ids.shape[1], dim=-1).indices
    weights = scores.gather(1, ids)
    factor = routed_scaling_factor / weights.sum(dim=-1, keepdim=True) if need_renorm else routed_scaling_factor
    topk_weights.copy_(weights * factor)
    topk_ids.copy_(ids.to(torch.int32))


@recorded()
def grouped_topk(
    gating_output: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_expert_group: int,
    topk_group: int,
    need_renorm: bool,
    is_softmax: bool = True,
    routed_scaling_factor: float = 1.0,
) -> None:
    logits = gating_output.float()
    scores = logits.softmax(dim=-1) if is_softmax else logits.sigmoid()
    _route(scores, scores, topk_weights, topk_ids, num_expert_group, topk_group, "max", need_renorm,
           routed_scaling_factor)


@recorded()
def biased_grouped_topk(
    gating_output: torch.Tensor,
    correction_bias: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_expert_group: int,
    topk_group: int,
    need_renorm: bool,
    routed_scaling_factor: float = 1.0,  # mul to topk_weights
):
    if gating_output.shape[0] > get_cu_num() * 212:  # the real wrapper switches to moe_fused_gate
        assert need_renorm, "Renormalization is required for moe_fused_gate."
    if gating_output.dtype != correction_bias.dtype:
        raise RuntimeError("gating_output.dtype() == correction_bias.dtype()")
    scores = gating_output.float().sigmoid()
    choice = scores + correction_bias.float().unsqueeze(0)
    _route(scores, choice, topk_weights, topk_ids, num_expert_group, topk_group, "top2", need_renorm,
           routed_scaling_factor)
