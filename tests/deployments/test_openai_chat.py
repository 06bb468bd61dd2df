"""POST /v1/chat/completions through the real openai client against SmolLM2."""
from __future__ import annotations

import pytest

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_answers_the_capital_of_france_with_paris(server):
    response = server.openai.chat.completions.create(model=server.model, messages=QUESTION, temperature=0,
                                                     max_tokens=40)
    choice = response.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    assert response.model == server.model


def test_usage_counts_the_template_tokens_and_the_generated_tokens(server, engine):
    response = server.openai.chat.completions.create(model=server.model, messages=QUESTION, temperature=0,
                                                     max_tokens=40, logprobs=True)
    usage = response.usage
    assert usage.prompt_tokens == len(engine.tokenizer.encode_chat(QUESTION))
    assert usage.completion_tokens == len(response.choices[0].logprobs.content)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_content_parts_are_joined_like_a_string(server):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]
    as_parts = server.openai.chat.completions.create(model=server.model, messages=parts, temperature=0,
                                                     max_tokens=12)
    as_string = server.openai.chat.completions.create(model=server.model, messages=QUESTION, temperature=0,
                                                      max_tokens=12)
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content


def test_stream_adds_up_to_the_whole_answer_and_ends_with_usage(server):
    whole = server.openai.chat.completions.create(model=server.model, messages=QUESTION, temperature=0,
                                                  max_tokens=40)
    chunks = list(server.openai.chat.completions.create(
        model=server.model, messages=QUESTION, temperature=0, max_tokens=40, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].message.content
    finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert finish == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert len({chunk.id for chunk in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_stream_without_include_usage_sends_no_usage(server):
    chunks = list(server.openai.chat.completions.create(model=server.model, messages=QUESTION, temperature=0,
                                                        max_tokens=5, stream=True))
    assert all(chunk.usage is None for chunk in chunks) and all(chunk.choices for chunk in chunks)


def test_n_samples_are_separate_choices_and_the_prompt_counts_once(server, engine):
    response = server.openai.chat.completions.create(model=server.model, messages=QUESTION, temperature=1.0,
                                                     seed=3, n=2, max_tokens=8, extra_body={"ignore_eos": True})
    assert [choice.index for choice in response.choices] == [0, 1]
    assert response.usage.completion_tokens == 16
    assert response.usage.prompt_tokens == len(engine.tokenizer.encode_chat(QUESTION))


def test_n_samples_stream_with_their_index(server):
    chunks = list(server.openai.chat.completions.create(
        model=server.model, messages=QUESTION, temperature=0, n=2, max_tokens=6, stream=True,
        stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] == texts[1] != ""  # greedy: both samples are the same
    assert chunks[-1].usage.completion_tokens == 12


def test_max_completion_tokens_takes_precedence_over_max_tokens(server):
    response = server.openai.chat.completions.create(model=server.model, messages=QUESTION, temperature=0,
                                                     max_tokens=40, max_completion_tokens=3)
    assert response.usage.completion_tokens == 3
    assert response.choices[0].finish_reason == "length"


def test_stop_string_ends_the_answer_before_it(server):
    for stream in (False, True):
        result = server.openai.chat.completions.create(model=server.model, messages=QUESTION, temperature=0,
                                                       max_tokens=40, stop=["Paris"], stream=stream)
        if stream:
            chunks = list(result)
            text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
            finish_reason = chunks[-1].choices[0].finish_reason
        else:
            text, finish_reason = result.choices[0].message.content, result.choices[0].finish_reason
        assert text == "The capital of France is "
        assert finish_reason == "stop"


def test_logprobs_have_openai_chat_shape(server):
    response = server.openai.chat.completions.create(model=server.model, messages=QUESTION, temperature=0,
                                                     max_tokens=6, logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely token
        values = [top.logprob for top in entry.top_logprobs]
        assert values == sorted(values, reverse=True)


def test_streamed_logprobs_cover_every_token(server):
    chunks = list(server.openai.chat.completions.create(
        model=server.model, messages=QUESTION, temperature=0, max_tokens=6, logprobs=True, stream=True,
        stream_options={"include_usage": True}))
    entries = [entry for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
               for entry in chunk.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens == 6
    assert all(entry.top_logprobs == [] for entry in entries)


@pytest.mark.parametrize("stream", [False, True])
def test_seed_makes_sampling_reproducible(server, stream):
    def sample() -> str:
        result = server.openai.chat.completions.create(model=server.model, messages=QUESTION, temperature=1.0,
                                                       seed=1234, max_tokens=12, stream=stream)
        if stream:
            return "".join(chunk.choices[0].delta.content or "" for chunk in result if chunk.choices)
        return result.choices[0].message.content
    assert sample() == sample()


def test_vllm_extras_pass_through_extra_body(server):
    response = server.openai.chat.completions.create(
        model=server.model, messages=QUESTION, temperature=0.7, max_tokens=4,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 4, "ignore_eos": True,
                    "skip_special_tokens": False})
    assert response.usage.completion_tokens == 4


def test_unknown_fields_are_ignored(server):
    response = server.post("/v1/chat/completions", json={
        "model": server.model, "messages": QUESTION, "max_tokens": 2, "user": "someone",
        "store": False, "metadata": {"a": "b"}, "parallel_tool_calls": False, "service_tier": "auto"})
    assert response.status_code == 200, response.text
