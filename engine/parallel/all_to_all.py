"""Expert-parallel token exchange: each rank sends every (token, expert) pair to the rank that holds the
expert, the experts run there, and the results come back to the token's rank to be summed.

`ExpertAllToAll` is the interface a MoE layer calls; `TorchAllToAll` implements it with
`torch.distributed.all_to_all_single` over the EP group (NCCL on GPUs, gloo on CPU). MORI's dispatch and
combine (ROCm; ../shared/reference/aiter_api.md) plug in here as another implementation chosen by
`make_all_to_all`: its dispatch takes the same (hidden states, top-k weights, top-k ids) and returns the
tokens each local expert must process, and its combine sums the weighted expert outputs back into each
token's row, which is exactly the `dispatch`/`combine` pair below.

Split sizes are data-dependent (they travel first, and reach the host), so a step with expert parallelism
is not CUDA-graph capturable; the runner runs such models eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dispatched:
    """What one rank received: rows of hidden states, each with the local index of the expert it is for and
    its routing weight; `handle` is what `combine` needs to send the results back."""
    hidden: torch.Tensor        # [R, H]
    local_ids: torch.Tensor     # [R] int32, index into this rank's experts
    weights: torch.Tensor       # [R] float32
    handle: tuple


class ExpertAllToAll:
    def dispatch(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> Dispatched:
        raise NotImplementedError

    def combine(self, expert_out: torch.Tensor, handle: tuple) -> torch.Tensor:
        raise NotImplementedError


class TorchAllToAll(ExpertAllToAll):
    """`owner[e]` is the EP rank holding global expert e, `local_index[e]` its index there."""

    def __init__(self, group, owner: torch.Tensor, local_index: torch.Tensor, host_collectives: bool) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.owner, self.local_index = owner, local_index
        self.host_collectives = host_collectives  # gloo: tensors travel through host memory

    def _exchange(self, tensor: torch.Tensor, recv_rows: int, recv_splits: list[int], send_splits: list[int]):
        device = tensor.device
        if self.host_collectives:
            tensor = tensor.cpu()
        out = torch.empty((recv_rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        dist.all_to_all_single(out, tensor.contiguous(), recv_splits, send_splits, group=self.group)
        return out.to(device)

    def dispatch(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> Dispatched:
        num_tokens, top_k = ids.shape
        flat_ids = ids.reshape(-1).long()
        destination = self.owner[flat_ids]
        order = torch.argsort(destination, stable=True)
        token_of_pair = torch.arange(num_tokens, device=hidden.device).repeat_interleave(top_k)[order]
        send_counts = torch.zeros(self.world, dtype=torch.int64, device=hidden.device)
        send_counts.scatter_add_(0, destination, torch.ones_like(destination))
        if self.host_collectives:
            send_counts = send_counts.cpu()
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()  # to the host: a sync on GPUs
        recv_rows = sum(recv_splits)
        rows = self._exchange(hidden[token_of_pair], recv_rows, recv_splits, send_splits)
        # Weight and local expert index travel together as float32 (indices are exact below 2**24).
        meta = torch.stack((weights.reshape(-1).float()[order], self.local_index[flat_ids[order]].float()), dim=1)
        meta = self._exchange(meta, recv_rows, recv_splits, send_splits)
        return Dispatched(rows, meta[:, 1].to(torch.int32), meta[:, 0],
                          (token_of_pair, num_tokens, send_splits, recv_splits))

    def combine(self, expert_out: torch.Tensor, handle: tuple) -> torch.Tensor:
        token_of_pair, num_tokens, send_splits, recv_splits = handle
        back = self._exchange(expert_out, sum(send_splits), send_splits, recv_splits)
        out = torch.zeros(num_tokens, expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
        out.index_add_(0, token_of_pair, back.float())
        return out.to(expert_out.dtype)


def make_all_to_all(group, owner: torch.Tensor, local_index: torch.Tensor, host_collectives: bool,
                    backend: str = "torch") -> ExpertAllToAll:
    """The EP exchange for a MoE layer. On ROCm with MORI installed, the `aiter` kernel backend passes
    backend='mori' (its adapter lives with that backend); everything else uses torch.distributed."""
    if backend != "torch":
        raise ValueError(f"expert all-to-all backend {backend!r} is not available here (only 'torch')")
    return TorchAllToAll(group, owner, local_index, host_collectives)
