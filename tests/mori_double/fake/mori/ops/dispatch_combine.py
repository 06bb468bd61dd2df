"""MORI's EP dispatch/combine op, emulated with torch.distributed collectives over the shmem world. What it
keeps of the real IntraNode kernels (amd-mori 1.2.4, _jit-sources/src/ops/dispatch_combine/intranode.hpp):
- dispatch sends a token once to each rank holding one of its experts (its first slot for that rank; ids
  < 0 go nowhere) with all k ids and weights. Rows land in buffers of max_num_tokens_to_recv() rows in an
  order of the double's choosing (rotated, so that no caller can rely on arrival order), with a [1] int32
  count; rows past it keep stale contents (at first NaN hidden states and this rank's first expert);
- combine sums, unweighted and in float32, the rows a token's ranks send back into a buffer of
  max_num_inp_token_per_rank rows that the next combine overwrites; the weights only travel along.
"""
import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mori.shmem import api as _shmem

TOPK_IDX_DTYPE = torch.int32
_TOKEN_DTYPES = (torch.float32, torch.bfloat16)  # the real kernels' _DTYPE_SUFFIX less FP8/FP4: no float16
_MAX_GPUS_PER_NODE = 8


class EpDispatchCombineKernelType(enum.Enum):
    IntraNode = 0
    InterNode = 1
    InterNodeV1 = 2
    InterNodeV1LL = 3
    AsyncLL = 4
    IntraNodeLL = 5


@dataclass
class EpDispatchCombineConfig:
    data_type: torch.dtype
    rank: int
    world_size: int
    hidden_dim: int
    scale_dim: int
    scale_type_size: int
    max_token_type_size: int
    max_num_inp_token_per_rank: int
    num_experts_per_rank: int
    num_experts_per_token: int
    warp_num_per_block: int = 8
    block_num: int = 80
    max_total_recv_tokens: int = 0
    use_external_inp_buf: bool = True
    kernel_type: EpDispatchCombineKernelType = EpDispatchCombineKernelType.IntraNode
    gpu_per_node: int = 8
    rdma_block_num: int = 0
    num_qp_per_pe: int = 1
    quant_type: str = "none"


def _exchange(tensor: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    out = torch.empty((sum(recv_splits), *tensor.shape[1:]), dtype=tensor.dtype)
    dist.all_to_all_single(out, tensor.contiguous(), recv_splits, send_splits, group=group)
    return out


class EpDispatchCombineOp:
    def __init__(self, config):
        group = _shmem._world()
        if config.kernel_type != EpDispatchCombineKernelType.IntraNode:
            raise NotImplementedError(f"the mori double emulates the IntraNode kernel, not {config.kernel_type}")
        if (config.rank, config.world_size) != (dist.get_rank(group), dist.get_world_size(group)):
            raise ValueError(f"config rank {config.rank} of {config.world_size} is not this shmem PE's "
                             f"({dist.get_rank(group)} of {dist.get_world_size(group)})")
        if config.world_size > _MAX_GPUS_PER_NODE:
            raise ValueError(f"IntraNode spans at most {_MAX_GPUS_PER_NODE} PEs")
        self.config = config
        self._group = group
        self._buffers: dict = {}
        self._total_recv = torch.zeros(1, dtype=TOPK_IDX_DTYPE)
        self._cur_tokens = 0
        dist.barrier(group=group)

    def max_num_tokens_to_recv(self):
        config = self.config
        per_rank = config.max_num_inp_token_per_rank
        if config.max_total_recv_tokens > 0:
            per_rank = min(-(-config.max_total_recv_tokens // config.world_size), per_rank)
        return config.world_size * per_rank

    def _buffer(self, name: str, shape: tuple, dtype: torch.dtype, fill) -> torch.Tensor:
        key = (name, dtype)
        if key not in self._buffers:
            self._buffers[key] = torch.full(shape, fill, dtype=dtype)
        return self._buffers[key]

    def _check_tokens(self, tensor: torch.Tensor) -> None:
        config = self.config
        if tensor.dtype not in _TOKEN_DTYPES:
            raise KeyError(tensor.dtype)  # the real op's _DTYPE_SUFFIX lookup
        if tensor.element_size() > config.max_token_type_size:
            raise ValueError(f"{tensor.dtype} tokens overflow buffers of max_token_type_size="
                             f"{config.max_token_type_size}")
        if tensor.dim() != 2 or tensor.shape[1] != config.hidden_dim:
            raise ValueError(f"tokens of shape {tuple(tensor.shape)}, hidden_dim={config.hidden_dim}")

    def dispatch(self, input, weights, scales, indices, block_num=-1, rdma_block_num=-1, warp_per_block=-1,
                 call_local_expert_count=False, *, routing=None, return_routing=False):
        if routing is not None or return_routing:
            raise NotImplementedError("the mori double has no routing handles")
        config, group = self.config, self._group
        self._check_tokens(input)
        if indices.dtype != TOPK_IDX_DTYPE or tuple(indices.shape) != (input.shape[0], config.num_experts_per_token):
            raise ValueError(f"indices must be [tokens, {config.num_experts_per_token}] int32, "
                             f"got {tuple(indices.shape)} {indices.dtype}")
        num_tokens, top_k = indices.shape
        if num_tokens > config.max_num_inp_token_per_rank:
            raise ValueError(f"{num_tokens} tokens, max_num_inp_token_per_rank={config.max_num_inp_token_per_rank}")
        ids = indices.long()
        valid = (ids >= 0) & (ids < config.world_size * config.num_experts_per_rank)
        pe = torch.where(valid, ids // config.num_experts_per_rank, -1)
        earlier = torch.ones(top_k, top_k, dtype=torch.bool).tril(-1)  # [slot, earlier slot]
        served = ((pe[:, :, None] == pe[:, None, :]) & valid[:, None, :] & earlier).any(-1)
        token, slot = (valid & ~served).nonzero(as_tuple=True)
        order = torch.argsort(pe[token, slot], stable=True)
        token, destination = token[order], pe[token, slot][order]
        send = torch.bincount(destination, minlength=config.world_size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        num_recv = sum(recv_splits)
        if num_recv > self.max_num_tokens_to_recv():
            raise RuntimeError(f"{num_recv} tokens arrived, max_num_tokens_to_recv()={self.max_num_tokens_to_recv()}")
        route_weights = weights.float() if weights is not None else torch.zeros(num_tokens, top_k)
        rows = _exchange(input[token].float(), send_splits, recv_splits, group)
        recv_weights = _exchange(route_weights[token], send_splits, recv_splits, group)
        recv_ids = _exchange(indices[token], send_splits, recv_splits, group)
        slots = (torch.arange(num_recv) + num_recv // 2) % max(num_recv, 1)

        capacity = self.max_num_tokens_to_recv()
        out = self._buffer("dispatch_out", (capacity, config.hidden_dim), input.dtype, float("nan"))
        out_weights = self._buffer("dispatch_weights", (capacity, top_k), torch.float32, 1.0)
        first_expert = config.rank * config.num_experts_per_rank
        out_indices = self._buffer("dispatch_indices", (capacity, top_k), TOPK_IDX_DTYPE, first_expert)
        out[slots] = rows.to(input.dtype)
        if weights is not None:
            out_weights[slots] = recv_weights
        out_indices[slots] = recv_ids
        self._total_recv[0] = num_recv
        self._cur_tokens = num_tokens
        self._route = (token, slots, send_splits, recv_splits)
        return out, out_weights, None, out_indices, self._total_recv

    def combine(self, input, weights, indices, block_num=-1, rdma_block_num=-1, warp_per_block=-1,
                use_external_inp_buf=-1, call_reset=False, *, routing=None):
        if routing is not None:
            raise NotImplementedError("the mori double has no routing handles")
        config, group = self.config, self._group
        self._check_tokens(input)
        if int(indices.size(0)) != self._cur_tokens:
            raise ValueError(f"combine() indices has {int(indices.size(0))} rows but this rank dispatched "
                             f"{self._cur_tokens} tokens. Pass this rank's own [num_tokens, topk] routing")
        token, slots, send_splits, recv_splits = self._route
        if input.shape[0] < slots.numel():
            raise ValueError(f"combine input has {input.shape[0]} rows, {slots.numel()} tokens were received")
        back = _exchange(input[slots].float(), recv_splits, send_splits, group)
        summed = torch.zeros(self._cur_tokens, config.hidden_dim).index_add_(0, token, back)
        out = self._buffer("combine_out", (config.max_num_inp_token_per_rank, config.hidden_dim), input.dtype,
                           float("nan"))
        out[:self._cur_tokens] = summed.to(input.dtype)
        out_weights = None
        if weights is not None and weights.size(0) != 0:
            back = _exchange(weights[slots].float(), recv_splits, send_splits, group)
            summed = torch.zeros(self._cur_tokens, config.num_experts_per_token).index_add_(0, token, back)
            out_weights = self._buffer("combine_weights", (config.max_num_inp_token_per_rank,
                                                           config.num_experts_per_token), weights.dtype, 0.0)
            out_weights[:self._cur_tokens] = summed.to(weights.dtype)
        return out, out_weights

    def reset(self):
        pass  # the real LaunchReset is empty (dispatch_combine.cpp)
