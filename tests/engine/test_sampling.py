"""Sampling parameters as a user sees them: stop conditions, lengths, logprobs, seeds, and the
statistics of temperature, top-k, top-p and min-p."""
from __future__ import annotations

import pytest
import torch

import tiny_models
from engine import LLM, SamplingParams
from engine.kernels.sampling import SamplingTensors, step_seed
from engine.kernels.torch.sampling import sample
from engine.layers.sampler import SamplingBatch, apply_penalties

PROMPT = list(range(10, 40))


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", show_progress=False)


@pytest.fixture(scope="module")
def greedy_reference(llm):
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]


def test_stop_string_truncates_text_and_reports_it(llm, greedy_reference):
    text = greedy_reference.text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    output = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))[0]
    assert output.text == text[:text.index(stop)]
    assert output.finish_reason == "stop" and output.stop_reason == stop
    assert len(output.token_ids) < 40


def test_stop_string_kept_when_asked(llm, greedy_reference):
    text = greedy_reference.text
    stop = text[10:13]
    output = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop,
                                                   include_stop_str_in_output=True))[0]
    assert output.text == text[:text.index(stop) + len(stop)]


def test_stop_token_id_ends_generation_at_its_first_occurrence(llm, greedy_reference):
    tokens = greedy_reference.token_ids
    stop_id = tokens[6]
    output = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id]))[0]
    assert output.token_ids == tokens[:tokens.index(stop_id) + 1]
    assert output.finish_reason == "stop" and output.stop_reason == stop_id


def test_max_tokens_is_exact_and_reports_length(llm):
    output = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(output.token_ids) == 5 and output.finish_reason == "length"


def test_generation_stops_at_max_model_len(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", max_model_len=40, show_progress=False)
    output = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(PROMPT) + len(output.token_ids) == 40 and output.finish_reason == "length"


@pytest.fixture(scope="module")
def eos_setup(tmp_path_factory, greedy_reference):
    """The same weights with a config whose EOS is the token greedy decoding emits sixth."""
    tokens = greedy_reference.token_ids
    eos = next(t for i, t in enumerate(tokens) if i >= 5 and t not in tokens[:i])
    folder = tiny_models.make_tiny_model(tmp_path_factory.mktemp("eos") / "llama", "llama", eos_token_id=eos)
    return LLM(str(folder), dtype="float32", show_progress=False), eos, tokens.index(eos)


def test_eos_stops_generation(eos_setup, greedy_reference):
    llm, eos, position = eos_setup
    output = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40))[0]
    assert output.token_ids == greedy_reference.token_ids[:position + 1]
    assert output.finish_reason == "stop" and output.stop_reason is None


def test_ignore_eos_runs_to_max_tokens(eos_setup, greedy_reference):
    llm, eos, _ = eos_setup
    output = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert output.token_ids == greedy_reference.token_ids and output.finish_reason == "length"


def test_min_tokens_suppresses_eos_until_reached(eos_setup):
    llm, eos, position = eos_setup
    output = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, min_tokens=position + 4))[0]
    assert eos not in output.token_ids[:position + 4]
    assert len(output.token_ids) >= position + 4


def test_logprobs_hold_sampled_token_and_top_k(llm):
    output = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=4,
                                                   ignore_eos=True))[0]
    assert len(output.logprobs) == 6
    for token, entry in zip(output.token_ids, output.logprobs):
        assert token in entry and 4 <= len(entry) <= 5
        assert sorted(lp.rank for lp in entry.values()) == sorted({1, 2, 3, 4, entry[token].rank})
        assert all(lp.logprob <= 0 for lp in entry.values())


def test_seeded_sampling_is_reproducible_and_batch_invariant(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([PROMPT], params)[0].token_ids
    again = llm.generate([PROMPT], params)[0].token_ids
    others = [SamplingParams(temperature=0.7, seed=s, max_tokens=30, ignore_eos=True) for s in range(5)]
    crowd = llm.generate([list(range(50, 90)), PROMPT, [4, 5, 6], PROMPT, list(range(7, 20)), [9] * 30],
                         [others[0], params, others[1], others[2], others[3], others[4]])
    assert alone == again == crowd[1].token_ids
    different = llm.generate([PROMPT], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=24,
                                                      ignore_eos=True))[0].token_ids
    assert different != alone


def test_n_samples_equal_separately_seeded_requests(llm):
    both = llm.generate([PROMPT], SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True))[0]
    assert len(both.outputs) == 2 and [o.index for o in both.outputs] == [0, 1]
    for index, completion in enumerate(both.outputs):
        single = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=7 + index, max_tokens=12,
                                                       ignore_eos=True))[0]
        assert completion.token_ids == single.token_ids
    assert both.outputs[0].token_ids != both.outputs[1].token_ids


def test_repetition_penalty_matches_transformers(llm, llama_dir):
    output = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.5,
                                                   ignore_eos=True))[0]
    reference = tiny_models.hf_model(llama_dir).generate(
        torch.tensor([PROMPT]), max_new_tokens=20, min_new_tokens=20, do_sample=False, repetition_penalty=1.5,
        pad_token_id=0)[0, len(PROMPT):].tolist()
    assert output.token_ids == reference


def test_presence_and_frequency_penalties_follow_openai_rule():
    logits = torch.zeros(1, 6)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    apply_penalties(logits, SamplingBatch([params], [0], [[5]], [[1, 1, 2]], [[]]))
    assert logits[0].tolist() == [0.0, -1.0, -0.75, 0.0, 0.0, 0.0]


# ---- the sampling kernel on a fixed distribution ------------------------------------------------------
PROBS = torch.tensor([0.5, 0.25, 0.15, 0.1])


def _draw(rows: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    logits = PROBS.log().expand(rows, -1).contiguous()
    seeds = [step_seed(row, 0) for row in range(rows)]
    tensors = SamplingTensors(
        temperature=torch.full((rows,), temperature), top_k=torch.full((rows,), top_k),
        top_p=torch.full((rows,), top_p), min_p=torch.full((rows,), min_p), seeds=torch.tensor(seeds),
        seeds_cpu=seeds, all_greedy=temperature == 0, any_top_k=top_k > 0, any_top_p=top_p < 1,
        any_min_p=min_p > 0)
    return torch.bincount(sample(logits, tensors), minlength=4).float() / rows


def test_plain_sampling_follows_the_distribution():
    assert torch.allclose(_draw(20000), PROBS, atol=0.015)


def test_temperature_sharpens_the_distribution():
    expected = PROBS ** 2 / (PROBS ** 2).sum()
    assert torch.allclose(_draw(20000, temperature=0.5), expected, atol=0.015)


def test_top_k_keeps_the_k_most_likely_renormalised():
    assert torch.allclose(_draw(20000, top_k=2), torch.tensor([2 / 3, 1 / 3, 0, 0]), atol=0.015)


def test_top_p_keeps_the_smallest_set_reaching_p():
    assert torch.allclose(_draw(20000, top_p=0.7), torch.tensor([2 / 3, 1 / 3, 0, 0]), atol=0.015)
    assert torch.allclose(_draw(20000, top_p=0.8), torch.tensor([0.5, 0.25, 0.15, 0]) / 0.9, atol=0.015)


def test_min_p_drops_tokens_below_a_fraction_of_the_top_one():
    assert torch.allclose(_draw(20000, min_p=0.35), torch.tensor([2 / 3, 1 / 3, 0, 0]), atol=0.015)


def test_zero_temperature_is_argmax():
    assert _draw(10, temperature=0).tolist() == [1.0, 0.0, 0.0, 0.0]
