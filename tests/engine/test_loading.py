"""Checkpoint formats: sharded safetensors, random (dummy) weights, and GGUF against transformers."""
from __future__ import annotations

import json

import pytest
import torch

import tiny_models
from engine import LLM, SamplingParams
from engine.loader.gguf import unpermute_rope_rows
from engine.loader.gguf_file import GGUFFile
from engine.loader.source import packaged_model_path

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_sharded_safetensors_load_like_a_single_file(tmp_path, llama_dir):
    sharded = tiny_models.hf_model(llama_dir)
    sharded.save_pretrained(str(tmp_path), safe_serialization=True, max_shard_size="100KB")
    tiny_models.build_tokenizer(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    prompt = [[5, 6, 7, 8]]
    single = LLM(str(llama_dir), dtype="float32", show_progress=False).generate(prompt, GREEDY)[0]
    assert LLM(str(tmp_path), dtype="float32", show_progress=False).generate(prompt, GREEDY)[0].token_ids \
        == single.token_ids


def test_dummy_weights_run_from_a_config_alone(tmp_path, llama_dir):
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((llama_dir / name).read_text())
    llm = LLM(str(tmp_path), load_format="dummy", show_progress=False)
    output = llm.generate(["hello"], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(output.token_ids) == 5


def test_unpermute_inverts_llama_cpp_rope_row_order():
    heads, head_dim, columns = 3, 8, 5
    weight = torch.randn(heads * head_dim, columns)
    # llama.cpp's converter: per head, rows [first half | second half] become interleaved pairs.
    permuted = weight.reshape(heads, 2, head_dim // 2, columns).transpose(1, 2).reshape(heads * head_dim, columns)
    assert torch.equal(unpermute_rope_rows(permuted, heads), weight)


def test_gguf_reader_agrees_with_the_gguf_package():
    from gguf import GGUFReader
    path = packaged_model_path("smollm2-135m")
    ours, theirs = GGUFFile(path), GGUFReader(str(path))
    for key in ("general.architecture", "llama.block_count", "llama.rope.freq_base", "tokenizer.ggml.eos_token_id"):
        assert ours.fields[key] == theirs.fields[key].contents()
    assert ours.fields["tokenizer.ggml.tokens"] == theirs.fields["tokenizer.ggml.tokens"].contents()
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in list(zip(ours.tensors, theirs.tensors))[:12]:
        assert mine.shape == tuple(int(d) for d in reversed(reference.shape))
        assert ours.tensor_data(mine).tobytes() == reference.data.tobytes()


def test_gguf_model_logits_match_transformers_gguf_loader(smollm2):
    """transformers de-quantizes and un-permutes GGUF itself: an independent oracle for our loader."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM
    path = packaged_model_path("smollm2-135m")
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    llm = LLM("smollm2-135m", dtype="float32", show_progress=False)
    prompt = llm.get_tokenizer().encode("The quick brown fox jumps over the lazy dog because")
    ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5))[0]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    for position, entry in enumerate(ours.prompt_logprobs[1:]):
        token = prompt[position + 1]
        assert abs(entry[token].logprob - expected[position, token].item()) < 1e-3
