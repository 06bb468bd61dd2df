"""Placement: which GPUs a rank actor sees and which one it computes on."""
from __future__ import annotations

import types

import pytest
import torch

from atom_ray import placement
from atom_ray.placement import KEEP_DEVICES_VISIBLE, PlacementOptions, assigned_device_index, rank_options
from engine.parallel.symmetric_all_reduce import SymmetricAllReduce


@pytest.fixture
def assigned_gpu(monkeypatch):
    """Pretend Ray assigned this process the GPU with the given id (None: no GPU)."""
    import ray

    def assign(gpu_id: str | None) -> None:
        ids = {"GPU": [gpu_id] if gpu_id is not None else []}
        monkeypatch.setattr(ray, "get_runtime_context",
                            lambda: types.SimpleNamespace(get_accelerator_ids=lambda: ids))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    return assign


def test_tp_group_ranks_on_gpus_keep_every_gpu_of_the_node_visible():
    shared = rank_options(None, 0, PlacementOptions(use_gpu=True, cpus_per_rank=1, share_devices=True))
    assert shared["runtime_env"]["env_vars"] == KEEP_DEVICES_VISIBLE
    assert "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES" in KEEP_DEVICES_VISIBLE
    single = rank_options(None, 0, PlacementOptions(use_gpu=True, cpus_per_rank=1))
    assert "runtime_env" not in single


def test_only_gpu_tp_and_ep_groups_share_devices(monkeypatch):
    import ray
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"GPU": 8, "CPU": 64})
    assert placement.placement_options("cuda", 2, None, None, 60).share_devices
    assert not placement.placement_options("cuda", 1, None, None, 60).share_devices
    assert not placement.placement_options("cpu", 2, None, None, 60).share_devices
    # DP ranks whose MoE layers form one EP group map each other's memory too; independent DP ranks do not.
    assert placement.placement_options("cuda", 1, None, None, 60, data_parallel_size=2, expert_parallel=True).share_devices
    assert not placement.placement_options("cuda", 1, None, None, 60, data_parallel_size=2).share_devices


def test_ranks_sharing_a_gpu_ask_for_a_fraction_of_it(monkeypatch):
    import ray
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"GPU": 1, "CPU": 16})
    options = placement.placement_options("cuda", 2, None, None, 60, gpus_per_rank=0.5)
    assert options.bundle["GPU"] == 0.5 and rank_options(None, 1, options)["num_gpus"] == 0.5
    assert options.share_devices
    with pytest.raises(RuntimeError, match="tensor_parallel_size=2 with gpus_per_rank=1 needs 2 GPUs"):
        placement.placement_options("cuda", 2, None, None, 60)
    assert not placement.placement_options("auto", 2, None, None, 60).use_gpu  # falls back to CPU ranks


@pytest.mark.parametrize("value", [0, -0.5, 1.5, True, "0.5", None])
def test_a_bad_gpus_per_rank_is_refused_before_anything_starts(value):
    with pytest.raises(ValueError, match="gpus_per_rank must be a number in \\(0, 1\\]"):
        placement.check_gpus_per_rank(value)
    with pytest.raises(ValueError, match="gpus_per_rank"):  # from the caller, before Ray is touched
        import atom_ray
        atom_ray.start("smollm2-135m", address="ray://nowhere.invalid:1", gpus_per_rank=value)


def test_a_rank_that_sees_the_whole_node_selects_its_assigned_gpu(assigned_gpu, monkeypatch):
    assigned_gpu("3")
    assert assigned_device_index() == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # the node itself exposes only two GPUs
    assert assigned_device_index() == 1


def test_a_rank_narrowed_to_its_gpu_uses_device_zero(assigned_gpu, monkeypatch):
    assigned_gpu("5")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert assigned_device_index() == 0


def test_a_rank_without_gpu_selects_none(assigned_gpu):
    assigned_gpu(None)
    assert assigned_device_index() is None


def test_symmetric_all_reduce_is_not_set_up_off_cuda():
    assert SymmetricAllReduce.create(group=None, device=torch.device("cpu")) is None
