"""How much memory the KV cache may take, and how TP ranks that share GPUs are laid out."""
from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.runner import kv_cache

GiB = 1 << 30


def fake_gpu(monkeypatch, free: int, total: int, reserved: int, peak: int = 0) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: reserved + peak)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)


def test_one_rank_takes_the_utilization_share_less_what_is_in_use(monkeypatch):
    fake_gpu(monkeypatch, free=70 * GiB, total=80 * GiB, reserved=8 * GiB, peak=2 * GiB)
    config = EngineConfig(model="x", gpu_memory_utilization=0.9)
    assert kv_cache.kv_cache_budget_bytes(config, torch.device("cuda")) == 72 * GiB - 10 * GiB - 2 * GiB


def test_ranks_sharing_a_gpu_split_it_even_when_both_see_it_free(monkeypatch):
    """Both ranks size their caches at once: each sees 70 GiB free, and each must take under half."""
    fake_gpu(monkeypatch, free=70 * GiB, total=80 * GiB, reserved=4 * GiB, peak=1 * GiB)
    config = EngineConfig(model="x", gpu_memory_utilization=0.9)
    each = kv_cache.kv_cache_budget_bytes(config, torch.device("cuda"), ranks_on_device=2)
    assert each == 36 * GiB - 4 * GiB - 1 * GiB
    assert 2 * (each + 4 * GiB + 1 * GiB) <= 72 * GiB


def test_a_given_kv_cache_size_wins(monkeypatch):
    fake_gpu(monkeypatch, free=1, total=2, reserved=0)
    config = EngineConfig(model="x", kv_cache_memory_bytes=GiB)
    assert kv_cache.kv_cache_budget_bytes(config, torch.device("cuda"), ranks_on_device=2) == GiB


def test_a_rank_with_its_own_gpu_still_reduces_on_the_host_when_others_share_one():
    from engine.parallel.state import device_layout
    assert device_layout(["gpu-a", "gpu-b"], 0) == (1, False)
    assert device_layout(["gpu-a", "gpu-a"], 1) == (2, True)
    assert device_layout(["gpu-a", "gpu-a", "gpu-b"], 2) == (1, True), "the group's collectives must match"
    assert device_layout(["gpu-a", "gpu-a", "gpu-b"], 0) == (2, True)


def test_a_budget_used_up_before_the_cache_says_where_the_memory_went(monkeypatch, caplog):
    """A model whose weights and activation peak leave nothing for the cache (the engine then refuses with
    "the KV cache holds 0 blocks") logs the budget's parts, so the cause is in the log."""
    fake_gpu(monkeypatch, free=20 * GiB, total=80 * GiB, reserved=58 * GiB, peak=15 * GiB)
    config = EngineConfig(model="x", gpu_memory_utilization=0.9)
    with caplog.at_level("INFO", logger="engine.runner.kv_cache"):
        assert kv_cache.kv_cache_budget_bytes(config, torch.device("cuda")) == 0
    record = next(r for r in caplog.records if r.name == "engine.runner.kv_cache")
    assert record.levelname == "WARNING"
    assert "0.00 GiB" in record.message and "60.0 GiB in use" in record.message and "peak 15.00 GiB" in record.message
