"""Every benchmark config (benchmarks/configs, real shapes, no weights) names an architecture we serve and
builds at its full size on the meta device (no memory), so a dummy-weight benchmark of it can start."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import kernels
from engine.loader.source import load_hf_config
from engine.models import model_class_for

CONFIGS = sorted((Path(__file__).parents[2] / "benchmarks" / "configs").glob("*/config.json"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.parent.name)
def test_benchmark_config_builds_at_full_size(path):
    kernels.activate("torch", torch.device("cpu"))
    config = load_hf_config(path.parent)
    model_class = model_class_for(config)
    with torch.device("meta"):
        model = model_class(config, residual_dtype=torch.bfloat16)
    num_params = sum(p.numel() for p in model.parameters())
    assert num_params > 1e8, num_params
