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

The E2B/E4B variants add per-layer input embeddings (a second, vocabulary-sized table giving each token a small
vector per layer, mixed with a projection of the scaled embedding, then gated into each layer after its MLP),
KV sharing (the last `num_kv_shared_layers` layers attend over the keys and values of the last earlier layer of
their type, with no K/V projections and no cache of their own) and double-wide MLPs on those sharing layers.

Not built (refused at start-up by name): bidirectional attention; every layer sharing KV (no layer to produce
it: an assistant model fed by another model's cache)."""
from __future__ import annotations

import re

import torch
from torch import nn

from engine.kernels import ops
from engine.kernels.attention import AttentionOptions
from engine.layers.attention import Attention, SharedKVAttention
from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from engine.layers.fused_moe import FusedMoE
from engine.layers.moe_router import Router, RouterConfig
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                  ReplicatedLinear, RowParallelLinear)
from engine.layers.rotary_embedding import RotaryEmbedding
from engine.models.llama import LlamaForCausalLM, layer_attention_shape

LAYER_TYPES = ("sliding_attention", "full_attention")
# A layer's attention projection or K/V norm in the checkpoint: (layer index, module).
_ATTENTION_TENSOR = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|k_norm|v_norm)\.")


def unsupported_features(config) -> list[str]:
    """What this config asks for that is not built here, by name (empty: servable)."""
    missing = []
    shared = getattr(config, "num_kv_shared_layers", 0) or 0
    if shared and shared >= config.num_hidden_layers:
        missing.append(f"KV sharing in every layer (num_kv_shared_layers={shared}: no layer computes the keys "
                       "and values they would read)")
    per_layer_vocab = getattr(config, "vocab_size_per_layer_input", config.vocab_size)
    if getattr(config, "hidden_size_per_layer_input", 0) and per_layer_vocab < config.vocab_size:
        missing.append(f"a per-layer input vocabulary (vocab_size_per_layer_input={per_layer_vocab}) smaller "
                       f"than the vocabulary ({config.vocab_size})")
    if getattr(config, "use_bidirectional_attention", None):
        missing.append(f"bidirectional attention (use_bidirectional_attention={config.use_bidirectional_attention!r})")
    if getattr(config, "hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        missing.append(f"hidden_activation {config.hidden_activation!r} (only GELU-tanh)")
    unknown = sorted(set(config.layer_types) - set(LAYER_TYPES))
    if unknown:
        missing.append(f"layer types {unknown}")
    return missing


def kv_sharing_sources(config) -> list[int | None]:
    """For each layer, the layer whose keys and values it reuses (None: its own): transformers' rule, each of
    the last `num_kv_shared_layers` layers reads the last earlier layer of its type."""
    num_layers, types = config.num_hidden_layers, config.layer_types
    first_shared = num_layers - (getattr(config, "num_kv_shared_layers", 0) or 0)
    last_of_type = {layer_type: i for i, layer_type in enumerate(types[:first_shared])}
    sources: list[int | None] = [None] * num_layers
    for i in range(first_shared, num_layers):
        if types[i] not in last_of_type:
            raise ValueError(f"Gemma 4 layer {i} ({types[i]}) shares the KV of an earlier {types[i]} layer, and "
                             f"none of the first {first_shared} layers is one")
        sources[i] = last_of_type[types[i]]
    return sources


class Gemma4Attention(nn.Module):
    """`kv_source`: the earlier layer whose keys and values this one reuses (KV sharing); it then has only its
    query and output projections and keeps no cache. A layer that others read puts its keys and values of
    the step into `shared_kv` (by its index) for them."""

    def __init__(self, config, layer_index: int, kv_source: "Gemma4Attention | None" = None) -> None:
        super().__init__()
        self.layer_index = layer_index
        layer_type = config.layer_types[layer_index]
        self.head_dim, num_kv_heads = layer_attention_shape(config, layer_index)
        bias = bool(getattr(config, "attention_bias", False))
        self.kv_source_index = None if kv_source is None else kv_source.layer_index
        self.stores_kv = False  # set on the layers others read
        eps = config.rms_norm_eps
        self.k_eq_v = False
        if kv_source is None:
            self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                              num_kv_heads, bias=bias)
            q_shard = self.qkv_proj.q_shard
            self.num_kv_heads = self.qkv_proj.num_kv_heads
            # V is the raw key (k_eq_v): its rows of the fused projection are the key's, copied once loaded.
            self.k_eq_v = bool(getattr(config, "attention_k_eq_v", False)) and layer_type == "full_attention"
            if self.k_eq_v:
                for param in self.qkv_proj.parameters():
                    param.check_loaded = self._check_q_and_k_loaded
            self.k_norm = RMSNorm(self.head_dim, eps, style="float32")
            self.v_norm = RMSNorm(self.head_dim, eps, style="none")
        else:
            # The checkpoint's q_proj (named apart so that the fused q/k/v mapping leaves it alone), with the
            # query heads the source layer has on this rank.
            q_shard = kv_source.qkv_proj.q_shard
            self.query_proj = ColumnParallelLinear(config.hidden_size, config.num_attention_heads * self.head_dim,
                                                   bias=bias, output_shard=q_shard)
            self.num_kv_heads = kv_source.num_kv_heads
        self.num_heads = q_shard[1] // self.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias,
                                        input_shard=q_shard)
        self.q_norm = RMSNorm(self.head_dim, eps, style="float32")
        self.rotary_emb = RotaryEmbedding(config, self.head_dim, self.head_dim, config.max_position_embeddings,
                                          layer_type=layer_type)
        if kv_source is None:
            window = config.sliding_window if layer_type == "sliding_attention" else None
            self.attn = Attention(self.num_heads, self.head_dim, 1.0, self.num_kv_heads,
                                  AttentionOptions(window=window))
        else:
            self.attn = SharedKVAttention(kv_source.attn, self.num_heads, 1.0)

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

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, shared_kv: dict) -> torch.Tensor:
        """`shared_kv`: layer index -> (keys before rotation, values) of this step, for the sharing layers."""
        if self.kv_source_index is None:
            qkv = self.qkv_proj(hidden_states)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
            v = self.v_norm(v.reshape(-1, self.num_kv_heads, self.head_dim))
            if self.stores_kv:
                shared_kv[self.layer_index] = k, v
        else:
            q = self.query_proj(hidden_states)
            k, v = shared_kv[self.kv_source_index]
        if self.stores_kv or self.kv_source_index is not None:
            k = k.clone()  # a backend may rotate the keys in place; the next sharing layer needs them unrotated
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
        return self.o_proj(self.attn(q, k, v, rope=self.rotary_emb.rope_args(positions)))


class Gemma4MLP(nn.Module):
    def __init__(self, config, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, config.hidden_size, bias=False)

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
    pre_norm_2(x)) routed by x)). With per-layer inputs (E2B/E4B), after the MLP: x + norm(projection(
    gelu_tanh(gate(x)) * this layer's input)), before the scalar. A KV-sharing layer's MLP is twice as wide
    where the config asks (use_double_wide_mlp)."""

    def __init__(self, config, layer_index: int, kv_source: Gemma4Attention | None = None) -> None:
        super().__init__()
        self.self_attn = Gemma4Attention(config, layer_index, kv_source)
        double_wide = kv_source is not None and getattr(config, "use_double_wide_mlp", False)
        self.mlp = Gemma4MLP(config, config.intermediate_size * (2 if double_wide else 1))
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, style="float32")
        self.post_attention_layernorm = RMSNorm(hidden, eps, style="float32")
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, style="float32")
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, style="float32")
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        per_layer = getattr(config, "hidden_size_per_layer_input", 0) or 0
        self.has_per_layer_input = bool(per_layer)
        if per_layer:
            self.per_layer_input_gate = ReplicatedLinear(hidden, per_layer, bias=False)
            self.per_layer_projection = ReplicatedLinear(per_layer, hidden, bias=False)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps, style="float32")
        self.moe = None
        if getattr(config, "enable_moe_block", False):
            router = RouterConfig("softmax_topk", config.top_k_experts, renormalize=True)
            self.moe = FusedMoE(config.num_experts, hidden, config.moe_intermediate_size, router, gelu=True)
            self.moe.gate = Gemma4Router(config.num_experts, hidden, eps)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps, style="float32")
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps, style="float32")
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps, style="float32")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, per_layer_input: torch.Tensor | None,
                shared_kv: dict) -> torch.Tensor:
        dtype = hidden_states.dtype
        # A row-parallel output may come back float32 (TP partial sums reduced unrounded): rounded to the
        # activations' dtype before its norm, as one device's GEMM gives it.
        attended = self.self_attn(positions, self.input_layernorm(hidden_states), shared_kv).to(dtype)
        hidden_states = hidden_states + self.post_attention_layernorm(attended)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden_states)).to(dtype)
        if self.moe is not None:
            experts = self.moe(self.pre_feedforward_layernorm_2(hidden_states), route_input=hidden_states).to(dtype)
            mlp_out = self.post_feedforward_layernorm_1(mlp_out) + self.post_feedforward_layernorm_2(experts)
        hidden_states = hidden_states + self.post_feedforward_layernorm(mlp_out)
        if self.has_per_layer_input:
            gated = ops.gelu_tanh_and_mul(torch.cat([self.per_layer_input_gate(hidden_states), per_layer_input], -1))
            hidden_states = hidden_states + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden_states * self.layer_scalar.to(dtype)


class Gemma4Model(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.kv_sources = kv_sharing_sources(config)
        layers: list[Gemma4DecoderLayer] = []
        for i, source in enumerate(self.kv_sources):
            layers.append(Gemma4DecoderLayer(config, i, None if source is None else layers[source].self_attn))
            if source is not None:
                layers[source].self_attn.stores_kv = True
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, style="float32")
        self.embed_scale = config.hidden_size ** 0.5
        # Per-layer inputs (E2B/E4B): one packed table of num_layers vectors per token, and a projection of the
        # scaled embedding to the same [num_layers, size], each scaled as transformers scales them.
        self.per_layer_size = getattr(config, "hidden_size_per_layer_input", 0) or 0
        if self.per_layer_size:
            packed = config.num_hidden_layers * self.per_layer_size
            self.embed_tokens_per_layer = VocabParallelEmbedding(config.vocab_size_per_layer_input, packed)
            self.per_layer_model_projection = ReplicatedLinear(config.hidden_size, packed, bias=False)
            self.per_layer_projection_norm = RMSNorm(self.per_layer_size, config.rms_norm_eps, style="float32")
            self.per_layer_embed_scale = self.per_layer_size ** 0.5
            self.per_layer_projection_scale = config.hidden_size ** -0.5
            self.per_layer_input_scale = 2.0 ** -0.5

    def per_layer_inputs(self, input_ids: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """[T, num_layers, per_layer_size]: (norm(projection(embeddings) * H^-1/2) + table[token] *
        sqrt(per_layer_size)) * 2^-1/2, `embeddings` already scaled."""
        shape = (input_ids.shape[0], len(self.layers), self.per_layer_size)
        # The table's scale rounded to the activations' dtype first, as transformers' scaled embedding does.
        token = self.embed_tokens_per_layer(input_ids) * torch.tensor(self.per_layer_embed_scale, dtype=embeddings.dtype)
        projected = self.per_layer_model_projection(embeddings) * self.per_layer_projection_scale
        projected = self.per_layer_projection_norm(projected.view(shape))
        return (projected + token.view(shape)) * self.per_layer_input_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        # transformers rounds the scale to the activations' dtype first (sqrt(5376) = 73.32 -> 73.5 in bf16).
        hidden_states = hidden_states * torch.tensor(self.embed_scale, dtype=hidden_states.dtype)
        per_layer_inputs = self.per_layer_inputs(input_ids, hidden_states) if self.per_layer_size else None
        shared_kv: dict = {}  # KV sharing: a source layer's keys and values of this step, by its index
        for i, layer in enumerate(self.layers):
            per_layer_input = per_layer_inputs[:, i] if per_layer_inputs is not None else None
            hidden_states = layer(positions, hidden_states, per_layer_input, shared_kv)
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
        """26B-A4B: the layer's `experts.*` and `router.*` are our `moe.*` (its router at `moe.gate`).
        KV-sharing layers (E2B/E4B): `q_proj` is our `query_proj`; the K/V projections and norms that the
        hub's checkpoints keep for them are never read (transformers skips them too)."""
        match = _ATTENTION_TENSOR.match(name)
        sources = self.model.kv_sources
        if match is not None and int(match.group(1)) < len(sources) and sources[int(match.group(1))] is not None:
            if match.group(2) != "q_proj":
                return None
            return name.replace(".self_attn.q_proj.", ".self_attn.query_proj.")
        name = name.replace(".router.proj.", ".moe.gate.").replace(".router.", ".moe.gate.")
        return name.replace(".experts.", ".moe.experts.")

    def checkpoint_module_name(self, name: str) -> str:
        """The checkpoint's name of our module `name` (a quantization config names those): a KV-sharing layer's
        `query_proj` is its `q_proj`."""
        return name.replace(".self_attn.query_proj", ".self_attn.q_proj")
