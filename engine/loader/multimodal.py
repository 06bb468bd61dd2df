"""Multimodal checkpoints (`*ForConditionalGeneration`) served as text: the wrapper's `text_config` becomes the
model's config and its text weights the model's weights; vision, audio and projector tensors are never read."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.loader.source import ModelSourceError

logger = logging.getLogger(__name__)

# Wrapper architecture -> the architecture of its text stack. A wrapper serves text once its text
# architecture is registered in engine/models; until then it is refused naming that architecture.
TEXT_ARCHITECTURES = {
    "KimiK25ForConditionalGeneration": "DeepseekV3ForCausalLM",  # Kimi-K2.5's config.json
    "Kimi_K25ForConditionalGeneration": "DeepseekV3ForCausalLM",  # transformers' class name
    "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}

# Where wrappers keep the text stack's tensors -> the text model's own names. transformers >= 4.52 writes
# `model.language_model.*`; older conversions and Kimi-K2.5 write `language_model.model.*` and
# `language_model.lm_head.*`. Every other tensor (vision tower, projector, audio tower) is not the text stack.
_TEXT_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
    ("mtp.", "mtp."),  # Qwen3.5's multi-token-prediction layer (the text model skips it unless it drafts)
)
# Wrapper-level fields that hold for the text stack where its text_config leaves them out.
_INHERITED_FIELDS = ("tie_word_embeddings", "quantization_config", "torch_dtype", "dtype", "bos_token_id",
                     "eos_token_id", "pad_token_id")
# The quantization_config lists that name checkpoint modules (engine/quantization/config.py).
_EXCLUSION_LISTS = ("ignore", "ignored_layers", "modules_to_not_convert", "exclude")


@dataclass(frozen=True)
class TextStack:
    """The text stack of a multimodal checkpoint: which wrapper it sits in, and its own architecture."""
    wrapper: str
    architecture: str

    @staticmethod
    def weight_name(name: str) -> str | None:
        """The text model's name for checkpoint tensor `name`; None for a tensor outside the text stack."""
        for prefix, target in _TEXT_PREFIXES:
            if name.startswith(prefix):
                return target + name[len(prefix):]
        return None

    def module_name(self, name: str) -> str:
        """A checkpoint module name (or glob) in the text model's names; names outside the text stack and
        `re:` patterns unchanged."""
        if name.startswith("re:"):
            return name
        mapped = self.weight_name(name + ".")
        return mapped[:-1] if mapped is not None else name


def text_stack_of(raw: dict) -> TextStack | None:
    """The text stack of config.json `raw` when its architecture is a known multimodal wrapper."""
    for architecture in raw.get("architectures") or []:
        if architecture in TEXT_ARCHITECTURES:
            return TextStack(architecture, TEXT_ARCHITECTURES[architecture])
    return None


def text_config_fields(raw: dict, stack: TextStack) -> dict:
    """config.json fields of the text model: the wrapper's `text_config` (a dict, or a transformers config),
    named for the text architecture, with the wrapper-level fields it leaves out. The vision config is never
    read (Kimi-K2.5's names its fields `vt_*` and has no hidden_size)."""
    from engine.models import UnsupportedModelError, supported_architectures
    if stack.architecture not in supported_architectures():
        raise UnsupportedModelError(
            f"architecture {stack.architecture} (the text stack of {stack.wrapper}) is not supported; "
            f"supported architectures: {', '.join(supported_architectures())}")
    text = raw.get("text_config")
    if hasattr(text, "to_diff_dict"):  # a sub-config object: only the fields it sets, like a dict from JSON
        text = {**text.to_diff_dict(), "model_type": text.model_type}
    if not isinstance(text, dict) or not text.get("model_type"):
        raise ModelSourceError(f"a {stack.wrapper} config.json needs a 'text_config' with a 'model_type' "
                               f"(got {type(text).__name__})")
    fields = {key: raw[key] for key in _INHERITED_FIELDS if key in raw and key not in text}
    fields.update((key, value) for key, value in text.items() if key != "auto_map")
    fields["architectures"] = [stack.architecture]
    if isinstance(fields.get("quantization_config"), dict):
        fields["quantization_config"] = _text_quantization_config(fields["quantization_config"], stack)
    logger.info("%s checkpoint: serving its text stack (%s, model_type %r); vision and projector weights "
                "are skipped", stack.wrapper, stack.architecture, fields["model_type"])
    return fields


def _text_quantization_config(config: dict, stack: TextStack) -> dict:
    """The quantization_config with its excluded modules named as in the text model."""
    config = dict(config)
    for key in _EXCLUSION_LISTS:
        if isinstance(config.get(key), list):
            config[key] = [stack.module_name(name) if isinstance(name, str) else name for name in config[key]]
    return config
