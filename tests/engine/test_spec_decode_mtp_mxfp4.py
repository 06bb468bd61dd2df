"""MTP drafting from MXFP4 checkpoints (AMD Quark's layout, as ATOM's DeepSeek-R1 FP4, GLM-5.1 MXFP4 and
Qwen3.5 MXFP4 MTP runs use): the checkpoint's MTP layer is written by the quantizer like the target's layers
(MXFP4 weights with their e8m0 scales; weights and activations, or weights only), loads into an MTP layer whose
linear layers and experts are MXFP4, and drafts. Where the target has no MLA (Qwen3.5-MoE), the greedy tokens are
those of the same quantized checkpoint run without speculation; under MLA a verify step runs the expanded path,
which rounds differently from a decode step's absorbed one (as with FP8), so there only the drafting and the
bookkeeping are checked."""
from __future__ import annotations

import subprocess
import sys

import pytest

import tiny_models
from engine import LLM, SamplingParams

MTP = {"method": "mtp", "num_speculative_tokens": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 9, 17, 33], list(range(10, 40)), [7] * 6 + [100, 101], [64, 3, 88]]


def quantized_with_mtp(tmp_path, arch: str, fmt: str):
    if arch == "deepseek_v3":
        # Every quantized layer's input a multiple of MXFP4's 32-element scale group.
        src = tiny_models.make_tiny_model(tmp_path / "src", arch, num_nextn_predict_layers=1,
                                          moe_intermediate_size=128, hidden_size=128, intermediate_size=256,
                                          v_head_dim=32, q_lora_rank=64)
        exclude = []
    else:  # Qwen3.5-MoE: the mtp.* layout beside Gated DeltaNet layers, whose projections stay in full
        # precision here (quantized ones load dequantized: tests/engine/test_gdn_quantized_projections.py)
        src = tiny_models.make_tiny_qwen3_next(tmp_path / "src", model_type=arch, num_nextn_predict_layers=1)
        exclude = ["lm_head", "re:.*embed_tokens$", "re:.*linear_attn\\..*"]
    src = tiny_models.add_random_mtp_layer(src)
    dst = tmp_path / fmt
    subprocess.run([sys.executable, "-m", "engine.quantization.quantizer", str(src), str(dst), "--format", fmt,
                    *[arg for pattern in exclude for arg in ("--exclude", pattern)]], check=True, capture_output=True)
    return dst


def mxfp4_modules(module) -> list[str]:
    return [name for name, m in module.named_modules()
            if getattr(getattr(m, "quant_scheme", None), "method", None) in ("mxfp4", "quark_mxfp4")]


@pytest.mark.parametrize("fmt", ["quark-mxfp4", "quark-mxfp4-w4a16"])
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_5_moe_text"])
def test_an_mxfp4_checkpoint_drafts_with_its_mxfp4_mtp_layer(tmp_path, arch, fmt):
    folder = str(quantized_with_mtp(tmp_path, arch, fmt))
    plain = LLM(folder, dtype="float32", show_progress=False)
    try:
        expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    finally:
        plain.shutdown()
    llm = LLM(folder, dtype="float32", show_progress=False, speculative_config=MTP)
    try:
        mtp = llm.engine.executor.runner.model.mtp
        quantized = mxfp4_modules(mtp)
        assert quantized, "the MTP layer loaded in full precision"
        assert any("mlp" in name or "expert" in name for name in quantized), quantized
        tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    assert stats["spec_draft_tokens"] > 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    if arch != "deepseek_v3":
        assert tokens == expected
    else:
        assert [len(t) for t in tokens] == [len(t) for t in expected]
