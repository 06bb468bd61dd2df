"""gpt-oss (gpt-oss-20b, gpt-oss-120b): a Llama-shaped decoder whose layers alternate 128-token sliding-window
and full attention (`layer_types`), each head with a learned attention sink; biased q/k/v/o projections; yarn
RoPE over the whole head (neox halves); norms with float32 weights; and a mixture of experts in every layer:
a biased router (top k of the logits, softmax over the k), experts with biases and the clamped activation
(up + 1) * gate * sigmoid(1.702 * gate), gate and up interleaved in the checkpoint's fused tensors.

Checkpoint names: `self_attn.{q,k,v,o}_proj`, `self_attn.sinks`, `mlp.router.{weight,bias}`,
`mlp.experts.{gate_up_proj,down_proj}[_bias]` (bf16, [E, in, out]) or the published MXFP4
`mlp.experts.{gate_up_proj,down_proj}_{blocks,scales}` ([E, out, in / 32, 16] and [E, out, in / 32])."""
from __future__ import annotations

import torch
from torch import nn

from engine.kernels.attention import AttentionOptions
from engine.layers.attention import Attention
from engine.layers.fused_moe import FusedMoE, RouterConfig, num_routed_experts
from engine.layers.linear import QKVParallelLinear, RowParallelLinear
from engine.layers.rotary_embedding import RotaryEmbedding
from engine.models.llama import LlamaForCausalLM, head_dim_of

LAYER_TYPES = ("sliding_attention", "full_attention")

# gpt-oss's activation constant: transformers before 5.2x has no `swiglu_alpha` in the config and uses this.
GPT_OSS_ALPHA = 1.702


def layer_types_of(config) -> list[str]:
    """Each layer's attention kind: the config's `layer_types`, else transformers' default (sliding on even
    layers, full on odd ones). Anything else is refused by name."""
    types = getattr(config, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config.num_hidden_layers)]
    types = list(types)
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"layer_types lists {len(types)} layers, the model has {config.num_hidden_layers}")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not known for gpt-oss (known: {LAYER_TYPES})")
    return types


class GptOssAttention(nn.Module):
    def __init__(self, config, layer_type: str) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", True))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias,
                                        input_shard=self.qkv_proj.q_shard)
        self.rotary_emb = RotaryEmbedding(config, self.head_dim, self.head_dim, config.max_position_embeddings)
        window = config.sliding_window if layer_type == "sliding_attention" else None
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads,
                              AttentionOptions(window=window), sinks=True)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, rope=self.rotary_emb.rope_args(positions)))


class GptOssForCausalLM(LlamaForCausalLM):
    norm_style = "float32"  # transformers keeps gpt-oss's norm weights in float32 and multiplies there
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}

    def __init__(self, config, residual_dtype: torch.dtype | None = None) -> None:
        self.layer_types = layer_types_of(config)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"gpt-oss with hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        if "sliding_attention" in self.layer_types and not getattr(config, "sliding_window", None):
            raise ValueError("gpt-oss: layer_types has sliding layers but the config gives no sliding_window")
        super().__init__(config, residual_dtype)

    def build_attention(self, layer_index: int) -> nn.Module:
        return GptOssAttention(self.config, self.layer_types[layer_index])

    def build_mlp(self, layer_index: int) -> nn.Module:
        config = self.config
        # Top k of the logits, softmax over the k: softmax over all experts renormalised over the chosen k.
        router = RouterConfig("softmax_topk", config.num_experts_per_tok, renormalize=True)
        return FusedMoE(num_routed_experts(config), config.hidden_size, config.intermediate_size, router,
                        swiglu_limit=float(config.swiglu_limit),
                        oai_alpha=float(getattr(config, "swiglu_alpha", GPT_OSS_ALPHA)),
                        expert_bias=True, router_bias=True, checkpoint_layout="gpt_oss")

    def remap_checkpoint_name(self, name: str) -> str | None:
        return name.replace(".mlp.router.", ".mlp.gate.").replace(".self_attn.sinks", ".self_attn.attn.sinks")
