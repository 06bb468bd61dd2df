"""RMSNorm, optionally fused with the residual add that precedes it."""
from __future__ import annotations

import torch
from torch import nn

from engine.kernels import ops
from engine.parallel import PartialSum, tensor_parallel_all_reduce, tensor_parallel_all_reduce_add_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With it: (norm(x + residual), x + residual). `x` may be a row-parallel
        layer's PartialSum: reduced here, with the add and the norm in one kernel where it can."""
        if isinstance(x, PartialSum):
            if residual is not None:
                return tensor_parallel_all_reduce_add_norm(x.tensor, residual, self.weight, self.eps)
            x = tensor_parallel_all_reduce(x.tensor)
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
