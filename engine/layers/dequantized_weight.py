"""A full-precision weight that also loads from a quantized checkpoint, for layers whose kernels take no quantized
form (the Gated DeltaNet's in-projections). Where the checkpoint stores a part of it quantized, the part is
dequantized once its weight and its scale have both arrived (in either order), in the scheme the checkpoint's
quantization plan names for that module (`load_scheme`, set by engine.loader.quant_plan.apply_plan), and handed
to the layer's own full-precision loader. The layer then computes in the model's dtype: its weight takes the
full-precision bytes, not the checkpoint's."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from engine.kernels.quant import QuantizedWeight, QuantScheme, dequantize_weight, e8m0_to_float

DEQUANTIZABLE = ("fp8_tensor", "fp8_channel", "fp8_block", "mxfp4")


def is_quantized(tensor: torch.Tensor) -> bool:
    """FP8 values, packed 4-bit codes or integers: not a full-precision weight."""
    return not tensor.dtype.is_floating_point or tensor.element_size() == 1


def dequantize(weight: torch.Tensor, scale: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """The float32 weight that a checkpoint's quantized `weight` with its `scale` stands for."""
    if scheme.method not in DEQUANTIZABLE:
        raise ValueError(f"{scheme.describe()} weights are not dequantized on load; supported here: "
                         f"{', '.join(DEQUANTIZABLE)}")
    if scheme.method == "mxfp4":  # e8m0 exponent bytes, or their float32 powers of two
        exponents = scale if scale.dtype == torch.uint8 else (torch.log2(scale.float()) + 127).round().to(torch.uint8)
        return dequantize_weight(QuantizedWeight(scheme, weight.view(torch.uint8), exponents))
    values = e8m0_to_float(scale) if scale.dtype == torch.uint8 else scale.float()
    if scheme.method == "fp8_tensor":
        values = values.reshape(())
    elif scheme.method == "fp8_channel":
        values = values.reshape(-1)
    elif tuple(values.shape) != tuple(expected := scheme.scale_shape(*weight.shape)):
        raise ValueError(f"block scales of shape {tuple(values.shape)} do not tile a {tuple(weight.shape)} weight "
                         f"in {scheme.block} blocks (expected {tuple(expected)})")
    return dequantize_weight(QuantizedWeight(scheme, weight, values))


class DequantizingWeight(nn.Module):
    """A bare `weight` [rows, cols] (the checkpoint's `<name>.weight`) loaded by `loader(param, tensor, shard)`,
    the layer's full-precision loader; `weight_scale` and `input_scale` receive a quantized checkpoint's scales
    (HF fp8's `weight_scale_inv` arrives as `weight_scale`; static activation scales are not needed in full
    precision)."""
    dequantizes_on_load = True

    def __init__(self, rows: int, cols: int, loader: Callable) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(0, dtype=torch.float32), requires_grad=False)
        self.input_scale = nn.Parameter(torch.empty(0, dtype=torch.float32), requires_grad=False)
        self.load_scheme: QuantScheme | None = None
        self._loader = loader
        self._parts: dict = {}  # shard -> {"weight": tensor, "scale": tensor}, until both arrived
        self.weight.weight_loader = self._load_weight
        self.weight_scale.weight_loader = self._load_scale
        self.input_scale.weight_loader = lambda param, loaded, shard=None: None
        self.weight_scale.check_loaded = self._check_complete
        self.input_scale.check_loaded = lambda param, shards: None

    def _load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard=None) -> None:
        if not is_quantized(loaded):
            self._loader(param, loaded, shard)
            return
        if self.load_scheme is None:
            raise ValueError(f"the checkpoint stores it quantized ({loaded.dtype}) but its quantization_config "
                             "names no scheme for this module")
        self._arrived(shard, "weight", loaded)

    def _load_scale(self, param: nn.Parameter, loaded: torch.Tensor, shard=None) -> None:
        self._arrived(shard, "scale", loaded)

    def _arrived(self, shard, kind: str, tensor: torch.Tensor) -> None:
        part = self._parts.setdefault(shard, {})
        part[kind] = tensor
        if len(part) == 2:
            del self._parts[shard]
            weight = dequantize(part["weight"], part["scale"], self.load_scheme)
            self._loader(self.weight, weight.to(self.weight.dtype), shard)

    def _check_complete(self, param: nn.Parameter, shards: set) -> str | None:
        if not self._parts:
            return None
        return "; ".join(f"{'the whole weight' if shard is None else f'shard {shard!r}'} has its "
                         f"{'weight' if 'weight' in part else 'scale'} but not its "
                         f"{'scale' if 'weight' in part else 'weight'}" for shard, part in self._parts.items())
