"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (`glm4_moe`): Llama's attention with a QKV bias (`attention_bias`),
neox-style RoPE over the first half of each head (partial_rotary_factor 0.5) and optional per-head QK
norm; the first `first_k_dense_replace` layers keep a dense MLP, the others are mixtures of experts routed
DeepSeek-V3's way (sigmoid scores, a correction bias that steers the choice, group-limited top-k, scaled
weights) beside always-on shared experts."""
from __future__ import annotations

import torch
from torch import nn

from engine.layers.fused_moe import FusedMoE, RouterConfig, num_routed_experts
from engine.models.llama import LlamaForCausalLM, LlamaMLP
from engine.models.mtp import MultiTokenPredictionMixin


class Glm4MoeForCausalLM(MultiTokenPredictionMixin, LlamaForCausalLM):
    @staticmethod
    def attention_flags(config, bias: bool) -> dict:
        return {"qkv_bias": bias, "o_bias": False, "qk_norm": bool(getattr(config, "use_qk_norm", False))}

    def build_mlp(self, layer_index: int) -> nn.Module:
        config = self.config
        if layer_index < config.first_k_dense_replace:
            return LlamaMLP(config)
        router = RouterConfig("grouped_topk", config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob),
                              scoring="sigmoid", num_groups=config.n_group, topk_groups=config.topk_group,
                              routed_scaling_factor=config.routed_scaling_factor, correction_bias=True)
        num_shared = getattr(config, "n_shared_experts", 0) or 0
        # One MLP as wide as all shared experts together, as transformers builds it (named `shared_experts`,
        # as in checkpoints); its partial sum is reduced with the routed experts'.
        shared = (LlamaMLP(config, intermediate_size=config.moe_intermediate_size * num_shared, reduce_results=False)
                  if num_shared else None)
        # transformers keeps GLM's router weight in float32 whatever the model's dtype: so do we.
        return FusedMoE(num_routed_experts(config), config.hidden_size, config.moe_intermediate_size, router,
                        shared_experts=shared, router_dtype=torch.float32)
