"""Multi-token prediction: the layer that DeepSeek-V3/R1 (and Kimi-K2, GLM-4.5/4.6, DeepSeek-V3.2, GLM-5)
checkpoints store after their last decoder layer (model.layers.{num_hidden_layers}.*) and Qwen3-Next / Qwen3.5
checkpoints as `mtp.*`, the drafter of speculative_config method "mtp". DeepSeek-V3.2's and GLM-5's is a DSA
layer with its own indexer (engine/models/deepseek_v32.py).

Its forward, as published: the next token's embedding (DeepSeek's zeroed at position 0) and the previous
position's hidden state (the target's after its final norm; the layer's own pre-norm output for chained
drafts), each RMS-normed, concatenated embedding first and projected back to the hidden size; one decoder
layer with its own cache entries; a norm; then the target's head. The families name the same parts apart
(`enorm` / `pre_fc_norm_embedding`, `hnorm` / `pre_fc_norm_hidden`, `eh_proj` / `fc`, `shared_head.norm` /
`norm`); DeepSeek's own copies of the embedding and the head (`embed_tokens`, `shared_head.head`) are the
target's and are not loaded twice."""
from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import ReplicatedLinear
from engine.models.llama import LlamaDecoderLayer, is_mtp_layer_tensor


class MultiTokenPredictor(nn.Module):
    """`forward` returns (the normed hidden state for the head, the pre-norm one the next draft step takes)."""

    def __init__(self, config, decoder_layer: nn.Module, make_norm, zero_first_position: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.enorm = make_norm(hidden, config.rms_norm_eps)
        self.hnorm = make_norm(hidden, config.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden)
        self.block = decoder_layer
        self.norm = make_norm(hidden, config.rms_norm_eps)
        self.zero_first_position = zero_first_position

    def forward(self, embeds: torch.Tensor, previous_hidden: torch.Tensor, positions: torch.Tensor):
        if self.zero_first_position:
            embeds = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(embeds), embeds)
        hidden = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(previous_hidden)), dim=-1))
        hidden, residual = self.block(positions, hidden, None)
        return self.norm(hidden, residual)


class MultiTokenPredictionMixin:
    """For a LlamaForCausalLM-style model whose checkpoints may carry MTP layers: `mtp=True` builds the first
    one (otherwise its tensors are skipped). The class attributes say how a family's checkpoint names it
    (DeepSeek's layout here; QwenMultiTokenPredictionMixin has Qwen's)."""

    supports_mtp = True
    # checkpoint module (under the layer's prefix) -> ours; whatever tensors it holds (an FP8 eh_proj has a
    # scale beside its weight)
    mtp_own = {"enorm.": "enorm.", "hnorm.": "hnorm.", "eh_proj.": "eh_proj.", "shared_head.norm.": "norm."}
    mtp_shared = ("embed_tokens.", "shared_head.head.")  # the target's own: not loaded twice
    mtp_block = ""  # where its decoder layer's tensors start under the layer's prefix (here: all the rest)
    mtp_zeroes_first_position = True

    @staticmethod
    def num_mtp_layers(config) -> int:
        return int(getattr(config, "num_nextn_predict_layers", 0) or 0)

    @staticmethod
    def mtp_prefix(config) -> str:
        return f"model.layers.{config.num_hidden_layers}."

    @staticmethod
    def mtp_shape_source(config) -> int:
        """The decoder layer whose tensors the MTP layer's are shaped as (a MoE layer like it)."""
        return config.num_hidden_layers - 1

    def __init__(self, config, residual_dtype: torch.dtype | None = None, mtp: bool = False) -> None:
        super().__init__(config, residual_dtype)
        self.mtp = None
        if mtp:
            layer = LlamaDecoderLayer(config, self.build_mtp_attention(), self.build_mlp(config.num_hidden_layers),
                                      residual_dtype, self.make_norm)
            self.mtp = MultiTokenPredictor(config, layer, self.make_norm, self.mtp_zeroes_first_position)

    def build_mtp_attention(self) -> nn.Module:
        return self.build_attention(self.config.num_hidden_layers)

    def mtp_forward(self, input_ids: torch.Tensor, previous_hidden: torch.Tensor, positions: torch.Tensor):
        return self.mtp(self.model.embed_tokens(input_ids), previous_hidden, positions)

    @classmethod
    def mtp_checkpoint_layout(cls, config, layout: list[tuple[str, tuple[int, ...]]]) -> list:
        """`layout` (a checkpoint's names and shapes) with the MTP layer's tensors added as the family's
        checkpoints name them: for dummy weights."""
        source, prefix = f"model.layers.{cls.mtp_shape_source(config)}.", cls.mtp_prefix(config)
        hidden = config.hidden_size
        extra = [(prefix + cls.mtp_block + name[len(source):], shape) for name, shape in layout
                 if name.startswith(source)]
        extra += [(f"{prefix}{theirs}weight", (hidden, 2 * hidden) if ours == "eh_proj." else (hidden,))
                  for theirs, ours in cls.mtp_own.items()]
        return layout + extra

    def remap_checkpoint_name(self, name: str) -> str | None:
        config = self.config
        if not is_mtp_layer_tensor(name, config, self.num_mtp_layers(config)):
            return name
        return self.mtp_checkpoint_name(name)

    def checkpoint_module_name(self, name: str) -> str:
        """The checkpoint's name of our module `name` (a quantization config's exclusions name those)."""
        return self.mtp_module_checkpoint_name(name) if name.startswith("mtp.") else name

    def mtp_module_checkpoint_name(self, name: str) -> str:
        """The checkpoint's name of a module of our MTP layer (`mtp.block.mlp` -> `model.layers.61.mlp`)."""
        rest, prefix = name[len("mtp."):], self.mtp_prefix(self.config)
        if rest.startswith("block."):
            return prefix + self.mtp_block + rest[len("block."):]
        for theirs, ours in self.mtp_own.items():
            if (rest + ".").startswith(ours):
                return (prefix + theirs + rest[len(ours):]).rstrip(".")
        return name

    def mtp_checkpoint_name(self, name: str) -> str | None:
        """Ours for a checkpoint tensor of an MTP layer; None: not built, a second layer, or the target's."""
        prefix = self.mtp_prefix(self.config)
        if self.mtp is None or not name.startswith(prefix):
            return None
        rest = name[len(prefix):]
        if rest.startswith(self.mtp_shared):
            return None
        for theirs, ours in self.mtp_own.items():
            if rest.startswith(theirs):
                return "mtp." + ours + rest[len(theirs):]
        return "mtp.block." + rest[len(self.mtp_block):] if rest.startswith(self.mtp_block) else None


class QwenMultiTokenPredictionMixin(MultiTokenPredictionMixin):
    """Qwen3-Next's and Qwen3.5's MTP layer: `mtp.*`, its decoder layer `mtp.layers.0` (a gated full-attention
    layer with the model's MLP: `build_mtp_attention`), depth `num_nextn_predict_layers` or Qwen3.5's
    `mtp_num_hidden_layers`; the embedding is not zeroed at position 0."""

    mtp_own = {"pre_fc_norm_embedding.": "enorm.", "pre_fc_norm_hidden.": "hnorm.", "fc.": "eh_proj.",
               "norm.": "norm."}
    mtp_shared = ()
    mtp_block = "layers.0."
    mtp_zeroes_first_position = False

    @staticmethod
    def num_mtp_layers(config) -> int:
        return int(getattr(config, "num_nextn_predict_layers", 0) or getattr(config, "mtp_num_hidden_layers", 0) or 0)

    @staticmethod
    def mtp_prefix(config) -> str:
        return "mtp."

    @staticmethod
    def mtp_shape_source(config) -> int:
        return max(i for i, kind in enumerate(config.layer_types) if kind == "full_attention")
