"""Speculative decoding through Ray rank actors (CPU, gloo): at TP=2 every rank keeps the same drafts and
moves its cache position back alike; under DP=2 + EP=2 each DP rank speculates on its own requests while the
MoE layers exchange tokens over both. Greedy and seeded tokens equal the single-process engine's without
speculation, and every KV block comes back."""
from __future__ import annotations

import pytest

import atom_ray
from engine import LLM, SamplingParams

# Repeats, so that the n-gram drafter finds matches in the prompts and the tiny models' outputs.
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], list(range(10, 30)) * 2, [100] * 9 + [200], list(range(50, 60)) + [51, 52]]
PARAMS = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=4, max_tokens=24, ignore_eos=True)]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def check_against_one_process(folder: str, speculative_config: dict, params_list=PARAMS, prompt_sets=(PROMPTS,),
                              **layout) -> None:
    """The tokens of `folder` through Ray with `layout` and speculation equal one process's without, for each
    prompt set and params; drafts ran and every block came back."""
    single = LLM(folder, dtype="float32", show_progress=False)
    expected = [[[o.token_ids for o in single.generate(prompts, params)] for params in params_list]
                for prompts in prompt_sets]
    single.shutdown()
    engine = atom_ray.start(folder, dtype="float32", speculative_config=speculative_config, **layout)
    try:
        for prompts, per_params in zip(prompt_sets, expected):
            for params, tokens in zip(params_list, per_params):
                assert [o.token_ids for o in engine.generate(prompts, params)] == tokens
        stats = engine.stats()
        assert stats["spec_draft_tokens"] > 0 and 0 <= stats["spec_acceptance_rate"] <= 1
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch, layout", [("llama", dict(tensor_parallel_size=2)),
                                          ("qwen3_moe", dict(data_parallel_size=2, enable_expert_parallel=True))],
                         ids=["tp2", "dp2-ep2"])
def test_speculation_over_ranks_gives_the_single_process_tokens(ray_cluster, tiny_model_dirs, arch, layout):
    check_against_one_process(str(tiny_model_dirs[arch]), NGRAM, **layout)


def tiny_deepseek_with_mtp(folder) -> str:
    import tiny_models
    return str(tiny_models.add_random_mtp_layer(
        tiny_models.make_tiny_model(folder, "deepseek_v3", num_nextn_predict_layers=1)))


def test_mtp_drafting_at_tp2_gives_the_single_process_tokens(ray_cluster, tmp_path):
    """Both TP ranks run the MTP layer (its attention heads and experts split like the target's) and draft
    alike."""
    check_against_one_process(tiny_deepseek_with_mtp(tmp_path / "dsv3"), {"method": "mtp", "num_speculative_tokens": 2},
                              PARAMS[:1], tensor_parallel_size=2)


def test_eagle3_drafting_at_tp2_gives_the_single_process_tokens(ray_cluster, tiny_model_dirs, tmp_path):
    import tiny_models
    draft = str(tiny_models.make_random_eagle3_draft(tmp_path / "draft", tiny_model_dirs["llama"]))
    check_against_one_process(str(tiny_model_dirs["llama"]),
                              {"method": "eagle3", "model": draft, "num_speculative_tokens": 2}, PARAMS[:1],
                              tensor_parallel_size=2)


def test_mtp_drafting_at_dp2_ep2_gives_the_single_process_tokens(ray_cluster, tmp_path):
    """Each DP rank drafts for its own requests; the MTP layer's experts are split over both ranks, so every
    rank runs k draft passes a step, empty ones where it has nothing to draft or nothing to run (one request:
    the other rank idles through dummy steps)."""
    check_against_one_process(tiny_deepseek_with_mtp(tmp_path / "dsv3"), {"method": "mtp", "num_speculative_tokens": 2},
                              PARAMS[:1], (PROMPTS[:1], PROMPTS), data_parallel_size=2, enable_expert_parallel=True)
