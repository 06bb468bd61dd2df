"""The per-step sampling inputs that every backend's `sample` kernel takes."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingTensors:
    """When `all_greedy`, the tensors are None: argmax needs nothing else."""
    temperature: torch.Tensor  # [B] float32; 0 means greedy
    top_k: torch.Tensor  # [B] int64; 0 means no top-k
    top_p: torch.Tensor  # [B] float32; 1 means no top-p
    min_p: torch.Tensor  # [B] float32; 0 means no min-p
    seeds: torch.Tensor  # [B] int64; per-row seed of this step (request seed mixed with the output index)
    seeds_cpu: list[int]
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool


def step_seed(request_seed: int, output_index: int) -> int:
    """A 63-bit seed that depends only on the request's seed and which output token is being drawn, so
    that a seeded request gets the same tokens whatever else is in the batch, and after preemption."""
    value = (request_seed * 0x9E3779B97F4A7C15 + output_index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB)
    value &= (1 << 64) - 1
    value ^= value >> 31
    return value & ((1 << 63) - 1)
