"""Tensor-parallel state of this process: its rank, the group's size, the device group (NCCL/RCCL on
GPUs, gloo on CPU), a gloo group for control messages, and on CUDA the one-shot all-reduce for small
tensors (engine/parallel/symmetric_all_reduce.py).

Ranks that share one GPU (atom_ray.start(..., gpus_per_rank=0.5)) cannot use NCCL, which refuses two
ranks on one device: their tensors are reduced by gloo through host memory, and CUDA graphs are off (gloo's
collectives cannot be captured). That is for checking TP numerics on a one-GPU machine, not for speed: the
sums are the same (a two-rank sum rounds once whichever library adds it), the time is not."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.parallel.symmetric_all_reduce import SymmetricAllReduce

logger = logging.getLogger(__name__)


@dataclass
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    device_group: object | None = None
    cpu_group: object | None = None
    small_all_reduce: object | None = None  # SymmetricAllReduce where the GPUs can map each other's memory
    reduce_in_fp32: bool = True  # row-parallel partial sums travel and add up in float32
    ranks_on_device: int = 1  # ranks of the group on this rank's GPU (they split its memory)
    # Some ranks of the group share a GPU, so the whole group's collectives go through gloo in host memory
    # (the same on every rank, or their collectives would not match), and no rank captures CUDA graphs.
    host_collectives: bool = False
    # Data parallelism with expert-parallel MoE: dp_size engine instances of tp_size ranks each, whose MoE
    # layers form one EP group of dp_size * tp_size ranks (vLLM's EP = DP x TP). Without expert parallelism
    # DP ranks share no group at all (each is an independent engine), and these keep their defaults.
    dp_rank: int = 0
    dp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: object | None = None  # the device group of all EP ranks (None: no expert parallelism)
    dp_leaders_group: object | None = None  # gloo group of every DP rank's TP rank 0 (the lockstep vote)
    max_num_batched_tokens: int = 0  # the most tokens of a step (MORI sizes its buffers by it; 0: unknown)
    expert_exchange: str = "auto"  # the EP exchange's form (engine.parallel.all_to_all.make_all_to_all)
    ep_small_all_reduce: object | None = None  # SymmetricAllReduce over the EP group (decode-sized exchanges)
    # AllReduceAddNorm (engine/parallel/fused_all_reduce_norm.py): a row-parallel sum, the residual add and
    # RMSNorm after it in one kernel, where `enable_fused_all_reduce_norm` could set it up.
    all_reduce_add_norm: object | None = None

    @property
    def expert_parallel(self) -> bool:
        return self.ep_group is not None


_state = ParallelState()


def get_parallel_state() -> ParallelState:
    return _state


def init_parallel(tp_rank: int, tp_size: int, init_method: str, device: torch.device,
                  timeout_s: float = 600.0, reduce_in_fp32: bool = True, dp_rank: int = 0, dp_size: int = 1,
                  expert_parallel: bool = False, max_num_batched_tokens: int = 0,
                  expert_exchange: str = "auto") -> ParallelState:
    """Join the groups of this rank rendezvousing at `init_method` (e.g. tcp://127.0.0.1:29500): the
    tensor-parallel group of `tp_size` ranks and, with `expert_parallel`, the EP group of all
    dp_size x tp_size ranks (this rank is number dp_rank * tp_size + tp_rank of it). `reduce_in_fp32`: see
    RowParallelLinear."""
    global _state
    world_size = dp_size * tp_size if expert_parallel else tp_size
    if world_size == 1:
        _state = ParallelState(dp_rank=dp_rank, dp_size=dp_size, expert_exchange=expert_exchange)
        return _state
    import datetime
    import os
    from urllib.parse import urlparse
    if urlparse(init_method).hostname in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo would otherwise pick the outward interface
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        nccl_environment(os.environ)
    rank = dp_rank * tp_size + tp_rank if expert_parallel else tp_rank
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    everyone = list(range(world_size))
    world_cpu_group = dist.new_group(everyone, backend="gloo") if backend != "gloo" else dist.group.WORLD
    if world_size == tp_size:
        tp_group, tp_cpu_group = dist.group.WORLD, world_cpu_group
    else:  # one TP group per DP rank; every rank creates every group, in the same order
        tp_group = tp_cpu_group = None
        for dp in range(dp_size):
            members = list(range(dp * tp_size, (dp + 1) * tp_size))
            device_group = dist.new_group(members, backend=backend)
            cpu_group = dist.new_group(members, backend="gloo") if backend != "gloo" else device_group
            if dp == dp_rank:
                tp_group, tp_cpu_group = device_group, cpu_group
    leaders = dist.new_group([dp * tp_size for dp in range(dp_size)], backend="gloo") if expert_parallel else None
    extra = dict(dp_rank=dp_rank, dp_size=dp_size, ep_rank=rank if expert_parallel else 0,
                 ep_size=world_size if expert_parallel else 1, dp_leaders_group=leaders,
                 max_num_batched_tokens=max_num_batched_tokens, expert_exchange=expert_exchange)
    if backend == "nccl":
        devices: list = [None] * world_size
        dist.all_gather_object(devices, device_identity(device), group=world_cpu_group)
        ranks_on_device, host_collectives = device_layout(devices, rank)
        if host_collectives:  # every rank takes this path, so the collectives match
            logger.warning(
                "ranks share a GPU (%s): collectives go through gloo in host memory and CUDA graphs are "
                "off; use this to check numerics, not speed", devices)
            _state = ParallelState(tp_rank, tp_size, tp_cpu_group, tp_cpu_group, None, reduce_in_fp32,
                                   ranks_on_device, host_collectives=True,
                                   ep_group=world_cpu_group if expert_parallel else None, **extra)
            return _state
    small_all_reduce = ep_small_all_reduce = None
    if backend == "nccl" and (tp_size > 1 and world_size == tp_size or expert_parallel):
        # Symmetric memory over the whole world: the TP group's where it is the world, the EP group's.
        ep_small_all_reduce = SymmetricAllReduce.create(dist.group.WORLD, device)
        small_all_reduce = ep_small_all_reduce if world_size == tp_size else None
    _state = ParallelState(tp_rank, tp_size, tp_group, tp_cpu_group, small_all_reduce, reduce_in_fp32,
                           ep_group=dist.group.WORLD if expert_parallel else None,
                           ep_small_all_reduce=ep_small_all_reduce if expert_parallel else None, **extra)
    return _state


def nccl_environment(environ) -> None:
    """NCCL settings for this process, set before its first communicator (NCCL reads them then); a value the
    user set wins.

    NCCL_GRAPH_MIXING_SUPPORT=0: NCCL's support for graph-captured and eager collectives of one communicator
    in flight together on unordered streams made every launch of a CUDA graph that holds collectives wait on
    the host for the previous one (2x H200, Qwen3-30B-A3B at TP=2 + EP: decode steps of 27.5 ms whose host
    launch took as long, 15.4 ms without it; docs/BENCHMARKS.md). A rank's collectives here, graph replays and
    eager calls alike, are all ordered after the work before them on its current stream (c10d's NCCL stream
    waits for it, and it for them), which is what running without that support asks."""
    environ.setdefault("NCCL_GRAPH_MIXING_SUPPORT", "0")


def device_layout(devices: list[str], rank: int) -> tuple[int, bool]:
    """For the group's GPUs by rank: how many ranks share `rank`'s GPU, and whether the group's collectives
    must go through host memory (some ranks, not necessarily this one, share a GPU)."""
    return devices.count(devices[rank]), len(set(devices)) < len(devices)


def device_identity(device: torch.device) -> str:
    """The physical GPU behind `device`, the same string in every process that sees it (whatever
    CUDA_VISIBLE_DEVICES numbers it): its UUID where torch reports one, else its PCI bus id."""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid:
        return str(uuid)
    return f"{props.pci_domain_id}:{props.pci_bus_id}:{props.pci_device_id}"


def destroy_parallel(abort: bool = False) -> None:
    """Leave every group. `abort`: NCCL communicators are aborted rather than destroyed (a destroy waits
    for every rank's and was seen to hang at TP=2 with expert parallelism on two H200s); for processes that
    are about to end."""
    global _state
    if dist.is_initialized():
        if abort and dist.get_backend() == "nccl":
            from torch.distributed.distributed_c10d import _abort_process_group
            _abort_process_group()
        else:
            dist.destroy_process_group()
    _state = ParallelState()


def tensor_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the group: `x` itself, reduced in place, or a new tensor (use the result)."""
    if _state.tp_size == 1:
        return x
    if _state.small_all_reduce is not None and _state.small_all_reduce.fits(x):
        return _state.small_all_reduce(x)
    if _state.host_collectives:
        host = x.cpu()
        dist.all_reduce(host, group=_state.device_group)
        return host.to(x.device)
    dist.all_reduce(x, group=_state.device_group)
    return x


def enable_fused_all_reduce_norm(hidden_size: int, device: torch.device) -> None:
    """A collective call on every TP rank (once the model is built): set up the fused all-reduce + residual
    add + RMSNorm where the one-shot all-reduce runs (CUDA GPUs that map each other's memory, the TP group
    being the whole world)."""
    if _state.tp_size == 1 or _state.small_all_reduce is None or _state.all_reduce_add_norm is not None:
        return
    from engine.parallel.fused_all_reduce_norm import AllReduceAddNorm
    _state.all_reduce_add_norm = AllReduceAddNorm.create(_state.device_group, device, hidden_size)


class PartialSum:
    """A row-parallel layer's output left unreduced for its consumer, an RMSNorm, to reduce together with
    its residual add (`tensor_parallel_all_reduce_add_norm`)."""
    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def tensor_parallel_all_reduce_add_norm(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_add_rms_norm(sum over the TP group of partial, residual, weight, eps)`: one kernel where the
    fused all-reduce serves this size, else the all-reduce and then the norm kernel."""
    fused = _state.all_reduce_add_norm
    if fused is not None and fused.fits(partial):
        return fused(partial, residual, weight, eps)
    from engine.kernels import ops
    return ops.fused_add_rms_norm(tensor_parallel_all_reduce(partial), residual, weight, eps)


def dp_agree(values: list[int]) -> list[int]:
    """The element-wise largest of `values` over all DP ranks: the per-step agreement that every DP rank's TP
    rank 0 makes at the same point of its step loop when their MoE layers exchange tokens (engine/lockstep.py).
    One all-reduce of a few integers over the leaders' gloo group, on the host: it overlaps the device's
    work on the step launched before. Without lockstep DP, this rank's own values."""
    if _state.dp_leaders_group is None:
        return list(values)
    vote = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=_state.dp_leaders_group)
    return vote.tolist()


def tensor_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _state.tp_size == 1:
        return x
    # gloo (CPU, or ranks sharing a GPU) gathers host tensors only
    local = x.contiguous().cpu() if _state.host_collectives else x.contiguous()
    parts = [torch.empty_like(local) for _ in range(_state.tp_size)]
    dist.all_gather(parts, local, group=_state.device_group)
    return torch.cat(parts, dim=dim).to(x.device)
