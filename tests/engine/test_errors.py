"""Bad input gets a clear error naming what is wrong, and the engine keeps serving afterwards."""
from __future__ import annotations

import json

import pytest

from engine import LLM, ConfigError, EngineConfig, InvalidRequestError, SamplingParams, SamplingParamsError
from engine.loader import ModelSourceError


@pytest.mark.parametrize("field, value", [
    ("dtype", "float64"), ("block_size", 0), ("block_size", 24), ("max_num_seqs", -1), ("load_format", "pt"),
    ("gpu_memory_utilization", 1.5), ("kernel_backend", "cuda"), ("tensor_parallel_size", 0),
    ("enable_prefix_caching", "yes"), ("num_kv_blocks", 0), ("max_model_len", 2.5), ("device", "tpu"),
    ("tp_reduce_dtype", "bfloat16"), ("residual_dtype", "bfloat16"),
])
def test_invalid_engine_config_names_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"EngineConfig\.{field}"):
        EngineConfig(model="m", **{field: value})


def test_unknown_engine_argument_lists_the_valid_ones(llama_dir):
    with pytest.raises(ConfigError, match="unknown engine argument.*max_num_sequences.*valid ones"):
        LLM(str(llama_dir), max_num_sequences=4)


@pytest.mark.parametrize("field, value", [
    ("temperature", -1), ("top_p", 0), ("top_k", -2), ("min_p", 2), ("max_tokens", 0), ("n", 0),
    ("logprobs", 21), ("presence_penalty", 3), ("repetition_penalty", 0), ("stop", [""]), ("seed", 1.5),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(SamplingParamsError, match=rf"SamplingParams\.{field}"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(SamplingParamsError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)


def test_missing_model_path_says_nothing_is_downloaded(tmp_path):
    with pytest.raises(ModelSourceError, match="never downloads"):
        LLM(str(tmp_path / "nope"))


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelSourceError, match="no config.json"):
        LLM(str(tmp_path))


def test_malformed_config_json_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelSourceError, match="not valid JSON"):
        LLM(str(tmp_path))


def test_unsupported_architecture_lists_the_supported_ones(tmp_path, llama_dir):
    config = json.loads((llama_dir / "config.json").read_text())
    config["architectures"] = ["LlamaForSequenceClassification"]
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((llama_dir / name).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not supported; supported architectures: DeepseekV2ForCausalLM, "
                       "DeepseekV32ForCausalLM, DeepseekV3ForCausalLM, DeepseekV4ForCausalLM, Gemma4ForCausalLM, "
                       "Glm4MoeForCausalLM, GlmMoeDsaForCausalLM, GptOssForCausalLM, LlamaForCausalLM, "
                       "MiniMaxM2ForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                       "Qwen3MoeForCausalLM, Qwen3NextForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM"):
        LLM(str(tmp_path), show_progress=False)


def test_checkpoint_missing_weights_is_refused(tmp_path, llama_dir):
    from safetensors.torch import load_file, save_file
    weights = load_file(str(llama_dir / "model.safetensors"))
    weights.pop("model.layers.1.mlp.up_proj.weight")
    save_file(weights, str(tmp_path / "model.safetensors"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((llama_dir / name).read_bytes())
    with pytest.raises(ModelSourceError, match="lacks weights.*gate_up_proj"):
        LLM(str(tmp_path), show_progress=False)


def test_corrupt_gguf_is_refused(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 10)
    with pytest.raises(ModelSourceError, match="not a readable GGUF file"):
        LLM(str(path))


@pytest.fixture(scope="module")
def small_llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", max_model_len=64, show_progress=False)


@pytest.mark.parametrize("prompt, message", [
    ("", "empty"), ([], "empty"), ([1, 2, 100000], "outside the vocabulary"), ([-1], "outside the vocabulary"),
    (list(range(3, 80)), "context length"), (3.5, "must be a string or a list of token ids"),
    ({"text": "x"}, "needs 'prompt' or 'prompt_token_ids'"), ([1, "a"], "must be a string or a list"),
])
def test_bad_prompt_is_refused_and_engine_keeps_serving(small_llm, prompt, message):
    with pytest.raises(InvalidRequestError, match=message):
        small_llm.generate([prompt], SamplingParams(max_tokens=2))
    good = small_llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(good.token_ids) == 3
    stats = small_llm.engine.stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and not small_llm.engine.has_unfinished_requests()


def test_a_bad_prompt_in_a_batch_leaves_no_request_behind(small_llm):
    with pytest.raises(InvalidRequestError):
        small_llm.generate([[5, 6], [7, 8], list(range(3, 90))], SamplingParams(max_tokens=2))
    assert not small_llm.engine.has_unfinished_requests()


def test_mismatched_sampling_params_count_is_refused(small_llm):
    with pytest.raises(InvalidRequestError, match="2 sampling params for 3 prompts"):
        small_llm.generate([[5], [6], [7]], [SamplingParams(), SamplingParams()])


def test_aborting_a_running_request_frees_its_blocks(small_llm):
    engine = small_llm.engine
    engine.add_request("to-abort", [5, 6, 7, 8], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    assert engine.stats()["num_free_kv_blocks"] < engine.stats()["num_kv_blocks"]
    final = engine.abort_request("to-abort")
    assert final.finished and final.finish_reason == "abort"
    engine.step()
    assert engine.stats()["num_free_kv_blocks"] == engine.stats()["num_kv_blocks"]


def test_duplicate_request_id_is_refused(small_llm):
    engine = small_llm.engine
    engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    engine.abort_request("dup")
