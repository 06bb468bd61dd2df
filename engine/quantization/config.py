"""A checkpoint's HF `quantization_config` read into the engine's schemes (engine/kernels/quant.py): which
scheme each checkpoint Linear (`model.layers.0.self_attn.q_proj`) and each layer's routed experts
(`model.layers.3.mlp.experts`) use, and whether the checkpoint carries per-tensor FP8 KV-cache scales.

Formats (quant_method, who writes it: how it maps):
- `fp8` (DeepSeek-V3/R1/V4, Qwen3-*-FP8, GLM-4.5-FP8): with `weight_block_size` fp8_block (dynamic
  activations), else fp8_tensor with `activation_scheme`; exclusions in `ignored_layers` /
  `modules_to_not_convert`. `scale_fmt: "ue8m0"` (DeepSeek-V3.2/V4) only says the scales are powers of two:
  they load as float32 scales whatever dtype stores them (float32, float8_e8m0fnu, or e8m0 exponent bytes;
  engine/loader/quant_plan.py `stored_form`). `expert_dtype` (transformers' name; DeepSeek-V4 writes it at the
  top level of config.json, V4.1 inside quantization_config; both are read): "fp8" (default) quantizes the
  routed experts as the linear layers, "fp4" as MXFP4 (FP4_EXPERTS below).
- `compressed-tensors` (llm-compressor, RedHatAI/*): each `config_groups` entry by its weight and input
  strategies: channel + dynamic token -> fp8_channel, tensor + tensor -> fp8_tensor, block + dynamic group of
  the block's width -> fp8_block; `pack-quantized` symmetric 4-bit int weights in groups with no input
  quantization (W4A16: Kimi-K2-Thinking, Kimi-K2.5, RedHatAI/*-w4a16) -> int4_group of the group size; targets
  `Linear`, names or `re:` regexes; exclusions in `ignore`.
- `quark` (AMD Quark, amd/*): `layer_quant_config` patterns, else `layer_type_quant_config` Linear, else
  `global_quant_config`; fp8_e4m3 per_tensor / per_channel (+ per-token inputs) / per_block (+ per_group
  inputs) as above, fp4 per_group 32 e8m0 -> mxfp4 (inputs fp4: "mxfp4", none: "none"); exclusions in `exclude`.
- `mxfp4` (gpt-oss): routed experts mxfp4, weight-only; every other layer unquantized.

Exclusion and override patterns are matched alike in every format (`module_matches`): a plain name matches
that module and everything under it (`lm_head`, `model.layers.0.self_attn`), a name with `*`/`?` is an
fnmatch glob (`model.layers.*.self_attn`), `re:` starts a regular expression (`re:.*mlp.gate$`). MoE routers
(`*.gate`, `*.router`, `*.shared_expert_gate`) are never quantized, and `lm_head` only where a pattern names
it: checkpoints keep both in full precision even where the config does not list them (DeepSeek-V3/R1), as
transformers and vLLM assume.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from engine.kernels.quant import MXFP4_GROUP, QuantScheme

ROUTER_NAMES = ("gate", "router", "shared_expert_gate")
# How routed experts' projections are named in checkpoints: one by one (two conventions) or fused.
EXPERT_PROBES = (("0.gate_proj", "0.up_proj", "0.down_proj"), ("0.w1", "0.w3", "0.w2"), ("gate_up_proj", "down_proj"))


# DeepSeek-V4's `expert_dtype: "fp4"` routed experts, as transformers' FP8Experts allocates and dequantizes them
# (integrations/finegrained_fp8.py `_alloc_expert_proj(weight_k_div=2, sf_gran_n=1, sf_gran_k=32)`,
# `Fp8Dequantize._unpack_fp4`), checked against that code: weight int8 [N, K/2], two e2m1 codes per byte, the
# even k in the low nibble (`u8 & 0xF` is value 2j, `u8 >> 4` value 2j + 1), code bit 3 the sign, magnitudes
# 0, .5, 1, 1.5, 2, 3, 4, 6; scale [N, K/32]: one power of two per output row and 32 consecutive k (ue8m0: an
# e8m0 exponent, 2^(e - 127), stored as float8_e8m0fnu). That is the engine's `mxfp4` layout byte for byte
# (engine/kernels/quant.py), int8 read as uint8. The activations stay unquantized (w4a16): transformers' and
# DeepSeek's kernels quantize them to FP8 per 128 (w4a8); the engine's product is the more precise one.
FP4_EXPERTS = QuantScheme("mxfp4", "none")
EXPERT_DTYPES = ("fp8", "fp4")


class QuantConfigError(ValueError):
    """A `quantization_config` the engine cannot run: the message names the field and what is supported."""


@dataclass(frozen=True)
class Unsupported:
    """A layer configuration that parsed but has no engine scheme; an error once a layer asks for it."""
    reason: str


Rule = QuantScheme | Unsupported | None


def module_matches(pattern: str, module: str) -> bool:
    """Whether an exclusion/override `pattern` covers `module` (or a module it sits under)."""
    parts = module.split(".")
    names = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    if pattern.startswith("re:"):
        regex = re.compile(pattern[3:])
        return any(regex.match(name) for name in names)
    if any(c in pattern for c in "*?["):
        return any(fnmatch.fnmatchcase(name, pattern) for name in names)
    return pattern in names


def is_router(module: str) -> bool:
    return module.rpartition(".")[2] in ROUTER_NAMES


def describe_scheme(rule: Rule) -> str:
    if rule is None:
        return "unquantized"
    if isinstance(rule, Unsupported):
        return f"unsupported ({rule.reason})"
    return rule.describe()


@dataclass(frozen=True)
class QuantConfig:
    """How a checkpoint is quantized. Resolution for a module: excluded -> None; else the first override
    whose pattern matches; else `default`."""
    method: str                                   # the HF quant_method
    default: Rule
    overrides: tuple[tuple[str, Rule], ...] = ()
    exclude: tuple[str, ...] = ()
    experts_only: bool = False                    # gpt-oss: nothing but routed experts is quantized
    kv_cache_scales: bool = False                 # per-tensor FP8 k_scale / v_scale in the checkpoint
    experts: QuantScheme | None = None            # routed experts' own scheme where quantized (DeepSeek-V4 fp4)

    def linear_scheme(self, module: str) -> QuantScheme | None:
        """The scheme of checkpoint Linear `module`; None: stored unquantized."""
        if self.experts_only or is_router(module):
            return None
        rule, named = self._resolve(module)
        if module.rpartition(".")[2] == "lm_head" and not named:
            return None  # the output head is quantized only where a pattern names it
        return _checked(module, rule)

    def experts_scheme(self, prefix: str) -> QuantScheme | None:
        """The one scheme of all routed experts under `prefix` (`model.layers.3.mlp.experts`)."""
        if self._excluded(prefix):
            return None
        if self.experts_only:
            return _checked(prefix, self._resolve(prefix)[0])
        # Ask about expert 0's projections under each naming convention; the convention a pattern names
        # (an override of `*.w2`, an exclusion of `*.experts.0.down_proj`) decides.
        resolved = [[self._resolve(f"{prefix}.{probe}") for probe in probes] for probes in EXPERT_PROBES]
        named = [rules for rules in resolved if any(specific for _, specific in rules)] or resolved[:1]
        rules = {rule for candidates in named for rule, _ in candidates}
        if len(rules) > 1:
            raise QuantConfigError(f"the routed experts of {prefix} are quantized differently per projection "
                                   f"({', '.join(sorted(map(describe_scheme, rules)))}); the engine needs one "
                                   f"scheme for all of a layer's experts")
        rule = rules.pop()
        if rule is not None and any(not _is_pattern(p) and p.startswith(prefix + ".") for p in self.exclude):
            raise QuantConfigError(f"the exclusion list names some experts of {prefix} but not all; the engine "
                                   f"needs one scheme for all of a layer's experts")
        if rule is not None and self.experts is not None:
            return self.experts
        return _checked(prefix, rule)

    def describe(self) -> str:
        """One line for logs."""
        if self.experts_only:
            text = f"{self.method}: routed experts {describe_scheme(self.default)}, other layers unquantized"
        else:
            text = f"{self.method}: {describe_scheme(self.default)}"
        if self.experts is not None:
            text += f"; routed experts: {describe_scheme(self.experts)}"
        text += "".join(f"; {pattern}: {describe_scheme(rule)}" for pattern, rule in self.overrides)
        if self.exclude:
            text += f"; excluded: {', '.join(_summarized(self.exclude))}"
        if self.kv_cache_scales:
            text += "; FP8 KV-cache scales"
        return text

    def _excluded(self, module: str) -> bool:
        return any(module_matches(pattern, module) for pattern in self.exclude)

    def _resolve(self, module: str) -> tuple[Rule, bool]:
        """(rule, whether a pattern named this module rather than the default applying)."""
        if self._excluded(module):
            return None, True
        for pattern, rule in self.overrides:
            if module_matches(pattern, module):
                return rule, True
        return self.default, False


def _checked(module: str, rule: Rule) -> QuantScheme | None:
    if isinstance(rule, Unsupported):
        raise QuantConfigError(f"{module}: {rule.reason}")
    return rule


def _is_pattern(pattern: str) -> bool:
    return pattern.startswith("re:") or any(c in pattern for c in "*?[")


def _summarized(names: tuple[str, ...]) -> list[str]:
    """Per-layer names folded into one entry each (`model.layers.*.mlp.gate`), in order."""
    return list(dict.fromkeys(re.sub(r"\.\d+(?=\.|$)", ".*", n) if not n.startswith("re:") else n for n in names))


def parse_quantization_config(hf_config) -> QuantConfig | None:
    """`hf_config.quantization_config` (a dict, or an object with `to_dict()`; `hf_config` may itself be the
    config.json dict) read into a QuantConfig; None when the checkpoint is not quantized."""
    raw = hf_config.get("quantization_config") if isinstance(hf_config, dict) else \
        getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raw = raw.to_dict()
    top_level = hf_config.get("expert_dtype") if isinstance(hf_config, dict) else \
        getattr(hf_config, "expert_dtype", None)
    if top_level is not None and "expert_dtype" not in raw:  # DeepSeek-V4 keeps it beside the model's fields
        raw = {**raw, "expert_dtype": top_level}
    method = raw.get("quant_method")
    if method not in PARSERS:
        raise QuantConfigError(f"quantization_config.quant_method {method!r} is not supported; supported: "
                               f"{', '.join(PARSERS)}")
    config = PARSERS[method](raw)
    if isinstance(config.default, Unsupported):  # it applies to (nearly) every layer: say so now
        raise QuantConfigError(f"quantization_config ({method}): {config.default.reason}")
    return config


# ---- HF fp8 (DeepSeek, Qwen, GLM) ----------------------------------------------------------------------

def _parse_hf_fp8(raw: dict) -> QuantConfig:
    if raw.get("fmt", "e4m3") != "e4m3":
        raise QuantConfigError(f"quantization_config.fmt {raw['fmt']!r} is not supported; supported: 'e4m3'")
    activation = raw.get("activation_scheme", "dynamic")
    if activation not in ("dynamic", "static"):
        raise QuantConfigError(f"quantization_config.activation_scheme {activation!r} is not supported; "
                               f"supported: 'dynamic', 'static'")
    if raw.get("scale_fmt") not in (None, "float", "ue8m0"):  # ue8m0: the scales are powers of two, same maths
        raise QuantConfigError(f"quantization_config.scale_fmt {raw['scale_fmt']!r} is not supported; "
                               f"supported: 'float', 'ue8m0' or absent")
    expert_dtype = raw.get("expert_dtype") or "fp8"
    if expert_dtype not in EXPERT_DTYPES:
        raise QuantConfigError(f"quantization_config.expert_dtype {expert_dtype!r} is not supported; supported: "
                               f"{', '.join(map(repr, EXPERT_DTYPES))}")
    block = raw.get("weight_block_size")
    if block is not None:
        if len(block) != 2:
            raise QuantConfigError(f"quantization_config.weight_block_size {block!r} must be [rows, columns]")
        if activation != "dynamic":
            raise QuantConfigError("quantization_config: block-quantized fp8 (weight_block_size) takes dynamic "
                                   "activations only, not activation_scheme 'static'")
        scheme = QuantScheme("fp8_block", "dynamic", (int(block[0]), int(block[1])))
    else:
        scheme = QuantScheme("fp8_tensor", activation)
    exclude = (*(raw.get("ignored_layers") or ()), *(raw.get("modules_to_not_convert") or ()))
    return QuantConfig("fp8", scheme, exclude=exclude, kv_cache_scales=bool(raw.get("kv_cache_scheme")),
                       experts=FP4_EXPERTS if expert_dtype == "fp4" else None)


# ---- compressed-tensors (llm-compressor) ---------------------------------------------------------------

CT_FORMATS = (None, "float-quantized", "naive-quantized")
CT_INT4_FORMAT = "pack-quantized"
# ActivationOrdering values that store the groups in column order (no `weight_g_idx`): "weight" (alias
# "static") only changes the calibration; "group" ("dynamic", or `true` in older exports) permutes them.
CT_IN_ORDER = (None, False, "weight", "static")


def _ct_scheme(group: dict, default_format: str | None) -> Rule:
    weights, inputs = group.get("weights"), group.get("input_activations")
    fmt = group.get("format") or default_format
    if weights is None:
        return None
    if weights.get("type", "int") == "int":  # compressed-tensors' defaults: int, 8 bits, symmetric
        return _ct_int_scheme(weights, inputs, fmt)
    if fmt not in CT_FORMATS:
        return Unsupported(f"compressed-tensors format {fmt!r} with float weights is not supported; supported: "
                           f"float-quantized, naive-quantized (FP8)")
    if weights.get("num_bits") != 8:
        return Unsupported(f"{weights.get('num_bits')}-bit float weights (NVFP4, MXFP4...) are not supported yet "
                           f"in compressed-tensors; supported: 8-bit float (FP8) weights, 4-bit int (W4A16)")
    if weights.get("dynamic") or weights.get("symmetric") is False:
        return Unsupported("dynamic or asymmetric FP8 weights are not supported; supported: static symmetric")
    if inputs is None:
        return Unsupported("weight-only FP8 (input_activations: null) is not supported; the engine's FP8 GEMMs "
                           "quantize activations too (supported: token, tensor or group-128 FP8 activations)")
    if (inputs.get("type"), inputs.get("num_bits")) != ("float", 8):
        return Unsupported(f"{inputs.get('num_bits')}-bit {inputs.get('type')} activations with FP8 weights are "
                           f"not supported; supported: FP8 activations")
    w, a, dynamic = weights.get("strategy"), inputs.get("strategy"), bool(inputs.get("dynamic"))
    if w == "channel" and a == "token" and dynamic:
        return QuantScheme("fp8_channel")
    if w == "tensor" and a == "tensor":
        return QuantScheme("fp8_tensor", "dynamic" if dynamic else "static")
    if w == "block":
        block = _block_structure(weights.get("block_structure"))
        if a == "group" and dynamic and inputs.get("group_size") == block[1]:
            return QuantScheme("fp8_block", "dynamic", block)
    return Unsupported(f"FP8 weights with strategy {w!r} and {'dynamic' if dynamic else 'static'} {a!r} "
                       f"activations are not supported; supported: channel + dynamic token, tensor + tensor, "
                       f"block + dynamic group of the block's width")


def _ct_int_scheme(weights: dict, inputs: dict | None, fmt: str | None) -> Rule:
    """Integer weights: symmetric 4-bit in groups, packed, weight-only (W4A16) -> int4_group."""
    bits, strategy, group_size = weights.get("num_bits", 8), weights.get("strategy"), weights.get("group_size")
    supported = ("supported: 4-bit int weights, symmetric, strategy group (a group_size that is a multiple of 8), "
                 "format pack-quantized, no input quantization (W4A16)")
    if bits != 4:
        return Unsupported(f"{bits}-bit int weights are not supported; {supported}")
    if inputs is not None:
        return Unsupported(f"4-bit int weights with {inputs.get('num_bits')}-bit {inputs.get('type')} activations "
                           f"(W4A{inputs.get('num_bits')}) are not supported; {supported}")
    if fmt != CT_INT4_FORMAT:
        return Unsupported(f"4-bit int weights in format {fmt!r} are not supported; {supported}")
    if strategy != "group" or not isinstance(group_size, int) or group_size <= 0 or group_size % 8:
        return Unsupported(f"4-bit int weights with strategy {strategy!r} and group_size {group_size!r} are not "
                           f"supported; {supported}")
    if weights.get("symmetric") is False:
        return Unsupported(f"asymmetric 4-bit int weights (weight_zero_point) are not supported; {supported}")
    if weights.get("dynamic"):
        return Unsupported(f"dynamic 4-bit int weights are not supported; {supported}")
    if weights.get("actorder") not in CT_IN_ORDER:
        return Unsupported(f"4-bit int weights with actorder {weights.get('actorder')!r} (groups permuted by "
                           f"weight_g_idx) are not supported; supported: actorder null or 'weight'")
    return QuantScheme("int4_group", "none", (1, group_size))


def _block_structure(value) -> tuple[int, int]:
    if isinstance(value, str):  # older exports: "128x128"
        value = value.lower().split("x")
    if not value or len(value) != 2:
        raise QuantConfigError(f"compressed-tensors weights.block_structure {value!r} must be [rows, columns]")
    return int(value[0]), int(value[1])


def _parse_compressed_tensors(raw: dict) -> QuantConfig:
    default: Rule = None
    names, regexes = [], []
    for name, group in (raw.get("config_groups") or {}).items():
        rule = _ct_scheme(group, raw.get("format"))
        for target in group.get("targets") or ():
            if target.startswith("re:"):
                regexes.append((target, rule))
            elif target[:1].isupper():  # a class name: Linear, or one (Embedding, ...) that is no Linear
                default = rule if target == "Linear" else default
            else:
                names.append((target, rule))
    kv = raw.get("kv_cache_scheme")
    if kv is not None and not (kv.get("type") == "float" and kv.get("num_bits") == 8
                               and kv.get("strategy") == "tensor" and not kv.get("dynamic")):
        raise QuantConfigError(f"quantization_config.kv_cache_scheme {kv} is not supported; supported: static "
                               f"per-tensor FP8 (type float, num_bits 8, strategy tensor, dynamic false) or null")
    # compressed-tensors prefers a target naming the layer, then a regex, then the class
    return QuantConfig("compressed-tensors", default, tuple(names + regexes), tuple(raw.get("ignore") or ()),
                       kv_cache_scales=kv is not None)


# ---- Quark (AMD) ---------------------------------------------------------------------------------------

def _quark_scheme(layer: dict | None, kv_output: bool) -> Rule:
    """One Quark layer config ({weight, input_tensors, output_tensors, bias}) -> a scheme. `kv_output`: its
    output_tensors are the KV cache's scales (k_proj/v_proj of the kv_cache_group), not output quantization."""
    layer = layer or {}
    weight, inputs = layer.get("weight"), layer.get("input_tensors")
    if layer.get("bias"):
        return Unsupported("quantized biases are not supported")
    if layer.get("output_tensors") and not kv_output:
        return Unsupported("output activation quantization (output_tensors) is not supported outside the "
                           "KV cache's k_proj/v_proj")
    if not weight:
        return None
    if isinstance(weight, list) or isinstance(inputs, list):
        return Unsupported("two-level weight quantization (NVFP4, W4A8) is not supported yet")
    if weight.get("is_dynamic"):
        return Unsupported("dynamic weight quantization is not supported; supported: static weights")
    dtype, qscheme = weight.get("dtype"), weight.get("qscheme")
    if dtype == "fp4":
        if (qscheme, weight.get("group_size"), weight.get("scale_format")) != ("per_group", MXFP4_GROUP, "e8m0"):
            return Unsupported(f"fp4 weights {qscheme} group {weight.get('group_size')} scale "
                               f"{weight.get('scale_format')} are not supported; supported: MXFP4 (per_group 32, "
                               f"e8m0)")
        if inputs is None:
            return QuantScheme("mxfp4", "none")
        if (inputs.get("dtype"), inputs.get("qscheme"), inputs.get("group_size"), inputs.get("is_dynamic")) == \
                ("fp4", "per_group", MXFP4_GROUP, True):
            return QuantScheme("mxfp4", "mxfp4")
        return Unsupported(f"MXFP4 weights with {inputs.get('dtype')} {inputs.get('qscheme')} activations are not "
                           f"supported; supported: none (W4A16) or dynamic MXFP4 (W4A4)")
    if dtype != "fp8_e4m3":
        return Unsupported(f"{dtype} weights are not supported yet; supported: fp8_e4m3, fp4 (MXFP4)")
    if inputs is None:
        return Unsupported("weight-only FP8 (input_tensors: null) is not supported; the engine's FP8 GEMMs "
                           "quantize activations too")
    if inputs.get("dtype") != "fp8_e4m3":
        return Unsupported(f"fp8_e4m3 weights with {inputs.get('dtype')} activations are not supported")
    a, dynamic = inputs.get("qscheme"), bool(inputs.get("is_dynamic"))
    if qscheme == "per_tensor" and a == "per_tensor":
        return QuantScheme("fp8_tensor", "dynamic" if dynamic else "static")
    if qscheme == "per_channel" and a == "per_channel" and dynamic:  # per channel of the input = per token
        return QuantScheme("fp8_channel")
    if qscheme == "per_block":
        block = tuple(weight.get("block_size") or ())
        if weight.get("scale_type", "float") != "float":
            return Unsupported(f"per_block fp8 weights with {weight['scale_type']} scales are not supported; "
                               f"supported: float scales")
        if len(block) == 2 and a == "per_group" and dynamic and inputs.get("group_size") == block[1]:
            return QuantScheme("fp8_block", "dynamic", (int(block[0]), int(block[1])))
    return Unsupported(f"fp8_e4m3 weights {qscheme} with {'dynamic' if dynamic else 'static'} {a} activations are "
                       f"not supported; supported: per_tensor + per_tensor, per_channel + dynamic per_channel "
                       f"(per token), per_block + dynamic per_group of the block's width")


def _parse_quark(raw: dict) -> QuantConfig:
    export = raw.get("export") or {}
    kv_group = list(export.get("kv_cache_group") or raw.get("kv_cache_group") or ())
    layers = raw.get("layer_quant_config") or {}

    def kv_output(pattern: str) -> bool:  # vLLM also drops q_proj's output scale when the KV cache has one
        return bool(kv_group) and (any(fnmatch.fnmatchcase(pattern, p) for p in kv_group) or
                                   fnmatch.fnmatchcase(pattern, "*q_proj"))

    for pattern, layer in layers.items():
        out = (layer or {}).get("output_tensors")
        if out and kv_output(pattern) and (out.get("dtype"), out.get("qscheme")) != ("fp8_e4m3", "per_tensor"):
            raise QuantConfigError(f"quantization_config.layer_quant_config[{pattern!r}].output_tensors (the KV "
                                   f"cache) {out.get('dtype')} {out.get('qscheme')} is not supported; supported: "
                                   f"fp8_e4m3 per_tensor")
    by_type = raw.get("layer_type_quant_config") or {}
    linear_types = [key for key in by_type if str(key).rstrip("'>").endswith("Linear")]
    default_layer = by_type[linear_types[0]] if linear_types else raw.get("global_quant_config")
    overrides = tuple((pattern, _quark_scheme(layer, kv_output(pattern))) for pattern, layer in layers.items())
    kv = bool(kv_group) or bool(raw.get("kv_cache_quant_config"))
    return QuantConfig("quark", _quark_scheme(default_layer, False), overrides, tuple(raw.get("exclude") or ()),
                       kv_cache_scales=kv)


# ---- gpt-oss MXFP4 -------------------------------------------------------------------------------------

def _parse_gpt_oss_mxfp4(raw: dict) -> QuantConfig:
    return QuantConfig("mxfp4", QuantScheme("mxfp4", "none"), exclude=tuple(raw.get("modules_to_not_convert") or ()),
                       experts_only=True)


PARSERS = {"fp8": _parse_hf_fp8, "compressed-tensors": _parse_compressed_tensors, "quark": _parse_quark,
           "mxfp4": _parse_gpt_oss_mxfp4}
