"""Mixtral (8x7B, 8x22B): Llama's attention with a mixture of experts in place of every MLP: softmax over
the experts, the top k, always renormalised; no shared expert. Checkpoints name the block
`block_sparse_moe` (experts `w1`/`w3`/`w2`), ours is `mlp`."""
from __future__ import annotations

import torch
from torch import nn

from engine.layers.fused_moe import FusedMoE, RouterConfig, num_routed_experts
from engine.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    def __init__(self, config, residual_dtype: torch.dtype | None = None) -> None:
        window = getattr(config, "sliding_window", None)
        if window is not None and window < config.max_position_embeddings:
            raise ValueError(f"{type(self).__name__} with sliding_window={window} (below max_position_embeddings="
                             f"{config.max_position_embeddings}) is not supported: sliding-window attention is "
                             f"not implemented yet")
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        super().__init__(config, residual_dtype)

    def router_config(self) -> RouterConfig:
        return RouterConfig("softmax_topk", self.config.num_experts_per_tok, renormalize=True)

    def build_mlp(self, layer_index: int) -> nn.Module:
        config = self.config
        # The experts' width is `intermediate_size` (there is no dense MLP to share the name with).
        return FusedMoE(num_routed_experts(config), config.hidden_size, config.intermediate_size,
                        self.router_config())

    def remap_checkpoint_name(self, name: str) -> str | None:
        return name.replace(".block_sparse_moe.", ".mlp.")
