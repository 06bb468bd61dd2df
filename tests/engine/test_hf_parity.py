"""Every architecture against transformers' own implementation (float32, CPU): greedy tokens, logits,
logprobs, also when prefill and decode share steps."""
from __future__ import annotations

import pytest
import torch

import tiny_models
from engine import LLM, LLMEngine, EngineConfig, SamplingParams
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
    return tiny_models.engine_logits(model, token_ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logits_within_1e_4_of_transformers(arch, tiny_model_dirs):
    prompt = list(range(3, 120))
    ours = _model_logits(tiny_model_dirs[arch], prompt)
    reference = tiny_models.hf_logits(tiny_model_dirs[arch], prompt)
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max().item() < 1e-4


def test_float32_residual_stream_between_bf16_layers(tiny_model_dirs):
    """residual_dtype float32 in a bf16 model: the stream between layers is float32, and every GEMM still
    takes and gives bf16."""
    model = build_model(resolve_model(str(tiny_model_dirs["qwen2"])), torch.bfloat16, torch.device("cpu"),
                        show_progress=False, residual_dtype=torch.float32)
    seen = {}

    def record(name):
        def hook(module, inputs, output):
            seen.setdefault(name, set()).add(inputs[0].dtype)
            for value in output if isinstance(output, tuple) else (output,):
                seen.setdefault(name + " out", set()).add(value.dtype)
        return hook
    for name, module in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind in ("qkv_proj", "o_proj", "mlp", "down_proj", "post_attention_layernorm"):
            module.register_forward_hook(record(kind))
    for layer in model.model.layers:
        layer.register_forward_hook(record("layer"))
    logits = tiny_models.engine_logits(model, list(range(3, 40)))
    assert torch.isfinite(logits).all()
    assert seen["qkv_proj"] == seen["mlp"] == seen["o_proj"] == seen["down_proj"] == {torch.bfloat16}
    assert seen["o_proj out"] == seen["down_proj out"] == {torch.bfloat16}
    assert seen["post_attention_layernorm out"] == {torch.bfloat16, torch.float32}  # (normalised, stream)
    assert seen["layer out"] == {torch.bfloat16, torch.float32}  # (the MLP's output, the stream)


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
    outputs = tiny_models.generate_staggered(engine, PROMPTS, GREEDY_32, every=3)
    assert outputs == [tiny_models.hf_greedy(folder, prompt, 32) for prompt in PROMPTS]
