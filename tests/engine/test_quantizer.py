"""Our checkpoint quantizer: tiny full-precision models written in each real-world quantized format hold the
tensors that format names, in its dtypes and shapes, with exactly the engine's quantized values; they
dequantize to the original weights within the format's error; and the written quantization_config parses to
the intended schemes."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import tiny_models
from engine.kernels.quant import QuantizedWeight, QuantScheme, dequantize_weight, e8m0_to_float, quantize_weight
from engine.quantization import parse_quantization_config
from engine.quantization.quantizer import FORMATS, calibrate, main, quantize_checkpoint

FP8_BLOCK = QuantScheme("fp8_block")
FP8_CHANNEL = QuantScheme("fp8_channel")
FP8_TENSOR_STATIC = QuantScheme("fp8_tensor", "static")
LAYER = "model.layers.0"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("full-precision")
    return {arch: tiny_models.make_tiny_model(root / arch, arch) for arch in ("llama", "qwen3_moe")}


@pytest.fixture(scope="module")
def quantized(sources, tmp_path_factory):
    """quantized(arch, fmt, kv=False) -> (source tensors, written tensors, written config.json), made once."""
    made = {}

    def make(arch: str, fmt: str, kv: bool = False):
        if (arch, fmt, kv) not in made:
            dst = tmp_path_factory.mktemp(f"{arch}-{fmt}")
            quantize_checkpoint(sources[arch], dst, fmt, kv_cache_scales=kv)
            made[arch, fmt, kv] = (load_file(str(sources[arch] / "model.safetensors")),
                                   load_file(str(dst / "model.safetensors")),
                                   json.loads((dst / "config.json").read_text()))
        return made[arch, fmt, kv]
    return make


def dequantized(tensors: dict, module: str, scheme: QuantScheme, scale_name: str = "weight_scale") -> torch.Tensor:
    """The float32 weight a written module stands for, read back through the engine's own dequantization."""
    scale = tensors[f"{module}.{scale_name}"]
    if scheme.method in ("fp8_tensor", "fp8_channel"):
        scale = scale.reshape(-1)  # [] / [1] / [N] / [N, 1] -> the engine's [1] / [N]
    return dequantize_weight(QuantizedWeight(scheme, tensors[f"{module}.weight"], scale))


def assert_written_like_the_engine(source: dict, written: dict, module: str, scheme: QuantScheme,
                                   scale_name: str = "weight_scale") -> None:
    """Bit for bit what engine.kernels.quant.quantize_weight makes of the source weight, and within the
    format's rounding error of it."""
    original = source[f"{module}.weight"].float()
    engine = quantize_weight(original, scheme)
    assert torch.equal(written[f"{module}.weight"].view(torch.uint8), engine.weight.view(torch.uint8))
    error = (dequantized(written, module, scheme, scale_name) - original).abs()
    if scheme.method == "mxfp4":  # half a step of e2m1, up to 2 steps where 6 saturates: <= 2 x the group scale
        bound = 2 * e8m0_to_float(written[f"{module}.{scale_name}"]).repeat_interleave(32, dim=-1)
    else:  # e4m3: 3 mantissa bits (half an ulp = 2^-4 relative), subnormal steps of 2^-9 x scale
        bound = original.abs() * 2 ** -4 + dequantized(written, module, scheme, scale_name).abs().max() * 2 ** -9
    assert (error <= bound + 1e-7).all(), f"{module}: {(error - bound).max()}"


# ---- HF fp8 ---------------------------------------------------------------------------------------------

def test_fp8_block_writes_fp8_weights_and_block_scale_inv(quantized):
    source, written, config = quantized("llama", "fp8-block")
    for proj, (n, k) in {"q_proj": (96, 96), "k_proj": (32, 96), "o_proj": (96, 96)}.items():
        module = f"{LAYER}.self_attn.{proj}"
        assert written[f"{module}.weight"].dtype == torch.float8_e4m3fn
        assert written[f"{module}.weight_scale_inv"].dtype == torch.float32
        assert written[f"{module}.weight_scale_inv"].shape == (-(-n // 128), -(-k // 128))
        assert_written_like_the_engine(source, written, module, FP8_BLOCK, "weight_scale_inv")
    assert_written_like_the_engine(source, written, f"{LAYER}.mlp.down_proj", FP8_BLOCK, "weight_scale_inv")
    for name in ("lm_head.weight", "model.embed_tokens.weight", f"{LAYER}.input_layernorm.weight"):
        assert torch.equal(written[name], source[name])
    assert config["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "modules_to_not_convert": ["lm_head", "model.embed_tokens"],
                                             "weight_block_size": [128, 128]}
    parsed = parse_quantization_config(config)
    assert parsed.linear_scheme(f"{LAYER}.self_attn.q_proj") == FP8_BLOCK
    assert parsed.linear_scheme("lm_head") is None


def test_fp8_tensor_static_keeps_one_weight_and_input_scale_per_projection(quantized):
    source, written, config = quantized("llama", "fp8-tensor-static")
    scales = {proj: written[f"{LAYER}.self_attn.{proj}.weight_scale"] for proj in ATTENTION}
    inputs = {proj: written[f"{LAYER}.self_attn.{proj}.input_scale"] for proj in ATTENTION}
    assert all(s.shape == () and s.dtype == torch.float32 for s in (*scales.values(), *inputs.values()))
    # q, k, v: their own weight scales (the loader requantizes to the largest), one input (the same tokens)
    assert len({scales[p].item() for p in ("q_proj", "k_proj", "v_proj")}) == 3
    assert inputs["q_proj"] == inputs["k_proj"] == inputs["v_proj"] != inputs["o_proj"]
    assert all(s > 0 for s in inputs.values())
    for proj in ATTENTION:
        assert_written_like_the_engine(source, written, f"{LAYER}.self_attn.{proj}", QuantScheme("fp8_tensor"))
    qc = config["quantization_config"]
    assert (qc["quant_method"], qc["activation_scheme"], qc["ignored_layers"]) == ("fp8", "static",
                                                                                  ["lm_head", "model.embed_tokens"])
    assert parse_quantization_config(config).linear_scheme(f"{LAYER}.mlp.up_proj") == FP8_TENSOR_STATIC


def test_static_expert_input_scales_come_from_each_experts_own_tokens(quantized):
    _, written, config = quantized("qwen3_moe", "fp8-tensor-static")
    experts = f"{LAYER}.mlp.experts"
    gate_inputs = {written[f"{experts}.{e}.gate_proj.input_scale"].item() for e in range(8)}
    down_inputs = {written[f"{experts}.{e}.down_proj.input_scale"].item() for e in range(8)}
    assert all(s > 0 for s in gate_inputs | down_inputs)
    assert len(down_inputs) == 8
    assert parse_quantization_config(config).experts_scheme(experts) == FP8_TENSOR_STATIC


# ---- compressed-tensors ---------------------------------------------------------------------------------

def test_ct_fp8_dynamic_writes_channel_scales_for_layers_and_experts(quantized):
    source, written, config = quantized("qwen3_moe", "ct-fp8-dynamic")
    for module in (f"{LAYER}.self_attn.q_proj", f"{LAYER}.mlp.experts.3.gate_proj", f"{LAYER}.mlp.experts.3.down_proj",
                   "model.layers.1.mlp.up_proj"):
        n = source[f"{module}.weight"].shape[0]
        assert written[f"{module}.weight_scale"].shape == (n, 1)
        assert_written_like_the_engine(source, written, module, FP8_CHANNEL)
    assert torch.equal(written[f"{LAYER}.mlp.gate.weight"], source[f"{LAYER}.mlp.gate.weight"])  # the router
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    assert qc["ignore"] == ["lm_head", "model.embed_tokens", f"{LAYER}.mlp.gate", "model.layers.2.mlp.gate"]
    group = qc["config_groups"]["group_0"]
    assert (group["weights"]["strategy"], group["input_activations"]["strategy"]) == ("channel", "token")
    parsed = parse_quantization_config(config)
    assert parsed.experts_scheme(f"{LAYER}.mlp.experts") == FP8_CHANNEL
    assert parsed.linear_scheme(f"{LAYER}.mlp.gate") is None
    assert not parsed.kv_cache_scales


def test_ct_fp8_static_tensor_writes_one_element_scales_and_kv_cache_scales(quantized):
    source, written, config = quantized("llama", "ct-fp8-static-tensor", kv=True)
    module = f"{LAYER}.self_attn.v_proj"
    assert written[f"{module}.weight_scale"].shape == (1,) and written[f"{module}.input_scale"].shape == (1,)
    assert_written_like_the_engine(source, written, module, QuantScheme("fp8_tensor"))
    for layer in range(3):
        for kind in ("k", "v"):
            scale = written[f"model.layers.{layer}.self_attn.{kind}_scale"]
            assert scale.shape == () and scale.dtype == torch.float32 and scale > 0
    qc = config["quantization_config"]
    assert qc["kv_cache_scheme"]["strategy"] == "tensor" and not qc["kv_cache_scheme"]["dynamic"]
    parsed = parse_quantization_config(config)
    assert parsed.kv_cache_scales
    assert parsed.linear_scheme(module) == FP8_TENSOR_STATIC


def test_kv_cache_scales_cover_the_values_the_cache_stores(sources):
    folder = sources["llama"]
    seen = calibrate(folder, set(), num_sequences=2, seq_len=8, seed=3)
    model = tiny_models.hf_model(folder)
    values = []
    hook = model.model.layers[1].self_attn.v_proj.register_forward_hook(lambda m, i, out: values.append(out))
    tokens = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(tokens, use_cache=False)
    hook.remove()
    keys_amax, values_amax = seen.kv_amax["model.layers.1.self_attn"]
    assert values_amax == pytest.approx(values[0].abs().amax().item())
    assert keys_amax > 0
    assert seen.linear_amax["model.layers.1.self_attn.o_proj"] > 0


# ---- Quark ------------------------------------------------------------------------------------------------

def test_quark_fp8_tensor_writes_scalar_scales_and_k_v_output_scales(quantized):
    source, written, config = quantized("llama", "quark-fp8-tensor", kv=True)
    attention = f"{LAYER}.self_attn"
    for name in ("q_proj.weight_scale", "q_proj.input_scale", "k_proj.output_scale", "v_proj.output_scale"):
        assert written[f"{attention}.{name}"].shape == ()
    assert f"{attention}.q_proj.output_scale" not in written
    assert_written_like_the_engine(source, written, f"{attention}.k_proj", QuantScheme("fp8_tensor"))
    qc = config["quantization_config"]
    assert qc["export"]["kv_cache_group"] == ["*k_proj", "*v_proj"]
    assert qc["global_quant_config"]["weight"]["qscheme"] == "per_tensor"
    parsed = parse_quantization_config(config)
    assert parsed.kv_cache_scales
    for proj in ATTENTION:
        assert parsed.linear_scheme(f"{attention}.{proj}") == FP8_TENSOR_STATIC


def test_quark_fp8_token_writes_per_channel_scales(quantized):
    source, written, config = quantized("llama", "quark-fp8-token")
    module = f"{LAYER}.mlp.gate_proj"
    assert written[f"{module}.weight_scale"].shape == (160,)
    assert_written_like_the_engine(source, written, module, FP8_CHANNEL)
    assert parse_quantization_config(config).linear_scheme(module) == FP8_CHANNEL


def test_quark_fp8_1x128_writes_block_scales(quantized):
    source, written, config = quantized("qwen3_moe", "quark-fp8-1x128")
    module = f"{LAYER}.self_attn.q_proj"  # [288, 96]
    assert written[f"{module}.weight_scale"].shape == (3, 1)
    assert_written_like_the_engine(source, written, module, FP8_BLOCK)
    assert_written_like_the_engine(source, written, f"{LAYER}.mlp.experts.5.up_proj", FP8_BLOCK)
    parsed = parse_quantization_config(config)
    assert parsed.linear_scheme(module) == FP8_BLOCK
    assert parsed.experts_scheme(f"{LAYER}.mlp.experts") == FP8_BLOCK


@pytest.mark.parametrize("arch, fmt, activation", [("qwen3_moe", "quark-mxfp4", "mxfp4"),
                                                   ("llama", "quark-mxfp4-w4a16", "none")])
def test_quark_mxfp4_packs_e2m1_pairs_with_e8m0_group_scales(quantized, arch, fmt, activation):
    source, written, config = quantized(arch, fmt)
    scheme = QuantScheme("mxfp4", activation)
    modules = [f"{LAYER}.self_attn.o_proj", f"{LAYER}.mlp.experts.7.down_proj" if arch == "qwen3_moe" else
               f"{LAYER}.mlp.down_proj"]
    for module in modules:
        n, k = source[f"{module}.weight"].shape
        assert (written[f"{module}.weight"].dtype, written[f"{module}.weight"].shape) == (torch.uint8, (n, k // 2))
        assert (written[f"{module}.weight_scale"].dtype, written[f"{module}.weight_scale"].shape) == \
            (torch.uint8, (n, k // 32))
        assert_written_like_the_engine(source, written, module, scheme)
    inputs = config["quantization_config"]["global_quant_config"]["input_tensors"]
    assert (inputs is None) == (activation == "none")
    parsed = parse_quantization_config(config)
    assert parsed.linear_scheme(f"{LAYER}.self_attn.q_proj") == scheme
    assert parsed.linear_scheme("lm_head") is None
    if arch == "qwen3_moe":
        assert parsed.experts_scheme(f"{LAYER}.mlp.experts") == scheme
        assert parsed.linear_scheme(f"{LAYER}.mlp.gate") is None


# ---- gpt-oss MXFP4 ----------------------------------------------------------------------------------------

def test_gptoss_mxfp4_fuses_experts_gate_rows_then_up_rows(quantized):
    source, written, config = quantized("qwen3_moe", "gptoss-mxfp4")
    experts, E, I, H = f"{LAYER}.mlp.experts", 8, 64, 96
    shapes = {"gate_up_proj_blocks": (E, 2 * I, H // 32, 16), "gate_up_proj_scales": (E, 2 * I, H // 32),
              "down_proj_blocks": (E, H, I // 32, 16), "down_proj_scales": (E, H, I // 32)}
    for name, shape in shapes.items():
        assert (written[f"{experts}.{name}"].dtype, written[f"{experts}.{name}"].shape) == (torch.uint8, shape)
    assert not any(".experts.0." in name for name in written)
    mx = QuantScheme("mxfp4", "none")
    gate_up = dequantize_weight(QuantizedWeight(mx, written[f"{experts}.gate_up_proj_blocks"].flatten(-2),
                                                written[f"{experts}.gate_up_proj_scales"]))
    down = dequantize_weight(QuantizedWeight(mx, written[f"{experts}.down_proj_blocks"].flatten(-2),
                                             written[f"{experts}.down_proj_scales"]))
    for e in (0, 5):
        for rows, proj in ((gate_up[e, :I], "gate_proj"), (gate_up[e, I:], "up_proj"), (down[e], "down_proj")):
            original = source[f"{experts}.{e}.{proj}.weight"]
            assert torch.equal(rows, dequantize_weight(quantize_weight(original, mx)))
    for name in (f"{LAYER}.self_attn.q_proj.weight", f"{LAYER}.mlp.gate.weight", "model.layers.1.mlp.down_proj.weight"):
        assert torch.equal(written[name], source[name])
    parsed = parse_quantization_config(config)
    assert parsed.experts_scheme(experts) == mx
    assert parsed.linear_scheme(f"{LAYER}.self_attn.q_proj") is None
    assert parsed.linear_scheme("model.layers.1.mlp.down_proj") is None


# ---- options and refusals ---------------------------------------------------------------------------------

def test_excluded_modules_stay_full_precision_and_are_listed(sources, tmp_path):
    quantize_checkpoint(sources["llama"], tmp_path, "ct-fp8-dynamic",
                        exclude=["lm_head", "re:.*embed_tokens$", "model.layers.0.self_attn"])
    written = load_file(str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    assert written[f"{LAYER}.self_attn.q_proj.weight"].dtype == torch.float32
    assert f"{LAYER}.self_attn.q_proj.weight_scale" not in written
    assert f"{LAYER}.self_attn.o_proj" in config["quantization_config"]["ignore"]
    parsed = parse_quantization_config(config)
    assert parsed.linear_scheme(f"{LAYER}.self_attn.o_proj") is None
    assert parsed.linear_scheme("model.layers.1.self_attn.o_proj") == FP8_CHANNEL


def test_tokenizer_and_generation_files_are_copied(sources, tmp_path):
    quantize_checkpoint(sources["llama"], tmp_path, "quark-fp8-token")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / name).read_bytes() == (sources["llama"] / name).read_bytes()


def test_command_line_writes_the_named_format(sources, tmp_path):
    main([str(sources["llama"]), str(tmp_path), "--format", "fp8-block"])
    config = json.loads((tmp_path / "config.json").read_text())
    assert parse_quantization_config(config).linear_scheme(f"{LAYER}.mlp.up_proj") == FP8_BLOCK


def test_unknown_format_is_refused_with_the_known_ones(sources, tmp_path):
    with pytest.raises(ValueError, match="unknown quantized format 'fp8'.*fp8-block"):
        quantize_checkpoint(sources["llama"], tmp_path, "fp8")


def test_kv_cache_scales_need_a_format_that_stores_them(sources, tmp_path):
    with pytest.raises(ValueError, match="fp8-block cannot carry KV-cache scales.*ct-fp8-static-tensor"):
        quantize_checkpoint(sources["llama"], tmp_path, "fp8-block", kv_cache_scales=True)


def test_an_already_quantized_checkpoint_is_refused(sources, tmp_path):
    quantize_checkpoint(sources["llama"], tmp_path / "once", "quark-fp8-token")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(tmp_path / "once", tmp_path / "twice", "fp8-block")


def test_excluding_some_experts_of_a_layer_is_refused(sources, tmp_path):
    with pytest.raises(ValueError, match="some routed experts of model.layers.0.mlp.experts"):
        quantize_checkpoint(sources["qwen3_moe"], tmp_path, "ct-fp8-dynamic",
                            exclude=["lm_head", "re:.*embed_tokens$", "re:.*experts.3.*"])


def test_every_format_is_documented_in_the_module():
    from engine.quantization import quantizer
    assert all(f"| {fmt} " in quantizer.__doc__ for fmt in FORMATS)
