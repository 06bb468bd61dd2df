"""DeepSeek-V2 / V2-Lite and DeepSeek-V3 / R1 (also Kimi-K2 and Moonlight, which ship the V3 architecture):
multi-head latent attention (engine/layers/mla.py) in every layer; the first `first_k_dense_replace` layers
keep a dense MLP, the rest are mixtures of experts beside `n_shared_experts` always-on experts.

Routing, as transformers implements it: V3 scores experts by sigmoid, chooses them by score + a correction
bias within the `topk_group` best of `n_group` groups (a group's rank: its two best biased scores), weights
them by unbiased score, renormalised when `norm_topk_prob`, times `routed_scaling_factor`. V2 scores by
softmax and chooses the top k over all experts (`greedy`) or within the best groups (`group_limited_greedy`,
a group's rank: its best score), never renormalises (transformers ignores V2's norm_topk_prob), and scales.
Both keep the router weight in float32."""
from __future__ import annotations

import torch
from torch import nn


from engine.layers.fused_moe import FusedMoE, RouterConfig, num_routed_experts
from engine.layers.mla import MLAAttention
from engine.models.llama import LlamaForCausalLM, LlamaMLP
from engine.models.mtp import MultiTokenPredictionMixin

class DeepseekV2ForCausalLM(MultiTokenPredictionMixin, LlamaForCausalLM):
    packed_modules_mapping = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def build_attention(self, layer_index: int) -> nn.Module:
        return MLAAttention(self.config)

    def is_sparse_layer(self, layer_index: int) -> bool:
        # DeepSeek's own code also asks `layer % moe_layer_freq == 0` (transformers does not; every published
        # config has moe_layer_freq 1).
        config = self.config
        return (num_routed_experts(config) > 0 and layer_index >= (config.first_k_dense_replace or 0)
                and layer_index % (getattr(config, "moe_layer_freq", 1) or 1) == 0)

    def router_config(self) -> RouterConfig:
        config = self.config
        method = getattr(config, "topk_method", None) or "greedy"
        scaling = float(config.routed_scaling_factor)
        if method == "greedy":
            return RouterConfig("softmax_topk", config.num_experts_per_tok, renormalize=False,
                                routed_scaling_factor=scaling)
        if method == "group_limited_greedy":
            return RouterConfig("grouped_topk", config.num_experts_per_tok, renormalize=False, scoring="softmax",
                                num_groups=config.n_group, topk_groups=config.topk_group,
                                routed_scaling_factor=scaling)
        raise ValueError(f"DeepSeek-V2 topk_method {method!r} is not supported (greedy, group_limited_greedy)")

    def build_mlp(self, layer_index: int) -> nn.Module:
        config = self.config
        if not self.is_sparse_layer(layer_index):
            return LlamaMLP(config)
        num_shared = getattr(config, "n_shared_experts", 0) or 0
        # One MLP as wide as all shared experts together (`shared_experts`, as in checkpoints); its partial
        # sum is reduced with the routed experts'.
        shared = (LlamaMLP(config, intermediate_size=config.moe_intermediate_size * num_shared, reduce_results=False)
                  if num_shared else None)
        return FusedMoE(num_routed_experts(config), config.hidden_size, config.moe_intermediate_size,
                        self.router_config(), shared_experts=shared, router_dtype=torch.float32)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    def router_config(self) -> RouterConfig:
        config = self.config
        return RouterConfig("grouped_topk", config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob),
                            scoring="sigmoid", num_groups=config.n_group or 1, topk_groups=config.topk_group or 1,
                            routed_scaling_factor=float(config.routed_scaling_factor), correction_bias=True)
