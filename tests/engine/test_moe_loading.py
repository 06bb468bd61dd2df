"""Mixture-of-experts checkpoints: experts named one by one (as on disk) or fused (transformers' in-memory
layout) load to the same model; a missing or mis-shaped expert tensor is refused by name; multi-token-
prediction layers stored after the last layer are skipped; random (dummy) weights build every MoE
architecture from its config alone; what is not supported yet is refused."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny_models
from engine import LLM, SamplingParams
from engine.loader import ModelSourceError, build_model, resolve_model

PROMPT = list(range(3, 60))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _copy_beside(source, target, weights: dict[str, torch.Tensor]) -> None:
    """`target`: the config and tokenizer of `source` with `weights` as its checkpoint."""
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", *TOKENIZER_FILES):
        shutil.copy(source / name, target / name)
    save_file(weights, str(target / "model.safetensors"))


def _logits(folder) -> torch.Tensor:
    model = build_model(resolve_model(str(folder)), torch.float32, torch.device("cpu"), show_progress=False)
    return tiny_models.engine_logits(model, PROMPT)


@pytest.mark.parametrize("arch", tiny_models.MOE_ARCHITECTURES)
def test_fused_expert_names_load_like_per_expert_names(arch, tiny_model_dirs, tmp_path):
    per_expert = tiny_model_dirs[arch]
    on_disk = load_file(str(per_expert / "model.safetensors"))
    assert any(".experts.0." in name for name in on_disk)  # save_pretrained wrote experts one by one
    in_memory = {name: tensor.contiguous() for name, tensor in tiny_models.hf_model(per_expert).state_dict().items()}
    assert any(name.endswith(".experts.gate_up_proj") for name in in_memory)
    _copy_beside(per_expert, tmp_path, in_memory)
    assert torch.equal(_logits(tmp_path), _logits(per_expert))


def test_missing_expert_tensor_names_the_parameter_and_the_expert(tiny_model_dirs, tmp_path):
    folder = tiny_model_dirs["qwen3_moe"]
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    _copy_beside(folder, tmp_path, weights)
    with pytest.raises(ModelSourceError, match=r"lacks weights.*model\.layers\.2\.mlp\.w13: experts \[.5\.up.\]"):
        build_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"), show_progress=False)


def test_mis_shaped_expert_tensor_names_the_checkpoint_tensor(tiny_model_dirs, tmp_path):
    folder = tiny_model_dirs["mixtral"]
    weights = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    weights[name] = weights[name][:, :-1].contiguous()
    _copy_beside(folder, tmp_path, weights)
    with pytest.raises(ModelSourceError, match=re.escape(name) + ".*expert 3 down has shape"):
        build_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"), show_progress=False)


@pytest.mark.parametrize("arch", tiny_models.MOE_ARCHITECTURES)
def test_dummy_weights_build_each_moe_architecture_from_its_config(arch, tiny_model_dirs, tmp_path):
    for name in ("config.json", *TOKENIZER_FILES):
        shutil.copy(tiny_model_dirs[arch] / name, tmp_path / name)
    llm = LLM(str(tmp_path), load_format="dummy", show_progress=False)
    output = llm.generate(["hello"], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(output.token_ids) == 5


def test_multi_token_prediction_layer_tensors_are_skipped(tiny_model_dirs, tmp_path):
    """GLM-4.5 checkpoints hold num_nextn_predict_layers extra layers after the last decoder layer."""
    folder = tiny_model_dirs["glm4_moe"]
    config = json.loads((folder / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 3
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.layers.3.eh_proj.weight"] = torch.zeros(96, 192)
    _copy_beside(folder, tmp_path, weights)
    assert torch.equal(_logits(tmp_path), _logits(folder))


def test_mixtral_with_a_sliding_window_is_refused(tiny_model_dirs, tmp_path):
    folder = tiny_model_dirs["mixtral"]
    _copy_beside(folder, tmp_path, load_file(str(folder / "model.safetensors")))
    config = json.loads((tmp_path / "config.json").read_text())
    config["sliding_window"] = 64
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sliding_window=64.*not supported"):
        build_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"), show_progress=False)
