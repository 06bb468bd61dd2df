"""Every architecture against transformers' own implementation (float32, CPU): greedy tokens, logits,
logprobs, also when prefill and decode share steps."""
from __future__ import annotations

import pytest
import torch

import tiny_models
from engine import LLM, LLMEngine, EngineConfig, SamplingParams
from engine.forward_context import forward_context
from engine.kernels.attention import CommonAttentionMetadata
from engine.loader import build_model, resolve_model

ARCHS = list(tiny_models.ARCHITECTURES)
PROMPTS = [[5, 6, 7], list(range(10, 40)), list(range(50, 67)), [100] * 9 + [200], list(range(3, 80))]
GREEDY_32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def llms(tiny_model_dirs):
    return {arch: LLM(str(tiny_model_dirs[arch]), dtype="float32", show_progress=False) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_tokens_equal_transformers_generate(arch, llms, tiny_model_dirs):
    outputs = llms[arch].generate(PROMPTS, GREEDY_32)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.prompt_token_ids == prompt
        assert output.token_ids == tiny_models.hf_greedy(tiny_model_dirs[arch], prompt, 32)
        assert output.finish_reason == "length"


def _model_logits(folder, token_ids):
    """Our model's logits for every position of one sequence (a single cache-less prefill)."""
    model = build_model(resolve_model(str(folder)), torch.float32, torch.device("cpu"), show_progress=False)
    n = len(token_ids)
    metadata = CommonAttentionMetadata(
        num_seqs=1, num_decodes=0, num_tokens=n, query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32), block_table=torch.zeros(1, 1, dtype=torch.int32),
        slot_mapping=torch.arange(n), max_query_len=n, max_seq_len=n, query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n], num_computed_tokens_cpu=[0])
    with torch.inference_mode(), forward_context(metadata, 16):
        hidden = model(torch.tensor(token_ids), torch.arange(n))
        return model.compute_logits(hidden)


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logits_within_1e_4_of_transformers(arch, tiny_model_dirs):
    prompt = list(range(3, 120))
    ours = _model_logits(tiny_model_dirs[arch], prompt)
    reference = tiny_models.hf_logits(tiny_model_dirs[arch], prompt)
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prompt_logprobs_through_chunked_paged_prefill_match_log_softmax(arch, tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs[arch]), dtype="float32", max_num_batched_tokens=16, max_num_seqs=4,
              show_progress=False)
    prompt = list(range(3, 60))
    output = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))[0]
    reference = tiny_models.hf_logits(tiny_model_dirs[arch], prompt).log_softmax(-1)
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    for position, entry in enumerate(output.prompt_logprobs[1:]):
        expected_row = reference[position]
        actual = prompt[position + 1]
        assert abs(entry[actual].logprob - expected_row[actual].item()) < 1e-4
        assert entry[actual].rank == int((expected_row > expected_row[actual]).sum()) + 1
        top = expected_row.topk(3)
        for value, token in zip(top.values.tolist(), top.indices.tolist()):
            assert abs(entry[token].logprob - value) < 1e-4


def test_generated_logprobs_match_log_softmax_of_transformers(llms, tiny_model_dirs):
    prompt = PROMPTS[1]
    output = llms["llama"].generate([prompt], SamplingParams(temperature=0, max_tokens=8, logprobs=2,
                                                              ignore_eos=True))[0]
    reference = tiny_models.hf_logits(tiny_model_dirs["llama"], prompt + output.token_ids).log_softmax(-1)
    assert len(output.logprobs) == 8
    for step, (token, entry) in enumerate(zip(output.token_ids, output.logprobs)):
        row = reference[len(prompt) - 1 + step]
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        assert entry[token].rank == 1  # greedy picks the most likely token
        assert len(entry) <= 3 and set(row.topk(2).indices.tolist()) <= set(entry)


def test_requests_joining_mid_flight_share_steps_and_keep_hf_tokens(tiny_model_dirs):
    """Later requests are prefilled in the same steps as earlier ones decode (mixed batches)."""
    folder = tiny_model_dirs["qwen2"]
    engine = LLMEngine(EngineConfig(str(folder), dtype="float32", max_num_batched_tokens=24, max_num_seqs=8), show_progress=False)
    finished = {}
    pending = list(enumerate(PROMPTS))
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 3 == 0:
            index, prompt = pending.pop(0)
            engine.add_request(str(index), prompt, GREEDY_32)
        for output in engine.step():
            if output.finished:
                finished[int(output.request_id)] = output.token_ids
        steps += 1
    for index, prompt in enumerate(PROMPTS):
        assert finished[index] == tiny_models.hf_greedy(folder, prompt, 32)
