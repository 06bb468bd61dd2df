"""Linear layers and their tensor-parallel variants. Each owns its weight and a `weight_loader` that
takes the full checkpoint tensor and keeps this rank's shard."""
from __future__ import annotations

import torch
from torch import nn

from engine.kernels import ops
from engine.parallel import get_parallel_state, tensor_parallel_all_reduce


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


def _copy_checked(param_slice: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if param_slice.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor for {name} has shape {tuple(loaded.shape)}, "
                         f"expected {tuple(param_slice.shape)}")
    param_slice.copy_(loaded)


class LinearBase(nn.Module):
    """y = x W^T + b, with W stored [output, input] on this rank (shard along `tp_dim` if any)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None) -> None:
        super().__init__()
        state = get_parallel_state()
        self.tp_rank, self.tp_size, self.tp_dim = state.tp_rank, state.tp_size, tp_dim
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if self.tp_dim is not None and self.tp_size > 1 and self.tp_dim < loaded.dim():
            shard = param.shape[self.tp_dim]
            loaded = loaded.narrow(self.tp_dim, self.tp_rank * shard, shard)
        _copy_checked(param.data, loaded, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.gemm(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias, tp_dim=None)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice (no communication)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = get_parallel_state().tp_size
        super().__init__(input_size, _divide(output_size, tp_size, "output size"), bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one (e.g. gate and up); shard i of each rank is the
    rank's slice of projection i."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        shard = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        loaded = loaded.narrow(0, self.tp_rank * shard, shard)
        _copy_checked(param.data.narrow(0, offset, shard), loaded, f"{type(self).__name__}[{shard_id}]")


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one weight, split by heads. With fewer KV heads than ranks, each KV head
    is replicated on tp_size / num_kv_heads ranks."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False) -> None:
        tp_size = get_parallel_state().tp_size
        self.head_size = head_size
        self.num_heads = _divide(total_num_heads, tp_size, "number of attention heads")
        if total_num_kv_heads >= tp_size:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, "number of KV heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = _divide(tp_size, total_num_kv_heads, "tensor_parallel_size over KV heads")
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp_size
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        if shard_id == "q":
            offset, size, index = 0, q_size, self.tp_rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, index = kv_size, self.tp_rank // self.kv_replicas
        loaded = loaded.narrow(0, index * size, size)
        _copy_checked(param.data.narrow(0, offset, size), loaded, f"{type(self).__name__}[{shard_id}]")


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products are summed with an all-reduce. The bias is
    added once, after the reduction."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True) -> None:
        tp_size = get_parallel_state().tp_size
        super().__init__(_divide(input_size, tp_size, "input size"), output_size, bias, tp_dim=1)
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return ops.gemm(x, self.weight, self.bias)
        y = ops.gemm(x, self.weight, None)
        if self.reduce_results:
            y = tensor_parallel_all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
