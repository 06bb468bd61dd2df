"""How much memory the KV cache may take on this device."""
from __future__ import annotations

import os

import torch

from engine.config import EngineConfig

CPU_KV_CACHE_CAP_BYTES = 4 << 30


def available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def kv_cache_budget_bytes(config: EngineConfig, device: torch.device, ranks_on_device: int = 1) -> int:
    """`kv_cache_memory_bytes` if given. On a GPU, after a profiling pass: the share
    `gpu_memory_utilization` of total memory, minus what is in use and the profiled activation peak; where
    `ranks_on_device` TP ranks share the GPU, each takes at most its equal part of that share less its own
    memory (they size their caches at the same time, each seeing the same free memory).
    On CPU: a quarter of available memory, at most 4 GiB."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        activation_peak = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
        usable = int(total * config.gpu_memory_utilization)
        budget = usable - (total - free)
        if ranks_on_device > 1:
            budget = min(budget, usable // ranks_on_device - torch.cuda.memory_reserved(device))
        return max(budget - activation_peak, 0)
    return min(available_host_memory() // 4, CPU_KV_CACHE_CAP_BYTES)
