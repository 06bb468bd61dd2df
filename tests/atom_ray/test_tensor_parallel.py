"""Tensor parallelism across Ray rank actors (gloo on CPU) gives the single-process engine's tokens."""
from __future__ import annotations

import pytest

import atom_ray
from engine import LLM, SamplingParams

PROMPTS = [[5, 6, 7], list(range(10, 40)), list(range(50, 67)), [100] * 9 + [200]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_matches_single_process_on_tiny_models(ray_cluster, tiny_model_dirs, arch):
    folder = str(tiny_model_dirs[arch])
    expected = [o.token_ids for o in LLM(folder, dtype="float32", show_progress=False).generate(PROMPTS, GREEDY)]
    engine = atom_ray.start(folder, tensor_parallel_size=2, dtype="float32")
    try:
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == expected
    finally:
        engine.shutdown()


def test_tp2_matches_single_process_on_smollm2_with_uneven_head_split(ray_cluster):
    """9 query heads and 3 KV heads over 2 ranks: 6 + 3 heads, whole GQA groups per rank."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = LLM("smollm2-135m", dtype="float32", show_progress=False).generate(prompts, params)
    engine = atom_ray.start("smollm2-135m", tensor_parallel_size=2, dtype="float32")
    try:
        outputs = engine.generate(prompts, params)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
        assert "Paris" in outputs[0].text
    finally:
        engine.shutdown()


def test_dummy_weights_are_one_model_whatever_the_tp_layout(ray_cluster, tiny_model_dirs):
    """Random weights are a seeded checkpoint sharded like a real one, so TP benchmarks compare like with like."""
    folder = str(tiny_model_dirs["qwen2"])
    args = dict(dtype="float32", load_format="dummy", seed=3)
    expected = [o.token_ids for o in LLM(folder, show_progress=False, **args).generate(PROMPTS, GREEDY)]
    engine = atom_ray.start(folder, tensor_parallel_size=2, **args)
    try:
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == expected
    finally:
        engine.shutdown()
