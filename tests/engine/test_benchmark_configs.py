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


def test_window_groups_hold_more_tokens_at_a_fixed_budget():
    """benchmarks/new_families.py's capacity arithmetic (the allocator's): gpt-oss keeps half its layers in
    128-token windows, so at a fixed budget its cache holds about twice the tokens of full-context layers;
    with more sequences than the budget's tokens can fill past their windows, Gemma 4's windows save nothing."""
    import argparse

    from benchmarks.new_families import capacity
    result = capacity(argparse.Namespace(models="gpt-oss-20b,gemma-4-26b-a4b", budget_gib=40.0, max_num_seqs="8,256"))
    gpt_oss, gemma = result["models"]["gpt-oss-20b"], result["models"]["gemma-4-26b-a4b"]
    assert 1.9 < gpt_oss[8]["ratio"] <= 2.0 and gpt_oss[256]["ratio"] < gpt_oss[8]["ratio"]
    assert gemma[8]["ratio"] > 5 and gemma[256]["ratio"] == 1.0


def test_the_decode_roofline_reads_gpt_oss_experts_as_published_mxfp4():
    """A step's bytes count the experts in their checkpoint format (MXFP4: ~0.53 bytes a weight), the top-k
    share of them, and a window layer's cache only inside its window."""
    from benchmarks.new_families import step_bytes
    short, long = step_bytes("gpt-oss-20b", 256), step_bytes("gpt-oss-20b", 32768)
    assert 3e9 < short["weights"] < 4.5e9, short  # bf16 experts would make it ~7.2 GB
    assert short["expert_fraction"] == 4 / 32 and short["state"] == 0
    # 12 full layers grow with the context, 12 windowed ones stop at 128 tokens
    per_token_layer = 2 * 8 * 64 * 2
    assert long["cache"] - short["cache"] == 12 * per_token_layer * (32768 - 256)
