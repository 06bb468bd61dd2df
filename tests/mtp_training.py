"""A tiny target's multi-token-prediction layer in transformers' modules, trained on the CPU, for the MTP
drafting tests (tests/engine/test_spec_decode_mtp.py, tests/engine/test_spec_decode_mtp_dsa.py).

The layer is trained on the target's own greedy continuations of NUM_TRAIN random prompts, with transformers'
decoder layer of the target's family as its block (DeepSeek-V3's, DeepSeek-V3.2's or GLM-5's, the indexer
included) and the published forward: the embedding of token p + 1 (zeroed at position 0) and the target's
last hidden state at p, each normed, concatenated (embedding first), projected, one decoder layer,
shared_head.norm, the target's head, predicting token p + 2."""
from __future__ import annotations

import torch
from torch import nn

import tiny_models
from engine import LLM, SamplingParams
from engine.loader import dummy_checkpoint_layout
from engine.models import model_class_for

PROMPT_LEN, CONTINUATION = 6, 40
NUM_TRAIN = 48


def mtp_names(config) -> list[tuple[str, tuple[int, ...]]]:
    """The MTP layer's checkpoint names and shapes, as the engine's loader expects them."""
    layout = dummy_checkpoint_layout(config)
    return model_class_for(config).mtp_checkpoint_layout(config, layout)[len(layout):]


def training_prompts(count: int = 12) -> list[list[int]]:
    """The first `count` prompts of the training set (target_sequences' draw with seed 1)."""
    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, tiny_models.VOCAB_SIZE, (NUM_TRAIN, PROMPT_LEN), generator=generator).tolist()[:count]


def target_sequences(folder, num: int, seed: int) -> torch.Tensor:
    """`num` random prompts with the target's greedy continuations (our engine's; equal to transformers')."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, tiny_models.VOCAB_SIZE, (num, PROMPT_LEN), generator=generator).tolist()
    llm = LLM(str(folder), dtype="float32", show_progress=False)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=CONTINUATION, ignore_eos=True))
    llm.shutdown()
    return torch.tensor([p + o.token_ids for p, o in zip(prompts, outputs)])


class ReferenceMtp(nn.Module):
    """The MTP layer of `target` (a transformers model) in transformers' modules. Its block starts as a copy
    of the decoder layer the engine shapes it as (`mtp_shape_source`: the last MoE layer, with an indexer of
    its own for DSA), built as that layer: transformers' layers read their kind from per-layer lists that
    stop at the last decoder layer, and without a cache the index changes nothing."""

    def __init__(self, target) -> None:
        super().__init__()
        config = target.config
        source = model_class_for(config).mtp_shape_source(config)
        source_layer = target.model.layers[source]
        self.block = type(source_layer)(config, source)
        make_norm = type(target.model.norm)
        self.enorm, self.hnorm, self.head_norm = (make_norm(config.hidden_size, config.rms_norm_eps)
                                                  for _ in range(3))
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        with torch.no_grad():
            self.block.load_state_dict(source_layer.state_dict())
        self.target = [target]  # (not a submodule: its weights are not the layer's)
        self.prefix = f"model.layers.{config.num_hidden_layers}."

    def forward(self, next_embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [B, L, vocab] of rows p < L: the embedding of token p + 1, the target's hidden state at p."""
        length = next_embeds.shape[1]
        embeds = next_embeds.clone()
        embeds[:, 0] = 0.0  # position 0's embedding is zeroed, as DeepSeek does
        positions = torch.arange(length).unsqueeze(0).expand(len(embeds), -1)
        target = self.target[0]
        causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None]  # (DSA's indexer reads it)
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))
        x = self.block(x, attention_mask=causal, position_ids=positions,
                       position_embeddings=target.model.rotary_emb(x, positions))
        x = x[0] if isinstance(x, tuple) else x
        return target.lm_head(self.head_norm(x))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Its tensors under the checkpoint's names (model.layers.{num_hidden_layers}.*)."""
        tensors = {self.prefix + k: v.detach().clone().contiguous() for k, v in self.block.state_dict().items()}
        for ours, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("head_norm", "shared_head.norm"),
                             ("eh_proj", "eh_proj")):
            tensors[f"{self.prefix}{theirs}.weight"] = getattr(self, ours).weight.detach().clone()
        return tensors


def train_mtp(folder, steps: int = 300) -> dict[str, torch.Tensor]:
    """The MTP layer's checkpoint tensors (model.layers.{num_hidden_layers}.*), trained for `steps` Adam
    steps to predict token p + 2 from (token p + 1, hidden p)."""
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    torch.manual_seed(0)
    mtp = ReferenceMtp(target)
    with torch.no_grad():
        sequences = target_sequences(folder, NUM_TRAIN, seed=1)
        hidden = target.model(sequences).last_hidden_state  # after the final norm, as the engine's forward
        embeds = target.model.embed_tokens(sequences)
    length = sequences.shape[1] - 2
    optimizer = torch.optim.Adam(mtp.parameters(), lr=3e-3)
    for _ in range(steps):
        logits = mtp(embeds[:, 1:length + 1], hidden[:, :length])
        loss = nn.functional.cross_entropy(logits[:, PROMPT_LEN - 1:].reshape(-1, logits.shape[-1]),
                                           sequences[:, PROMPT_LEN + 1:length + 2].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    tensors = mtp.checkpoint_tensors()
    expected = {name for name, _ in mtp_names(target.config)}
    assert set(tensors) == expected, set(tensors) ^ expected
    return tensors


def reference_logits(folder, tensors: dict[str, torch.Tensor], token_ids: list[int]) -> torch.Tensor:
    """transformers' logits [len - 1, vocab] of the MTP layer with checkpoint `tensors` over one sequence:
    row p from token p + 1 and the target's hidden state at p."""
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    mtp = ReferenceMtp(target)
    own = {name[len(mtp.prefix):]: tensor for name, tensor in tensors.items()}
    state = {f"block.{k}": v for k, v in own.items() if k.split(".")[0] in ("self_attn", "mlp", "input_layernorm",
                                                                          "post_attention_layernorm")}
    state.update({"enorm.weight": own["enorm.weight"], "hnorm.weight": own["hnorm.weight"],
                  "head_norm.weight": own["shared_head.norm.weight"], "eh_proj.weight": own["eh_proj.weight"]})
    mtp.load_state_dict(state)
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        hidden = target.model(ids).last_hidden_state
        return mtp(target.model.embed_tokens(ids[:, 1:]), hidden[:, :-1])[0]
