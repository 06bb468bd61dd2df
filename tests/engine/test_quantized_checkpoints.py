"""Quantized checkpoints in every format our quantizer writes (engine/quantization/quantizer.py), loaded as a user
loads them: a trained tiny model keeps its teacher-forced choices and stays within each format's logit error of
its full-precision self (a corrupted scale breaks that bound), the aiter backend (on the AITER double) chooses as
the torch backend does, an FP8 KV cache takes a checkpoint's scales, and broken checkpoints are refused naming
what is wrong."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import aiter_double
from engine.llm import LLM
from engine.loader import ModelSourceError, build_model, resolve_model
from engine.quantization.quantizer import FORMATS, quantize_checkpoint
from engine.sampling_params import SamplingParams
from tiny_models import AITER_SHAPES, VOCAB_SIZE, engine_logits, make_trained_tiny_model, training_sequence

ARCHS = {"llama": "llama", "moe": "qwen3_moe"}
# gpt-oss's format quantizes routed experts only: the Llama has none.
CASES = [(arch, fmt) for arch in ARCHS for fmt in FORMATS if not (arch == "llama" and fmt == "gptoss-mxfp4")]
RANDOM_TOKENS = torch.randint(3, VOCAB_SIZE, (64,), generator=torch.Generator().manual_seed(0)).tolist()
# Relative L2 error of all logits over RANDOM_TOKENS against the full-precision model, (Llama, MoE): what was
# measured plus about 25%, so that a misread scale shows. Formats of one scheme measure the same; the MoE's
# errors are mostly a few tokens whose experts change (they stay with its attention quantized alone).
LOGIT_ERROR_BOUND = {
    "fp8-block": (0.065, 0.15),             # measured 0.052, 0.121
    "quark-fp8-1x128": (0.065, 0.15),
    "ct-fp8-dynamic": (0.065, 0.2),         # 0.050, 0.157
    "quark-fp8-token": (0.065, 0.2),
    "fp8-tensor-static": (0.07, 0.17),      # 0.054, 0.134
    "ct-fp8-static-tensor": (0.07, 0.17),
    "quark-fp8-tensor": (0.07, 0.17),
    "quark-mxfp4": (0.29, 0.38),            # 0.228, 0.305
    "quark-mxfp4-w4a16": (0.19, 0.28),      # 0.153, 0.226
    "gptoss-mxfp4": (None, 0.09),           # experts only: 0.069
}
# Formats whose stored values are exactly what online quantization (`quantization=`) makes of the source.
ONLINE_EQUIVALENT = {"fp8-block": "fp8_block", "quark-fp8-1x128": "fp8_block", "ct-fp8-dynamic": "fp8_channel",
                     "quark-fp8-token": "fp8_channel", "quark-mxfp4-w4a16": "mxfp4"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Trained once per process (make_trained_tiny_model), with AITER's head size so the aiter tests keep
    attention on AITER."""
    root = tmp_path_factory.mktemp("trained")
    return {arch: make_trained_tiny_model(root / arch, model_type, **AITER_SHAPES)
            for arch, model_type in ARCHS.items()}


@pytest.fixture(scope="module")
def quantized(models, tmp_path_factory):
    """quantized(arch, fmt, kv=False) -> the folder of `arch` written in `fmt`, made once."""
    made = {}

    def make(arch: str, fmt: str, kv: bool = False):
        if (arch, fmt, kv) not in made:
            made[arch, fmt, kv] = tmp_path_factory.mktemp(f"{arch}-{fmt}")
            quantize_checkpoint(models[arch], made[arch, fmt, kv], fmt, kv_cache_scales=kv)
        return made[arch, fmt, kv]
    return make


@pytest.fixture(scope="module")
def full_precision(models):
    """full_precision(arch) -> (teacher-forced top-1 tokens, logits over RANDOM_TOKENS) of the unquantized model."""
    seen = {}

    def reference(arch: str):
        if arch not in seen:
            seen[arch] = (teacher_forced_top1(load(models[arch]), models[arch]), logits(models[arch]))
        return seen[arch]
    return reference


@pytest.fixture
def double():
    with aiter_double.serving("gfx950") as aiter:
        yield aiter


def load(folder, **engine_args) -> LLM:
    return LLM(str(folder), **{"dtype": "float32", "device": "cpu", "num_kv_blocks": 64, "show_progress": False,
                               **engine_args})


def teacher_forced_top1(llm: LLM, folder) -> list[int]:
    """The model's most likely next token at each position of a stretch of its training text."""
    sequence = training_sequence(folder, 96)
    out = llm.generate([sequence], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    return [min(entry.items(), key=lambda kv: kv[1].rank)[0] for entry in out.prompt_logprobs[1:]]


def agreement(got: list[int], expected: list[int]) -> float:
    assert len(got) == len(expected)
    return sum(a == b for a, b in zip(got, expected)) / len(expected)


def logits(folder, **build_args) -> torch.Tensor:
    model = build_model(resolve_model(str(folder)), torch.float32, torch.device("cpu"), show_progress=False,
                        **build_args)
    return engine_logits(model, RANDOM_TOKENS)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()


def edited_copy(folder, destination, edit_tensors=None, edit_config=None):
    """A copy of a checkpoint folder with its tensors (a dict, edited in place) or its config.json changed."""
    shutil.copytree(folder, destination)
    if edit_tensors:
        tensors = load_file(str(destination / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(destination / "model.safetensors"), metadata={"format": "pt"})
    if edit_config:
        config = json.loads((destination / "config.json").read_text())
        edit_config(config)
        (destination / "config.json").write_text(json.dumps(config))
    return destination


# ---- every format on the torch backend --------------------------------------------------------------------

@pytest.mark.parametrize("arch, fmt", CASES)
def test_each_format_keeps_the_teacher_forced_choices(arch, fmt, quantized, full_precision):
    expected, _ = full_precision(arch)
    folder = quantized(arch, fmt)
    assert agreement(teacher_forced_top1(load(folder), folder), expected) >= 0.95


@pytest.mark.parametrize("arch, fmt", CASES)
def test_each_format_keeps_the_logits_within_its_error_bound(arch, fmt, quantized, full_precision):
    _, expected = full_precision(arch)
    bound = dict(zip(ARCHS, LOGIT_ERROR_BOUND[fmt]))[arch]
    assert relative_error(logits(quantized(arch, fmt)), expected) < bound


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", ONLINE_EQUIVALENT)
def test_dynamic_formats_load_exactly_as_online_quantization_of_their_source(arch, fmt, models, quantized):
    """The checkpoint's weights and scales, however the format shapes and names them, reach the layers as the
    engine's own quantization of the source puts them there: bit for bit the same logits."""
    online = logits(models[arch], quantization=ONLINE_EQUIVALENT[fmt])
    torch.testing.assert_close(logits(quantized(arch, fmt)), online, rtol=0, atol=0)


@pytest.mark.parametrize("fmt, scale", [("fp8-block", "model.layers.0.mlp.down_proj.weight_scale_inv"),
                                        ("quark-fp8-tensor", "model.layers.0.mlp.down_proj.weight_scale")])
def test_one_corrupted_scale_breaks_the_logit_bound(fmt, scale, quantized, full_precision, tmp_path):
    """The negative control of the bound above: one 128x128 block scale of a down projection (or its
    per-tensor scale) times 4 is far outside it."""
    def corrupt(tensors):
        tensors[scale].view(-1)[0] *= 4
    broken = edited_copy(quantized("llama", fmt), tmp_path / "broken", corrupt)
    _, expected = full_precision("llama")
    assert relative_error(logits(broken), expected) > 2 * LOGIT_ERROR_BOUND[fmt][0]


# ---- the aiter backend, on the AITER double ---------------------------------------------------------------

# What each format must run on AITER (aiter_double.CALLS names), beside the unquantized ops.
AITER_KERNELS = {
    ("llama", "fp8-block"): {"gemm_a8w8_blockscale_bpreshuffle"},
    ("llama", "ct-fp8-dynamic"): {"gemm_a8w8_bpreshuffle"},
    ("llama", "quark-fp8-tensor"): {"per_tensor_quant_hip"},  # static input scales, then tgemm.mm with scales
    ("moe", "fp8-block"): {"gemm_a8w8_blockscale_bpreshuffle", "fused_moe"},
    ("moe", "quark-mxfp4"): {"per_1x32_f4_quant_hip", "gemm_a4w4", "fused_moe"},  # w4a4
}


def aiter_agreement(folder) -> float:
    """Teacher-forced choices of the aiter backend against the torch backend's, both bf16."""
    expected = teacher_forced_top1(load(folder, dtype="bfloat16", kernel_backend="torch"), folder)
    aiter_double.CALLS.clear()
    return agreement(teacher_forced_top1(load(folder, dtype="bfloat16", kernel_backend="aiter"), folder), expected)


@pytest.mark.parametrize("arch, fmt", AITER_KERNELS)
def test_aiter_backend_chooses_as_the_torch_backend(double, arch, fmt, quantized):
    assert aiter_agreement(quantized(arch, fmt)) >= 0.95
    assert AITER_KERNELS[arch, fmt] <= set(aiter_double.CALLS), aiter_double.CALLS


def test_weight_only_mxfp4_experts_run_on_the_fallback_and_the_kernel_table_says_so(double, quantized):
    folder = quantized("moe", "gptoss-mxfp4")
    assert aiter_agreement(folder) >= 0.95
    assert "fused_moe" not in aiter_double.CALLS
    runner = load(folder, dtype="bfloat16", kernel_backend="aiter").engine.executor.runner
    table = dict(runner.kernel_backend.table())
    assert table["fused_experts_mxfp4"].startswith("torch.quant.fused_experts_quantized (torch fallback: weight-only")


# ---- FP8 KV cache -----------------------------------------------------------------------------------------

# A prefill attends over its own keys as computed; only later chunks (and decodes) read them from the cache: so
# prompts go in 16-token chunks, and the choices after the first chunk see the FP8 cache.
CHUNKED = dict(max_num_batched_tokens=16, max_num_seqs=1)


def checkpoint_kv_scales(folder, fmt: str) -> list[float]:
    """Each layer's key then value scale, as the checkpoint stores them."""
    names = {"ct-fp8-static-tensor": ("self_attn.k_scale", "self_attn.v_scale"),
             "quark-fp8-tensor": ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale")}[fmt]
    tensors = load_file(str(folder / "model.safetensors"))
    return [tensors[f"model.layers.{layer}.{name}"].item() for layer in range(3) for name in names]


@pytest.mark.parametrize("fmt", ["ct-fp8-static-tensor", "quark-fp8-tensor"])
def test_fp8_kv_cache_takes_the_checkpoints_per_tensor_scales(fmt, quantized, full_precision):
    folder = quantized("llama", fmt, kv=True)
    llm = load(folder, kv_cache_dtype="fp8", **CHUNKED)  # kv_cache_scales="auto"
    runner = llm.engine.executor.runner
    assert runner.kv_scale_granularity == "tensor"
    used = [scale.item() for layer in runner.attention_layers
            for scale in (layer.kv_quant.k_scale, layer.kv_quant.v_scale)]
    assert used == pytest.approx(checkpoint_kv_scales(folder, fmt)) and 1.0 not in used
    assert agreement(teacher_forced_top1(llm, folder), full_precision("llama")[0]) >= 0.95


def test_fp8_kv_cache_with_per_token_scales_keeps_the_choices(quantized, full_precision):
    folder = quantized("llama", "ct-fp8-static-tensor", kv=True)
    llm = load(folder, kv_cache_dtype="fp8", kv_cache_scales="token", **CHUNKED)
    assert llm.engine.executor.runner.kv_scale_granularity == "token"
    assert agreement(teacher_forced_top1(llm, folder), full_precision("llama")[0]) >= 0.95


def test_the_checkpoints_kv_scales_are_what_quantizes_the_cache(quantized, full_precision, tmp_path):
    """The negative control of the test above: scales 1000 times too small saturate the cache."""
    def shrink(tensors):
        for name in tensors:
            if name.endswith(("self_attn.k_scale", "self_attn.v_scale")):
                tensors[name] /= 1000
    folder = edited_copy(quantized("llama", "ct-fp8-static-tensor", kv=True), tmp_path / "small", shrink)
    llm = load(folder, kv_cache_dtype="fp8", **CHUNKED)
    assert agreement(teacher_forced_top1(llm, folder), full_precision("llama")[0]) < 0.8


# ---- refusals ---------------------------------------------------------------------------------------------

def test_an_unsupported_quantization_config_is_refused_naming_the_problem(quantized, tmp_path):
    def int4(config):
        group = config["quantization_config"]["config_groups"]["group_0"]
        group["weights"].update(type="int", num_bits=4, strategy="group", group_size=128)
    folder = edited_copy(quantized("llama", "ct-fp8-dynamic"), tmp_path / "int4", edit_config=int4)
    with pytest.raises(ModelSourceError, match="unsupported quantization_config.*4-bit int weights"):
        load(folder)


def test_online_quantization_of_a_quantized_checkpoint_is_refused(quantized):
    with pytest.raises(ModelSourceError, match=r"already quantized \(fp8: fp8_block.*drop quantization='fp8'"):
        load(quantized("llama", "fp8-block"), quantization="fp8")


def test_a_checkpoint_missing_a_scale_is_refused_naming_it(quantized, tmp_path):
    folder = edited_copy(quantized("llama", "fp8-block"), tmp_path / "no-scale",
                         lambda tensors: tensors.pop("model.layers.1.mlp.down_proj.weight_scale_inv"))
    with pytest.raises(ModelSourceError, match=r"lacks weights.*model\.layers\.1\.mlp\.down_proj\.weight_scale"):
        load(folder)


def test_static_experts_without_any_input_scale_are_refused(quantized, tmp_path):
    """Their input scale would stay 0 and every logit NaN."""
    def drop_expert_input_scales(tensors):
        for name in [n for n in tensors if ".experts." in n and n.endswith(".input_scale")]:
            del tensors[name]
    folder = edited_copy(quantized("moe", "fp8-tensor-static"), tmp_path / "no-input", drop_expert_input_scales)
    with pytest.raises(ModelSourceError, match="w13_input_scale: no routed expert has an input_scale"):
        load(folder)


def test_random_weights_of_a_static_fp8_config_run(quantized):
    """load_format="dummy" quantizes random weights with the config's schemes; static activations get unit
    input scales, there being nothing to calibrate."""
    model = build_model(resolve_model(str(quantized("moe", "fp8-tensor-static")), "dummy"), torch.float32,
                        torch.device("cpu"), show_progress=False)
    assert torch.isfinite(engine_logits(model, RANDOM_TOKENS)).all()
