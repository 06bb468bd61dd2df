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


_state = ParallelState()


def get_parallel_state() -> ParallelState:
    return _state


def init_parallel(tp_rank: int, tp_size: int, init_method: str, device: torch.device,
                  timeout_s: float = 600.0, reduce_in_fp32: bool = True) -> ParallelState:
    """Join a tensor-parallel group of `tp_size` processes rendezvousing at `init_method`
    (e.g. tcp://127.0.0.1:29500). `reduce_in_fp32`: see RowParallelLinear."""
    global _state
    if tp_size == 1:
        _state = ParallelState()
        return _state
    import datetime
    import os
    from urllib.parse import urlparse
    if urlparse(init_method).hostname in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo would otherwise pick the outward interface
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, init_method=init_method, rank=tp_rank, world_size=tp_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    ranks = list(range(tp_size))
    cpu_group = dist.new_group(ranks, backend="gloo") if backend != "gloo" else dist.group.WORLD
    if backend == "nccl":
        devices: list = [None] * tp_size
        dist.all_gather_object(devices, device_identity(device), group=cpu_group)
        ranks_on_device, host_collectives = device_layout(devices, tp_rank)
        if host_collectives:  # every rank takes this path, so the collectives match
            logger.warning(
                "TP ranks share a GPU (%s): all-reduces go through gloo in host memory and CUDA graphs are "
                "off; use this to check numerics, not speed", devices)
            _state = ParallelState(tp_rank, tp_size, cpu_group, cpu_group, None, reduce_in_fp32, ranks_on_device,
                                   host_collectives=True)
            return _state
    small_all_reduce = SymmetricAllReduce.create(dist.group.WORLD, device) if backend == "nccl" else None
    _state = ParallelState(tp_rank, tp_size, dist.group.WORLD, cpu_group, small_all_reduce, reduce_in_fp32)
    return _state


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


def destroy_parallel() -> None:
    global _state
    if dist.is_initialized():
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


def tensor_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _state.tp_size == 1:
        return x
    # gloo (CPU, or ranks sharing a GPU) gathers host tensors only
    local = x.contiguous().cpu() if _state.host_collectives else x.contiguous()
    parts = [torch.empty_like(local) for _ in range(_state.tp_size)]
    dist.all_gather(parts, local, group=_state.device_group)
    return torch.cat(parts, dim=dim).to(x.device)
