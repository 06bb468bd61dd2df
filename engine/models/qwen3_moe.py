"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head QK norm) with a mixture of
experts in place of the MLP: softmax top-k routing, renormalised when `norm_topk_prob`, no shared expert.
Layers listed in `mlp_only_layers`, or off the `decoder_sparse_step` grid, keep a dense MLP."""
from __future__ import annotations

from torch import nn

from engine.layers.fused_moe import FusedMoE, RouterConfig, num_routed_experts
from engine.models.llama import LlamaMLP
from engine.models.qwen3 import Qwen3ForCausalLM


def qwen_sparse_layer(config, layer_index: int) -> bool:
    """Qwen's MoE placement (Qwen3-MoE, Qwen3-Next): experts unless the layer is in `mlp_only_layers` or off
    the `decoder_sparse_step` grid."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_index not in (getattr(config, "mlp_only_layers", None) or [])
            and num_routed_experts(config) > 0 and (layer_index + 1) % step == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def is_sparse_layer(self, layer_index: int) -> bool:
        return qwen_sparse_layer(self.config, layer_index)

    def build_mlp(self, layer_index: int) -> nn.Module:
        config = self.config
        if not self.is_sparse_layer(layer_index):
            return LlamaMLP(config)
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        router = RouterConfig("softmax_topk", config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob))
        return FusedMoE(num_routed_experts(config), config.hidden_size, config.moe_intermediate_size, router)
