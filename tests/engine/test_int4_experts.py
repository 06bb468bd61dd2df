"""compressed-tensors pack-quantized INT4 experts, as Kimi-K2-Thinking and Kimi-K2.5 ship them (W4A16: symmetric
int4 in groups of 32, no input quantization; attention, shared experts, dense MLPs and lm_head in `ignore`):
a tiny DeepSeek-V3 whose routed experts are written in that format gives the logits and greedy tokens of the
same model with the dequantized values as its full-precision weights (the exact reference; transformers agrees
on the tokens), and a wrong nibble order or scale group does not; Kimi-K2.5's wrapper serves it, and AMD's Quark
MXFP4 release layout of it; tensor-parallel ranks hold whole groups, or start-up says why not; what the engine
cannot run is refused by name.

The packing is written here from compressed-tensors' own code (compressed_tensors 0.20.0,
compressors/pack_quantized/helpers.py `pack_to_int32`, num_bits 4): each value q in [-8, 7] is stored as the
unsigned q + 8, value i of a row at bits 4 * (i % 8) of int32 word i // 8; `weight_scale` [out, in / 32] in bf16,
`weight_shape` [out, in]; the weight is q * scale (forward_helpers.py `_dequantize`, zero point none)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny_models
from engine import LLM, SamplingParams
from engine.kernels.quant import QuantScheme
from engine.loader import ModelSourceError, build_model, resolve_model
from engine.parallel import state as parallel_state
from engine.quantization import QuantConfigError, parse_quantization_config

GROUP = 32
INT4 = QuantScheme("int4_group", "none", (1, GROUP))
PROMPT = list(range(3, 40))
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# moonshotai/Kimi-K2-Thinking config.json's block (as a public copy of it lists the fields).
KIMI_INT4_CONFIG = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": GROUP, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                    "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}
ROUTED_EXPERT = ".mlp.experts."


# ---- writing the checkpoints ----------------------------------------------------------------------------

def quantize_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int64 [out, in] in [-8, 7], scale bf16 [out, in / GROUP]): round to nearest over amax / 7.5."""
    out_features, in_features = weight.shape
    groups = weight.reshape(out_features, in_features // GROUP, GROUP)
    scale = (groups.abs().amax(dim=-1) / 7.5).bfloat16()
    q = torch.round(groups / scale.float()[..., None]).clamp(-8, 7).long()
    return q.reshape(out_features, in_features), scale


def pack_int32(q: torch.Tensor, nibble_order: list[int] = list(range(8))) -> torch.Tensor:
    """compressed-tensors' pack_to_int32 (4 bits): value i of a row, as q + 8, at bits 4 * nibble_order[i % 8] of
    word i // 8 (the format's order: 0..7, low nibble first)."""
    unsigned = q + 8
    words = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.int64)
    for position, nibble in enumerate(nibble_order):
        words |= unsigned[:, position::8] << (4 * nibble)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)  # the bits as int32


def write_int4(source: Path, int4: Path, reference: Path | None = None, nibble_order: list[int] = list(range(8)),
               scale_shift: int = 0) -> None:
    """`source` with its routed experts pack-quantized into `int4`, and (where given) with them replaced by
    their dequantized values into `reference`. `scale_shift` rolls each row's scales by whole groups (a
    negative control)."""
    tensors = load_file(str(source / "model.safetensors"))
    packed, dequantized = {}, {}
    for name, tensor in tensors.items():
        if ROUTED_EXPERT not in name:
            packed[name] = dequantized[name] = tensor
            continue
        q, scale = quantize_groups(tensor)
        module = name.removesuffix(".weight")
        packed[f"{module}.weight_packed"] = pack_int32(q, nibble_order)
        packed[f"{module}.weight_scale"] = scale.roll(scale_shift, dims=1).contiguous()
        packed[f"{module}.weight_shape"] = torch.tensor(list(tensor.shape), dtype=torch.int64)
        dequantized[name] = q.float() * scale.float().repeat_interleave(GROUP, dim=1)
    config = json.loads((source / "config.json").read_text())
    _save(source, int4, packed, {**config, "quantization_config": KIMI_INT4_CONFIG})
    if reference is not None:
        _save(source, reference, dequantized, config)


def _save(source: Path, folder: Path, tensors: dict, config: dict) -> None:
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    for path in source.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(path, folder / path.name)


def write_kimi_k25(text: Path, folder: Path, quantization_config_at: str = "text_config") -> Path:
    """The text checkpoint in `text` as a Kimi-K2.5 folder: weights under `language_model.model.*` beside vision
    tensors, the text config as `text_config`; its quantization_config inside the text_config or beside it
    (`wrapper`: exclusions then name the hub's modules, `language_model.lm_head`, and the vision tower)."""
    text_config = json.loads((text / "config.json").read_text())
    quantization = text_config.pop("quantization_config")
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "text_config": text_config, "vision_config": {"vt_hidden_size": 40, "patch_size": 14}}
    if quantization_config_at == "text_config":
        text_config["quantization_config"] = quantization
    else:
        key = "ignore" if "ignore" in quantization else "exclude"
        renamed = [f"language_model.{n}" if n in ("lm_head", "*lm_head") else n for n in quantization[key]]
        config["quantization_config"] = {**quantization, key: [*renamed, "re:.*vision_tower.*"]}
    tensors = {("language_model." + name if name.startswith(("model.", "lm_head.")) else name): tensor
               for name, tensor in load_file(str(text / "model.safetensors")).items()}
    tensors["vision_tower.encoder.blocks.0.wqkv.weight"] = torch.zeros(7, 5)
    _save(text, folder, tensors, config)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int4")
    source = tiny_models.make_tiny_model(root / "source", "deepseek_v3")
    write_int4(source, root / "int4", root / "reference")
    return {"source": source, "int4": root / "int4", "reference": root / "reference", "root": root}


@pytest.fixture(autouse=True)
def cpu_kernels():
    from engine import kernels
    kernels.activate("torch", torch.device("cpu"))


def logits(folder: Path) -> torch.Tensor:
    model = build_model(resolve_model(str(folder)), torch.float32, torch.device("cpu"), show_progress=False)
    return tiny_models.engine_logits(model, PROMPT)


def greedy(folder: Path) -> list[int]:
    return LLM(str(folder), dtype="float32", show_progress=False).generate([PROMPT], GREEDY)[0].token_ids


def layer_schemes(folder: Path) -> dict[str, object]:
    model = build_model(resolve_model(str(folder)), torch.float32, torch.device("cpu"), show_progress=False)
    return {name: module.quant_scheme for name, module in model.named_modules() if hasattr(module, "quant_scheme")}


# ---- the format -----------------------------------------------------------------------------------------

def test_int4_experts_give_the_dequantized_models_logits_and_tokens(folders):
    expected = logits(folders["reference"])
    torch.testing.assert_close(logits(folders["int4"]), expected, rtol=0, atol=1e-5)
    tokens = greedy(folders["int4"])
    assert tokens == greedy(folders["reference"]) == tiny_models.hf_greedy(folders["reference"], PROMPT,
                                                                            GREEDY.max_tokens)


@pytest.mark.parametrize("wrong", ["nibble order", "scale group"])
def test_a_wrong_packing_does_not_give_the_dequantized_model(folders, wrong):
    """Negative controls: the nibbles of each word in reverse order; each row's scales one group off."""
    broken = folders["root"] / wrong.replace(" ", "_")
    edit = {"nibble order": dict(nibble_order=list(range(7, -1, -1))), "scale group": dict(scale_shift=1)}[wrong]
    write_int4(folders["source"], broken, **edit)
    assert (logits(broken) - logits(folders["reference"])).abs().max() > 0.1


def test_only_the_routed_experts_are_int4(folders):
    schemes = layer_schemes(folders["int4"])
    assert schemes["model.layers.1.mlp"] == schemes["model.layers.2.mlp"] == INT4  # the FusedMoE layers
    quantized = sorted(name for name, scheme in schemes.items() if scheme is not None)
    assert quantized == ["model.layers.1.mlp", "model.layers.2.mlp"]  # not attention, shared experts, dense MLP


def test_a_weight_shape_other_than_the_layers_is_refused_naming_it(folders, tmp_path):
    shutil.copytree(folders["int4"], tmp_path / "bad")
    tensors = load_file(str(tmp_path / "bad" / "model.safetensors"))
    tensors["model.layers.2.mlp.experts.3.down_proj.weight_shape"] = torch.tensor([96, 72])
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"))
    with pytest.raises(ModelSourceError, match=r"experts\.3\.down_proj\.weight_shape.*\[96, 72\].*\[96, 64\]"):
        logits(tmp_path / "bad")


def test_random_weights_of_an_int4_config_run(folders):
    model = build_model(resolve_model(str(folders["int4"]), "dummy"), torch.float32, torch.device("cpu"),
                        show_progress=False)
    assert torch.isfinite(tiny_models.engine_logits(model, PROMPT)).all()


# ---- Kimi-K2.5's wrapper ---------------------------------------------------------------------------------

@pytest.mark.parametrize("placement", ["text_config", "wrapper"])
def test_kimi_k25_with_int4_experts_serves_its_text_stack(folders, tmp_path, placement):
    kimi = write_kimi_k25(folders["int4"], tmp_path / "kimi", placement)
    assert torch.equal(logits(kimi), logits(folders["int4"]))
    schemes = layer_schemes(kimi)
    assert schemes["model.layers.1.mlp"] == INT4 and schemes["model.layers.1.self_attn.kv_b_proj"] is None


def test_kimi_k25_in_amds_quark_mxfp4_layout_serves_its_text_stack(folders, tmp_path):
    """amd/Kimi-K2.5-MXFP4: Quark MXFP4 weights and activations (w4a4) for the routed and shared experts and the
    dense MLP, excluded by its model card's patterns `*self_attn* *mlp.gate *lm_head *mm_projector*
    *vision_tower*`."""
    from engine.quantization.quantizer import quantize_checkpoint
    text = tmp_path / "quark"
    quantize_checkpoint(folders["source"], text, "quark-mxfp4",
                        exclude=("lm_head", "re:.*embed_tokens$", "re:.*self_attn.*"))
    config = json.loads((text / "config.json").read_text())
    config["quantization_config"]["exclude"] = ["*self_attn*", "*mlp.gate", "*lm_head", "*mm_projector*",
                                                "*vision_tower*"]
    (text / "config.json").write_text(json.dumps(config))
    kimi = write_kimi_k25(text, tmp_path / "kimi", "wrapper")
    assert torch.equal(logits(kimi), logits(text))
    schemes = layer_schemes(kimi)
    mxfp4 = QuantScheme("mxfp4", "mxfp4")
    assert schemes["model.layers.1.mlp"] == schemes["model.layers.1.mlp.shared_experts.down_proj"] == mxfp4
    assert schemes["model.layers.0.mlp.gate_up_proj"] == mxfp4
    assert schemes["model.layers.0.self_attn.q_a_proj"] is None


# ---- tensor parallelism ----------------------------------------------------------------------------------

def build_at(folder: Path, monkeypatch, tp_rank: int, tp_size: int):
    monkeypatch.setattr(parallel_state, "_state", parallel_state.ParallelState(tp_rank=tp_rank, tp_size=tp_size))
    return build_model(resolve_model(str(folder)), torch.float32, torch.device("cpu"), show_progress=False)


def test_tensor_parallel_ranks_hold_whole_groups_of_each_experts_slice(folders, monkeypatch):
    """moe_intermediate_size 64 over two ranks: 32 rows of gate and of up each, and the down projection's 32
    input columns (16 packed bytes, one group's scale) per rank."""
    full = build_at(folders["int4"], monkeypatch, 0, 1).model.layers[2].mlp
    for rank in range(2):
        part = build_at(folders["int4"], monkeypatch, rank, 2).model.layers[2].mlp
        rows = slice(32 * rank, 32 * (rank + 1))
        assert torch.equal(part.w13.data, torch.cat([full.w13.data[:, rows], full.w13.data[:, 64:][:, rows]], 1))
        assert torch.equal(part.w13_scale.data, torch.cat([full.w13_scale.data[:, rows],
                                                          full.w13_scale.data[:, 64:][:, rows]], 1))
        assert torch.equal(part.w2.data, full.w2.data[:, :, 16 * rank:16 * (rank + 1)])
        assert torch.equal(part.w2_scale.data, full.w2_scale.data[:, :, rank:rank + 1])


def test_a_tensor_parallel_size_that_splits_a_group_is_refused_at_start_up(folders, monkeypatch):
    with pytest.raises(ValueError, match=r"int4 experts quantized in groups of 32 .* 64 split over "
                                         r"tensor_parallel_size 4 gives 16 .* divides 2 groups"):
        build_at(folders["int4"], monkeypatch, 0, 4)


# ---- what is refused --------------------------------------------------------------------------------------

def _config(**weights) -> dict:
    config = json.loads(json.dumps(KIMI_INT4_CONFIG))
    config["config_groups"]["group_0"]["weights"].update(weights)
    return config


def test_kimi_config_reads_as_int4_groups_for_the_routed_experts_only():
    config = parse_quantization_config({"quantization_config": KIMI_INT4_CONFIG})
    assert config.experts_scheme("model.layers.3.mlp.experts") == INT4
    for module in ("model.layers.3.self_attn.kv_b_proj", "model.layers.3.mlp.shared_experts.down_proj",
                   "model.layers.0.mlp.gate_proj", "model.layers.3.mlp.gate", "lm_head"):
        assert config.linear_scheme(module) is None, module
    assert "int4_group 32, unquantized activations" in config.describe()


@pytest.mark.parametrize("change, message", [
    (dict(num_bits=8), r"8-bit int weights are not supported; supported: 4-bit int weights, symmetric"),
    (dict(actorder="group"), r"actorder 'group' \(groups permuted by weight_g_idx\) are not supported"),
    (dict(symmetric=False), r"asymmetric 4-bit int weights \(weight_zero_point\) are not supported"),
    (dict(strategy="channel", group_size=None), r"strategy 'channel' and group_size None are not supported"),
    (dict(group_size=20), r"group_size 20 are not supported"),
])
def test_unsupported_int_variants_are_refused_naming_them(change, message):
    with pytest.raises(QuantConfigError, match=message):
        parse_quantization_config({"quantization_config": _config(**change)})


def test_int4_weights_with_quantized_activations_are_refused():
    config = _config()
    config["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "strategy": "token",
                                                               "dynamic": True, "symmetric": True}
    with pytest.raises(QuantConfigError, match=r"4-bit int weights with 8-bit int activations \(W4A8\)"):
        parse_quantization_config({"quantization_config": config})


def test_an_unsupported_variant_is_refused_when_the_model_loads(folders, tmp_path):
    shutil.copytree(folders["int4"], tmp_path / "int8")
    config = json.loads((tmp_path / "int8" / "config.json").read_text())
    config["quantization_config"] = _config(actorder="dynamic")
    (tmp_path / "int8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelSourceError, match=r"unsupported quantization_config.*actorder 'dynamic'"):
        LLM(str(tmp_path / "int8"), dtype="float32", show_progress=False)
