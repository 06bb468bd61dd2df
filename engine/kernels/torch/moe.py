"""Mixture-of-experts reference ops in plain PyTorch: routing (top-k of softmax or sigmoid scores, with
group limits, a selection bias and a scaling factor) and the expert MLPs over routed tokens. These are the
oracle for the Triton and AITER versions, and what runs on CPU.

Conventions shared by every backend:
- routing takes float32 router logits [T, E] and returns (weights [T, k] float32, ids [T, k] int32);
- `fused_experts(x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights [T, k], ids [T, k])` returns
  sum_k weights[t, k] * w2[e] @ (silu(gate) * up)(w13[e] @ x[t]) for e = ids[t, k], in x's dtype, summed
  in float32 and rounded once. An id of -1 (an expert held by another rank) contributes nothing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, then the top k (Mixtral, Qwen3-MoE); `renormalize` makes the k weights
    sum to one."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def moe_grouped_topk(logits: torch.Tensor, top_k: int, renormalize: bool, num_groups: int, topk_groups: int,
                     scoring: str, correction_bias: torch.Tensor | None,
                     routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited top-k (DeepSeek-V2/V3, GLM-4.5, MiniMax-M2 with one group): scores are softmax or
    sigmoid of the logits; experts are chosen by score + correction_bias (the bias only steers the choice),
    first the `topk_groups` best of `num_groups` equal groups (a group's rank: the sum of its two best
    biased scores when there is a bias, its best score otherwise), then the top k inside them. The weights
    are the unbiased scores of the chosen experts, renormalised (+1e-20) if asked, times the scaling factor."""
    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    num_tokens, num_experts = choice.shape
    if num_groups > 1:
        grouped = choice.view(num_tokens, num_groups, num_experts // num_groups)
        if correction_bias is not None:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        group_ids = torch.topk(group_scores, topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, swiglu_limit: float | None = None, w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None, oai_alpha: float | None = None,
                  gelu: bool = False) -> torch.Tensor:
    """The routed experts' MLPs, one expert at a time over the tokens routed to it (HF's loop, kept as the
    reference: no fused kernel can be checked against anything simpler). `swiglu_limit`: clamp gate to
    <= limit and up to [-limit, limit] first (DeepSeek-V4, gpt-oss). `w13_bias` [E, 2I] / `w2_bias` [E, H]:
    the experts' biases (gpt-oss), added by each GEMM. `oai_alpha`: gpt-oss's activation
    (up + 1) * gate * sigmoid(alpha * gate) in place of silu(gate) * up; `gelu`: gelu_tanh(gate) * up
    (Gemma 4's experts)."""
    return each_expert(x, weights, ids, w2.shape[2], with_bias(lambda rows, e: F.linear(rows, w13[e]), w13_bias),
                       with_bias(lambda rows, e: F.linear(rows, w2[e]).float(), w2_bias), swiglu_limit, oai_alpha,
                       gelu)


def with_bias(gemm, bias: torch.Tensor | None):
    """An expert GEMM `gemm(rows, e)` followed by expert e's bias (none: the GEMM itself)."""
    if bias is None:
        return gemm
    return lambda rows, e: (lambda out: out + bias[e].to(out.dtype))(gemm(rows, e))


def gated_activation(gate: torch.Tensor, up: torch.Tensor, swiglu_limit: float | None = None,
                     oai_alpha: float | None = None, gelu: bool = False) -> torch.Tensor:
    """silu(gate) * up, gelu_tanh(gate) * up (`gelu`), or gpt-oss's (up + 1) * gate * sigmoid(oai_alpha *
    gate), each operation in the inputs' dtype as transformers runs it; `swiglu_limit` clamps gate to
    <= limit and up to [-limit, limit] first."""
    if swiglu_limit is not None:
        gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
    if gelu:
        return F.gelu(gate, approximate="tanh") * up
    if oai_alpha is None:
        return F.silu(gate) * up
    return (up + 1) * (gate * torch.sigmoid(gate * oai_alpha))


def each_expert(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, intermediate: int, gate_up, down,
                swiglu_limit: float | None = None, oai_alpha: float | None = None, gelu: bool = False):
    """sum_k weights[t, k] * down(act(gate_up(x[t], e)), e) for e = ids[t, k] >= 0, one expert at a time over
    its tokens, summed in float32 and rounded once to x's dtype. `gate_up(rows, e)` returns x's dtype,
    `down(rows, e)` float32; `act` is `gated_activation` (silu-and-mul, clamped, or gpt-oss's)."""
    num_tokens, hidden = x.shape
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out.to(x.dtype)
    flat_ids = ids.reshape(-1).long()
    token_of_pair = torch.arange(num_tokens, device=x.device).repeat_interleave(ids.shape[1])
    flat_weights = weights.reshape(-1).float()
    for expert in torch.unique(flat_ids).tolist():
        if expert < 0:
            continue
        pairs = (flat_ids == expert).nonzero(as_tuple=True)[0]
        tokens = token_of_pair[pairs]
        projected = gate_up(x[tokens], expert)
        hidden_act = gated_activation(projected[:, :intermediate], projected[:, intermediate:], swiglu_limit,
                                      oai_alpha, gelu)
        out.index_add_(0, tokens, down(hidden_act, expert) * flat_weights[pairs, None])
    return out.to(x.dtype)


def moe_route_mask(weights: torch.Tensor, ids: torch.Tensor, first_row: int, valid: torch.Tensor | int | None,
                   counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) with the rows at or past `valid` (rows numbered from `first_row`; None: every row is
    real) routed nowhere: id -1, weight 0 (a NaN weight times a skipped expert's zero would still poison the
    sum). `counts` [E + 1] int64: += the result's pairs per expert, -1 counted at index E."""
    if valid is not None:
        rows = torch.arange(first_row, first_row + ids.shape[0], device=ids.device)
        real = (rows < valid)[:, None]
        weights, ids = torch.where(real, weights, 0.0), torch.where(real, ids, -1)
    if counts is not None:
        add_counts(counts, ids)
    return weights, ids


def moe_local_slots(routing: torch.Tensor, expert_start: int, num_local: int,
                    counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing rows gathered from every EP rank, float32 [R, 2k] (k global ids, -1 = none, then k weights),
    as this rank's (local ids int32 [R, k], weights float32 [R, k]): experts outside [expert_start,
    expert_start + num_local) become -1 with weight 0. `counts` [E + 1] int64: += the global pairs per
    expert (the whole group's routing)."""
    top_k = routing.shape[1] // 2
    ids, weights = routing[:, :top_k].to(torch.int64), routing[:, top_k:]
    if counts is not None:
        add_counts(counts, ids)
    local = ids - expert_start
    mine = (ids >= 0) & (local >= 0) & (local < num_local)
    return torch.where(mine, local, -1).to(torch.int32), torch.where(mine, weights.float(), 0.0)


def add_counts(counts: torch.Tensor, ids: torch.Tensor) -> None:
    """counts[e] += pairs routed to e; ids of -1 land in counts[E]. No host sync (capturable)."""
    flat = ids.reshape(-1).long()
    flat = torch.where(flat >= 0, flat, counts.numel() - 1)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
