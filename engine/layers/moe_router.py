"""MoE routing: how a model chooses its experts (`RouterConfig`, the `ROUTERS` registry of routing functions)
and the gate layer that computes the router logits (`Router`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.kernels import ops


@dataclass(frozen=True)
class RouterConfig:
    """How a model chooses its experts. `kind` names an entry of ROUTERS."""
    kind: str                      # "softmax_topk" | "grouped_topk" | "scored_topk"
    top_k: int
    renormalize: bool = True
    scoring: str = "softmax"       # grouped_topk: "softmax" | "sigmoid"; scored_topk: also "sqrtsoftplus"
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False  # a learned per-expert bias added to the scores for selection only


def _softmax_topk(logits: torch.Tensor, config: RouterConfig, bias: torch.Tensor | None):
    weights, ids = ops.moe_topk_softmax(logits, config.top_k, config.renormalize)
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    return weights, ids


def _grouped_topk(logits: torch.Tensor, config: RouterConfig, bias: torch.Tensor | None):
    return ops.moe_grouped_topk(logits, config.top_k, config.renormalize, config.num_groups, config.topk_groups,
                                config.scoring, bias, config.routed_scaling_factor)


# Expert scores from float32 router logits [T, E].
SCORING = {
    "softmax": lambda logits: torch.softmax(logits, dim=-1),
    "sigmoid": torch.sigmoid,
    "sqrtsoftplus": lambda logits: torch.nn.functional.softplus(logits).sqrt(),  # DeepSeek-V4
}


def _weigh_chosen(scores: torch.Tensor, ids: torch.Tensor, config: RouterConfig) -> torch.Tensor:
    """The chosen experts' unbiased scores, renormalised (+1e-20) if asked, times the scaling factor."""
    weights = scores.gather(1, ids.long())
    if config.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * config.routed_scaling_factor if config.routed_scaling_factor != 1.0 else weights


def _scored_topk(logits: torch.Tensor, config: RouterConfig, bias: torch.Tensor | None):
    """Top k of score + bias over all experts, weighted by the unbiased scores (DeepSeek-V4: sqrtsoftplus).
    Plain torch on every backend: one small op per layer."""
    scores = SCORING[config.scoring](logits.float())
    choice = scores if bias is None else scores + bias.float()
    ids = torch.topk(choice, config.top_k, dim=-1, sorted=False)[1]
    return _weigh_chosen(scores, ids, config), ids.to(torch.int32)


def fixed_route_weights(logits: torch.Tensor, config: RouterConfig, ids: torch.Tensor) -> torch.Tensor:
    """Weights of experts chosen elsewhere (DeepSeek-V4's hash-routed layers: ids = tid2eid[input_ids]): the
    router's scores of those experts, renormalised and scaled as `config` says."""
    return _weigh_chosen(SCORING[config.scoring](logits.float()), ids, config)


# The router registry: kind -> (router logits [T, E] float32, config, correction bias) -> (weights, ids).
ROUTERS = {
    "softmax_topk": _softmax_topk,   # Mixtral, Qwen3-MoE (renormalize = norm_topk_prob)
    "grouped_topk": _grouped_topk,   # DeepSeek-V2/V3, GLM-4.5 (sigmoid + bias + groups), MiniMax-M2 (1 group)
    "scored_topk": _scored_topk,     # DeepSeek-V4 (sqrtsoftplus + bias, no groups)
}


def check_router(config: RouterConfig, num_experts: int) -> None:
    if config.kind not in ROUTERS:
        raise ValueError(f"unknown MoE router {config.kind!r}; known: {sorted(ROUTERS)}")
    if not 0 < config.top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={config.top_k} must be in [1, {num_experts}]")
    scorings = tuple(SCORING) if config.kind == "scored_topk" else ("softmax", "sigmoid")
    if config.scoring not in scorings:
        raise ValueError(f"MoE scoring function {config.scoring!r} is not supported by the {config.kind} router "
                         f"({', '.join(scorings)})")
    if num_experts % config.num_groups or not 0 < config.topk_groups <= config.num_groups:
        raise ValueError(f"{num_experts} experts cannot form {config.num_groups} groups with topk_group="
                         f"{config.topk_groups}")


class Router(nn.Module):
    """The gate: router logits accumulated and returned in float32, unrounded (the choice between near-tied
    experts decides whole outputs), and the selection bias where there is one. The weight is held in the
    model's dtype (one skinny GEMM with a float32 output on GPUs), or in float32 where the model's own
    router weight is float32 (GLM-4.5, DeepSeek-V3: `weight_dtype=torch.float32`)."""

    def __init__(self, num_experts: int, hidden_size: int, correction_bias: bool,
                 weight_dtype: torch.dtype | None = None, logit_bias: bool = False) -> None:
        """`logit_bias`: a learned bias added to every logit (gpt-oss's router is a biased linear layer)."""
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=weight_dtype), requires_grad=False)
        if logit_bias:
            self.bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
            self.bias.weight_loader = lambda param, loaded: param.data.copy_(loaded.float())
        else:
            self.register_parameter("bias", None)
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                        requires_grad=False)
        else:
            self.register_parameter("e_score_correction_bias", None)

    def route(self, x: torch.Tensor, config: RouterConfig,
              expert_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, ids [T, k] int32); `expert_ids` given: those experts, weighted by score."""
        if self.weight.dtype == torch.float32 or x.dtype == torch.float32:
            logits = torch.nn.functional.linear(x.float(), self.weight.float())
        else:
            logits = ops.gemm_float32(x, self.weight)
        if self.bias is not None:
            logits = logits + self.bias
        if expert_ids is not None:
            return fixed_route_weights(logits, config, expert_ids), expert_ids.to(torch.int32)
        return ROUTERS[config.kind](logits, config, self.e_score_correction_bias)
