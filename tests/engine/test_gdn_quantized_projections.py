"""Quantized checkpoints of Gated DeltaNet models whose in-projections are quantized too (as the quantizer writes
them unless told to exclude `linear_attn`): those projections load dequantized to full precision, in Qwen3-Next's
fused interleaved layout and in Qwen3.5's separate one, from FP8 (blocks, channels, one scale per tensor with
static activation scales) and MXFP4; a weight whose scale is missing is refused by name."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny_models
from engine import LLM, SamplingParams
from engine.layers.gated_delta_net import GatedDeltaNet
from engine.loader.source import ModelSourceError

# 128 x 128 blocks on a Qwen3.5 wide enough that its attention and MLP parts fill whole blocks.
CASES = [("qwen3_next", "ct-fp8-dynamic", 0.08), ("qwen3_next", "quark-fp8-tensor", 0.08),
         ("qwen3_next", "quark-mxfp4-w4a16", 0.35), ("qwen3_5_wide", "fp8-block", 0.08),
         ("qwen3_5_moe_text", "fp8-tensor-static", 0.08), ("qwen3_5_moe_text", "quark-mxfp4-w4a16", 0.35)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("gdn-src")
    folders = {arch: tiny_models.make_tiny_qwen3_next(root / arch, model_type=arch)
               for arch in ("qwen3_next", "qwen3_5_moe_text")}
    folders["qwen3_5_wide"] = tiny_models.make_tiny_qwen3_next(
        root / "wide", model_type="qwen3_5_text", hidden_size=128, intermediate_size=256, num_attention_heads=8,
        num_key_value_heads=8)
    return folders


def quantize(src, dst, fmt: str):
    subprocess.run([sys.executable, "-m", "engine.quantization.quantizer", str(src), str(dst), "--format", fmt],
                   check=True, capture_output=True)
    return dst


def projections(llm) -> list[torch.Tensor]:
    layers = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, GatedDeltaNet)]
    return [p.weight.detach().clone() for m in layers for p in (m.in_proj_qkvz, m.in_proj_ba)]


def load(folder) -> tuple[list[torch.Tensor], list[list[int]]]:
    llm = LLM(str(folder), dtype="float32", show_progress=False)
    try:
        tokens = [o.token_ids for o in llm.generate([[5, 9, 17, 33], list(range(10, 40))],
                                                    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
        return projections(llm), tokens
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch,fmt,tolerance", CASES)
def test_quantized_in_projections_load_dequantized_in_their_own_layout(sources, tmp_path, arch, fmt, tolerance):
    """Each projection, as loaded from the quantized checkpoint, is the full-precision one up to the format's
    rounding (a part loaded into the wrong rows or shards would be off by about its whole norm)."""
    exact, _ = load(sources[arch])
    loaded, tokens = load(quantize(sources[arch], tmp_path / fmt, fmt))
    assert len(loaded) == len(exact) > 0
    for ours, reference in zip(loaded, exact):
        error = ((ours - reference).norm() / reference.norm()).item()
        assert 0 < error < tolerance, error  # rounded, not copied; close, not shuffled
    assert all(len(t) == 8 for t in tokens)


def test_a_quantized_projection_without_its_scale_is_refused_by_name(sources, tmp_path):
    folder = quantize(sources["qwen3_next"], tmp_path / "q", "ct-fp8-dynamic")
    [shard] = [p for p in folder.glob("*.safetensors")]
    tensors = load_file(str(shard))
    dropped = next(name for name in tensors if name.endswith("linear_attn.in_proj_ba.weight_scale"))
    del tensors[dropped]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(ModelSourceError, match="in_proj_ba.*has its weight but not its scale"):
        LLM(str(folder), dtype="float32", show_progress=False)
