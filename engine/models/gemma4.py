"""Gemma 4 (the text stack: `Gemma4ForCausalLM`, and that of `Gemma4ForConditionalGeneration` through the
multimodal loader), dense: sliding-window layers (their own head size, KV heads and RoPE) and full-attention
layers (wider heads, proportional RoPE over the whole head and, with `attention_k_eq_v`, no V projection: V is
the raw key, normalised apart), per-head q/k norms with float32 weights and a weightless v norm, attention
scale 1, sandwich norms (each block's output normalised before its residual add), a per-layer scalar, a
GELU-tanh gated MLP, embeddings times sqrt(hidden_size) rounded to the activations' dtype, tied embeddings,
final logit soft-capping.

The 26B-A4B variant adds a mixture of experts beside each layer's MLP: routed by the residual stream
(weightless norm, times a learned scale and hidden_size^-1/2, softmax, top k renormalised, times a learned
per-expert scale), fed its own normalised copy, GELU-tanh experts, both outputs normalised and summed.

Not built (refused at start-up by name): the E2B/E4B extras (per-layer input embeddings, KV sharing between
layers, double-wide MLPs), bidirectional attention."""
from __future__ import annotations

import torch
from torch import nn

from engine.kernels import ops
from engine.kernels.attention import AttentionOptions
from engine.layers.attention import Attention
from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from engine.layers.fused_moe import FusedMoE
from engine.layers.moe_router import Router, RouterConfig
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.rotary_embedding import RotaryEmbedding
from engine.models.llama import LlamaForCausalLM, layer_attention_shape

LAYER_TYPES = ("sliding_attention", "full_attention")


def unsupported_features(config) -> list[str]:
    """What this config asks for that is not built here, by name (empty: servable)."""
    missing = []
    if getattr(config, "hidden_size_per_layer_input", 0):
        missing.append("per-layer input embeddings (hidden_size_per_layer_input, Gemma 4 E2B/E4B)")
    if getattr(config, "num_kv_shared_layers", 0):
        missing.append("KV sharing between layers (num_kv_shared_layers, Gemma 4 E2B/E4B)")
    if getattr(config, "use_double_wide_mlp", False):
        missing.append("double-wide MLPs of KV-sharing layers (use_double_wide_mlp)")
    if getattr(config, "use_bidirectional_attention", None):
        missing.append(f"bidirectional attention (use_bidirectional_attention={config.use_bidirectional_attention!r})")
    if getattr(config, "hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        missing.append(f"hidden_activation {config.hidden_activation!r} (only GELU-tanh)")
    unknown = sorted(set(config.layer_types) - set(LAYER_TYPES))
    if unknown:
        missing.append(f"layer types {unknown}")
    return missing


class Gemma4Attention(nn.Module):
    def __init__(self, config, layer_index: int) -> None:
        super().__init__()
        layer_type = config.layer_types[layer_index]
        self.head_dim, num_kv_heads = layer_attention_shape(config, layer_index)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          num_kv_heads, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias,
                                        input_shard=self.qkv_proj.q_shard)
        # V is the raw key (k_eq_v): its rows of the fused projection are the key's, copied once loaded.
        self.k_eq_v = bool(getattr(config, "attention_k_eq_v", False)) and layer_type == "full_attention"
        if self.k_eq_v:
            for param in self.qkv_proj.parameters():
                param.check_loaded = self._check_q_and_k_loaded
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, style="float32")
        self.k_norm = RMSNorm(self.head_dim, eps, style="float32")
        self.v_norm = RMSNorm(self.head_dim, eps, style="none")
        self.rotary_emb = RotaryEmbedding(config, self.head_dim, self.head_dim, config.max_position_embeddings,
                                          layer_type=layer_type)
        window = config.sliding_window if layer_type == "sliding_attention" else None
        self.attn = Attention(self.num_heads, self.head_dim, 1.0, self.num_kv_heads, AttentionOptions(window=window))

    @staticmethod
    def _check_q_and_k_loaded(param: nn.Parameter, shards: set) -> str | None:
        missing = sorted({"q", "k"} - shards)
        return f"shards {missing}" if missing else None

    def finish_loading(self) -> None:
        """k_eq_v: the V rows (and bias) of the fused projection become the key's."""
        if not self.k_eq_v:
            return
        if getattr(self.qkv_proj, "qweight", None) is not None:
            raise ValueError("Gemma 4's K-as-V layers with quantized projections are not supported")
        q, kv = self.q_size, self.kv_size
        for param in (self.qkv_proj.weight, self.qkv_proj.bias):
            if param is not None:
                param.data[q + kv:q + 2 * kv].copy_(param.data[q:q + kv])

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        v = self.v_norm(v.reshape(-1, self.num_kv_heads, self.head_dim))
        return self.o_proj(self.attn(q, k, v, rope=self.rotary_emb.rope_args(positions)))


class Gemma4MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma4Router(Router):
    """The 26B-A4B router: logits of norm(x) * scale * hidden_size^-1/2 (a weightless norm), softmax, top k
    renormalised, each weight times its expert's learned scale."""

    def __init__(self, num_experts: int, hidden_size: int, eps: float) -> None:
        super().__init__(num_experts, hidden_size, correction_bias=False)
        self.norm = RMSNorm(hidden_size, eps, style="none")
        self.scale = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts), requires_grad=False)
        self.root_size = hidden_size ** -0.5

    def route(self, x: torch.Tensor, config: RouterConfig, expert_ids: torch.Tensor | None = None):
        scaled = self.norm(x) * self.scale.to(x.dtype) * self.root_size
        weights, ids = super().route(scaled, config, expert_ids)
        return weights * self.per_expert_scale.float()[ids.long()], ids


class Gemma4DecoderLayer(nn.Module):
    """Sandwich norms: x + post_norm(block(pre_norm(x))) for attention and MLP, then x * layer_scalar. With
    experts (26B-A4B) the MLP's block is post_norm(post_norm_1(mlp(pre_norm(x))) + post_norm_2(experts(
    pre_norm_2(x)) routed by x))."""

    def __init__(self, config, layer_index: int) -> None:
        super().__init__()
        self.self_attn = Gemma4Attention(config, layer_index)
        self.mlp = Gemma4MLP(config)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, style="float32")
        self.post_attention_layernorm = RMSNorm(hidden, eps, style="float32")
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, style="float32")
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, style="float32")
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.moe = None
        if getattr(config, "enable_moe_block", False):
            router = RouterConfig("softmax_topk", config.top_k_experts, renormalize=True)
            self.moe = FusedMoE(config.num_experts, hidden, config.moe_intermediate_size, router, gelu=True)
            self.moe.gate = Gemma4Router(config.num_experts, hidden, eps)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps, style="float32")
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps, style="float32")
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps, style="float32")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        # A row-parallel output may come back float32 (TP partial sums reduced unrounded): rounded to the
        # activations' dtype before its norm, as one device's GEMM gives it.
        attended = self.self_attn(positions, self.input_layernorm(hidden_states)).to(dtype)
        hidden_states = hidden_states + self.post_attention_layernorm(attended)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden_states)).to(dtype)
        if self.moe is not None:
            experts = self.moe(self.pre_feedforward_layernorm_2(hidden_states), route_input=hidden_states).to(dtype)
            mlp_out = self.post_feedforward_layernorm_1(mlp_out) + self.post_feedforward_layernorm_2(experts)
        hidden_states = hidden_states + self.post_feedforward_layernorm(mlp_out)
        return hidden_states * self.layer_scalar.to(dtype)


class Gemma4Model(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, style="float32")
        self.embed_scale = config.hidden_size ** 0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        # transformers rounds the scale to the activations' dtype first (sqrt(5376) = 73.32 -> 73.5 in bf16).
        hidden_states = hidden_states * torch.tensor(self.embed_scale, dtype=hidden_states.dtype)
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states)
        return self.norm(hidden_states)


class Gemma4ForCausalLM(nn.Module):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(self, config, residual_dtype: torch.dtype | None = None) -> None:
        """`residual_dtype` is not used: the residual stream stays in the activations' dtype, as transformers'
        (each block's output is normalised before its add, so no fused add + norm kernel applies)."""
        super().__init__()
        missing = unsupported_features(config)
        if missing:
            raise ValueError(f"{type(self).__name__}: this checkpoint needs {'; '.join(missing)}, which atom-ray "
                             "does not implement yet")
        self.config = config
        self.model = Gemma4Model(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def remap_checkpoint_name(self, name: str) -> str | None:
        """26B-A4B: the layer's `experts.*` and `router.*` are our `moe.*` (its router at `moe.gate`)."""
        name = name.replace(".router.proj.", ".moe.gate.").replace(".router.", ".moe.gate.")
        return name.replace(".experts.", ".moe.experts.")
