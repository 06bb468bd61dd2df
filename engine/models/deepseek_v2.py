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
from engine.layers.linear import ReplicatedLinear
from engine.layers.mla import MLAAttention
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, is_mtp_layer_tensor

# An MTP layer's own tensors (checkpoint names under model.layers.{num_hidden_layers}.) and ours.
_MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
            "shared_head.norm.weight": "shared_head_norm.weight"}
# Tensors an MTP layer ships that are the target's (the embedding and the head): shared, not loaded twice.
_MTP_SHARED = ("embed_tokens.", "shared_head.head.")


class MultiTokenPredictor(nn.Module):
    """DeepSeek-V3's multi-token-prediction layer (also GLM-4.5's, Kimi-K2's), the drafter of
    speculative_config method "mtp": the next token's embedding and the previous position's hidden state,
    each RMS-normed, concatenated (embedding first) and projected back to the hidden size; one decoder layer
    of the target's kind (MLA, experts) with its own cache; `shared_head.norm`, then the target's head.
    `forward` returns (normed hidden for the head, the pre-norm hidden the next draft step takes)."""

    def __init__(self, config, decoder_layer: nn.Module, make_norm) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.enorm = make_norm(hidden, config.rms_norm_eps)
        self.hnorm = make_norm(hidden, config.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden)
        self.block = decoder_layer
        self.shared_head_norm = make_norm(hidden, config.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, previous_hidden: torch.Tensor, positions: torch.Tensor):
        embeds = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(embeds), embeds)
        hidden = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(previous_hidden)), dim=-1))
        hidden, residual = self.block(positions, hidden, None)
        return self.shared_head_norm(hidden, residual)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping = {
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    supports_mtp = True

    def __init__(self, config, residual_dtype: torch.dtype | None = None, mtp: bool = False) -> None:
        """`mtp`: build the checkpoint's first multi-token-prediction layer (speculative decoding's drafter),
        which is otherwise skipped."""
        super().__init__(config, residual_dtype)
        self.mtp = None
        if mtp:
            index = config.num_hidden_layers
            layer = LlamaDecoderLayer(config, self.build_attention(index), self.build_mlp(index), residual_dtype,
                                      self.make_norm)
            self.mtp = MultiTokenPredictor(config, layer, self.make_norm)

    def mtp_forward(self, input_ids: torch.Tensor, previous_hidden: torch.Tensor, positions: torch.Tensor):
        return self.mtp(self.model.embed_tokens(input_ids), previous_hidden, positions)

    @classmethod
    def mtp_checkpoint_layout(cls, config, layout: list[tuple[str, tuple[int, ...]]]) -> list:
        """The MTP layer's tensors as a checkpoint names them, shaped as the last decoder layer's (which is a
        MoE layer like it) plus its own: for dummy weights."""
        last, index, hidden = config.num_hidden_layers - 1, config.num_hidden_layers, config.hidden_size
        prefix = f"model.layers.{last}."
        extra = [(f"model.layers.{index}.{name[len(prefix):]}", shape) for name, shape in layout
                 if name.startswith(prefix)]
        extra += [(f"model.layers.{index}.{name}", (hidden,)) for name in ("enorm.weight", "hnorm.weight",
                                                                             "shared_head.norm.weight")]
        extra.append((f"model.layers.{index}.eh_proj.weight", (hidden, 2 * hidden)))
        return layout + extra

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

    def remap_checkpoint_name(self, name: str) -> str | None:
        config = self.config
        if not is_mtp_layer_tensor(name, config, getattr(config, "num_nextn_predict_layers", 0) or 0):
            return name
        prefix = f"model.layers.{config.num_hidden_layers}."
        if self.mtp is None or not name.startswith(prefix):  # not asked for, or a second MTP layer
            return None
        rest = name[len(prefix):]
        if rest.startswith(_MTP_SHARED):
            return None
        return "mtp." + _MTP_OWN.get(rest, "block." + rest)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    def router_config(self) -> RouterConfig:
        config = self.config
        return RouterConfig("grouped_topk", config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob),
                            scoring="sigmoid", num_groups=config.n_group or 1, topk_groups=config.topk_group or 1,
                            routed_scaling_factor=float(config.routed_scaling_factor), correction_bias=True)
