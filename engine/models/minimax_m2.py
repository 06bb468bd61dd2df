"""MiniMax-M2: Mixtral's layout (`block_sparse_moe`, experts `w1`/`w3`/`w2` of width `intermediate_size`)
with sigmoid routing steered by a per-expert correction bias (one group, renormalised), partial rotary
(`rotary_dim`), and RMSNorm on queries and keys over all heads' features at once, before RoPE."""
from __future__ import annotations

import torch
from torch import nn

from engine.layers.fused_moe import RouterConfig
from engine.models.llama import LlamaAttention, head_dim_of, is_mtp_layer_tensor
from engine.models.mixtral import MixtralForCausalLM
from engine.parallel import get_parallel_state, tensor_parallel_all_reduce


class AllHeadsRMSNorm(nn.Module):
    """RMSNorm over the concatenated features of all heads, of which this rank holds heads
    [head_start, head_start + num_local_heads) of `total_heads`. The mean square is taken over the whole
    width, so under tensor parallelism the per-token sums of squares are added across the TP group; a head
    replicated on several ranks (fewer KV heads than ranks) is counted once."""

    def __init__(self, total_heads: int, head_start: int, num_local_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.eps, self.head_dim = eps, head_dim
        self.total_width = total_heads * head_dim
        self.start, self.width = head_start * head_dim, num_local_heads * head_dim
        tp_size = get_parallel_state().tp_size
        self.replicas = tp_size // total_heads if total_heads < tp_size else 1
        self.weight = nn.Parameter(torch.ones(self.width), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != (self.total_width,):
            raise ValueError(f"shape {tuple(loaded.shape)}, expected ({self.total_width},)")
        param.data.copy_(loaded[self.start:self.start + self.width])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, local heads, head_dim] -> the same shape, normalised (transformers' order: normalise in
        float32, round to x's dtype, then scale)."""
        flat = x.reshape(x.shape[0], self.width).float()
        sum_of_squares = flat.square().sum(dim=-1, keepdim=True)
        sum_of_squares = tensor_parallel_all_reduce(sum_of_squares)
        if self.replicas > 1:
            sum_of_squares = sum_of_squares / self.replicas
        normed = flat * torch.rsqrt(sum_of_squares / self.total_width + self.eps)
        return (normed.to(x.dtype) * self.weight).view_as(x)


class MiniMaxM2Attention(LlamaAttention):
    def __init__(self, config) -> None:
        super().__init__(config, qkv_bias=False, o_bias=False, qk_norm=False)
        qkv, head_dim, eps = self.qkv_proj, head_dim_of(config), config.rms_norm_eps
        # LlamaAttention applies q_norm / k_norm to [T, heads, head_dim] before the rotation.
        self.q_norm = AllHeadsRMSNorm(config.num_attention_heads, qkv.q_head_start, qkv.num_heads, head_dim, eps)
        self.k_norm = AllHeadsRMSNorm(config.num_key_value_heads, qkv.kv_head_start, qkv.num_kv_heads, head_dim, eps)


class MiniMaxM2ForCausalLM(MixtralForCausalLM):
    def __init__(self, config, residual_dtype: torch.dtype | None = None) -> None:
        scoring = getattr(config, "scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ValueError(f"MiniMax-M2 with scoring_func={scoring!r} is not supported (only 'sigmoid')")
        if getattr(config, "shared_intermediate_size", 0):
            raise ValueError("MiniMax-M2 with shared experts (shared_intermediate_size > 0) is not supported")
        super().__init__(config, residual_dtype)

    def router_config(self) -> RouterConfig:
        return RouterConfig("grouped_topk", self.config.num_experts_per_tok, renormalize=True, scoring="sigmoid",
                            correction_bias=True)

    def build_attention(self, layer_index: int) -> nn.Module:
        return MiniMaxM2Attention(self.config)

    def remap_checkpoint_name(self, name: str) -> str | None:
        if is_mtp_layer_tensor(name, self.config, getattr(self.config, "num_mtp_modules", 0) or 0):
            return None
        name = super().remap_checkpoint_name(name)
        # Checkpoints keep the bias beside the gate (`block_sparse_moe.e_score_correction_bias`, transformers'
        # `mlp.e_score_correction_bias`); ours belongs to the gate.
        return name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
