"""EAGLE3 drafters (speculative_config method "eagle3" with `model`: a draft checkpoint in the published EAGLE3
layout, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B) for Llama-family targets.

The layout: `fc` (3 target hidden states -> the draft's hidden size), one Llama decoder layer `midlayer.*`
whose q/k/v take twice the hidden size (the normed embedding of the next token, then the normed hidden state),
`norm`, `lm_head` over a draft vocabulary, `d2t` (target id = draft id + d2t[draft id]) where that vocabulary
is smaller, and optionally its own `embed_tokens` (else the target's). The target hidden states are the inputs
of the layers the draft config names (`eagle_aux_hidden_state_layer_ids`, top level or under `eagle_config`;
default 2, L // 2 and L - 3), i.e. the previous layer's output with its residual added.

Forward at position p: embedding of token p + 1 and h = fc(target states at p) for the first draft, the
drafter's own pre-norm output for chained ones; x = cat(input_layernorm(embedding), hidden_norm(h));
attention over x with its own cache; + h; post_attention_layernorm; MLP; + residual; norm -> lm_head."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from engine.config import ConfigError
from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import ReplicatedLinear
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


def aux_layer_ids(draft_config: dict, num_target_layers: int) -> tuple[int, ...]:
    ids = draft_config.get("eagle_aux_hidden_state_layer_ids") or (
        (draft_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
    if ids:
        return tuple(int(i) for i in ids)
    return (2, num_target_layers // 2, num_target_layers - 3)


class Eagle3Drafter(nn.Module):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(self, config, target_hidden_size: int, num_aux: int, vocab_size: int, own_embedding: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.config = config
        self.fc = ReplicatedLinear(num_aux * target_hidden_size, hidden)
        self.embed_tokens = VocabParallelEmbedding(vocab_size, hidden) if own_embedding else None
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, qkv_bias=False, o_bias=False, qk_norm=False, input_size=2 * hidden)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or vocab_size)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden)
        self.d2t = None
        if self.draft_vocab_size != vocab_size:
            self.d2t = nn.Parameter(torch.zeros(self.draft_vocab_size, dtype=torch.int64), requires_grad=False)

    def remap_checkpoint_name(self, name: str) -> str | None:
        if name == "t2d":  # the target-to-draft map: not needed to draft
            return None
        for prefix in ("midlayer.", "layers.0.", "model.layers.0."):
            if name.startswith(prefix):
                return name[len(prefix):]
        return name[len("model."):] if name.startswith("model.") else name

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """(normed hidden for the head, pre-norm hidden for the next draft step)."""
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, hidden)
        return self.norm(self.mlp(x), residual)

    def tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """The greedy drafts as target token ids."""
        ids = self.lm_head(normed).argmax(dim=-1)
        return ids + self.d2t[ids] if self.d2t is not None else ids


def read_draft_config(folder: str) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"speculative_config.model: no EAGLE3 draft checkpoint at {folder} (config.json missing)")
    return json.loads(path.read_text())


def build_eagle3(folder: str, target, dtype: torch.dtype, device: torch.device, show_progress: bool = False):
    """The drafter of the draft checkpoint at `folder` for `target` (a Llama-family model), loaded, and the
    target's layers whose inputs it reads marked for capture."""
    from transformers import LlamaConfig
    from engine.loader import default_dtype, load_weights
    from engine.loader import safetensors as st
    target_config = target.config
    raw = read_draft_config(folder)
    layers = getattr(getattr(target, "model", None), "layers", None)
    if layers is None or not all(isinstance(layer, LlamaDecoderLayer) for layer in layers):
        raise ConfigError(f"speculative_config.method 'eagle3' is built for Llama-family targets (decoder layers of "
                          f"Llama's kind), not {type(target).__name__}")
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    config = LlamaConfig(**fields)
    target_hidden = int(raw.get("target_hidden_size") or config.hidden_size)
    if target_hidden != target_config.hidden_size:
        raise ConfigError(f"speculative_config.model: the EAGLE3 draft reads target hidden states of size "
                          f"{target_hidden} (its target_hidden_size / hidden_size), but this model's hidden_size is "
                          f"{target_config.hidden_size}")
    if int(config.vocab_size) != int(target_config.vocab_size):
        raise ConfigError(f"speculative_config.model: the EAGLE3 draft's vocab_size ({config.vocab_size}) is not "
                          f"the target's ({target_config.vocab_size})")
    ids = aux_layer_ids(raw, len(layers))
    bad = [i for i in ids if not 0 <= i < len(layers)]
    if bad:
        raise ConfigError(f"speculative_config.model: eagle_aux_hidden_state_layer_ids {list(ids)} name layers "
                          f"outside the target's {len(layers)}")
    from safetensors import safe_open
    files = st.checkpoint_files(Path(folder))
    if not files:
        raise ConfigError(f"speculative_config.model: no safetensors files in {folder}")
    own_embedding = False
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            own_embedding |= any(name.endswith("embed_tokens.weight") for name in f.keys())
    with default_dtype(dtype), torch.device(device):
        drafter = Eagle3Drafter(config, target_hidden, len(ids), int(target_config.vocab_size), own_embedding)
    drafter.eval()
    load_weights(drafter, st.iter_weights(files, None), st.count_tensors(files, None), show_progress)
    for i in ids:
        layers[i].capture_input = True
    return drafter, ids
