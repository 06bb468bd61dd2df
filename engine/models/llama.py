"""Llama family (Llama 2/3, SmolLM2, ...): the decoder that Qwen2 and Qwen3 also build on.

Variants differ only in flags: bias on the QKV projection (Qwen2), per-head RMSNorm on queries and keys
before RoPE (Qwen3), and tied or untied input/output embeddings.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from engine.layers.attention import Attention
from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.rotary_embedding import RotaryEmbedding


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_attention_shape(config, layer_index: int) -> tuple[int, int]:
    """(head size, KV heads) of one layer: transformers' per-layer overrides in a heterogeneous config (Gemma
    4's full layers: global_head_dim, num_global_key_value_heads; there the global head_dim is ambiguous and
    reading it raises), else the config's one shape."""
    if vars(config).get("_heterogeneity_spec") is not None:
        config = config.per_layer_config[layer_index]
        return int(config.head_dim), int(config.num_key_value_heads)
    heads = getattr(config, "num_attention_heads", 1) or 1
    return int(head_dim_of(config)), int(getattr(config, "num_key_value_heads", None) or heads)


def rotary_dim_of(config, head_dim: int) -> int:
    """The rotated features per head: partial_rotary_factor (in rope_parameters with transformers 5, a
    top-level attribute before), else a `rotary_dim` attribute, else the whole head."""
    from engine.layers.rotary_embedding import rope_parameters
    factor = rope_parameters(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if factor is not None:
        return int(head_dim * factor)
    return int(getattr(config, "rotary_dim", None) or head_dim)


_LAYER_PREFIX = re.compile(r"^model\.layers\.(\d+)\.")


def is_mtp_layer_tensor(name: str, config, num_mtp_layers: int) -> bool:
    """Whether a checkpoint tensor belongs to one of the `num_mtp_layers` multi-token-prediction layers that
    some checkpoints (GLM-4.5, MiniMax-M2, DeepSeek-V3) store after the last decoder layer; they are for
    speculative decoding and are not built here."""
    match = _LAYER_PREFIX.match(name)
    layers = config.num_hidden_layers
    return match is not None and layers <= int(match.group(1)) < layers + num_mtp_layers


class LlamaAttention(nn.Module):
    def __init__(self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool, input_size: int | None = None) -> None:
        """`input_size`: the width q, k and v are projected from (default the hidden size; an EAGLE3 drafter's
        layer takes twice that)."""
        super().__init__()
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(input_size or config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=o_bias,
                                        input_shard=self.qkv_proj.q_shard)
        rotary_dim = rotary_dim_of(config, self.head_dim)
        self.rotary_emb = RotaryEmbedding(config, self.head_dim, rotary_dim, config.max_position_embeddings)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        # The attention backend applies the rotation (fused with its KV-cache write where it can).
        return self.o_proj(self.attn(q, k, v, rope=self.rotary_emb.rope_args(positions)))


class LlamaMLP(nn.Module):
    """`intermediate_size` defaults to the config's; `reduce_results=False` leaves the TP partial sum
    unreduced (a MoE layer's shared experts, reduced with the routed ones)."""

    def __init__(self, config, intermediate_size: int | None = None, reduce_results: bool = True) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        bias = getattr(config, "mlp_bias", False)
        intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, config.hidden_size, bias=bias,
                                           reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_gated(x))


class LlamaDecoderLayer(nn.Module):
    """`residual_dtype` float32: the stream that the attention and MLP outputs add to stays float32
    between layers (see ops.fused_add_rms_norm); the GEMMs' inputs and outputs stay in the activations'
    dtype."""

    def __init__(self, config, self_attn: nn.Module, mlp: nn.Module, residual_dtype: torch.dtype | None = None,
                 make_norm=RMSNorm) -> None:
        """`make_norm(hidden_size, eps)`: the family's norm (RMSNorm by default; gpt-oss: float32 weights)."""
        super().__init__()
        self.residual_dtype = residual_dtype  # None: the embedding's (the activations') dtype
        # An EAGLE3 drafter reads some layers' input (the previous layer's output, residual added): set, the
        # layer keeps it in `captured` at each forward.
        self.capture_input = False
        self.captured: torch.Tensor | None = None
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = make_norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = make_norm(config.hidden_size, config.rms_norm_eps)
        # Both blocks' outputs go to an RMSNorm with the residual (this layer's, the next layer's or the
        # model's final one), which reduces their row-parallel sums in the same kernel.
        for block, name in ((self_attn, "o_proj"), (mlp, "down_proj")):
            projection = getattr(block, name, None)
            if isinstance(projection, RowParallelLinear):
                projection.reduce_in_norm = True

    def forward(self, positions, hidden_states, residual):
        if residual is None:  # the first layer: the stream starts at the embedding
            residual = hidden_states.to(self.residual_dtype or hidden_states.dtype)  # no copy if the same
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if self.capture_input:
            self.captured = residual
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config, build_attention, build_mlp, residual_dtype: torch.dtype | None = None,
                 make_norm=RMSNorm) -> None:
        """`build_attention(layer index)` and `build_mlp(layer index)` make each layer's blocks;
        `make_norm(hidden_size, eps)` every norm of the decoder stack (the layers' and the final one)."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, build_attention(i), build_mlp(i), residual_dtype,
                                                      make_norm)
                                    for i in range(config.num_hidden_layers))
        self.norm = make_norm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # checkpoint projection name -> (our fused parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    norm_style = "llama"  # a family's RMSNorm style (engine.layers.layernorm.RMSNorm)

    def __init__(self, config, residual_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.build_attention, self.build_mlp, residual_dtype=residual_dtype,
                                make_norm=self.make_norm)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_norm(self, hidden_size: int, eps: float) -> nn.Module:
        return RMSNorm(hidden_size, eps, style=self.norm_style)

    @staticmethod
    def attention_flags(config, bias: bool) -> dict:
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}

    def build_attention(self, layer_index: int) -> nn.Module:
        config = self.config
        return LlamaAttention(config, **self.attention_flags(config, getattr(config, "attention_bias", False)))

    def build_mlp(self, layer_index: int) -> nn.Module:
        return LlamaMLP(self.config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)
