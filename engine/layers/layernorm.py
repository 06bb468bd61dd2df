"""RMSNorm, optionally fused with the residual add that precedes it."""
from __future__ import annotations

import torch
from torch import nn

from engine.kernels import ops
from engine.kernels.torch.ops import NORM_STYLES
from engine.parallel import PartialSum, tensor_parallel_all_reduce, tensor_parallel_all_reduce_add_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, style: str = "llama") -> None:
        """`style`: how the weight applies (engine.kernels.torch.ops.NORM_STYLES): "llama" (the normalised
        value rounded to the weight's dtype, then times w), "offset" (times 1 + w in float32: Gemma 1-3,
        Qwen3-Next), "float32" (times w in float32: Gemma 4, gpt-oss), "none" (no weight)."""
        super().__init__()
        if style not in NORM_STYLES:
            raise ValueError(f"RMSNorm style {style!r} is unknown; one of {NORM_STYLES}")
        self.eps, self.style = eps, style
        if style == "none":
            self.register_parameter("weight", None)
        else:  # an offset weight of 0 is the identity, as 1 is for the others
            self.weight = nn.Parameter(torch.zeros(hidden_size) if style == "offset" else torch.ones(hidden_size),
                                       requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With it: (norm(x + residual), x + residual). `x` may be a row-parallel
        layer's PartialSum: reduced here, with the add and the norm in one kernel where it can."""
        if isinstance(x, PartialSum):  # the fused kernel computes Llama's style only
            if residual is not None and self.style == "llama":
                return tensor_parallel_all_reduce_add_norm(x.tensor, residual, self.weight, self.eps)
            x = tensor_parallel_all_reduce(x.tensor)
        if self.style != "llama":
            if residual is None:
                return ops.rms_norm_variant(x, self.weight, self.eps, self.style)
            return ops.fused_add_rms_norm_variant(x, residual, self.weight, self.eps, self.style)
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class RMSNormGated(nn.Module):
    """Gated DeltaNet's output norm: w * norm(x) * silu(gate)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm_gated(x, gate, self.weight, self.eps)
