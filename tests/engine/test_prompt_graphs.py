"""Prompt-step graphs (engine/runner/prompt_graphs.py): what can be checked without a GPU, the token buckets
and the non-owning views that let one chain's graphs share memory. Replay itself: tests/engine/test_gpu.py."""
from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError, EngineConfig
from engine.runner.prompt_graphs import non_owning, prompt_buckets


def test_buckets_are_fine_and_end_at_the_step_budget_rounded_to_the_exchange_multiple():
    buckets = prompt_buckets(8192)
    assert buckets[:9] == [64, 128, 192, 256, 320, 384, 448, 512, 768] and buckets[-2:] == [7936, 8192]
    assert all(b - a <= 256 for a, b in zip(buckets, buckets[1:]))  # a large step pads by a few per cent
    assert prompt_buckets(2000)[-3:] == [1536, 1792, 2048]
    assert prompt_buckets(100) == [64, 128]
    assert prompt_buckets(16384)[-1] == 16384


def test_a_non_owning_view_reads_the_same_elements_with_the_same_layout():
    base = torch.arange(60.0).view(6, 10)
    view = base[1:5, 2:8]
    weak = non_owning(view)
    assert weak.shape == view.shape and weak.stride() == view.stride()
    assert weak.data_ptr() == view.data_ptr()
    assert torch.equal(weak, view)
    base[2, 3] = -1.0  # the same memory, not a copy
    assert weak[1, 1].item() == -1.0


def test_the_switch_takes_auto_on_or_off():
    assert EngineConfig(model="m").cuda_graph_prompt_steps == "auto"
    assert EngineConfig(model="m", cuda_graph_prompt_steps="off").cuda_graph_prompt_steps == "off"
    for wrong in ("no", False, None):
        with pytest.raises(ConfigError, match="cuda_graph_prompt_steps"):
            EngineConfig(model="m", cuda_graph_prompt_steps=wrong)
