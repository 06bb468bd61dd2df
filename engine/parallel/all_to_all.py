"""Expert-parallel token exchange: each rank sends every (token, expert) pair to the rank that holds the
expert, the experts run there, and the results come back to the token's rank to be summed.

`ExpertAllToAll` is the interface a MoE layer calls; `make_all_to_all` picks the implementation:
- `TorchAllToAll`: `torch.distributed.all_to_all_single` over the EP group (NCCL on GPUs, gloo on CPU), one
  row per (token, expert) pair. Split sizes are data-dependent (they travel first, and reach the host), so a
  step with expert parallelism is not CUDA-graph capturable; the runner runs such models eagerly.
- `MoriAllToAll` (engine/parallel/mori_all_to_all.py): AMD's MORI dispatch/combine kernels, one row per
  (token, destination rank) with the token's top-k ids, on the GPUs of one ROCm node; chosen with the
  `aiter` kernel backend where MORI is installed and the layer's layout fits it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine import kernels

logger = logging.getLogger(__name__)


@dataclass
class Dispatched:
    """What one rank received: rows of hidden states, each with the local indices of the experts it is for
    and their routing weights; `handle` is what `combine` needs to send the results back. A row carries one
    expert ([R], TorchAllToAll) or a token's k slots ([R, k], MoriAllToAll), where -1 (weight 0) marks a slot
    for another rank's expert or a row past what was received."""
    hidden: torch.Tensor        # [R, H]
    local_ids: torch.Tensor     # [R] or [R, k] int32, index into this rank's experts, -1 = none
    weights: torch.Tensor       # [R] or [R, k] float32
    handle: tuple


@dataclass(frozen=True)
class ExchangeLayout:
    """What an exchange may size its buffers by: the MoE layer's shape and the most tokens one rank sends in
    a step (0: unknown)."""
    num_experts: int
    hidden_size: int
    top_k: int
    max_tokens_per_rank: int
    dtype: torch.dtype          # of the hidden states sent


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
                    backend: str = "auto", layout: ExchangeLayout | None = None) -> ExpertAllToAll:
    """The EP exchange for a MoE layer. backend "auto" takes MORI when the `aiter` kernel backend is active,
    `import mori` works and `layout` fits MORI's kernels (engine/parallel/mori_all_to_all.py says what
    fits), "mori" takes it wherever it fits; otherwise, and for "torch", torch.distributed. Why MORI was not
    taken is logged once per reason."""
    if backend not in ("auto", "torch", "mori"):
        raise ValueError(f"expert all-to-all backend {backend!r} is unknown; use 'auto', 'torch' or 'mori'")
    if backend != "torch":
        if backend == "mori" or kernels.active_backend().name == "aiter":
            from engine.parallel import mori_all_to_all
            problem = mori_all_to_all.unsuitable(group, layout, host_collectives)
            if problem is None:
                return mori_all_to_all.MoriAllToAll(group, layout)
            _log_once(f"expert all-to-all: MORI not used, torch.distributed instead: {problem}")
    return TorchAllToAll(group, owner, local_index, host_collectives)


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)
