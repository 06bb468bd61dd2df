"""The expert-parallel exchange through MORI (AMD's EP dispatch/combine kernels, amd-mori on ROCm), over the
GPUs of one node (its IntraNode kernel). `mori` is imported only when an exchange is built.

MORI's semantics (amd-mori 1.2.4, `mori/ops/dispatch_combine.py` and the kernels it compiles,
`_jit-sources/src/ops/dispatch_combine/intranode.hpp`):
- dispatch sends each token once to every rank holding one of its top-k experts (a later slot for an
  already-served rank is skipped, an id < 0 is sent nowhere), with all k global ids and weights. The rows
  land in the receiver's buffers of `max_num_tokens_to_recv()` rows, in no particular order; a one-element
  device tensor says how many arrived. We mark slots for other ranks' experts, and rows past that count,
  as id -1 / weight 0 without reading the count on the host; so the expert op runs over all
  max_num_tokens_to_recv() rows and must skip -1 pairs cheaply.
- combine sends each received row back and sums, per token, the rows from the ranks it went to, unweighted
  (`WarpAccumLF(outPtr, srcPtrs, nullptr, ...)`: no scales; the weights passed to combine only travel
  alongside). Our expert op already multiplied each expert's output by its routing weight, so combine is
  called with weights=None and nothing is weighted twice.
- both are collective over the shmem world: every EP rank calls them for every MoE layer, in order.
- the output views MORI's own buffers, which the next dispatch/combine overwrites: combine returns a copy.

One MORI op serves every layer of the same shape (its symmetric buffers are sized by
max_num_inp_token_per_rank x ranks x hidden size; one per layer would not fit the shmem heap, whose size
MORI reads from MORI_SHMEM_HEAP_SIZE, 4 GiB (static heap) by default).
"""
from __future__ import annotations

import atexit
import socket

import torch
import torch.distributed as dist

from engine.parallel.all_to_all import Dispatched, ExchangeLayout, ExpertAllToAll, count_over_group

SHMEM_GROUP_NAME = "atom_ray_ep"
MAX_RANKS = 8  # the IntraNode kernel's MAX_GPUS_PER_NODE
TOKEN_DTYPES = (torch.bfloat16, torch.float32)  # the unquantized token types MORI has kernels for (no fp16)

_shmem_group = None
_ops: dict[tuple, object] = {}
_one_node: dict[int, bool] = {}


def unsuitable(group, layout: ExchangeLayout | None, host_collectives: bool) -> str | None:
    """Why MORI cannot serve this exchange, or None."""
    try:
        import mori.ops  # noqa: F401
        import mori.shmem  # noqa: F401
    except (ImportError, OSError) as error:  # OSError: its compiled part cannot load the ROCm libraries
        return f"`import mori` failed ({error})"
    if layout is None:
        return "the layer did not give its layout"
    ranks = dist.get_world_size(group)
    if layout.num_experts % ranks:
        return f"{layout.num_experts} experts do not divide evenly over {ranks} EP ranks"
    if ranks > MAX_RANKS:
        return f"MORI's IntraNode kernel spans at most {MAX_RANKS} GPUs, the EP group has {ranks}"
    if layout.max_tokens_per_rank <= 0:
        return "the most tokens a rank sends per step (max_num_batched_tokens) is unknown"
    if layout.dtype not in TOKEN_DTYPES:
        return f"MORI's kernels take {', '.join(map(str, TOKEN_DTYPES))}, the hidden states are {layout.dtype}"
    if host_collectives:
        return "the EP ranks do not each have a GPU of their own (collectives go through host memory)"
    if not _on_one_node(group):
        return "the EP ranks span several nodes (the IntraNode kernel needs GPUs of one node)"
    return None


def _on_one_node(group) -> bool:
    key = id(group)
    if key not in _one_node:
        hosts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        _one_node[key] = len(set(hosts)) == 1
    return _one_node[key]


def _init_shmem(group) -> None:
    """MORI's symmetric heap over the EP group, once per process (MORI-EP-GUIDE.md, section 5)."""
    global _shmem_group
    if _shmem_group is not None:
        assert _shmem_group is group, "MORI's shmem serves one EP group per process"
        return
    import mori.shmem
    torch._C._distributed_c10d._register_process_group(SHMEM_GROUP_NAME, group)
    mori.shmem.shmem_torch_process_group_init(SHMEM_GROUP_NAME)
    _shmem_group = group
    atexit.register(shutdown)


def shutdown() -> None:
    """Drop the MORI ops and finalize the heap (at exit; tests call it to start afresh)."""
    global _shmem_group
    if _shmem_group is None:
        return
    import mori.shmem
    _ops.clear()
    mori.shmem.shmem_finalize()
    torch._C._distributed_c10d._unregister_process_group(SHMEM_GROUP_NAME)
    _shmem_group = None
    _one_node.clear()


def _op(group, layout: ExchangeLayout):
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    key = (id(group), layout.hidden_size, layout.top_k, layout.num_experts, layout.max_tokens_per_rank,
           layout.dtype)
    if key not in _ops:
        _init_shmem(group)
        import mori.ops
        config = mori.ops.EpDispatchCombineConfig(
            data_type=layout.dtype, rank=rank, world_size=ranks, hidden_dim=layout.hidden_size,
            scale_dim=0, scale_type_size=torch.float32.itemsize, max_token_type_size=layout.dtype.itemsize,
            max_num_inp_token_per_rank=layout.max_tokens_per_rank,
            num_experts_per_rank=layout.num_experts // ranks, num_experts_per_token=layout.top_k,
            kernel_type=mori.ops.EpDispatchCombineKernelType.IntraNode, gpu_per_node=ranks)
        _ops[key] = mori.ops.EpDispatchCombineOp(config)
    return _ops[key]


class MoriAllToAll(ExpertAllToAll):
    """Rank r holds experts [r E/n, (r+1) E/n) (equal shares, as `unsuitable` requires)."""

    capturable = False  # its kernels keep device-side counts of their own (and were never run in a graph)

    def __init__(self, group, layout: ExchangeLayout) -> None:
        self.group = group
        self.op = _op(group, layout)
        self.num_local_experts = layout.num_experts // dist.get_world_size(group)
        self.expert_start = dist.get_rank(group) * self.num_local_experts
        self.max_tokens_per_rank = layout.max_tokens_per_rank

    def dispatch(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 counts: torch.Tensor | None = None) -> Dispatched:
        if counts is not None:
            count_over_group(counts, ids, self._all_reduce)
        num_tokens = hidden.shape[0]
        assert num_tokens <= self.max_tokens_per_rank, (
            f"{num_tokens} tokens exceed MORI's buffers of {self.max_tokens_per_rank} per rank")
        ids = ids.to(torch.int32).contiguous()
        rows, recv_weights, _, recv_ids, recv_count = self.op.dispatch(
            input=hidden.contiguous(), weights=weights.float().contiguous(), scales=None, indices=ids)
        local = recv_ids - self.expert_start
        received = torch.arange(rows.shape[0], device=rows.device)[:, None] < recv_count
        mine = received & (local >= 0) & (local < self.num_local_experts)
        return Dispatched(rows, torch.where(mine, local, -1), torch.where(mine, recv_weights, 0.0),
                          (ids, num_tokens, hidden.dtype))

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def combine(self, expert_out: torch.Tensor, handle: tuple) -> torch.Tensor:
        ids, num_tokens, dtype = handle
        out, _ = self.op.combine(input=expert_out.contiguous(), weights=None, indices=ids, call_reset=True)
        return out[:num_tokens].to(dtype, copy=True)
