"""What benchmarks/node_scaling.py runs on a host of n GPUs, decided without a GPU: the layouts of each model
shape, how many of its layers fit, the engine arguments, the workload and the batch-1 decode roofline.

Memory: dummy weights take at most WEIGHT_FRACTION of a GPU (the rest is the KV cache and activations).
The bytes come from our own model built on the meta device (bf16, or the FP8 blocks and their scales of a
quantized config), split by what each rank keeps: tensor parallelism divides the column/row-parallel layers,
the embedding and the LM head by TP, expert parallelism divides the routed experts by EP, and everything
else (replicated linears, norms, routers) is whole on every rank. So under DP=n + EP=n each rank holds the
whole attention and dense weights plus 1/n of the experts; under TP=n, 1/n of nearly everything. Where the
whole model does not fit, every layout of that model runs the same first L layers
(`hf_overrides={"num_hidden_layers": L}`; DeepSeek keeps its first_k_dense_replace dense layers).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent / "configs"
WEIGHT_FRACTION = 0.65
GiB = 1 << 30
# DeepSeek-V3/R1's published quantization_config: FP8 e4m3 weights in 128x128 blocks, dynamic activations.
DEEPSEEK_FP8_BLOCKS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [128, 128]}


@dataclass(frozen=True)
class ModelSpec:
    config: str  # a folder of benchmarks/configs
    overrides: dict = field(default_factory=dict)  # hf_overrides beyond the layer count
    note: str = ""


MOE_MODELS = {
    "qwen3-235b-a22b": ModelSpec("qwen3-235b-a22b", note="dummy bf16"),
    "deepseek-v3": ModelSpec("deepseek-v3", note="MLA, dummy bf16"),
    "deepseek-v3-fp8": ModelSpec("deepseek-v3", {"quantization_config": DEEPSEEK_FP8_BLOCKS},
                                 note="MLA, dummy FP8 128x128 blocks as published"),
}
DENSE_MODELS = {  # the 70B first: its TP=n decode against the roofline is the target
    "llama-3.1-70b": ModelSpec("llama-3.1-70b", note="dummy bf16"),
    "llama-3.1-8b": ModelSpec("llama-3.1-8b", note="dummy bf16"),
}
SERVING_MODEL = "llama-3.1-70b"  # deployments/configs/mi355x_tp8.yaml: the whole-node TP config


@dataclass
class WeightBytes:
    """A model's weight bytes by what a rank keeps: per layer (index order) and outside the layers, each as
    {"tp": split by tensor parallelism, "experts": routed experts, "whole": on every rank}."""
    layers: list[dict]
    outside: dict

    def per_rank(self, num_layers: int, tp: int, ep: int) -> int:
        """Bytes one rank holds with the first `num_layers` layers, TP=tp and EP=ep (ep 1: experts split by
        TP like the other layers)."""
        expert_split = ep if ep > 1 else tp
        return sum(-(-part["tp"] // tp) + -(-part["experts"] // expert_split) + part["whole"]
                   for part in [self.outside, *self.layers[:num_layers]])


@dataclass
class ModelPlan:
    name: str
    spec: ModelSpec
    full_layers: int
    layers: int
    overrides: dict  # hf_overrides of every layout (the layer count where the whole model does not fit)
    layouts: dict[str, dict]  # label -> engine arguments over multi_gpu.ENGINE_ARGS
    gib_per_rank: dict[str, float]
    baseline: str  # the label every ratio of this model is against

    @property
    def model(self) -> str:
        return str(CONFIGS / self.spec.config)

    @property
    def shape(self) -> str:
        layers = f"all {self.full_layers} layers" if self.layers == self.full_layers else \
            f"{self.layers} of {self.full_layers} layers"
        return f"{self.name} ({layers}; {self.spec.note})"

    def hf_config(self):
        """The config as the engine reads it, with this plan's overrides."""
        from engine.loader.source import load_hf_config
        config = load_hf_config(Path(self.model))
        for key, value in self.overrides.items():
            setattr(config, key, value)
        return config


def weight_bytes(config) -> WeightBytes:
    """Build the model of `config` on the meta device (no memory) and sort its parameters' bytes."""
    import torch

    from engine import kernels
    from engine.layers.fused_moe import FusedMoE
    from engine.layers.embed_head import VocabParallelEmbedding
    from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
    from engine.layers.quantization import quantized_build
    from engine.loader import default_dtype
    from engine.loader.quant_plan import apply_plan, resolve_quant_plan
    from engine.models import model_class_for
    kernels.activate("torch", torch.device("cpu"))  # some layers ask the kernel registry while they build
    plan = resolve_quant_plan(config, None, "dummy")
    with default_dtype(torch.bfloat16), torch.device("meta"), quantized_build(plan):
        model = model_class_for(config)(config, residual_dtype=torch.bfloat16)
        if plan is not None:
            apply_plan(model, plan)
    layers = [{"tp": 0, "experts": 0, "whole": 0} for _ in range(config.num_hidden_layers)]
    outside = {"tp": 0, "experts": 0, "whole": 0}
    for module_name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            kind = "experts"
        elif isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            kind = "tp"
        else:
            kind = "whole"
        found = re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", module_name)
        target = layers[int(found.group(1))] if found else outside
        for param in module.parameters(recurse=False):
            target[kind] += param.numel() * param.element_size()
    return WeightBytes(layers, outside)


def layout_sizes(layout: dict) -> tuple[int, int]:
    """(TP, EP) of a layout's engine arguments; EP 1 without expert parallelism."""
    tp, dp = layout.get("tensor_parallel_size", 1), layout.get("data_parallel_size", 1)
    return tp, tp * dp if layout.get("enable_expert_parallel") else 1


def spec_config(spec: ModelSpec):
    """The config the engine reads for `spec`: its benchmarks/configs file with the spec's overrides."""
    from engine.loader.source import load_hf_config
    config = load_hf_config(CONFIGS / spec.config)
    for key, value in spec.overrides.items():
        setattr(config, key, value)
    return config


def min_layers(config) -> int:
    """The fewest layers that still hold the model's kinds of layer (DeepSeek: its dense ones and one MoE)."""
    return (getattr(config, "first_k_dense_replace", 0) or 0) + 1


def layer_overrides(spec: ModelSpec, config, layers: int) -> dict:
    """hf_overrides for the first `layers` layers (DeepSeek's first_k_dense_replace stated, though unchanged)."""
    overrides = dict(spec.overrides)
    if layers < config.num_hidden_layers:
        overrides["num_hidden_layers"] = layers
        if getattr(config, "first_k_dense_replace", None) is not None:
            overrides["first_k_dense_replace"] = config.first_k_dense_replace
    return overrides


def plan_model(name: str, spec: ModelSpec, layouts: dict[str, dict], baseline: str, gpu_mem_gib: float) -> ModelPlan:
    """The largest layer count that fits every layout, and the layouts' engine arguments with it."""
    config = spec_config(spec)
    weights = weight_bytes(config)
    full, fewest, budget = config.num_hidden_layers, min_layers(config), WEIGHT_FRACTION * gpu_mem_gib * GiB
    layers = full
    for layout in layouts.values():
        tp, ep = layout_sizes(layout)
        while layers >= fewest and weights.per_rank(layers, tp, ep) > budget:
            layers -= 1
    if layers < fewest:
        raise ValueError(f"{name}: not even {fewest} layers fit {WEIGHT_FRACTION:.0%} of "
                         f"{gpu_mem_gib:g} GiB per GPU in every layout of {list(layouts)}")
    overrides = layer_overrides(spec, config, layers)
    layouts = {label: {**layout, **({"hf_overrides": overrides} if overrides else {})}
               for label, layout in layouts.items()}
    sizes = {label: weights.per_rank(layers, *layout_sizes(layout)) / GiB for label, layout in layouts.items()}
    return ModelPlan(name, spec, full, layers, overrides, layouts, sizes, baseline)


def moe_plans(n: int, gpu_mem_gib: float, names: list[str] | None = None) -> list[ModelPlan]:
    """Each MoE shape at DP=n + EP=n against TP=n (the baseline), the same layers for both."""
    layouts = {f"DP={n} + EP={n}": {"data_parallel_size": n, "enable_expert_parallel": True},
               f"TP={n}": {"tensor_parallel_size": n}}
    return [plan_model(name, MOE_MODELS[name], layouts, f"TP={n}", gpu_mem_gib) for name in names or MOE_MODELS]


def dense_plans(n: int, gpu_mem_gib: float, names: list[str] | None = None) -> list[ModelPlan]:
    """Llama-3.1-8B at TP=1, 2, 4, 8 (up to n) against TP=1; Llama-3.1-70B at TP=n and, on eight GPUs, TP=4
    (its baseline: the fewest GPUs it runs on here)."""
    plans = []
    for name in names or DENSE_MODELS:
        sizes = [1, 2, 4, 8] if name == "llama-3.1-8b" else [8, 4] if n == 8 else [n]  # the target first
        layouts = {f"TP={tp}": {"tensor_parallel_size": tp} if tp > 1 else {} for tp in sizes if tp <= n}
        plans.append(plan_model(name, DENSE_MODELS[name], layouts, f"TP={min(s for s in sizes if s <= n)}",
                                gpu_mem_gib))
    return plans


def serving_plan(n: int, gpu_mem_gib: float) -> ModelPlan:
    """The whole-node TP config's shape (Llama-3.1-70B) at TP=n."""
    return plan_model(SERVING_MODEL, DENSE_MODELS[SERVING_MODEL], {f"TP={n}": {"tensor_parallel_size": n}},
                      f"TP={n}", gpu_mem_gib)


def decode_roofline(hf_config, tp: int, bandwidth_bytes_s: float, context: float) -> dict:
    """Batch-1 decode on TP=tp GPUs, each reading its 1/tp of the weights a step reads (gpu_perf.model_facts:
    the embedding table only gathered) and its KV heads' cache at the mean `context`: tokens/s when every
    GPU streams its bytes at the measured bandwidth."""
    from benchmarks.gpu_perf import model_facts
    facts = model_facts(hf_config)
    kv_heads = hf_config.num_key_value_heads
    kv_share = max(1, kv_heads // tp) / kv_heads  # KV heads are replicated when TP exceeds them
    step_bytes = facts["weight_bytes_per_step"] / tp + facts["kv_bytes_per_token"] * context * kv_share
    return {"bytes_per_gpu_step": step_bytes, "bandwidth_GBps": bandwidth_bytes_s / 1e9,
            "roofline_tok_s": bandwidth_bytes_s / step_bytes}


def gpus_to_use(count: int) -> int:
    """The largest of 8, 4, 2 GPUs the host has."""
    for n in (8, 4, 2):
        if count >= n:
            return n
    raise ValueError(f"the host has {count} GPU(s); the node benchmark needs at least 2")


def workload(vocab_size: int, num_requests: int, max_tokens: int | None):
    """The first `num_requests` of gpu_perf's 512-request workload, outputs capped at `max_tokens`."""
    from benchmarks.gpu_perf import throughput_workload
    prompts, output_lens = throughput_workload(vocab_size)
    output_lens = [min(n, max_tokens) if max_tokens else n for n in output_lens[:num_requests]]
    return prompts[:num_requests], output_lens


def plan_rows(plans: list[ModelPlan], num_requests: int, max_tokens: int | None) -> list[tuple]:
    """The dry run's table: one row per layout."""
    rows = []
    for plan in plans:
        for label, layout in plan.layouts.items():
            tp, ep = layout_sizes(layout)
            rows.append((plan.name, f"{plan.layers} of {plan.full_layers}", label,
                         f"TP={tp}, EP={ep}" if ep > 1 else f"TP={tp}", f"{plan.gib_per_rank[label]:.1f}",
                         num_requests, max_tokens or "64..512", plan.baseline))
    return rows


PLAN_HEADERS = ["model", "layers", "layout", "split", "weights GiB/rank", "requests", "max_tokens", "ratio against"]
