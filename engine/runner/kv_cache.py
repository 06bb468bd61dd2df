"""How much memory the KV cache may take on this device, and how its two pools share it."""
from __future__ import annotations

import logging
import os

import numpy as np
import torch

from engine.config import EngineConfig
from engine.kv_cache_spec import FULL_GROUP, CacheGroupLayout, CacheLayout, PagedSpec, StateSpec, group_blocks_for

CPU_KV_CACHE_CAP_BYTES = 4 << 30
logger = logging.getLogger(__name__)


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
        gib = 1 << 30
        (logger.warning if budget - activation_peak <= 0 else logger.info)(
            "KV cache budget %.2f GiB: gpu_memory_utilization %.2f of %.1f GiB = %.1f GiB, less %.1f GiB in use "
            "(this process: %.1f GiB allocated, weights included)%s, less the activation peak %.2f GiB of the "
            "profiling pass", max(budget - activation_peak, 0) / gib, config.gpu_memory_utilization, total / gib,
            usable / gib, (total - free) / gib, torch.cuda.memory_allocated(device) / gib,
            f", {ranks_on_device} ranks sharing the GPU" if ranks_on_device > 1 else "", activation_peak / gib)
        return max(budget - activation_peak, 0)
    return min(available_host_memory() // 4, CPU_KV_CACHE_CAP_BYTES)


class CachePools:
    """Both pools of a runner's caches, sized from its layers' specs (engine/kv_cache_spec.py): the paged
    groups' bytes per block and the state pool's bytes per slot; `layout(n)` gives every group's blocks when
    the cache holds n blocks' worth of tokens (`group_blocks_for`) and max_num_seqs state slots.
    `dtype_of(name, spec)` is a cache's dtype; `per_token_kv_scales`: FP8 "kv" caches carry float32 key and
    value scales per token."""

    def __init__(self, cache_layers, block_size: int, dtype_of, per_token_kv_scales: bool, max_num_seqs: int,
                 max_batched_tokens: int) -> None:
        self.layer_specs = [(layer, layer.cache_specs()) for layer in cache_layers]
        self.block_size, self.dtype_of, self.per_token_kv_scales = block_size, dtype_of, per_token_kv_scales
        self.max_num_seqs, self.max_batched_tokens = max_num_seqs, max_batched_tokens

    def group_keys(self) -> list[tuple[int, int | None]]:
        """The paged groups, (ratio, window), the full group first."""
        keys = {spec.group for _, specs in self.layer_specs for spec in specs.values() if isinstance(spec, PagedSpec)}
        return sorted(keys, key=lambda key: (key != FULL_GROUP, key[0], key[1] or 0))

    def group_bytes_per_block(self) -> dict[tuple[int, int | None], int]:
        """Bytes one block of each paged group takes (every layer's caches in it, FP8 KV scales included)."""
        out = dict.fromkeys(self.group_keys(), 0)
        for layer, specs in self.layer_specs:
            for name, spec in specs.items():
                if not isinstance(spec, PagedSpec):
                    continue
                element_size = torch.empty((), dtype=self.dtype_of(name, spec)).element_size()
                out[spec.group] += int(np.prod(spec.shape(1, self.block_size))) * element_size
                if name == "kv" and self.per_token_kv_scales:  # float32 key and value scales
                    out[spec.group] += 2 * 4 * int(np.prod(layer.kv_scale_shape(1, self.block_size)))
        return out

    def state_bytes_per_slot(self) -> int:
        return sum(spec.bytes_per_slot(self.dtype_of(name, spec)) for _, specs in self.layer_specs
                   for name, spec in specs.items() if isinstance(spec, StateSpec))

    def layout(self, num_token_blocks: int) -> CacheLayout:
        per_block = self.group_bytes_per_block()
        kinds: dict = {}
        for _, specs in self.layer_specs:
            for spec in specs.values():
                if isinstance(spec, PagedSpec) and spec.kind not in kinds.setdefault(spec.group, []):
                    kinds[spec.group].append(spec.kind)
        groups = tuple(CacheGroupLayout(key[0], key[1], group_blocks_for(
            key, num_token_blocks, self.block_size, self.max_num_seqs, self.max_batched_tokens),
            per_block[key], tuple(kinds[key])) for key in per_block)
        state_bytes = self.state_bytes_per_slot()
        state_kinds = tuple(sorted({spec.kind for _, specs in self.layer_specs for spec in specs.values()
                                    if isinstance(spec, StateSpec)}))
        return CacheLayout(self.block_size, groups, self.max_num_seqs if state_bytes else 0, state_bytes, state_kinds)

    def most_blocks_within(self, budget: int, cap: int) -> int:
        """The largest token-block count (at most `cap`) whose pools fit `budget` bytes (they grow with it)."""
        low, high = 0, cap
        while low < high:
            middle = (low + high + 1) // 2
            if self.layout(middle).total_bytes <= budget:
                low = middle
            else:
                high = middle - 1
        return low
