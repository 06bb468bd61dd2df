"""The packaged real model (SmolLM2-135M-Instruct, GGUF Q4_1, run in the default dtype)."""
from __future__ import annotations

from engine import SamplingParams
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
