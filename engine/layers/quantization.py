"""Quantized weights inside layers: which scheme a layer is built with, how its checkpoint tensors (weights,
scales, activation scales) are sharded into its parameters, and the one-time preparation after loading.

A model is built inside `quantized_build(plan)`: each `LinearBase` and `FusedMoE` takes the plan's default
scheme at construction (no full-precision copy is ever allocated for a quantized layer); once the model
exists and its module names are known, `apply_plan` rebuilds the few layers whose own scheme differs
(excluded layers, per-layer overrides) and `finish_loading` turns each loaded layer into the
`QuantizedWeight` its kernel op reads.

Parameter names follow the checkpoints: `weight`, `weight_scale` (HF fp8's `weight_scale_inv` is renamed to
it on load: both multiply), `input_scale`; experts `w13`, `w13_scale`, `w13_input_scale`, and `w2`, ...
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from engine.kernels.quant import QuantScheme, quantize_weight

logger = logging.getLogger(__name__)

ONLINE_METHODS = {"fp8": QuantScheme("fp8_channel"), "fp8_tensor": QuantScheme("fp8_tensor"),
                  "fp8_channel": QuantScheme("fp8_channel"), "fp8_block": QuantScheme("fp8_block"),
                  "mxfp4": QuantScheme("mxfp4", "none")}


@dataclass
class QuantPlan:
    """Which scheme each layer gets. `linear(module)` / `experts(prefix)` take checkpoint module names
    (`model.layers.0.self_attn.q_proj`, `model.layers.0.mlp.experts`) and return a scheme or None.
    `online`: the checkpoint is full precision and the loader quantizes each weight as it arrives."""
    linear: Callable[[str], QuantScheme | None]
    experts: Callable[[str], QuantScheme | None]
    online: bool = False
    description: str = ""
    kv_cache_scales: bool = False  # the checkpoint carries per-tensor FP8 KV-cache scales
    default_linear: QuantScheme | None = field(init=False, default=None)
    default_experts: QuantScheme | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        # The scheme most layers get; the others are rebuilt by apply_plan.
        self.default_linear = self.linear("model.layers.0.mlp.down_proj")
        self.default_experts = self.experts("model.layers.0.mlp.experts")

    @classmethod
    def uniform(cls, scheme: QuantScheme, description: str = "") -> "QuantPlan":
        """Every linear layer and every expert in one scheme, quantized online from a full-precision model."""
        return cls(lambda _: scheme, lambda _: scheme, online=True, description=description or scheme.method)


_ACTIVE: list[QuantPlan] = []


@contextlib.contextmanager
def quantized_build(plan: QuantPlan | None):
    _ACTIVE.append(plan)
    try:
        yield
    finally:
        _ACTIVE.pop()


def building_linear_scheme() -> QuantScheme | None:
    plan = _ACTIVE[-1] if _ACTIVE else None
    return plan.default_linear if plan else None


def building_experts_scheme() -> QuantScheme | None:
    plan = _ACTIVE[-1] if _ACTIVE else None
    return plan.default_experts if plan else None


def new_param(shape, dtype: torch.dtype | None = None, fill: float | None = None) -> nn.Parameter:
    data = torch.empty(shape, dtype=dtype) if fill is None else torch.full(shape, fill, dtype=dtype)
    return nn.Parameter(data, requires_grad=False)


def aligned_narrow(tensor: torch.Tensor, dim: int, start: int, size: int, per_unit: int, what: str) -> torch.Tensor:
    """tensor.narrow over a quantized dimension where one stored element covers `per_unit` weight columns
    or rows (2 for packed e2m1, the block or group for scales): `start` must fall on a unit boundary."""
    if start % per_unit:
        raise ValueError(f"{what}: this rank's slice starts at {start}, inside a quantization group of "
                         f"{per_unit}; choose a tensor-parallel size whose slices align with the groups")
    unit_start = start // per_unit
    return tensor.narrow(dim, unit_start, min(size, tensor.shape[dim] - unit_start))


def unit_size(count: int, per_unit: int, what: str, exact: bool) -> int:
    """Stored elements covering `count` weight rows/columns; `exact` demands whole groups (a fused
    projection's part must not share a scale block with the next part)."""
    if exact and count % per_unit:
        raise ValueError(f"{what}: a part of {count} rows does not fill whole quantization blocks of {per_unit}")
    return -(-count // per_unit)


def requantize_to_max_scale(weight: torch.Tensor, scales: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Fused FP8 parts with one per-tensor scale each (q, k, v; gate, up) -> one scale, their maximum:
    each part's FP8 values are rescaled (dequantize, requantize). Returns the new [1] scale; `weight` is
    updated in place. Parts whose scale is already the maximum are untouched, bit for bit."""
    top = scales.max()
    offset = 0
    for part, size in enumerate(rows):
        if size and scales[part] != top:
            rows_view = weight.narrow(-2, offset, size)
            rows_view.copy_((rows_view.float() * (scales[part] / top)).to(weight.dtype))
        offset += size
    return top.reshape(1)


def quantize_for_loading(tensor: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Online quantization of one full-precision checkpoint tensor: (weight, scale) in the scheme's stored
    form, each then sharded by the layer's loaders as a checkpoint's would be."""
    qw = quantize_weight(tensor, scheme)
    scale = qw.scale
    if scheme.method == "fp8_tensor":
        scale = scale.reshape(()) if tensor.dim() == 2 else scale
    return qw.weight, scale


def describe_scheme(scheme: QuantScheme | None) -> str:
    return "unquantized" if scheme is None else scheme.describe()


def log_plan(model: nn.Module, plan: QuantPlan) -> None:
    """The plan's description, then one line per scheme: how many layers use it (the start-up log)."""
    from engine.layers.fused_moe import FusedMoE
    from engine.layers.linear import LinearBase
    logger.info("%s", plan.description)
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, (LinearBase, FusedMoE)):
            key = f"{type(module).__name__.replace('Parallel', '')}: {describe_scheme(module.quant_scheme)}"
            counts[key] = counts.get(key, 0) + 1
    for key, count in sorted(counts.items()):
        logger.info("quantization: %d x %s", count, key)
