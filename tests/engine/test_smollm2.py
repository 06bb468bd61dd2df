"""The packaged real model (SmolLM2-135M-Instruct, GGUF Q4_1, run in the default dtype)."""
from __future__ import annotations

import torch

import tiny_models
from engine import SamplingParams
from engine.loader import build_model, resolve_model
from engine.tokenizer import IncrementalDetokenizer


def test_capital_of_france_is_paris(smollm2):
    output = smollm2.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0]
    assert "Paris" in output.text


def test_chat_question_gets_a_coherent_answer(smollm2):
    output = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                          SamplingParams(temperature=0, max_tokens=40))[0]
    assert "Paris" in output.text
    assert output.finish_reason == "stop"  # the model ends its turn with <|im_end|>


def test_chat_template_is_applied(smollm2):
    tokenizer = smollm2.get_tokenizer()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in text


def test_streamed_pieces_add_up_to_the_final_text(smollm2):
    engine = smollm2.engine
    engine.add_request("stream", "Write three emoji and the word Tokyo in Japanese:",
                       SamplingParams(temperature=0.8, seed=5, max_tokens=40))
    pieces, final = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            pieces.append(output.outputs[0].new_text)
            final = output
    assert "".join(pieces) == final.text
    assert final.text == engine.tokenizer.decode(final.token_ids)


def test_incremental_detokenization_is_correct_across_multibyte_characters(smollm2):
    tokenizer = smollm2.get_tokenizer()
    text = "naïve café — 東京タワー 😀🚀 Привет, мир! ✓"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # several characters span more than one token
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=[])
    pieces = [detokenizer.add(token) for token in ids]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_float32_residual_stream_brings_bf16_logits_closer_to_float32(smollm2):
    """residual_dtype="float32" on real weights (30 layers): the bf16 model's logits move closer to the
    float32 model's (mean error about 0.7x of the bf16 stream's on this text)."""
    token_ids = smollm2.get_tokenizer().encode(
        "The quick brown fox jumps over the lazy dog. Paged attention stores the key and value cache in "
        "fixed-size blocks, so that sequences of any length share one pool of memory without fragmenting it. " * 3)
    source = resolve_model("smollm2-135m")

    def logits(dtype, residual_dtype=None):
        model = build_model(source, dtype, torch.device("cpu"), show_progress=False, residual_dtype=residual_dtype)
        return tiny_models.engine_logits(model, token_ids).float()
    exact = logits(torch.float32)
    error = {residual: (logits(torch.bfloat16, residual) - exact).abs().mean().item()
             for residual in (torch.bfloat16, torch.float32)}
    assert error[torch.float32] < 0.85 * error[torch.bfloat16], error
