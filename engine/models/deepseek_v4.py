"""DeepSeek-V4 (V4-Flash, V4-Pro), as transformers 5 implements it (`DeepseekV4ForCausalLM`).

Each layer: attention (engine/layers/deepseek_v4.py: sliding-only, CSA or HCA per `config.layer_types`) and a
mixture of experts, each wrapped in hyper-connections (engine/layers/deepseek_v4_hyper_connection.py) instead
of add + norm; the model keeps `hc_mult` residual streams per token from the embedding (copied) to the head
(collapsed, then normalised).

MoE (every layer): routed experts scored by sqrt(softplus(logits)), chosen by score + a correction bias
(`mlp_layer_types` "moe"), or by a fixed token -> experts table (`tid2eid[input_ids]`, "hash_moe", the first
layers), weighted by the chosen scores renormalised, times `routed_scaling_factor`; experts and the shared
expert are SwiGLU clamped at `swiglu_limit` (gate <= limit, -limit <= up <= limit). Norm, hyper-connection,
sink, position-bias and router-bias weights stay float32, as transformers keeps them.

Checkpoints: DeepSeek's release names (`layers.0.attn.wq_a.weight`, `layers.0.ffn.experts.3.w1.scale`) and
transformers' (save_pretrained: `model.layers.0.self_attn.q_a_proj.weight`, `...weight_scale_inv`, fused
`mlp.experts.gate_up_proj` / `gate_up_proj_scale_inv`), full precision or quantized as DeepSeek-V4-Flash
ships: `quantization_config` fp8 with 128x128 blocks and ue8m0 scales for the linear layers (the shared expert
and the grouped o_a_proj included), `expert_dtype: "fp4"` MXFP4 routed experts (engine/quantization/config.py
FP4_EXPERTS states the layout), and the compressors' and indexer's kv/gate projections and the indexer's
weights_proj in bf16 whatever the config says (`unquantized_modules`)."""
from __future__ import annotations

import re

import torch
from torch import nn

from engine.layers.deepseek_v4 import DeepseekV4Attention
from engine.layers.deepseek_v4_hyper_connection import HyperConnection, HyperHead
from engine.layers.deepseek_v4_rope import DeepseekV4RMSNorm
from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from engine.layers.fused_moe import FusedMoE, RouterConfig
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.models.llama import is_mtp_layer_tensor

MLP_LAYER_TYPES = ("hash_moe", "moe")


class ClampedSwiGLU(nn.Module):
    """The shared expert: down(silu(min(gate, limit)) * clamp(up, -limit, limit)), split over TP ranks by
    the intermediate size and left unreduced (FusedMoE reduces it with the routed experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(-self.limit, self.limit)
        return self.down_proj(torch.nn.functional.silu(gate) * up)


class DeepseekV4MoE(FusedMoE):
    """FusedMoE with V4's router; a hash layer's gate also holds `tid2eid` [vocab, top_k] (the experts of
    each token id) and routes by the step's input ids."""

    def __init__(self, hf_config, hashed: bool) -> None:
        router = RouterConfig("scored_topk", hf_config.num_experts_per_tok, renormalize=True,
                              scoring=hf_config.scoring_func,
                              routed_scaling_factor=float(hf_config.routed_scaling_factor),
                              correction_bias=not hashed)
        limit = float(hf_config.swiglu_limit)
        # One shared expert of the routed experts' width, whatever n_shared_experts says (as in transformers).
        shared = ClampedSwiGLU(hf_config.hidden_size, hf_config.moe_intermediate_size, limit)
        super().__init__(hf_config.n_routed_experts, hf_config.hidden_size, hf_config.moe_intermediate_size, router,
                         shared_experts=shared, swiglu_limit=limit)
        self.hashed = hashed
        if hashed:
            self.gate.tid2eid = nn.Parameter(
                torch.zeros(hf_config.vocab_size, hf_config.num_experts_per_tok, dtype=torch.int64),
                requires_grad=False)
            self.gate.tid2eid.weight_loader = self._load_hash_table

    def _load_hash_table(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != param.shape:
            raise ValueError(f"tid2eid has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
        if loaded.min() < 0 or loaded.max() >= self.num_experts:
            raise ValueError(f"tid2eid names experts outside [0, {self.num_experts})")
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(x, self.gate.tid2eid[input_ids] if self.hashed else None)


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, hf_config, layer_index: int) -> None:
        super().__init__()
        mlp_type = hf_config.mlp_layer_types[layer_index]
        if mlp_type not in MLP_LAYER_TYPES:
            raise ValueError(f"DeepSeek-V4 mlp layer type {mlp_type!r} is not supported ({MLP_LAYER_TYPES})")
        self.self_attn = DeepseekV4Attention(hf_config, layer_index)
        self.mlp = DeepseekV4MoE(hf_config, hashed=mlp_type == "hash_moe")
        self.input_layernorm = DeepseekV4RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = DeepseekV4RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.attn_hc = HyperConnection(hf_config)
        self.ffn_hc = HyperConnection(hf_config)

    def forward(self, positions: torch.Tensor, streams: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        post, comb, collapsed = self.attn_hc(streams)
        out = self.self_attn(positions, self.input_layernorm(collapsed))
        streams = HyperConnection.expand(streams, out, post, comb)
        post, comb, collapsed = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(collapsed), input_ids)
        return HyperConnection.expand(streams, out, post, comb)


class DeepseekV4Model(nn.Module):
    def __init__(self, hf_config) -> None:
        super().__init__()
        self.hc_mult = hf_config.hc_mult
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(hf_config, i) for i in range(hf_config.num_hidden_layers))
        self.hc_head = HyperHead(hf_config)
        self.norm = DeepseekV4RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        embedded = self.embed_tokens(input_ids)
        streams = embedded[:, None, :].expand(-1, self.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(positions, streams, input_ids)
        return self.norm(self.hc_head(streams))


class DeepseekV4ForCausalLM(nn.Module):
    # Shipped in bf16 beside FP8 layers in DeepSeek-V4-Flash (transformers' `_keep_in_fp32_modules`).
    unquantized_modules = tuple(f"model.layers.*.self_attn.compressor.{name}" for name in (
        "kv_proj", "gate_proj", "indexer.kv_proj", "indexer.gate_proj", "indexer.scorer.weights_proj"))

    def __init__(self, config, residual_dtype: torch.dtype | None = None) -> None:
        """`residual_dtype` is not used: the hyper-connection streams stay in the activations' dtype, their
        mixing weights in float32, as in transformers."""
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"DeepSeek-V4 hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        if getattr(config, "mlp_bias", False):
            raise ValueError("DeepSeek-V4 with mlp_bias=True is not supported (no released checkpoint has one)")
        self.config = config
        self.model = DeepseekV4Model(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def dummy_tensor(self, name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor | None:
        """Random weights (`load_format="dummy"`): a hash layer's token -> experts table must name
        `top_k` distinct experts of the layer's per token."""
        if not name.endswith("tid2eid"):
            return None
        vocab, top_k = shape
        scores = torch.rand(vocab, self.config.n_routed_experts, generator=generator, device=generator.device)
        return scores.argsort(dim=1)[:, :top_k].to(torch.int64)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def remap_checkpoint_name(self, name: str) -> str | None:
        """Our name for a checkpoint tensor, or None to skip it (the multi-token-prediction layers)."""
        name = checkpoint_to_module_name(name)
        if name is None or is_mtp_layer_tensor(name, self.config,
                                               getattr(self.config, "num_nextn_predict_layers", 0) or 0):
            return None
        return name


# DeepSeek's release names (which transformers' save_pretrained writes back) -> transformers' module names,
# applied in order to the part of a layer tensor's name after `layers.<i>`.
_LAYER_RENAMES = [(re.compile(pattern), replacement) for pattern, replacement in (
    (r"(?<!_hc)\.scale$", ".weight_scale_inv"),  # a quantized weight's scale (`attn_hc.scale` is the HC's own)
    (r"\.attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
    (r"\.attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)]
_TOP_LEVEL = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
              "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
              "hc_head_scale": "model.hc_head.hc_scale", "norm.weight": "model.norm.weight"}
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)(\..*)$")


def checkpoint_to_module_name(name: str) -> str | None:
    """transformers' module name for a DeepSeek-V4 tensor named either way (release or transformers names,
    with or without the `model.` prefix); None for the multi-token-prediction module (`mtp.*`)."""
    bare = name[len("model."):] if name.startswith("model.") else name
    if bare.startswith("mtp."):
        return None
    if bare in _TOP_LEVEL:
        return _TOP_LEVEL[bare]
    match = _LAYER.match(name)
    if match is None:
        return name
    rest = match.group(2)
    for pattern, replacement in _LAYER_RENAMES:
        rest = pattern.sub(replacement, rest)
    return f"model.layers.{match.group(1)}{rest}"
