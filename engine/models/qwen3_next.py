"""Qwen3-Next (Qwen3-Next-80B-A3B) and Qwen3.5 (dense `Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`): hybrids of
Gated DeltaNet layers (`layer_types` "linear_attention", engine/layers/gated_delta_net.py) and gated full
attention (q_proj gives each head's query and an output gate: out * sigmoid(gate)), q/k norms and every other
norm zero-centred ((1 + w) in float32), partial RoPE (a quarter of each head by default); MoE layers with
softmax top-k routing and a shared expert scaled by sigmoid(shared_expert_gate(x)), dense MLPs elsewhere.

Checkpoint names: the Gated DeltaNet sits at `linear_attn` (ours at `self_attn`, the decoder's one token
mixer); Qwen3-Next fuses its in-projections interleaved per key-head group, Qwen3.5 keeps them apart (see the
layer); `mlp.shared_expert` is our `mlp.shared_experts`. Prefix caching is off for these models (their
recurrent state is not cached per prefix), as the start-up log says."""
from __future__ import annotations

import re

import torch
from torch import nn

from engine.kernels.attention import AttentionOptions
from engine.layers.attention import Attention
from engine.layers.fused_moe import FusedMoE, RouterConfig, num_routed_experts
from engine.layers.gated_delta_net import GatedDeltaNet
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import QKVParallelLinear, RowParallelLinear
from engine.layers.rotary_embedding import RotaryEmbedding
from engine.models.llama import LlamaForCausalLM, LlamaMLP, head_dim_of, rotary_dim_of
from engine.models.mtp import QwenMultiTokenPredictionMixin
from engine.models.qwen3_moe import qwen_sparse_layer

LAYER_TYPES = ("linear_attention", "full_attention")


class GatedAttention(nn.Module):
    """Full attention whose q_proj gives, per head, the query and a gate of the same width: the attention
    output times sigmoid(gate), then o_proj. The query/gate pairs are held as twice the heads in the fused
    QKV projection (head 2h the query, 2h + 1 the gate), so TP splits them in whole heads."""

    def __init__(self, config) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, 2 * config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias)
        self.num_heads = self.qkv_proj.num_heads // 2
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        start, size = self.qkv_proj.q_shard
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias,
                                        input_shard=(start // 2, size // 2))
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, style="offset")
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, style="offset")
        self.rotary_emb = RotaryEmbedding(config, self.head_dim, rotary_dim_of(config, self.head_dim),
                                          config.max_position_embeddings)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads,
                              AttentionOptions())

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qg, k, v = self.qkv_proj(hidden_states).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        qg = qg.reshape(-1, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., :self.head_dim], qg[..., self.head_dim:]
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, rope=self.rotary_emb.rope_args(positions))
        return self.o_proj(out * torch.sigmoid(gate.reshape(out.shape)))


class Qwen3NextForCausalLM(QwenMultiTokenPredictionMixin, LlamaForCausalLM):
    norm_style = "offset"  # (1 + w) in float32, every norm of the model

    def __init__(self, config, residual_dtype: torch.dtype | None = None, mtp: bool = False) -> None:
        types = list(config.layer_types)
        unknown = sorted(set(types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"{type(self).__name__}: layer_types {unknown} are not known (known: {LAYER_TYPES})")
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        self.layer_types = types
        super().__init__(config, residual_dtype, mtp)

    def build_attention(self, layer_index: int) -> nn.Module:
        if self.layer_types[layer_index] == "linear_attention":
            return GatedDeltaNet(self.config)
        return GatedAttention(self.config)

    def build_mtp_attention(self) -> nn.Module:
        return GatedAttention(self.config)

    def is_sparse_layer(self, layer_index: int) -> bool:
        return qwen_sparse_layer(self.config, layer_index)

    def build_mlp(self, layer_index: int) -> nn.Module:
        config = self.config
        if not self.is_sparse_layer(layer_index):
            return LlamaMLP(config)
        # Qwen3.5-MoE's config has no norm_topk_prob: its router always renormalises.
        router = RouterConfig("softmax_topk", config.num_experts_per_tok,
                              renormalize=bool(getattr(config, "norm_topk_prob", True)))
        shared = None
        if getattr(config, "shared_expert_intermediate_size", 0):
            shared = LlamaMLP(config, intermediate_size=config.shared_expert_intermediate_size, reduce_results=False)
        return FusedMoE(num_routed_experts(config), config.hidden_size, config.moe_intermediate_size, router,
                        shared_experts=shared, shared_expert_gate=shared is not None)

    def checkpoint_module_name(self, name: str) -> str:
        """The checkpoint's name of our module `name` (a quantization config's exclusions name those, e.g.
        `model.layers.0.linear_attn.in_proj_ba`): a Gated DeltaNet layer's `self_attn` is its `linear_attn`,
        the shared experts are its `shared_expert`, and the MTP layer is under `mtp.`."""
        if name.startswith("mtp."):
            name = self.mtp_module_checkpoint_name(name)
        else:
            layer = re.match(r"model\.layers\.(\d+)\.self_attn(\.|$)", name)
            if layer and self.layer_types[int(layer[1])] == "linear_attention":
                name = name.replace(".self_attn", ".linear_attn", 1)
        return name.replace(".mlp.shared_experts", ".mlp.shared_expert")

    def remap_checkpoint_name(self, name: str) -> str | None:
        if name.startswith("mtp."):  # the multi-token-prediction layer: built only for speculative decoding
            name = self.mtp_checkpoint_name(name)
            if name is None:
                return None
        name = name.replace(".linear_attn.", ".self_attn.")
        return name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5: the Gated DeltaNet's in-projections apart and contiguous; dense MLPs in every layer."""
    packed_modules_mapping = {
        **Qwen3NextForCausalLM.packed_modules_mapping,
        "in_proj_qkv": ("in_proj_qkvz", "qkv"),
        "in_proj_z": ("in_proj_qkvz", "z"),
        "in_proj_b": ("in_proj_ba", "b"),
        "in_proj_a": ("in_proj_ba", "a"),
    }

    def is_sparse_layer(self, layer_index: int) -> bool:
        return False


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE: every layer's MLP is the mixture of experts (no dense layers)."""

    def is_sparse_layer(self, layer_index: int) -> bool:
        return True
