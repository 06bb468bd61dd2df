"""Prompt-step graphs (engine/runner/prompt_graphs.py): what can be checked without a GPU, the token buckets
and the non-owning views that let one chain's graphs share memory. Replay itself: tests/engine/test_gpu.py."""
from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError, EngineConfig
from engine.runner.prompt_graphs import non_owning, prompt_buckets


def test_buckets_end_at_the_step_budget_rounded_to_the_exchange_multiple():
    assert prompt_buckets(8192) == [64, 128, 256, 512, 1024, 1536, 2048, 3072, 4096, 5120, 6144, 7168, 8192]
    assert prompt_buckets(2000) == [64, 128, 256, 512, 1024, 1536, 2048]
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


def test_the_switch_is_a_boolean():
    assert EngineConfig(model="m", cuda_graph_prompt_steps=False).cuda_graph_prompt_steps is False
    with pytest.raises(ConfigError, match="cuda_graph_prompt_steps"):
        EngineConfig(model="m", cuda_graph_prompt_steps="no")
