"""EAGLE3 drafting (speculative_config method "eagle3", `model`: a draft checkpoint in the published layout)
on a tiny Llama target.

As for MTP (tests/engine/test_spec_decode_mtp.py): an EAGLE3 head trained here for 300 CPU steps on the tiny
target's greedy continuations of 48 prompts (a plain-torch copy of the published forward: fc over the
inputs of target layers 2, L // 2 and L - 3, the next token's normed embedding beside the normed hidden state
into one attention layer whose q/k/v take both, MLP, norm, lm_head) keeps most drafts when the engine runs it
on those prompts, and fed the wrong rows keeps almost none. Tokens equal a run without speculation, with any
head; nothing leaks; a draft vocabulary smaller than the target's maps its ids through d2t."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import tiny_models
from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.models.eagle3 import Eagle3Drafter, aux_layer_ids

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
PROMPT_LEN, CONTINUATION, NUM_TRAIN = 6, 40, 48


def draft_config(target_config) -> dict:
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": target_config.hidden_size, "intermediate_size": target_config.intermediate_size,
            "num_attention_heads": target_config.num_attention_heads,
            "num_key_value_heads": target_config.num_key_value_heads, "head_dim": target_config.head_dim,
            "vocab_size": target_config.vocab_size, "draft_vocab_size": target_config.vocab_size,
            "rms_norm_eps": target_config.rms_norm_eps, "rope_theta": getattr(target_config, "rope_theta", 10000.0),
            "max_position_embeddings": target_config.max_position_embeddings, "hidden_act": "silu"}


def training_prompts(num: int = NUM_TRAIN) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, tiny_models.VOCAB_SIZE, (num, PROMPT_LEN), generator=generator).tolist()


def train_eagle3(target_folder, steps: int = 300) -> tuple[dict, dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm
    target = AutoModelForCausalLM.from_pretrained(target_folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    raw = draft_config(target.config)
    config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "sdpa"
    hidden, layer_ids = config.hidden_size, aux_layer_ids(raw, target.config.num_hidden_layers)
    torch.manual_seed(0)
    attn = LlamaAttention(config, 0)
    for name in ("q_proj", "k_proj", "v_proj"):
        old = getattr(attn, name)
        setattr(attn, name, torch.nn.Linear(2 * hidden, old.out_features, bias=False))
    modules = torch.nn.ModuleDict({
        "fc": torch.nn.Linear(len(layer_ids) * hidden, hidden, bias=False), "attn": attn, "mlp": LlamaMLP(config),
        **{name: LlamaRMSNorm(hidden, config.rms_norm_eps)
           for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm", "norm")},
        "lm_head": torch.nn.Linear(hidden, config.vocab_size, bias=False)})
    llm = LLM(str(target_folder), dtype="float32", show_progress=False)
    prompts = training_prompts()
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=CONTINUATION, ignore_eos=True))
    llm.shutdown()
    sequences = torch.tensor([p + o.token_ids for p, o in zip(prompts, outputs)])
    with torch.no_grad():
        states = target.model(sequences, output_hidden_states=True).hidden_states  # [i]: layer i's input
        aux = torch.cat([states[i] for i in layer_ids], dim=-1)
        embeds = target.model.embed_tokens(sequences)
    length = sequences.shape[1] - 2
    positions = torch.arange(length).unsqueeze(0).expand(len(sequences), -1)
    position_embeddings = target.model.rotary_emb(embeds, positions)
    optimizer = torch.optim.Adam(modules.parameters(), lr=3e-3)
    m = modules
    for _ in range(steps):
        h = m["fc"](aux[:, :length])
        x = torch.cat((m["input_layernorm"](embeds[:, 1:length + 1]), m["hidden_norm"](h)), dim=-1)
        a = m["attn"](x, position_embeddings=position_embeddings, attention_mask=None)[0]
        residual = a + h
        out = m["norm"](m["mlp"](m["post_attention_layernorm"](residual)) + residual)
        logits = m["lm_head"](out)
        loss = torch.nn.functional.cross_entropy(logits[:, PROMPT_LEN - 1:].reshape(-1, logits.shape[-1]),
                                                 sequences[:, PROMPT_LEN + 1:length + 2].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    tensors = {"fc.weight": m["fc"].weight, "norm.weight": m["norm"].weight, "lm_head.weight": m["lm_head"].weight,
               "midlayer.input_layernorm.weight": m["input_layernorm"].weight,
               "midlayer.hidden_norm.weight": m["hidden_norm"].weight,
               "midlayer.post_attention_layernorm.weight": m["post_attention_layernorm"].weight}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        tensors[f"midlayer.self_attn.{name}.weight"] = getattr(attn, name).weight
    for name in ("gate_proj", "up_proj", "down_proj"):
        tensors[f"midlayer.mlp.{name}.weight"] = getattr(m["mlp"], name).weight
    tensors["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)  # published files carry it; unused
    return raw, {k: v.detach().clone().contiguous() for k, v in tensors.items()}


def write_draft(folder, raw: dict, tensors: dict) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    target = tiny_models.make_tiny_model(root / "target", "llama")
    raw, tensors = train_eagle3(target)
    return str(target), write_draft(root / "draft", raw, tensors), raw, tensors


def run(target, draft, prompts, k=1, **engine_args):
    llm = LLM(target, dtype="float32", show_progress=False,
              speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": k}, **engine_args)
    try:
        outputs = llm.generate(prompts, GREEDY)
        return [o.token_ids for o in outputs], llm.engine.stats()
    finally:
        llm.shutdown()


def test_trained_eagle3_head_keeps_most_drafts_with_the_tokens_without_speculation(trained):
    target, draft, _, _ = trained
    prompts = training_prompts()[:12]
    plain = LLM(target, dtype="float32", show_progress=False)
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    plain.shutdown()
    tokens, stats = run(target, draft, prompts)
    assert tokens == expected and stats["spec_acceptance_rate"] > 0.8, stats
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    tokens, stats = run(target, draft, prompts, k=3, max_num_batched_tokens=4, max_num_seqs=4, num_kv_blocks=48,
                        block_size=4, max_model_len=64)
    assert tokens == expected and stats["spec_acceptance_rate"] > 0.3, stats
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


@pytest.mark.parametrize("kind", ["no target states", "layers in the wrong order"])
def test_a_miswired_eagle3_head_keeps_almost_nothing(trained, monkeypatch, kind):
    """The head fed zeros for the target's states, or the layers' states concatenated in reverse order
    (measured: 0.05 and 0.02, against 1.0). The tiny target's next-next token is carried by its states: the
    head fed a wrong token still keeps 0.9, so that is not a control here."""
    from engine.spec_decode import draft_models
    target, draft, _, _ = trained
    prompts = training_prompts()[:12]
    _, good = run(target, draft, prompts)
    if kind == "no target states":
        original = draft_models.Eagle3Draft.first_hidden
        monkeypatch.setattr(draft_models.Eagle3Draft, "first_hidden",
                            lambda self, hidden, rows: original(self, hidden * 0, rows) * 0)
    else:
        def reversed_states(self, hidden, rows):
            layers = self.model.model.layers
            states = [layers[i].captured[rows].to(hidden.dtype) for i in reversed(self.layer_ids)]
            return self.drafter.fc(torch.cat(states, dim=-1))
        monkeypatch.setattr(draft_models.Eagle3Draft, "first_hidden", reversed_states)
    _, bad = run(target, draft, prompts)
    assert bad["spec_acceptance_rate"] < 0.15 and bad["spec_acceptance_rate"] < good["spec_acceptance_rate"] / 4


def test_the_captured_layer_inputs_are_transformers_hidden_states(trained):
    """What the head reads: the inputs of target layers (2, L // 2, L - 3) = transformers' hidden_states[i]."""
    from transformers import AutoModelForCausalLM
    target, draft, _, _ = trained
    prompt = training_prompts()[0]
    llm = LLM(target, dtype="float32", show_progress=False,
              speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": 1})
    try:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
        layers = llm.engine.executor.runner.model.model.layers
        captured = {i: layers[i].captured.clone() for i in (0, 1, 2)}
    finally:
        llm.shutdown()
    reference = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    states = reference.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    for i, tensor in captured.items():  # the last step: the prompt's prefill
        torch.testing.assert_close(tensor, states[i][0], atol=1e-4, rtol=1e-4)


def test_draft_ids_map_to_target_ids_through_d2t():
    from transformers import LlamaConfig
    config = LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=4, vocab_size=20, draft_vocab_size=4)
    head = Eagle3Drafter(config, 8, 3, 20, own_embedding=False)
    with torch.no_grad():
        head.lm_head.weight.copy_(torch.eye(4, 8))
        head.d2t.copy_(torch.tensor([0, 5, 9, 16]))  # draft id d is target id d + d2t[d]
    normed = torch.eye(4, 8)[[2, 0, 3, 1]]
    assert head.tokens(normed).tolist() == [11, 0, 19, 6]


def test_bad_eagle3_drafts_are_refused_naming_the_field(trained, tmp_path):
    target, _, raw, tensors = trained
    wider = write_draft(tmp_path / "wider", {**raw, "target_hidden_size": raw["hidden_size"] * 2}, tensors)
    with pytest.raises(ConfigError, match="speculative_config.model: the EAGLE3 draft reads target hidden states"):
        run(target, wider, [[1, 2, 3]])
    with pytest.raises(ConfigError, match="no EAGLE3 draft checkpoint"):
        run(target, str(tmp_path / "nowhere"), [[1, 2, 3]])
    far = write_draft(tmp_path / "far", {**raw, "eagle_aux_hidden_state_layer_ids": [0, 1, 7]}, tensors)
    with pytest.raises(ConfigError, match="outside the target's 3"):
        run(target, far, [[1, 2, 3]])
