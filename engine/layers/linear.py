"""Linear layers and their tensor-parallel variants. Each owns its weight and a `weight_loader` that
takes the full checkpoint tensor and keeps this rank's shard.

Sizes that do not divide by the number of ranks are split as evenly as possible (the first ranks get one
unit more); paired layers (column then row) use the same split, so the maths is unchanged. Attention is
split in whole GQA groups, so a model with 9 heads and 3 KV heads runs on 2 ranks as 6 + 3 heads.

A layer built inside `engine.layers.quantization.quantized_build` holds its weight quantized (FP8, MXFP4, int4:
`weight`, `weight_scale`, maybe `input_scale`) and runs the scheme's GEMM op; its loaders shard the scales
with the weight (a TP slice must start on a quantization-block boundary, checked).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.kernels import ops
from engine.kernels.quant import QuantizedWeight, QuantScheme
from engine.kernels.registry import prepare_quantized
from engine.layers.quantization import (aligned_narrow, building_linear_scheme, new_param,
                                        requantize_to_max_scale, unit_size)
from engine.parallel import PartialSum, get_parallel_state, tensor_parallel_all_reduce


def shard_range(total: int, num_shards: int, index: int) -> tuple[int, int]:
    """(start, size) of shard `index` when `total` units are split as evenly as possible."""
    base, extra = divmod(total, num_shards)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)


def _copy_checked(param_slice: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if param_slice.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor for {name} has shape {tuple(loaded.shape)}, "
                         f"expected {tuple(param_slice.shape)}")
    param_slice.copy_(loaded)


class LinearBase(nn.Module):
    """y = x W^T + b, with W stored [output, input] on this rank (shard along `tp_dim` if any). `parts`: the
    output rows of each fused projection on this rank (q, k, v; gate, up), for per-part checkpoint scales."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None,
                 shard_start: int = 0, parts: list[int] | None = None) -> None:
        super().__init__()
        state = get_parallel_state()
        self.tp_rank, self.tp_size, self.tp_dim = state.tp_rank, state.tp_size, tp_dim
        self.input_size, self.output_size = input_size, output_size
        self.shard_start = shard_start  # offset of this rank's slice along tp_dim in the full tensor
        self.parts = parts or [output_size]
        self.set_quant_scheme(building_linear_scheme())
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    # ---- weights ----------------------------------------------------------------------------------------
    def set_quant_scheme(self, scheme: QuantScheme | None) -> None:
        """(Re)create the weight parameters for `scheme` (None: full precision in the default dtype)."""
        self.quant_scheme, self.qweight = scheme, None
        n, k = self.output_size, self.input_size
        if scheme is None:
            self.weight = new_param((n, k))
            self.register_parameter("weight_scale", None)
            self.register_parameter("input_scale", None)
        else:
            self.weight = new_param(scheme.weight_shape(n, k), scheme.weight_dtype)
            scale_shape = (len(self.parts),) if scheme.method == "fp8_tensor" else scheme.scale_shape(n, k)
            self.weight_scale = new_param(scale_shape, scheme.scale_dtype)
            if scheme.activation == "static":
                self.input_scale = new_param((len(self.parts),), torch.float32)
            else:
                self.register_parameter("input_scale", None)
        for param in (self.weight, self.weight_scale, self.input_scale):
            if param is not None:
                param.weight_loader = self.weight_loader

    def _units(self, param: nn.Parameter) -> tuple[int, int] | None:
        """Weight rows and columns per stored element of `param` along (dim 0, dim 1); None for a per-part
        scalar (per-tensor weight scale, static input scale)."""
        scheme = self.quant_scheme
        if scheme is None or param is self.bias:
            return (1, 1)
        if param is self.weight:
            return (1, scheme.packed)
        if param is self.input_scale or scheme.method == "fp8_tensor":
            return None
        return scheme.scale_block or (1, 1)

    def _checkpoint_form(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        if param is self.weight_scale and self.quant_scheme.method == "fp8_channel":
            return loaded.reshape(-1)  # [N, 1] in compressed-tensors checkpoints
        return loaded

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        units = self._units(param)
        if units is None:  # a single projection's scalar scale
            _copy_checked(param.data, loaded.reshape(1).to(param.dtype), type(self).__name__)
            return
        loaded = self._checkpoint_form(param, loaded)
        dim = self.tp_dim
        if dim is not None and self.tp_size > 1 and dim < loaded.dim():
            loaded = aligned_narrow(loaded, dim, self.shard_start, param.shape[dim], units[dim],
                                    f"{type(self).__name__} {'weight' if param is self.weight else 'scale'}")
        _copy_checked(param.data, loaded, type(self).__name__)

    def _load_part(self, param: nn.Parameter, loaded: torch.Tensor, part: int, offset: int, size: int,
                   start: int, what: str) -> None:
        """Rows [start, start + size) of a fused part's checkpoint tensor -> rows [offset, offset + size) of
        this layer's (in weight rows; scales follow at their granularity)."""
        units = self._units(param)
        if units is None:
            _copy_checked(param.data[part:part + 1], loaded.reshape(1).to(param.dtype), what)
            return
        loaded = self._checkpoint_form(param, loaded)
        per_row = units[0]
        last = part == len(self.parts) - 1
        rows = unit_size(size, per_row, what, exact=not last)
        source = aligned_narrow(loaded, 0, start, rows, per_row, what)
        _copy_checked(param.data.narrow(0, unit_size(offset, per_row, what, exact=True), rows), source, what)

    def finish_loading(self) -> None:
        """After every tensor arrived: merge per-part scales, build the kernel's view, let the backend prepare."""
        scheme = self.quant_scheme
        if scheme is None:
            return
        scale = self.weight_scale.data
        if scheme.method == "fp8_tensor":
            scale = requantize_to_max_scale(self.weight.data, scale, self.parts)
        input_scale = None if self.input_scale is None else self.input_scale.data.max().reshape(1)
        self.qweight = QuantizedWeight(scheme, self.weight.data, scale, input_scale)
        prepare_quantized(getattr(ops, scheme.gemm_op), self.qweight)

    def _gemm(self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None):
        if self.qweight is not None:
            return getattr(ops, self.quant_scheme.gemm_op)(x, self.qweight, bias, out_dtype)
        if out_dtype == torch.float32:
            return ops.gemm_float32(x, self.weight)
        return ops.gemm(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemm(x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias, tp_dim=None)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice (no communication)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 output_shard: tuple[int, int] | None = None, parts: list[int] | None = None) -> None:
        state = get_parallel_state()
        start, size = output_shard or shard_range(output_size, state.tp_size, state.tp_rank)
        super().__init__(input_size, size, bias, tp_dim=0, shard_start=start, parts=parts)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one (e.g. gate and up); shard i of each rank is the
    rank's slice of projection i."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        state = get_parallel_state()
        self.shards = [shard_range(size, state.tp_size, state.tp_rank) for size in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, output_shard=(0, sum(s for _, s in self.shards)),
                         parts=[size for _, size in self.shards])

    def forward_gated(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a [gate; up] pair, in one operation that a backend may run as one kernel."""
        assert len(self.shards) == 2 and self.shards[0][1] == self.shards[1][1], self.shards
        if self.qweight is not None:
            return ops.silu_and_mul(self._gemm(x, self.bias))
        return ops.gated_gemm(x, self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        start, size = self.shards[shard_id]
        offset = sum(s for _, s in self.shards[:shard_id])
        self._load_part(param, loaded, shard_id, offset, size, start, f"{type(self).__name__}[{shard_id}]")


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one weight, split by heads in whole GQA groups. With fewer KV heads than
    ranks, each KV head is replicated on tp_size / num_kv_heads ranks."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False) -> None:
        state = get_parallel_state()
        tp_size, tp_rank = state.tp_size, state.tp_rank
        if total_num_heads % total_num_kv_heads:
            raise ValueError(f"{total_num_heads} attention heads do not form groups over "
                             f"{total_num_kv_heads} KV heads")
        group = total_num_heads // total_num_kv_heads
        self.head_size = head_size
        if total_num_kv_heads >= tp_size:
            self.kv_head_start, self.num_kv_heads = shard_range(total_num_kv_heads, tp_size, tp_rank)
            self.q_head_start, self.num_heads = self.kv_head_start * group, self.num_kv_heads * group
        else:
            if tp_size % total_num_kv_heads or total_num_heads % tp_size:
                raise ValueError(f"tensor_parallel_size {tp_size} cannot share {total_num_kv_heads} KV heads "
                                 f"and {total_num_heads} heads evenly")
            self.num_kv_heads, self.kv_head_start = 1, tp_rank // (tp_size // total_num_kv_heads)
            self.num_heads = total_num_heads // tp_size
            self.q_head_start = tp_rank * self.num_heads
        local = (self.num_heads + 2 * self.num_kv_heads) * head_size
        kv_size = self.num_kv_heads * head_size
        super().__init__(hidden_size, local, bias, output_shard=(0, local),
                         parts=[self.num_heads * head_size, kv_size, kv_size])

    @property
    def q_shard(self) -> tuple[int, int]:
        """(start, size) of this rank's query features in the full model: the output projection's input."""
        return self.q_head_start * self.head_size, self.num_heads * self.head_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        if shard_id == "q":
            offset, size, start = 0, q_size, self.q_head_start * self.head_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, start = kv_size, self.kv_head_start * self.head_size
        part = "qkv".index(shard_id)
        self._load_part(param, loaded, part, offset, size, start, f"{type(self).__name__}[{shard_id}]")


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products are summed with an all-reduce. The bias is
    added once, after the reduction.

    With more than one rank and float32 reduction (tp_reduce_dtype "float32", or "auto" on GPUs) each
    rank's partial product stays in float32, the all-reduce sums float32 and the result is returned in
    float32, unrounded: its consumer, the fused residual-add + RMSNorm, rounds it to the activations' dtype
    once, as one device's GEMM rounds its full sum. Summing rounded half-precision partials instead adds a
    rounding per rank and per layer, which flips near-tied greedy choices. The cost: twice the all-reduce
    bytes."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True,
                 input_shard: tuple[int, int] | None = None) -> None:
        state = get_parallel_state()
        start, size = input_shard or shard_range(input_size, state.tp_size, state.tp_rank)
        super().__init__(size, output_size, bias, tp_dim=1, shard_start=start)
        self.reduce_results = reduce_results
        self.sum_in_fp32 = reduce_results and state.reduce_in_fp32  # fixed for the process, like tp_size
        # Set by a layer whose consumer is an RMSNorm with a residual: the output is a PartialSum, reduced by
        # the norm together with its add (tensor_parallel_all_reduce_add_norm).
        self.reduce_in_norm = False

    def forward(self, x: torch.Tensor):
        if self.tp_size == 1:
            return self._gemm(x, self.bias)
        if self.reduce_in_norm and self.reduce_results and self.bias is None:
            return PartialSum(self._gemm(x, None, torch.float32 if self.sum_in_fp32 else None))
        if self.sum_in_fp32:
            y = tensor_parallel_all_reduce(self._gemm(x, None, torch.float32))
        else:
            y = self._gemm(x, None)
            if self.reduce_results:
                y = tensor_parallel_all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
