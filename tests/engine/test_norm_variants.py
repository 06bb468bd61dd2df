"""RMSNorm variants against transformers' own norms, in float32 and bf16: Gemma 3's and Qwen3-Next's
(1 + w) in float32, Gemma 4's and gpt-oss's w in float32, Gemma 4's weightless norm, Qwen3-Next's gated
output norm; and that the styles really differ (a test of one style would pass with another otherwise)."""
from __future__ import annotations

import pytest
import torch

from engine.layers.layernorm import RMSNorm, RMSNormGated

HIDDEN = 48


def random_weight(module: torch.nn.Module) -> None:
    with torch.no_grad():
        module.weight.normal_(0.3, 0.5)


def ours(style: str, theirs: torch.nn.Module) -> RMSNorm:
    norm = RMSNorm(HIDDEN, 1e-6, style)
    if norm.weight is not None:
        norm.weight.data.copy_(theirs.weight.data)
    return norm


def hf_norm(kind: str) -> torch.nn.Module:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm
    return {"gemma3": Gemma3RMSNorm(HIDDEN, 1e-6), "qwen3_next": Qwen3NextRMSNorm(HIDDEN, 1e-6),
            "gemma4": Gemma4RMSNorm(HIDDEN, 1e-6), "gemma4_weightless": Gemma4RMSNorm(HIDDEN, 1e-6, with_scale=False),
            "gpt_oss": GptOssRMSNorm(HIDDEN, 1e-6)}[kind]


STYLES = {"gemma3": "offset", "qwen3_next": "offset", "gemma4": "float32", "gemma4_weightless": "none",
          "gpt_oss": "float32"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(STYLES))
def test_each_style_equals_its_transformers_norm(kind, dtype):
    theirs = hf_norm(kind)
    if getattr(theirs, "weight", None) is not None:
        random_weight(theirs)
    norm = ours(STYLES[kind], theirs)
    if kind != "gpt_oss":  # gpt-oss keeps its norm weights in float32 (_keep_in_fp32_modules)
        theirs, norm = theirs.to(dtype), norm.to(dtype)
    x = (torch.randn(5, HIDDEN) * 3).to(dtype)
    torch.testing.assert_close(norm(x), theirs(x), atol=0, rtol=0)


def test_the_styles_differ_on_the_same_weight():
    x, weight = torch.randn(4, HIDDEN), torch.randn(HIDDEN)
    outputs = {}
    for style in ("llama", "offset", "float32", "none"):
        norm = RMSNorm(HIDDEN, 1e-6, style)
        if norm.weight is not None:
            norm.weight.data.copy_(weight)
        outputs[style] = norm(x)
    assert not torch.allclose(outputs["offset"], outputs["float32"])
    assert not torch.allclose(outputs["float32"], outputs["none"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gated_norm_equals_qwen3_nexts(dtype):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated
    theirs = Qwen3NextRMSNormGated(HIDDEN, 1e-6)
    random_weight(theirs)
    norm = RMSNormGated(HIDDEN, 1e-6)
    norm.weight.data.copy_(theirs.weight.data)
    theirs, norm = theirs.to(dtype), norm.to(dtype)
    x, gate = (torch.randn(5, HIDDEN) * 2).to(dtype), torch.randn(5, HIDDEN).to(dtype)
    torch.testing.assert_close(norm(x, gate), theirs(x, gate), atol=0, rtol=0)


def test_an_unknown_style_is_refused_naming_the_styles():
    with pytest.raises(ValueError, match="style 'gemma' is unknown; one of"):
        RMSNorm(HIDDEN, 1e-6, "gemma")
