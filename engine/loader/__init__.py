"""Builds a model shard on its device and fills its weights (checkpoint, GGUF or random)."""
from __future__ import annotations

import zlib
from contextlib import contextmanager

import torch
from torch import nn
from tqdm import tqdm

from engine.loader.source import ModelSource, ModelSourceError, resolve_model
from engine.models import model_class_for

__all__ = ["ModelSource", "ModelSourceError", "build_model", "load_weights", "resolve_model"]


@contextmanager
def default_dtype(dtype: torch.dtype):
    """Parameters made inside take `dtype` (torch's default dtype, restored after)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(source: ModelSource, dtype: torch.dtype, device: torch.device, seed: int = 0,
                show_progress: bool = True, residual_dtype: torch.dtype | None = None,
                quantization: str | None = None, mtp: bool = False) -> nn.Module:
    """`residual_dtype`: the residual stream's dtype (default: `dtype`). `quantization`: quantize a
    full-precision checkpoint as it loads (engine.layers.quantization.ONLINE_METHODS); a quantized
    checkpoint's own `quantization_config` needs nothing. `mtp`: build and load the checkpoint's
    multi-token-prediction layer too (speculative decoding's drafter)."""
    from engine.layers.quantization import log_plan, quantized_build
    from engine.loader.quant_plan import apply_plan, finish_loading, resolve_quant_plan
    model_class = model_class_for(source.hf_config)
    plan = resolve_quant_plan(source.hf_config, quantization, source.format)
    extra = {}
    if mtp:
        check_mtp_support(model_class, source.hf_config)
        extra["mtp"] = True
    with default_dtype(dtype), torch.device(device), quantized_build(plan):
        model = model_class(source.hf_config, residual_dtype=residual_dtype or dtype, **extra)
        if plan is not None:
            apply_plan(model, plan)
    model.eval()
    if source.format == "dummy":
        names_and_shapes = dummy_checkpoint_layout(source.hf_config)
        if mtp:
            names_and_shapes = model_class.mtp_checkpoint_layout(source.hf_config, names_and_shapes)
        load_weights(model, dummy_checkpoint(names_and_shapes, device, seed, getattr(model, "dummy_tensor", None)),
                     len(names_and_shapes), show_progress, plan)
    elif source.format == "gguf":
        load_weights(model, source.gguf.iter_weights(), source.gguf.num_tensors, show_progress, plan)
    else:
        from engine.loader import safetensors
        files = safetensors.checkpoint_files(source.path)
        rename = source.text_stack.weight_name if source.text_stack is not None else None
        load_weights(model, safetensors.iter_weights(files, rename), safetensors.count_tensors(files, rename),
                     show_progress, plan)
    finish_loading(model)
    if plan is not None:
        log_plan(model, plan)
    return model


def check_mtp_support(model_class, hf_config) -> None:
    """Raises ConfigError naming speculative_config where the model cannot draft with its MTP layer."""
    from engine.config import ConfigError
    if not getattr(model_class, "supports_mtp", False):
        raise ConfigError(f"speculative_config.method 'mtp': MTP drafting is built for DeepSeek-V2/V3 (Kimi-K2), "
                          f"DeepSeek-V3.2, GLM-4.5/4.6, GLM-5, Qwen3-Next and Qwen3.5 checkpoints only, not "
                          f"{model_class.__name__}")
    if not model_class.num_mtp_layers(hf_config):
        raise ConfigError("speculative_config.method 'mtp': this checkpoint has no multi-token-prediction layer "
                          "(its config's num_nextn_predict_layers / mtp_num_hidden_layers is 0 or missing)")


def load_weights(model: nn.Module, weights, total: int | None = None, show_progress: bool = True,
                 plan=None) -> None:
    """Feed (HF name, full tensor) pairs to the parameters' weight loaders; fail on anything missing.

    A model may rename checkpoint tensors first (`remap_checkpoint_name`: a new name, or None to skip one);
    routed-expert tensors, per expert or fused, go to their FusedMoE's parameters; the names in the
    model's `packed_modules_mapping` go to their fused projection's shard. Quantized checkpoints' scales go
    beside their weights (quant_plan.checkpoint_param_name); with an online `plan`, full-precision weights
    of quantized layers are quantized first."""
    from engine.layers.fused_moe import FusedMoE
    from engine.loader.quant_plan import checkpoint_param_name, online_quantized
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    remap = getattr(model, "remap_checkpoint_name", None)
    expected_shards = {}
    for target, shard in packed.values():
        expected_shards.setdefault(target, set()).add(shard)
    loaded: dict[str, set] = {}
    tie = getattr(model, "tie_word_embeddings", False)
    with torch.no_grad():
        for checkpoint_name, tensor in tqdm(weights, total=total, desc="Loading weights", unit="tensor",
                                            disable=not show_progress, leave=False):
            name = remap(checkpoint_name) if remap is not None else checkpoint_name
            if name is None or "rotary_emb.inv_freq" in name or (tie and name == "lm_head.weight"):
                continue
            name = checkpoint_param_name(name, params)
            if name is None:
                continue
            shard = None
            expert_target = FusedMoE.checkpoint_target(name)
            if expert_target is not None:
                name, shard = expert_target
            else:
                for source_name, (target, shard_id) in packed.items():
                    if f".{source_name}." in name:
                        name, shard = name.replace(f".{source_name}.", f".{target}."), shard_id
                        break
            param = params.get(name)
            if param is None:
                raise ModelSourceError(f"checkpoint tensor {checkpoint_name!r} has no parameter in "
                                       f"{type(model).__name__}; is this the right architecture?")
            try:
                for target, value in online_quantized(model, name, param, tensor, params, plan):
                    _load_one(params[target], value, shard)
                    loaded.setdefault(target, set()).add(shard)
            except ValueError as exc:
                raise ModelSourceError(f"checkpoint tensor {checkpoint_name!r} does not fit {name}: {exc}") from exc
    missing = []
    for name, param in params.items():
        check = getattr(param, "check_loaded", None)
        if check is not None:
            problem = check(param, loaded.get(name, set()))
            if problem:
                missing.append(f"{name}: {problem}")
            continue
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
        want = expected_shards.get(module, {None})
        if not want <= loaded.get(name, set()):
            missing.append(name)
    if missing and all(name.startswith("mtp.") for name in missing):
        from engine.config import ConfigError
        raise ConfigError("speculative_config.method 'mtp': the checkpoint has no weights for its multi-token-"
                          f"prediction layer (its config declares {model.num_mtp_layers(model.config)}, but the files "
                          f"lack it), e.g. {missing[:3]}")
    if missing:
        raise ModelSourceError(f"checkpoint lacks weights for {len(missing)} parameter(s), e.g. {missing[:5]}")


def _load_one(param: nn.Parameter, tensor: torch.Tensor, shard) -> None:
    loader = getattr(param, "weight_loader", None)
    if shard is not None:
        loader(param, tensor, shard)
    elif loader is not None:
        loader(param, tensor)
    else:
        if param.shape != tensor.shape:
            raise ValueError(f"shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(tensor)


def dummy_checkpoint_layout(hf_config) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of the checkpoint transformers would write for this config (no memory used)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(hf_config)
    return [(name, tuple(tensor.shape)) for name, tensor in reference.state_dict().items()]


def dummy_checkpoint(layout, device: torch.device, seed: int, special=None):
    """A random checkpoint: N(0, 0.02) matrices, unit norm weights, zero biases. Each tensor is drawn from
    a generator seeded by its name, so every tensor-parallel layout shards the same model. `special(name,
    shape, generator)` (a model's `dummy_tensor`) may draw a tensor that must hold valid values instead
    (e.g. expert ids), or return None."""
    generator = torch.Generator(device=device)
    for name, shape in layout:
        generator.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        drawn = special(name, shape, generator) if special is not None else None
        if drawn is not None:
            yield name, drawn
        elif "norm" in name:
            yield name, torch.ones(shape, device=device)
        elif name.endswith("bias"):
            yield name, torch.zeros(shape, device=device)
        else:
            yield name, torch.empty(shape, device=device).normal_(0.0, 0.02, generator=generator)
