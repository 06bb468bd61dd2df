"""Which models' decode steps CUDA graphs can serve (engine/runner/cuda_graphs.py `uncapturable_layers`),
decided from the model's layers and cache layout, on the CPU: sliding-window and full groups side by side
(gpt-oss, Gemma 4) can be captured; a state pool (Gated DeltaNet) cannot yet. The replay itself is checked
against eager steps on a GPU (tests/engine/test_gpu.py)."""
from __future__ import annotations

import pytest

import tiny_models
from engine import LLM
from engine.runner.cuda_graphs import uncapturable_layers

FAMILIES = {
    "llama": (lambda folder: tiny_models.make_tiny_model(folder, "llama"), 1, True),
    "gpt-oss": (tiny_models.make_tiny_gpt_oss, 2, True),
    "gemma4": (tiny_models.make_tiny_gemma4, 2, True),
    "qwen3-next": (tiny_models.make_tiny_qwen3_next, 1, False),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_window_groups_are_capturable_and_state_pools_are_not(family, tmp_path):
    make, num_groups, capturable = FAMILIES[family]
    llm = LLM(str(make(tmp_path / family)), dtype="float32", show_progress=False)
    runner = llm.engine.executor.runner
    assert len(runner.layout.groups) == num_groups
    reasons = uncapturable_layers(runner.cache_layers, runner.layout)
    assert (not reasons) == capturable, reasons
    if not capturable:
        assert "GatedDeltaNet" in " ".join(reasons)
