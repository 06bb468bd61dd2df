"""From a checkpoint's `quantization_config` (or an online `quantization` request) to quantized layers:
the plan, its application to the built model, checkpoint names of scales, online quantization while
loading, and the preparation once everything is loaded."""
from __future__ import annotations

import logging
import re
import sys

import torch
from torch import nn

from engine.kernels.quant import e8m0_to_float
from engine.layers.quantization import ONLINE_METHODS, QuantPlan, quantize_for_loading
from engine.loader.source import ModelSourceError

logger = logging.getLogger(__name__)


def resolve_quant_plan(hf_config, requested: str | None, load_format: str = "safetensors") -> QuantPlan | None:
    """The checkpoint's own quantization, or `requested` (online) for a full-precision one; None: neither.
    A dummy load of a quantized config quantizes its random weights online with the config's schemes."""
    parsed = None
    if getattr(hf_config, "quantization_config", None):
        from engine.quantization import QuantConfigError, parse_quantization_config
        try:
            parsed = parse_quantization_config(hf_config)
        except QuantConfigError as exc:
            raise ModelSourceError(f"unsupported quantization_config: {exc}") from exc
    if parsed is not None:
        if requested is not None:
            raise ModelSourceError(f"the checkpoint is already quantized ({parsed.describe()}); "
                                   f"drop quantization={requested!r}")
        return QuantPlan(parsed.linear_scheme, parsed.experts_scheme, online=load_format == "dummy",
                         description=f"quantized checkpoint: {parsed.describe()}",
                         kv_cache_scales=parsed.kv_cache_scales)
    if requested is None:
        return None
    if requested not in ONLINE_METHODS:
        raise ModelSourceError(f"quantization={requested!r} is not supported; choose one of {sorted(ONLINE_METHODS)}")
    return QuantPlan.uniform(ONLINE_METHODS[requested], f"quantizing the weights as they load: {requested}")


def _checkpoint_names(model: nn.Module, name: str) -> list[str]:
    """The checkpoint module names behind one of our modules: a fused projection stands for its parts."""
    packed = getattr(model, "packed_modules_mapping", {})
    parent, _, leaf = name.rpartition(".")
    parts = [source for source, (target, _) in packed.items() if target == leaf]
    names = [f"{parent}.{part}" for part in parts] if parts else [name]
    to_checkpoint = getattr(model, "checkpoint_module_name", None)
    return [to_checkpoint(n) for n in names] if to_checkpoint else names


def apply_plan(model: nn.Module, plan: QuantPlan) -> None:
    """Give every layer whose scheme is not the plan's default its own (excluded layers, overrides). A model's
    `unquantized_modules` (patterns of engine.quantization.config.module_matches over our module names, as
    transformers' `_keep_in_fp32_modules`: layers its quantized releases ship in full precision whatever the
    quantization_config says) stay full precision under every plan."""
    from engine.layers.fused_moe import FusedMoE
    from engine.layers.linear import LinearBase
    from engine.quantization.config import module_matches
    keep = getattr(model, "unquantized_modules", ())
    for name, module in model.named_modules():
        if getattr(module, "dequantizes_on_load", False):  # full precision, from whatever the checkpoint holds
            module.load_scheme = _linear_scheme(model, name, plan)
            continue
        if not isinstance(module, (FusedMoE, LinearBase)):
            continue
        if any(module_matches(pattern, name) for pattern in keep):
            wanted = None
        elif isinstance(module, FusedMoE):
            prefix = _checkpoint_names(model, name)[0]
            wanted = plan.experts(f"{prefix}.experts")
        else:
            wanted = _linear_scheme(model, name, plan)
        if wanted != module.quant_scheme:
            module.set_quant_scheme(wanted)


def _linear_scheme(model: nn.Module, name: str, plan: QuantPlan):
    """The plan's scheme of our linear module `name`, one for all the checkpoint layers it fuses."""
    schemes = {plan.linear(n) for n in _checkpoint_names(model, name)}
    if len(schemes) > 1:
        raise ModelSourceError(f"{name} fuses checkpoint layers {_checkpoint_names(model, name)} that are "
                               f"quantized differently ({schemes}); they must share one scheme")
    return schemes.pop()


_SCALE_SUFFIX = re.compile(r"\.weight_scale_inv$")
# compressed-tensors pack-quantized: the packed codes are the layer's weight; `weight_shape` goes to the weight
# too, where online_quantized checks it and loads nothing.
_PACKED_SUFFIX = re.compile(r"\.weight_(?:packed|shape)$")
_KV_SCALE = re.compile(r"\.(?:(k|v)_scale|(k|v)_proj\.output_scale)$")


def checkpoint_param_name(name: str, params: dict) -> str | None:
    """Our name for a quantized checkpoint's extra tensors, or None to skip one: HF fp8's `weight_scale_inv`
    is our `weight_scale` (both multiply the weight); compressed-tensors' `weight_packed` (and `weight_shape`)
    our `weight`; per-tensor KV-cache scales (`self_attn.k_scale`, Quark's `k_proj.output_scale`) belong to
    the attention layer (`self_attn.attn.k_scale`), and are skipped for a model without one there."""
    name = _PACKED_SUFFIX.sub(".weight", _SCALE_SUFFIX.sub(".weight_scale", name))
    match = _KV_SCALE.search(name)
    if match:
        kind = match.group(1) or match.group(2)
        target = f"{name[:match.start()]}.attn.{kind}_scale"
        if target not in params:
            logger.debug("skipping %s: no attention layer takes KV-cache scales there", name)
            return None
        return target
    if name.endswith(".output_scale"):
        return None  # output activation scales of other layers: nothing uses them
    return name


_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_FP4X2 = getattr(torch, "float4_e2m1fn_x2", None)


def stored_form(name: str, param: nn.Parameter, tensor: torch.Tensor) -> torch.Tensor:
    """A checkpoint tensor in its parameter's stored form where the checkpoint's dtype is another encoding of
    the same values (engine/kernels/quant.py: FP8 scales float32, MXFP4 codes and scales uint8):
    - packed e2m1 codes stored as int8 (DeepSeek-V4's FP4 experts) or float4_e2m1fn_x2: the same bytes;
    - e8m0 scales (`scale_fmt: "ue8m0"`) as float8_e8m0fnu: the exponent bytes of an MXFP4 scale, or the
      (exact, power-of-two) float32 scale of an FP8 layer;
    - e8m0 exponent bytes (uint8) for an FP8 layer's float32 scale: 2^(e - 127);
    - float32 scales of an MXFP4 layer: their exponents, which must be powers of two;
    - compressed-tensors' packed int4 weights, int32 [N, K/8] with value k at bits 4 (k % 8): their bytes
      [N, K/2] in memory order, which on a little-endian machine put value 2j in byte j's low nibble.
    Anything else is returned as it is (the parameter's loader converts or refuses it)."""
    is_scale = name.endswith("scale")
    if param.dtype == torch.uint8:
        if tensor.dtype in (torch.int8, _E8M0, _FP4X2):
            return tensor.view(torch.uint8)
        if tensor.dtype == torch.int32 and not is_scale and tensor.dim() >= 2:
            if sys.byteorder != "little":
                raise ValueError("packed int4 weights are read as little-endian bytes; this machine is big-endian")
            return tensor.contiguous().view(torch.uint8)
        if is_scale and tensor.dtype == torch.float32:
            exponent = torch.log2(tensor)
            if not (torch.isfinite(exponent).all() and (exponent == exponent.round()).all()
                    and exponent.abs().max() <= 127):
                raise ValueError("MXFP4 scales must be powers of two within 2^-127 .. 2^127 (e8m0)")
            return (exponent + 127).to(torch.uint8)
    elif param.dtype == torch.float32 and is_scale:
        if tensor.dtype == _E8M0:
            return tensor.float()
        if tensor.dtype == torch.uint8:
            return e8m0_to_float(tensor)
    return tensor


def online_quantized(model: nn.Module, name: str, param: nn.Parameter, tensor: torch.Tensor, params: dict,
                     plan: QuantPlan | None):
    """(parameter name, tensor) pairs to load for one checkpoint tensor: itself in its parameter's stored form
    (`stored_form`), or, when `plan` quantizes online and the tensor is a full-precision weight of a quantized
    layer, its quantized values and scale (and an input scale of 1 where the scheme's activations are static:
    random weights have no calibration)."""
    if is_packed_shape(param, tensor):
        check_packed_shape(model, name, tensor)
        return []
    tensor = stored_form(name, param, tensor)
    quantizing = (plan is not None and plan.online and tensor.is_floating_point()
                  and param.dtype in (torch.float8_e4m3fn, torch.uint8))
    if not quantizing:
        return [(name, tensor)]
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    scheme = module.quant_scheme
    to_rows = getattr(module, "full_precision_rows", None)  # a layout stored [in, out] (gpt-oss's experts)
    if to_rows is not None:
        tensor = to_rows(leaf, tensor)
    weight, scale = quantize_for_loading(tensor, scheme)
    if leaf == "weight":  # a layer's weight_scale and input_scale sit beside its weight
        scale_name, input_name = f"{module_name}.weight_scale", f"{module_name}.input_scale"
    else:  # experts: w13_scale, w13_input_scale
        scale_name, input_name = f"{name}_scale", f"{name}_input_scale"
    pairs = [(name, weight), (scale_name, scale)]
    if scheme.activation == "static":  # a dummy load of a static-FP8 config: no calibration, inputs up to fp8 max
        pairs.append((input_name, torch.ones(())))
    return pairs


def is_packed_shape(param: nn.Parameter, tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a compressed-tensors `weight_shape` (two integers) arriving at a packed weight."""
    return param.dtype == torch.uint8 and tensor.dim() == 1 and tensor.numel() == 2 and \
        not tensor.is_floating_point()


def check_packed_shape(model: nn.Module, name: str, shape: torch.Tensor) -> None:
    """A packed weight's `weight_shape` [out, in] against its layer: routed experts' gate/up [I, H] and down
    [H, I]; a linear layer's input features where it holds them all (its packed tensor's own shape check covers
    the rest). The packing must not pad the input features (a padded row would shift every scale group)."""
    from engine.layers.fused_moe import FusedMoE
    from engine.layers.linear import LinearBase
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if module.quant_scheme is None or module.quant_scheme.method != "int4_group":
        raise ValueError(f"a weight_shape (of a pack-quantized weight) arrived for a layer quantized as "
                         f"{module.quant_scheme.describe() if module.quant_scheme else 'nothing'}")
    out_features, in_features = (int(v) for v in shape.tolist())
    if isinstance(module, FusedMoE):
        I, H = module.intermediate_size, module.hidden_size
        expected = (H, I) if leaf == "w2" else (I, H)
        if (out_features, in_features) != expected:
            raise ValueError(f"weight_shape says the packed expert weight is {[out_features, in_features]}; the "
                             f"layer's is {list(expected)}")
    elif isinstance(module, LinearBase) and (module.tp_dim != 1 or module.tp_size == 1):
        if in_features != module.input_size:
            raise ValueError(f"weight_shape says the packed weight has {in_features} input features; the layer "
                             f"has {module.input_size}")
    group = module.quant_scheme.block[1]
    if in_features % group:
        raise ValueError(f"weight_shape's {in_features} input features are not whole groups of {group}")


def finish_loading(model: nn.Module) -> None:
    for module in model.modules():
        finish = getattr(module, "finish_loading", None)
        if finish is not None:
            finish()
