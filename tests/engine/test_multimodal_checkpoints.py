"""Multimodal checkpoints (`*ForConditionalGeneration`) serve their text stack: a tiny Kimi-K2.5 in the hub's
layout (a DeepSeek-V3 text_config, a vision config of `vt_*` fields, vision and projector tensors beside the
text weights) gives transformers' DeepSeek-V3 tokens; its vision tensors are never read; a wrapper whose text
family is not implemented is refused naming the text architecture."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny_models
from engine import LLM, SamplingParams
from engine.loader import ModelSourceError, resolve_model
from engine.loader.source import load_hf_config

PROMPTS = [[5, 6, 7], list(range(10, 40))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# Kimi-K2.5's vision config names its fields vt_*, and has no hidden_size.
KIMI_VISION_CONFIG = {"patch_size": 14, "init_pos_emb_height": 8, "init_pos_emb_width": 8, "merge_kernel_size": [2, 2],
                      "vt_hidden_size": 40, "vt_intermediate_size": 72, "vt_num_attention_heads": 4,
                      "vt_num_hidden_layers": 2, "text_hidden_size": 96, "mm_hidden_size": 40}
# Odd shapes: loading any of them into a text parameter would fail.
VISION_TENSORS = {
    "vision_tower.patch_embed.proj.weight": (40, 3, 14, 14),
    "vision_tower.encoder.blocks.0.wqkv.weight": (120, 40),
    "vision_tower.encoder.blocks.0.norm0.weight": (40,),
    "mm_projector.pre_norm.weight": (40,),
    "mm_projector.proj.0.weight": (7, 160),
    "mm_projector.proj.2.weight": (96, 7),
}
# Where the text weights sit: Kimi-K2.5 on the hub (language_model.model.*), transformers >= 4.52.
LAYOUTS = {
    "hub": {"model.": "language_model.model.", "lm_head.": "language_model.lm_head."},
    "transformers": {"model.": "model.language_model.", "lm_head.": "lm_head."},
}


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    return tiny_models.make_tiny_model(tmp_path_factory.mktemp("text") / "deepseek_v3", "deepseek_v3")


def write_kimi_k25(folder: Path, text_dir: Path, layout: str = "hub", architecture="KimiK25ForConditionalGeneration",
                   rename: dict[str, str] | None = None) -> Path:
    """A Kimi-K2.5 checkpoint folder whose text stack is the checkpoint in `text_dir`; `rename` moves text
    tensors to other names."""
    folder.mkdir(parents=True)
    text_config = json.loads((text_dir / "config.json").read_text())
    config = {"architectures": [architecture], "model_type": "kimi_k25", "text_config": text_config,
              "vision_config": KIMI_VISION_CONFIG, "media_placeholder_token_id": 7, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {}
    for name, tensor in load_file(str(text_dir / "model.safetensors")).items():
        prefix = next(p for p in LAYOUTS[layout] if name.startswith(p))
        tensors[LAYOUTS[layout][prefix] + name[len(prefix):]] = tensor
    for old, new in (rename or {}).items():
        tensors[new] = tensors.pop(old)
    generator = torch.Generator().manual_seed(0)
    tensors.update({name: torch.randn(shape, generator=generator) for name, shape in VISION_TENSORS.items()})
    save_file(tensors, str(folder / "model.safetensors"))
    for path in text_dir.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):
            (folder / path.name).write_bytes(path.read_bytes())
    return folder


@pytest.fixture(autouse=True)
def cpu_kernels():
    from engine import kernels
    kernels.activate("torch", torch.device("cpu"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kimi_k25_text_stack_gives_transformers_deepseek_v3_tokens(tmp_path, text_dir, layout):
    folder = write_kimi_k25(tmp_path / "kimi", text_dir, layout)
    llm = LLM(str(folder), dtype="float32", show_progress=False)
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, GREEDY)):
        assert output.token_ids == tiny_models.hf_greedy(text_dir, prompt, GREEDY.max_tokens)


def test_kimi_k25_with_its_tiktoken_tokenizer_serves_text_prompts(tmp_path, text_dir):
    """Kimi-K2.5 ships tiktoken.model and a tokenizer class in its own code (never run): the text prompt's ids
    are tiktoken's, the tokens transformers' for those ids."""
    tiktoken = pytest.importorskip("tiktoken")
    from kimi_tokenizer import write_kimi_tokenizer
    folder = write_kimi_k25(tmp_path / "kimi", text_dir)
    for path in folder.glob("*token*"):
        path.unlink()
    num_ranks = 256 + 100  # the special tokens fill the model's vocabulary up to its last id
    specials = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                7: "<|im_middle|>", tiny_models.VOCAB_SIZE - 1 - num_ranks: "[PAD]"}
    encoding = write_kimi_tokenizer(folder, num_merges=num_ranks - 256, special_tokens=specials)
    llm = LLM(str(folder), dtype="float32", show_progress=False)
    prompt = "<|im_user|>今天天气很好, the quick brown fox<|im_end|>"
    output = llm.generate([prompt], GREEDY)[0]
    assert output.prompt_token_ids == tiktoken.Encoding(**encoding).encode(prompt, allowed_special="all")
    assert output.token_ids == tiny_models.hf_greedy(text_dir, output.prompt_token_ids, GREEDY.max_tokens)


def test_kimi_k25_config_is_its_deepseek_v3_text_config(tmp_path, text_dir):
    config = load_hf_config(write_kimi_k25(tmp_path / "kimi", text_dir))
    reference = tiny_models.hf_model(text_dir).config
    assert type(config).__name__ == "DeepseekV3Config" and config.architectures == ["DeepseekV3ForCausalLM"]
    for field in ("hidden_size", "num_hidden_layers", "kv_lora_rank", "q_lora_rank", "n_routed_experts",
                  "vocab_size", "tie_word_embeddings"):
        assert getattr(config, field) == getattr(reference, field), field


def test_transformers_class_name_of_the_wrapper_is_accepted(tmp_path, text_dir):
    folder = write_kimi_k25(tmp_path / "kimi", text_dir, architecture="Kimi_K25ForConditionalGeneration")
    assert resolve_model(str(folder)).hf_config.architectures == ["DeepseekV3ForCausalLM"]


def test_text_config_of_remote_code_model_type_is_read_by_its_architecture(tmp_path, text_dir):
    """Kimi-K2.5 on the hub names its text model_type "kimi_k2" (remote code): read as DeepSeek-V3's."""
    folder = write_kimi_k25(tmp_path / "kimi", text_dir)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["model_type"] = "kimi_k2"
    config["text_config"]["auto_map"] = {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}
    (folder / "config.json").write_text(json.dumps(config))
    assert type(load_hf_config(folder)).__name__ == "DeepseekV3Config"


def test_vision_and_projector_tensors_are_never_read(tmp_path, text_dir, monkeypatch):
    import safetensors
    folder = write_kimi_k25(tmp_path / "kimi", text_dir)
    real_open, read = safetensors.safe_open, []

    class RecordingOpen:
        def __init__(self, *args, **kwargs):
            self.file = real_open(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.file.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", RecordingOpen)
    LLM(str(folder), dtype="float32", show_progress=False)
    assert read and not [name for name in read if "vision_tower" in name or "mm_projector" in name]
    assert len(read) == len(load_file(str(text_dir / "model.safetensors")))


def test_text_weight_under_an_unmapped_prefix_is_a_missing_weight(tmp_path, text_dir):
    """Negative control: a text tensor outside the text stack's prefixes is skipped like a vision tensor,
    so its parameter is reported missing."""
    name = "layers.1.self_attn.kv_a_layernorm.weight"
    folder = write_kimi_k25(tmp_path / "kimi", text_dir, rename={f"language_model.model.{name}": f"text_model.{name}"})
    with pytest.raises(ModelSourceError, match=r"lacks weights.*layers\.1\.self_attn\.kv_a_layernorm"):
        LLM(str(folder), dtype="float32", show_progress=False)


def test_wrapper_of_an_unimplemented_text_family_is_refused_naming_the_text_architecture(tmp_path, monkeypatch):
    """Every wrapper in the table has its text family now: a wrapper of one that is not registered (as
    Gemma 4's and Qwen3.5's were until their families came) is refused naming the text architecture."""
    from engine.loader import multimodal
    monkeypatch.setitem(multimodal.TEXT_ARCHITECTURES, "Qwen3_5ForConditionalGeneration", "Qwen9ForCausalLM")
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": {"model_type": "qwen3_5_text", "hidden_size": 64, "num_hidden_layers": 2},
              "vision_config": {"model_type": "qwen3_5_vision", "hidden_size": 32}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"model.language_model.embed_tokens.weight": torch.zeros(4, 64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"architecture Qwen9ForCausalLM \(the text stack of "
                                         r"Qwen3_5ForConditionalGeneration\) is not supported; supported architectures"):
        LLM(str(tmp_path), show_progress=False)


def test_wrapper_level_fields_hold_for_the_text_stack_where_it_leaves_them_out(tmp_path, text_dir):
    """A quantization_config beside the text_config applies to the text stack, its exclusions renamed to the
    text model's modules; the text_config's own values win over the wrapper's."""
    folder = write_kimi_k25(tmp_path / "kimi", text_dir)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128],
                                     "ignored_layers": ["language_model.lm_head", "re:.*vision_tower.*",
                                                        "language_model.model.layers.0.self_attn.q_a_proj",
                                                        "model.language_model.layers.*.mlp.gate"]}
    config["tie_word_embeddings"] = True  # the text_config's false wins
    (folder / "config.json").write_text(json.dumps(config))
    text = load_hf_config(folder)
    assert text.quantization_config["ignored_layers"] == [
        "lm_head", "re:.*vision_tower.*", "model.layers.0.self_attn.q_a_proj", "model.layers.*.mlp.gate"]
    assert text.tie_word_embeddings is False


def test_dummy_weights_of_a_wrapper_build_its_text_stack(tmp_path, text_dir):
    folder = write_kimi_k25(tmp_path / "kimi", text_dir)
    llm = LLM(str(folder), load_format="dummy", dtype="float32", show_progress=False)
    assert type(llm.engine.source.hf_config).__name__ == "DeepseekV3Config"
    assert len(llm.generate([PROMPTS[0]], GREEDY)[0].token_ids) == GREEDY.max_tokens


def test_text_config_given_as_a_transformers_config_reads_like_its_dict(text_dir):
    from transformers import AutoConfig
    from engine.loader.multimodal import text_config_fields, text_stack_of
    as_dict = json.loads((text_dir / "config.json").read_text())
    raw = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
           "text_config": AutoConfig.for_model(**as_dict)}
    fields = text_config_fields(raw, text_stack_of(raw))
    assert fields["model_type"] == "deepseek_v3" and fields["architectures"] == ["DeepseekV3ForCausalLM"]
    for key in ("hidden_size", "kv_lora_rank", "n_routed_experts", "vocab_size"):
        assert fields[key] == as_dict[key], key
