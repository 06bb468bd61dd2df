"""Model registry keyed by the Hugging Face `architectures` name."""
from __future__ import annotations

import importlib

# architecture -> (module, class)
_MODELS = {
    "DeepseekV2ForCausalLM": ("engine.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("engine.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("engine.models.deepseek_v32", "DeepseekV32ForCausalLM"),
    "DeepseekV4ForCausalLM": ("engine.models.deepseek_v4", "DeepseekV4ForCausalLM"),
    "Gemma4ForCausalLM": ("engine.models.gemma4", "Gemma4ForCausalLM"),
    "Glm4MoeForCausalLM": ("engine.models.glm4_moe", "Glm4MoeForCausalLM"),
    "GptOssForCausalLM": ("engine.models.gpt_oss", "GptOssForCausalLM"),
    "GlmMoeDsaForCausalLM": ("engine.models.deepseek_v32", "GlmMoeDsaForCausalLM"),
    "LlamaForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
    "MiniMaxM2ForCausalLM": ("engine.models.minimax_m2", "MiniMaxM2ForCausalLM"),
    "MixtralForCausalLM": ("engine.models.mixtral", "MixtralForCausalLM"),
    "Qwen2ForCausalLM": ("engine.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("engine.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("engine.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen3NextForCausalLM": ("engine.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("engine.models.qwen3_next", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("engine.models.qwen3_next", "Qwen3_5MoeForCausalLM"),
}


class UnsupportedModelError(ValueError):
    """The model's architecture has no implementation here."""


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class_for(hf_config):
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for name in architectures:
        if name in _MODELS:
            module, cls = _MODELS[name]
            return getattr(importlib.import_module(module), cls)
    raise UnsupportedModelError(
        f"architecture {architectures or '(none given in config.json)'} is not supported; "
        f"supported architectures: {', '.join(supported_architectures())}")
