"""Placement: one placement group per engine instance, one bundle per rank, packed per node."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass


# Ray narrows each GPU actor's view to its own device unless told not to. Ranks of one TP group, and the ranks
# of an expert-parallel group, keep the node's GPUs visible so that they can map each other's memory (the
# one-shot all-reduces of engine/parallel/symmetric_all_reduce.py and of the EP exchange); each rank then
# selects its assigned GPU itself.
KEEP_DEVICES_VISIBLE = {f"RAY_EXPERIMENTAL_NOSET_{name}": "1"
                        for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")}


@dataclass
class PlacementOptions:
    use_gpu: bool
    cpus_per_rank: int
    accelerator_type: str | None = None
    timeout_s: float = 600.0
    share_devices: bool = False  # GPU ranks of a TP or EP group see every GPU of their node
    gpus_per_rank: float = 1.0  # below 1, ranks share GPUs (for checking TP numerics on fewer GPUs)

    @property
    def bundle(self) -> dict:
        bundle = {"CPU": self.cpus_per_rank}
        if self.use_gpu:
            bundle["GPU"] = self.gpus_per_rank
        if self.accelerator_type:
            # Ray's per-node label resource: asking a sliver of it pins the bundle to such GPUs.
            bundle[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return bundle


def describe_layout(tensor_parallel_size: int, data_parallel_size: int = 1) -> str:
    if data_parallel_size == 1:
        return f"tensor_parallel_size={tensor_parallel_size}"
    return (f"data_parallel_size={data_parallel_size} x tensor_parallel_size={tensor_parallel_size} = "
            f"{data_parallel_size * tensor_parallel_size} ranks")


def placement_options(device: str, tensor_parallel_size: int, cpus_per_rank: int | None,
                      accelerator_type: str | None, timeout_s: float, gpus_per_rank: float = 1.0,
                      data_parallel_size: int = 1, expert_parallel: bool = False) -> PlacementOptions:
    """GPU ranks when the engine asks for CUDA, or for 'auto' when the cluster has enough GPUs.
    `gpus_per_rank` below 1 packs several ranks on one GPU (0.5: two); such ranks reduce through host
    memory (engine/parallel/state.py), so it is for checking TP numerics, not for speed. A layout that the
    cluster cannot hold at all is refused at once, naming the fields."""
    import ray
    num_ranks = tensor_parallel_size * data_parallel_size
    layout = describe_layout(tensor_parallel_size, data_parallel_size)
    resources = ray.cluster_resources()
    gpus = resources.get("GPU", 0)
    needed = num_ranks * gpus_per_rank
    use_gpu = device == "cuda" or (device == "auto" and gpus >= needed)
    if device == "cuda" and gpus < needed:
        raise RuntimeError(f"{layout} with gpus_per_rank={gpus_per_rank:g} needs {needed:g} GPUs; the Ray cluster "
                           f"has {gpus:g}")
    if cpus_per_rank is None:
        cpus_per_rank = 1 if use_gpu else max(1, (os.cpu_count() or 1) // num_ranks)
    cpus = resources.get("CPU", 0)
    if num_ranks * cpus_per_rank > cpus:
        raise RuntimeError(f"{layout} with cpus_per_rank={cpus_per_rank} needs {num_ranks * cpus_per_rank} CPUs; "
                           f"the Ray cluster has {cpus:g}. Lower data_parallel_size or tensor_parallel_size, or "
                           "add nodes.")
    return PlacementOptions(use_gpu, cpus_per_rank, accelerator_type, timeout_s,
                            share_devices=use_gpu and (tensor_parallel_size > 1 or expert_parallel and num_ranks > 1),
                            gpus_per_rank=gpus_per_rank)


def check_gpus_per_rank(gpus_per_rank) -> float:
    if isinstance(gpus_per_rank, bool) or not isinstance(gpus_per_rank, (int, float)) or not 0 < gpus_per_rank <= 1:
        raise ValueError(f"gpus_per_rank must be a number in (0, 1] (0.5 puts two ranks on a GPU), got {gpus_per_rank!r}")
    return float(gpus_per_rank)


def create_placement_group(num_ranks: int, options: PlacementOptions):
    import ray
    from ray.util.placement_group import placement_group
    bundle = options.bundle
    group = placement_group([dict(bundle) for _ in range(num_ranks)], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=options.timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        raise RuntimeError(
            f"could not reserve {num_ranks} x {bundle} within {options.timeout_s:.0f}s; the cluster has "
            f"{ray.available_resources()} available. Lower tensor_parallel_size or cpus_per_rank, or add nodes.")
    return group


def rank_options(group, rank: int, options: PlacementOptions) -> dict:
    """Actor options pinning a rank to its bundle. A single GPU rank sees only its own GPU (Ray sets
    CUDA_VISIBLE_DEVICES, or HIP_VISIBLE_DEVICES on ROCm); ranks of a TP group on GPUs see the whole node
    (`share_devices`) and pick theirs with `assigned_device_index`. On CPU Ray sets OMP_NUM_THREADS to
    the bundle's cores, which sizes torch's thread pool."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    options_ = {
        "num_cpus": options.cpus_per_rank,
        "num_gpus": options.gpus_per_rank if options.use_gpu else 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=rank,
            placement_group_capture_child_tasks=False),
    }
    if options.share_devices:
        options_["runtime_env"] = {"env_vars": dict(KEEP_DEVICES_VISIBLE)}
    return options_


def assigned_device_index() -> int | None:
    """Inside a GPU actor: its assigned GPU as an index among the devices this process sees (0 when Ray
    narrowed the view to that GPU); None for an actor without a GPU."""
    import ray
    ids = ray.get_runtime_context().get_accelerator_ids().get("GPU") or []
    if not ids:
        return None
    assert len(ids) == 1, f"a rank owns exactly one GPU, got {ids}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or os.environ.get("HIP_VISIBLE_DEVICES")
    return visible.split(",").index(ids[0]) if visible else int(ids[0])


def select_assigned_device() -> None:
    """Make this actor's GPU the current device (of the calling thread), before anything touches CUDA: the
    engine runs on the current device."""
    index = assigned_device_index()
    if index is not None:
        import torch
        torch.cuda.set_device(index)


def rendezvous_address() -> str:
    """tcp://<this node's IP>:<a free port>, for a TP group's torch.distributed rendezvous at rank 0."""
    import ray
    host = ray.util.get_node_ip_address()
    with socket.socket() as sock:
        sock.bind((host, 0))
        port = sock.getsockname()[1]
    return f"tcp://{host}:{port}"
