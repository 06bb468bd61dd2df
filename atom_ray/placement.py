"""Placement: one placement group per engine instance, one bundle per rank, packed per node."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class PlacementOptions:
    use_gpu: bool
    cpus_per_rank: int
    accelerator_type: str | None = None
    timeout_s: float = 600.0

    @property
    def bundle(self) -> dict:
        bundle = {"CPU": self.cpus_per_rank}
        if self.use_gpu:
            bundle["GPU"] = 1
        if self.accelerator_type:
            # Ray's per-node label resource: asking a sliver of it pins the bundle to such GPUs.
            bundle[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return bundle


def placement_options(device: str, tensor_parallel_size: int, cpus_per_rank: int | None,
                      accelerator_type: str | None, timeout_s: float) -> PlacementOptions:
    """GPU ranks when the engine asks for CUDA, or for 'auto' when the cluster has enough GPUs."""
    import ray
    gpus = ray.cluster_resources().get("GPU", 0)
    use_gpu = device == "cuda" or (device == "auto" and gpus >= tensor_parallel_size)
    if device == "cuda" and gpus < tensor_parallel_size:
        raise RuntimeError(f"tensor_parallel_size={tensor_parallel_size} needs {tensor_parallel_size} GPUs; "
                           f"the Ray cluster has {gpus:g}")
    if cpus_per_rank is None:
        cpus_per_rank = 1 if use_gpu else max(1, (os.cpu_count() or 1) // tensor_parallel_size)
    return PlacementOptions(use_gpu, cpus_per_rank, accelerator_type, timeout_s)


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
    """Actor options pinning a rank to its bundle. Ray sets CUDA_VISIBLE_DEVICES (HIP_VISIBLE_DEVICES on
    ROCm) to the bundle's GPU, so every rank sees its own GPU as device 0; on CPU it sets OMP_NUM_THREADS
    to the bundle's cores, which sizes torch's thread pool."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    return {
        "num_cpus": options.cpus_per_rank,
        "num_gpus": 1 if options.use_gpu else 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=rank,
            placement_group_capture_child_tasks=False),
    }
