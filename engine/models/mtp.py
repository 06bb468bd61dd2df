"""Multi-token prediction: the layer DeepSeek-V3/R1 (and Kimi-K2, GLM-4.5/4.6) checkpoints store after their
last decoder layer (model.layers.{num_hidden_layers}.*), the drafter of speculative_config method "mtp".

Its forward, as published: the next token's embedding (zeroed at position 0) and the previous position's hidden
state (the target's after its final norm; the layer's own pre-norm output for chained drafts), each
RMS-normed (`enorm`, `hnorm`), concatenated embedding first and projected back to the hidden size
(`eh_proj`); one decoder layer of the target's kind with its own cache entries; `shared_head.norm`; then the
target's head. The checkpoint's own copies of the embedding and the head (`embed_tokens`,
`shared_head.head`) are the target's and are not loaded twice."""
from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import ReplicatedLinear
from engine.models.llama import LlamaDecoderLayer, is_mtp_layer_tensor

# The layer's own modules (checkpoint names under its prefix) and ours, whatever tensors they hold (an FP8
# eh_proj has a scale beside its weight); its decoder layer's go under `block.`.
_OWN = {"enorm.": "enorm.", "hnorm.": "hnorm.", "eh_proj.": "eh_proj.", "shared_head.norm.": "shared_head_norm."}
_SHARED = ("embed_tokens.", "shared_head.head.")


class MultiTokenPredictor(nn.Module):
    """`forward` returns (the normed hidden state for the head, the pre-norm one the next draft step takes)."""

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


class MultiTokenPredictionMixin:
    """For a LlamaForCausalLM-style model whose checkpoints may carry MTP layers: `mtp=True` builds the first
    one (otherwise its tensors are skipped)."""

    supports_mtp = True

    @staticmethod
    def num_mtp_layers(config) -> int:
        return int(getattr(config, "num_nextn_predict_layers", 0) or 0)

    def __init__(self, config, residual_dtype: torch.dtype | None = None, mtp: bool = False) -> None:
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
        """`layout` (a checkpoint's names and shapes) with the MTP layer's tensors added, shaped as the last
        decoder layer's (a MoE layer like it) plus its own: for dummy weights."""
        last, index, hidden = config.num_hidden_layers - 1, config.num_hidden_layers, config.hidden_size
        prefix = f"model.layers.{last}."
        extra = [(f"model.layers.{index}.{name[len(prefix):]}", shape) for name, shape in layout
                 if name.startswith(prefix)]
        extra += [(f"model.layers.{index}.{name}", (hidden,)) for name in ("enorm.weight", "hnorm.weight",
                                                                             "shared_head.norm.weight")]
        extra.append((f"model.layers.{index}.eh_proj.weight", (hidden, 2 * hidden)))
        return layout + extra

    def remap_checkpoint_name(self, name: str) -> str | None:
        config = self.config
        if not is_mtp_layer_tensor(name, config, self.num_mtp_layers(config)):
            return name
        prefix = f"model.layers.{config.num_hidden_layers}."
        if self.mtp is None or not name.startswith(prefix):  # not asked for, or a second MTP layer
            return None
        rest = name[len(prefix):]
        if rest.startswith(_SHARED):
            return None
        for theirs, ours in _OWN.items():
            if rest.startswith(theirs):
                return "mtp." + ours + rest[len(theirs):]
        return "mtp.block." + rest


class QwenMultiTokenPredictor(nn.Module):
    """Qwen3-Next's and Qwen3.5's MTP layer (checkpoint names `mtp.*`): `fc` over cat(pre_fc_norm_embedding(
    embedding), pre_fc_norm_hidden(hidden)), one gated full-attention decoder layer with the model's MLP
    (`mtp.layers.0`), `norm`, the target's head. `forward` as MultiTokenPredictor's."""

    def __init__(self, config, decoder_layer: nn.Module, make_norm) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.pre_fc_norm_embedding = make_norm(hidden, config.rms_norm_eps)
        self.pre_fc_norm_hidden = make_norm(hidden, config.rms_norm_eps)
        self.fc = ReplicatedLinear(2 * hidden, hidden)
        self.block = decoder_layer
        self.norm = make_norm(hidden, config.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, previous_hidden: torch.Tensor, positions: torch.Tensor):
        hidden = self.fc(torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(previous_hidden)),
                                   dim=-1))
        hidden, residual = self.block(positions, hidden, None)
        return self.norm(hidden, residual)


class QwenMultiTokenPredictionMixin:
    """MultiTokenPredictionMixin's counterpart for Qwen3-Next / Qwen3.5 checkpoints, whose MTP layer is
    `mtp.*` (its depth: `num_nextn_predict_layers`, or Qwen3.5's `mtp_num_hidden_layers`); built with `mtp=True`,
    skipped otherwise. `build_mtp_attention()` makes its full-attention block."""

    supports_mtp = True

    @staticmethod
    def num_mtp_layers(config) -> int:
        return int(getattr(config, "num_nextn_predict_layers", 0) or getattr(config, "mtp_num_hidden_layers", 0) or 0)

    def __init__(self, config, residual_dtype: torch.dtype | None = None, mtp: bool = False) -> None:
        super().__init__(config, residual_dtype)
        self.mtp = None
        if mtp:
            layer = LlamaDecoderLayer(config, self.build_mtp_attention(), self.build_mlp(config.num_hidden_layers),
                                      residual_dtype, self.make_norm)
            self.mtp = QwenMultiTokenPredictor(config, layer, self.make_norm)

    def mtp_forward(self, input_ids: torch.Tensor, previous_hidden: torch.Tensor, positions: torch.Tensor):
        return self.mtp(self.model.embed_tokens(input_ids), previous_hidden, positions)

    @classmethod
    def mtp_checkpoint_layout(cls, config, layout: list[tuple[str, tuple[int, ...]]]) -> list:
        """`layout` with the MTP layer's tensors added: its decoder layer shaped as the last full-attention
        layer's, and its own fc and norms (for dummy weights)."""
        full = max(i for i, kind in enumerate(config.layer_types) if kind == "full_attention")
        prefix, hidden = f"model.layers.{full}.", config.hidden_size
        extra = [(f"mtp.layers.0.{name[len(prefix):]}", shape) for name, shape in layout if name.startswith(prefix)]
        extra += [(f"mtp.{name}.weight", (hidden,)) for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")]
        extra.append(("mtp.fc.weight", (hidden, 2 * hidden)))
        return layout + extra

    def remap_mtp_name(self, name: str) -> str | None:
        """A checkpoint name under `mtp.`: ours, or None (not built, or a second MTP layer)."""
        if self.mtp is None:
            return None
        if name.startswith("mtp.layers.0."):
            return "mtp.block." + name[len("mtp.layers.0."):]
        if name.startswith("mtp.layers."):
            return None
        return name
