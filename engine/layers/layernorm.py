"""RMSNorm, optionally fused with the residual add that precedes it and with the projection after it."""
from __future__ import annotations

import torch
from torch import nn

from engine.kernels import ops
from engine.layers.linear import LinearBase


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With it: (norm(x + residual), x + residual)."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def forward_into(self, linear, x: torch.Tensor, residual: torch.Tensor | None = None, gated: bool = False):
        """(linear(norm(x + residual)), x + residual), or (linear(norm(x)), x) without residual: the norm and
        the projection that consumes it as one operation, which a backend may run as one kernel. `linear` is a
        projection without communication (column-parallel or replicated); with gated it is a merged
        [gate; up] projection and the first result silu(gate) * up."""
        assert type(linear).forward is LinearBase.forward, f"{type(linear).__name__} cannot take a fused norm"
        assert not gated or linear.gated_pair, f"{type(linear).__name__} is not a [gate; up] pair"
        return ops.rms_norm_gemm(x, residual, self.weight, self.eps, linear.weight, linear.bias, gated)
