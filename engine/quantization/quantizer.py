"""Writes a quantized HF checkpoint from a full-precision one (a bf16/fp32 safetensors folder) in each
real-world format that engine/quantization/config.py reads, with the engine's own maths
(`engine.kernels.quant.quantize_weight`), so the stored values are exactly the engine's. Static input and
KV-cache scales come from running the model in transformers on a few random token sequences.

    python -m engine.quantization.quantizer SRC DST --format fp8-block [--exclude PATTERN] [--kv-cache-scales]

| format               | quantization_config                         | tensors of each quantized `<m>` (scales fp32) |
|----------------------|---------------------------------------------|-----------------------------------------------|
| fp8-block            | fp8, weight_block_size [128, 128]           | weight e4m3 [N, K], weight_scale_inv [⌈N/128⌉, ⌈K/128⌉] |
| fp8-tensor-static    | fp8, activation_scheme static               | weight, weight_scale [], input_scale []      |
| ct-fp8-dynamic       | compressed-tensors channel + dynamic token  | weight, weight_scale [N, 1]                  |
| ct-fp8-static-tensor | compressed-tensors tensor + static tensor   | weight, weight_scale [1], input_scale [1]    |
| quark-fp8-tensor     | quark per_tensor + static per_tensor        | weight, weight_scale [], input_scale []      |
| quark-fp8-token      | quark per_channel + dynamic per token       | weight, weight_scale [N]                     |
| quark-fp8-1x128      | quark per_block 128x128 + dynamic 1x128     | weight, weight_scale [⌈N/128⌉, ⌈K/128⌉]      |
| quark-mxfp4          | quark fp4 per_group 32 e8m0 + MXFP4 inputs  | weight uint8 [N, K/2], weight_scale uint8 [N, K/32] |
| quark-mxfp4-w4a16    | the same with input_tensors null            | the same                                     |
| gptoss-mxfp4         | mxfp4 (routed experts only)                 | see below                                    |

MXFP4 weights hold two e2m1 codes per byte, even k in the low nibble; their scales are e8m0 exponents.
gptoss-mxfp4 fuses each layer's routed experts as gpt-oss stores them: `<p>.experts.gate_up_proj_blocks`
uint8 [E, 2I, H/32, 16] (gate rows, then up rows) with `gate_up_proj_scales` [E, 2I, H/32], and
`down_proj_blocks` [E, H, I/32, 16] with `down_proj_scales` [E, H, I/32]; all else stays full precision.

By default lm_head and the embeddings stay full precision (`--exclude` replaces that list); routers are
never quantized (engine/quantization/config.py says why) and norms are 1-D. Routed experts stored one by one
(`<p>.experts.<e>.gate_proj.weight`) keep their names and get the tensors above in every format but
gptoss-mxfp4. Per-tensor scales stay per checkpoint module (q, k and v each have their own), as real
checkpoints have them. With `kv_cache_scales` (ct-fp8-static-tensor, quark-fp8-tensor) each attention layer
also gets per-tensor FP8 scales of what its KV cache stores: amax / 448 of the keys after k_norm and RoPE and
of the values, as `self_attn.k_scale` / `v_scale` [] (compressed-tensors) or `self_attn.k_proj.output_scale` /
`v_proj.output_scale` [] (Quark).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.kernels.quant import MXFP4_GROUP, QuantizedWeight, QuantScheme, fp8_max, quantize_weight
from engine.quantization.config import is_router, module_matches

# Routers are never quantized (config.is_router); norms are 1-D and never candidates.
DEFAULT_EXCLUDE = ("lm_head", "re:.*embed_tokens$")
EXPERT_WEIGHT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)"
                           r"\.weight$")
CALIBRATION_ATTENTION = "atom_ray_calibration"


@dataclass(frozen=True)
class Format:
    family: str            # "fp8" (HF) | "compressed-tensors" | "quark" | "gpt-oss"
    scheme: QuantScheme


FORMATS = {
    "fp8-block": Format("fp8", QuantScheme("fp8_block")),
    "fp8-tensor-static": Format("fp8", QuantScheme("fp8_tensor", "static")),
    "ct-fp8-dynamic": Format("compressed-tensors", QuantScheme("fp8_channel")),
    "ct-fp8-static-tensor": Format("compressed-tensors", QuantScheme("fp8_tensor", "static")),
    "quark-fp8-tensor": Format("quark", QuantScheme("fp8_tensor", "static")),
    "quark-fp8-token": Format("quark", QuantScheme("fp8_channel")),
    "quark-fp8-1x128": Format("quark", QuantScheme("fp8_block")),
    "quark-mxfp4": Format("quark", QuantScheme("mxfp4", "mxfp4")),
    "quark-mxfp4-w4a16": Format("quark", QuantScheme("mxfp4", "none")),
    "gptoss-mxfp4": Format("gpt-oss", QuantScheme("mxfp4", "none")),
}
# Where each family keeps per-tensor KV-cache scales, relative to the attention module.
KV_SCALE_NAMES = {"compressed-tensors": ("k_scale", "v_scale"),
                  "quark": ("k_proj.output_scale", "v_proj.output_scale")}


def quantize_checkpoint(src: Path, dst: Path, fmt: str, *, exclude: list[str] | tuple[str, ...] = DEFAULT_EXCLUDE,
                        kv_cache_scales: bool = False) -> None:
    """Write `src` (config.json + *.safetensors, full precision) quantized as `fmt` (a key of FORMATS) to
    `dst`, with the other files copied and `quantization_config` added to config.json. Every 2-D
    `<module>.weight` not matched by `exclude` (engine/quantization/config.py's patterns) is quantized;
    gptoss-mxfp4 quantizes routed experts only."""
    src, dst = Path(src), Path(dst)
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; choose one of {', '.join(FORMATS)}")
    spec = FORMATS[fmt]
    if kv_cache_scales and spec.family not in KV_SCALE_NAMES:
        raise ValueError(f"{fmt} cannot carry KV-cache scales; formats that can: "
                         f"{', '.join(f for f, s in FORMATS.items() if s.family in KV_SCALE_NAMES)}")
    config = json.loads((src / "config.json").read_text())
    if "quantization_config" in config:
        raise ValueError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')}); "
                         f"start from a full-precision checkpoint")
    checkpoint = _Checkpoint(src)
    plan = _Plan.make(checkpoint, spec, tuple(exclude))
    calibration = None
    if spec.scheme.activation == "static" or kv_cache_scales:
        calibration = calibrate(src, set(plan.experts))

    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json",
                                                                                 "model.safetensors.index.json"):
            shutil.copy(path, dst / path.name)
    weight_map = {}
    for file in checkpoint.files:
        out = {}
        for name in checkpoint.names_in(file):
            out.update(_converted(name, checkpoint, plan, spec, calibration, kv_cache_scales))
        save_file({n: t.contiguous() for n, t in out.items()}, str(dst / file.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, file.name))
    index = src / "model.safetensors.index.json"
    if index.exists():
        metadata = json.loads(index.read_text()).get("metadata", {})
        (dst / index.name).write_text(json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2))
    config["quantization_config"] = CONFIGS[spec.family](spec.scheme, plan.unquantized, kv_cache_scales)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# ---- reading and planning ----------------------------------------------------------------------------

class _Checkpoint:
    """The safetensors files of a folder, read lazily by tensor name."""

    def __init__(self, folder: Path):
        self.files = sorted(folder.glob("*.safetensors"))
        if not self.files:
            raise ValueError(f"{folder} holds no *.safetensors files")
        self._handles = {file: safe_open(str(file), "pt") for file in self.files}
        self._file_of = {name: file for file, handle in self._handles.items() for name in handle.keys()}

    def names_in(self, file: Path) -> list[str]:
        return list(self._handles[file].keys())

    @property
    def names(self):
        return self._file_of.keys()

    def shape(self, name: str) -> list[int]:
        return self._handles[self._file_of[name]].get_slice(name).get_shape()

    def get(self, name: str) -> torch.Tensor:
        return self._handles[self._file_of[name]].get_tensor(name)


@dataclass
class _Plan:
    quantized: set[str]                                # checkpoint module names quantized in place
    experts: dict[str, dict[int, dict[str, str]]]      # experts prefix -> expert -> gate/up/down -> tensor name
    unquantized: list[str]                             # modules whose 2-D weight stays full precision

    @classmethod
    def make(cls, checkpoint: _Checkpoint, spec: Format, exclude: tuple[str, ...]) -> "_Plan":
        from engine.layers.fused_moe import FusedMoE
        quantized, unquantized, experts = set(), [], {}
        for name in sorted(checkpoint.names):
            if not name.endswith(".weight") or len(checkpoint.shape(name)) != 2:
                continue
            module = name[:-len(".weight")]
            expert = EXPERT_WEIGHT.match(name)
            if expert:
                experts.setdefault(expert["prefix"], {}).setdefault(int(expert["expert"]), {})[
                    FusedMoE.PART[expert["proj"]]] = name
            wanted = (expert is not None or spec.family != "gpt-oss") and not is_router(module) and \
                not any(module_matches(pattern, module) for pattern in exclude)
            if wanted:
                quantized.add(module)
                if spec.scheme.method == "mxfp4" and checkpoint.shape(name)[1] % MXFP4_GROUP:
                    raise ValueError(f"{module}: {checkpoint.shape(name)[1]} input features are not a multiple "
                                     f"of {MXFP4_GROUP} (one MXFP4 scale group); exclude it")
            else:
                unquantized.append(module)
        for prefix, by_expert in experts.items():
            if len(by_expert) != max(by_expert) + 1 or any(len(parts) != 3 for parts in by_expert.values()):
                raise ValueError(f"{prefix}: experts 0..{max(by_expert)} each need gate, up and down weights")
            modules = {name[:-len(".weight")] for parts in by_expert.values() for name in parts.values()}
            if 0 < len(modules & quantized) < len(modules):
                raise ValueError(f"the exclusions quantize some routed experts of {prefix} but not others; "
                                 f"a layer's experts share one scheme")
        quantized_experts = {prefix: by_expert for prefix, by_expert in experts.items()
                             if by_expert[0]["gate"][:-len(".weight")] in quantized}
        return cls(quantized, quantized_experts, unquantized)


# ---- writing -------------------------------------------------------------------------------------------

def _converted(name: str, checkpoint: _Checkpoint, plan: _Plan, spec: Format, calibration, kv: bool) -> dict:
    """The destination tensors standing for source tensor `name` (a k_proj weight brings its layer's KV-cache
    scales along)."""
    expert = EXPERT_WEIGHT.match(name)
    module = name.removesuffix(".weight") if name.endswith(".weight") else None
    out = {}
    attention = module.rpartition(".")[0] if module and module.endswith(".k_proj") else None
    if kv and attention in calibration.kv_amax:
        for kv_name, amax in zip(KV_SCALE_NAMES[spec.family], calibration.kv_amax[attention]):
            out[f"{attention}.{kv_name}"] = _fp8_scale(amax)
    if spec.family == "gpt-oss" and expert and expert["prefix"] in plan.experts:
        by_expert = plan.experts[expert["prefix"]]
        if name == by_expert[0]["gate"]:  # the layer's fused tensors once; the other experts' names go
            out.update(_fused_experts(expert["prefix"], by_expert, checkpoint, spec.scheme))
        return out
    if module not in plan.quantized:
        return {**out, name: checkpoint.get(name)}
    qw = quantize_weight(checkpoint.get(name), spec.scheme)
    out.update({name: qw.weight, _scale_name(module, spec): _stored_scale(qw, spec.family)})
    if spec.scheme.activation == "static":
        scale = _fp8_scale(calibration.input_amax(module, checkpoint, plan, expert))
        out[f"{module}.input_scale"] = scale.reshape(1) if spec.family == "compressed-tensors" else scale
    return out


def _scale_name(module: str, spec: Format) -> str:
    # HF fp8's block scales are named weight_scale_inv (DeepSeek's name), though they multiply like the others
    return f"{module}.weight_scale_inv" if spec.family == "fp8" and spec.scheme.method == "fp8_block" \
        else f"{module}.weight_scale"


def _stored_scale(qw: QuantizedWeight, family: str) -> torch.Tensor:
    """The engine's scale in the family's stored shape: per-tensor [] ([1] in compressed-tensors), per-channel
    [N] ([N, 1] in compressed-tensors); block and MXFP4 scales as they are."""
    method = qw.scheme.method
    if method == "fp8_tensor":
        return qw.scale.reshape(1 if family == "compressed-tensors" else ())
    if method == "fp8_channel" and family == "compressed-tensors":
        return qw.scale[:, None]
    return qw.scale


def _fp8_scale(amax: float) -> torch.Tensor:
    """The per-tensor scale [] that maps amax to the largest e4m3 value."""
    return torch.tensor(max(amax, 1e-12) / fp8_max(), dtype=torch.float32)


def _fused_experts(prefix: str, by_expert: dict[int, dict[str, str]], checkpoint: _Checkpoint,
                   scheme: QuantScheme) -> dict:
    """gpt-oss's fused MXFP4 experts: [gate; up] rows and down, blocks of 32 codes as [.., K/32, 16] bytes."""
    experts = range(len(by_expert))
    gate_up = torch.stack([torch.cat([checkpoint.get(by_expert[e]["gate"]), checkpoint.get(by_expert[e]["up"])])
                           for e in experts])
    down = torch.stack([checkpoint.get(by_expert[e]["down"]) for e in experts])
    out = {}
    for name, weight in (("gate_up_proj", gate_up), ("down_proj", down)):
        qw = quantize_weight(weight, scheme)
        out[f"{prefix}.{name}_blocks"] = qw.weight.unflatten(-1, (-1, MXFP4_GROUP // 2))
        out[f"{prefix}.{name}_scales"] = qw.scale
    return out


# ---- calibration ---------------------------------------------------------------------------------------

@dataclass
class Calibration:
    """What a few random sequences through the full-precision model saw."""
    linear_amax: dict[str, float]                             # nn.Linear module -> amax of its input
    moe_inputs: dict[str, tuple[torch.Tensor, torch.Tensor]]  # experts prefix -> (tokens [T, H], chosen [T, k])
    kv_amax: dict[str, tuple[float, float]]                   # attention module -> (rotated keys, values) amax
    hidden_act: str

    def input_amax(self, module: str, checkpoint: _Checkpoint, plan: _Plan, expert: re.Match | None) -> float:
        """amax of a Linear's input, or of routed expert `expert`'s: the tokens routed to it (all tokens if
        none was) for gate/up, act(gate) * up of those tokens (from the checkpoint's weights) for down."""
        from transformers.activations import ACT2FN
        from engine.layers.fused_moe import FusedMoE
        if expert is None:
            if module not in self.linear_amax:
                raise ValueError(f"transformers' model has no nn.Linear named {module}; cannot calibrate it")
            return self.linear_amax[module]
        tokens, chosen = self.moe_inputs[expert["prefix"]]
        index = int(expert["expert"])
        routed = tokens[(chosen == index).any(dim=-1)]
        x = routed if len(routed) else tokens
        if FusedMoE.PART[expert["proj"]] != "down":
            return x.abs().amax().item()
        names = plan.experts[expert["prefix"]][index]
        gate, up = (x @ checkpoint.get(names[part]).float().t() for part in ("gate", "up"))
        return (ACT2FN[self.hidden_act](gate) * up).abs().amax().item()


def calibrate(src: Path, expert_prefixes: set[str], num_sequences: int = 4, seq_len: int = 32,
              seed: int = 0) -> Calibration:
    """Run the model (transformers, float32, CPU) on random tokens and record the ranges static scales need."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def recording_attention(module, query, key, value, attention_mask, **kwargs):
        seen = getattr(module, "calibration_kv", None)
        if seen is not None:  # keys as cached: after k_norm and RoPE
            seen[0], seen[1] = max(seen[0], key.abs().amax().item()), max(seen[1], value.abs().amax().item())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(CALIBRATION_ATTENTION, recording_attention)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32,
                                                 attn_implementation=CALIBRATION_ATTENTION).eval()
    linear_amax, moe_inputs, attention = {}, {}, {}

    def record_linear(name):
        def hook(module, args):
            linear_amax[name] = max(linear_amax.get(name, 0.0), args[0].abs().amax().item())
        return hook

    def record_moe(name):
        def hook(module, args, kwargs):  # experts(hidden_states [T, H], top_k_index [T, k], top_k_weights)
            hidden = args[0] if args else kwargs["hidden_states"]
            chosen = args[1] if len(args) > 1 else next(v for k, v in kwargs.items() if "ind" in k)
            hidden = hidden.reshape(-1, hidden.shape[-1])
            moe_inputs.setdefault(name, []).append((hidden, chosen.reshape(len(hidden), -1)))
        return hook

    handles = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            handles.append(module.register_forward_pre_hook(record_linear(name)))
        elif name in expert_prefixes:
            handles.append(module.register_forward_pre_hook(record_moe(name), with_kwargs=True))
        elif hasattr(module, "k_proj") and hasattr(module, "v_proj"):
            module.calibration_kv = attention[name] = [0.0, 0.0]
    missing = expert_prefixes - {name for name, _ in model.named_modules()}
    if missing:
        raise ValueError(f"transformers' model has no experts module at {sorted(missing)}; cannot calibrate them")
    tokens = torch.randint(0, model.config.vocab_size, (num_sequences, seq_len),
                           generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model(tokens, use_cache=False)
    for handle in handles:
        handle.remove()
    moe = {name: tuple(map(torch.cat, zip(*seen))) for name, seen in moe_inputs.items()}
    return Calibration(linear_amax, moe, {name: tuple(seen) for name, seen in attention.items()},
                       model.config.hidden_act)


# ---- quantization_config blocks ------------------------------------------------------------------------

def _hf_fp8_config(scheme: QuantScheme, unquantized: list[str], kv: bool) -> dict:
    config = {"activation_scheme": scheme.activation, "fmt": "e4m3", "quant_method": "fp8"}
    if scheme.method == "fp8_block":  # as Qwen3-*-FP8 write it
        return {**config, "modules_to_not_convert": unquantized, "weight_block_size": list(scheme.block)}
    return {**config, "ignored_layers": unquantized}  # as AMD's / vLLM's per-tensor FP8 exports write it


def _compressed_tensors_config(scheme: QuantScheme, unquantized: list[str], kv: bool) -> dict:
    fp8 = {"actorder": None, "block_structure": None, "group_size": None, "num_bits": 8, "observer_kwargs": {},
           "symmetric": True, "type": "float"}
    static_tensor = {**fp8, "dynamic": False, "observer": "minmax", "strategy": "tensor"}
    if scheme.method == "fp8_channel":
        weights = {**fp8, "dynamic": False, "observer": "minmax", "strategy": "channel"}
        inputs = {**fp8, "dynamic": True, "observer": None, "strategy": "token"}
    else:
        weights, inputs = static_tensor, static_tensor
    return {"config_groups": {"group_0": {"input_activations": inputs, "output_activations": None,
                                          "targets": ["Linear"], "weights": weights}},
            "format": "float-quantized", "ignore": unquantized, "kv_cache_scheme": static_tensor if kv else None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed"}


def _quark_tensor(dtype: str, qscheme: str, dynamic: bool, **fields) -> dict:
    observer = {"per_tensor": "PerTensorMinMaxObserver", "per_channel": "PerChannelMinMaxObserver",
                "per_block": "PerBlockMinMaxObserver", "per_group": "PerGroupMinMaxObserver"}[qscheme]
    spec = {"block_size": None, "ch_axis": None, "dtype": dtype, "group_size": None, "is_dynamic": dynamic,
            "observer_cls": observer, "qscheme": qscheme, "round_method": "half_even", "scale_format": None,
            "scale_type": "float", "symmetric": True}
    return {**spec, **fields}


def _quark_layer(scheme: QuantScheme) -> dict:
    """Quark's {weight, input_tensors} for a scheme (the fields vLLM's and ATOM's Quark readers test)."""
    method = scheme.method
    if method == "fp8_tensor":
        weight = _quark_tensor("fp8_e4m3", "per_tensor", False)
        inputs = _quark_tensor("fp8_e4m3", "per_tensor", scheme.activation == "dynamic")
    elif method == "fp8_channel":  # per channel of the weight's rows; of the input's rows = per token
        weight = _quark_tensor("fp8_e4m3", "per_channel", False, ch_axis=0)
        inputs = _quark_tensor("fp8_e4m3", "per_channel", True, ch_axis=1)
    elif method == "fp8_block":
        weight = _quark_tensor("fp8_e4m3", "per_block", False, block_size=list(scheme.block), ch_axis=-1)
        inputs = _quark_tensor("fp8_e4m3", "per_group", True, group_size=scheme.block[1], ch_axis=-1)
    else:
        mx = {"ch_axis": -1, "group_size": MXFP4_GROUP, "observer_cls": "PerBlockMXObserver", "scale_format": "e8m0",
              "scale_calculation_mode": "even", "symmetric": None}
        weight = _quark_tensor("fp4", "per_group", False, **mx)
        inputs = _quark_tensor("fp4", "per_group", True, **mx) if scheme.activation == "mxfp4" else None
    return {"bias": None, "input_tensors": inputs, "output_tensors": None, "weight": weight}


def _quark_config(scheme: QuantScheme, unquantized: list[str], kv: bool) -> dict:
    layer = _quark_layer(scheme)
    kv_group = ["*k_proj", "*v_proj"] if kv else []
    kv_cache = _quark_tensor("fp8_e4m3", "per_tensor", False)
    return {"algo_config": None, "exclude": unquantized,
            "export": {"kv_cache_group": kv_group, "min_kv_scale": 0.0, "pack_method": "reorder",
                       "weight_format": "real_quantized", "weight_merge_groups": None},
            "global_quant_config": layer,
            "layer_quant_config": {pattern: {**layer, "output_tensors": kv_cache} for pattern in kv_group},
            "layer_type_quant_config": {}, "quant_method": "quark", "quant_mode": "eager_mode"}


def _gpt_oss_config(scheme: QuantScheme, unquantized: list[str], kv: bool) -> dict:
    return {"modules_to_not_convert": unquantized, "quant_method": "mxfp4"}


CONFIGS = {"fp8": _hf_fp8_config, "compressed-tensors": _compressed_tensors_config, "quark": _quark_config,
           "gpt-oss": _gpt_oss_config}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Quantize a full-precision HF checkpoint (see the module doc).")
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--format", required=True, choices=list(FORMATS))
    parser.add_argument("--exclude", action="append", metavar="PATTERN",
                        help=f"module name, glob or re: pattern to keep unquantized (repeatable; replaces the "
                             f"default {list(DEFAULT_EXCLUDE)})")
    parser.add_argument("--kv-cache-scales", action="store_true",
                        help="also write calibrated per-tensor FP8 KV-cache scales")
    args = parser.parse_args(argv)
    quantize_checkpoint(args.src, args.dst, args.format, exclude=args.exclude or DEFAULT_EXCLUDE,
                        kv_cache_scales=args.kv_cache_scales)


if __name__ == "__main__":
    main()
