"""POST /v1/completions through the real openai client against SmolLM2."""
from __future__ import annotations

PROMPT = "The capital of France is"


def test_completes_the_capital_of_france_with_paris(server, engine):
    response = server.openai.completions.create(model=server.model, prompt=PROMPT, temperature=0, max_tokens=5)
    choice = response.choices[0]
    assert "Paris" in choice.text
    assert choice.finish_reason == "length" and choice.index == 0
    assert response.id.startswith("cmpl-") and response.object == "text_completion"
    assert response.usage.prompt_tokens == len(engine.tokenizer.encode(PROMPT))
    assert response.usage.completion_tokens == 5
    assert response.usage.total_tokens == response.usage.prompt_tokens + 5


def test_default_max_tokens_is_sixteen(server):
    response = server.openai.completions.create(model=server.model, prompt=PROMPT, temperature=0,
                                                extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 16


def test_token_id_prompt_matches_the_text_prompt(server, engine):
    token_ids = engine.tokenizer.encode(PROMPT)
    by_ids = server.openai.completions.create(model=server.model, prompt=token_ids, temperature=0, max_tokens=5)
    by_text = server.openai.completions.create(model=server.model, prompt=PROMPT, temperature=0, max_tokens=5)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(token_ids)


def test_several_prompts_with_n_index_choices_by_prompt_then_sample(server, engine):
    prompts = [PROMPT, "1, 2, 3, 4,"]
    response = server.openai.completions.create(model=server.model, prompt=prompts, n=2, temperature=0,
                                                max_tokens=4, extra_body={"ignore_eos": True})
    assert [choice.index for choice in response.choices] == [0, 1, 2, 3]
    texts = [choice.text for choice in response.choices]
    assert "Paris" in texts[0] and texts[0] == texts[1]
    assert texts[2] == texts[3] and "5" in texts[2]
    assert response.usage.prompt_tokens == sum(len(engine.tokenizer.encode(p)) for p in prompts)
    assert response.usage.completion_tokens == 16


def test_stream_adds_up_to_the_whole_completion_and_ends_with_usage(server):
    whole = server.openai.completions.create(model=server.model, prompt=PROMPT, temperature=0, max_tokens=8)
    chunks = list(server.openai.completions.create(model=server.model, prompt=PROMPT, temperature=0,
                                                   max_tokens=8, stream=True,
                                                   stream_options={"include_usage": True}))
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert chunks[-2].choices[0].finish_reason == "length"


def test_stream_of_several_prompts_keeps_choices_apart(server):
    prompts = [PROMPT, "1, 2, 3, 4,"]
    whole = server.openai.completions.create(model=server.model, prompt=prompts, n=2, temperature=0, max_tokens=6)
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in server.openai.completions.create(model=server.model, prompt=prompts, n=2, temperature=0,
                                                  max_tokens=6, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                assert choice.index not in finish  # each choice finishes exactly once
                finish[choice.index] = choice.finish_reason
    assert texts == {choice.index: choice.text for choice in whole.choices}
    assert finish == {choice.index: choice.finish_reason for choice in whole.choices}


def test_streamed_tokens_match_usage(server):
    chunks = list(server.openai.completions.create(model=server.model, prompt="Once upon a time", temperature=0.8,
                                                   seed=7, max_tokens=12, logprobs=0, stream=True,
                                                   stream_options={"include_usage": True}))
    tokens = [token for chunk in chunks if chunk.choices for token in chunk.choices[0].logprobs.tokens]
    assert len(tokens) == chunks[-1].usage.completion_tokens
    offsets = [offset for chunk in chunks if chunk.choices for offset in chunk.choices[0].logprobs.text_offset]
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_stop_strings_end_the_text_before_them(server):
    response = server.openai.completions.create(model=server.model, prompt=PROMPT, temperature=0, max_tokens=10,
                                                stop=["."])
    choice = response.choices[0]
    assert choice.text == " Paris" and choice.finish_reason == "stop"
    kept = server.openai.completions.create(model=server.model, prompt=PROMPT, temperature=0, max_tokens=10,
                                            stop="Paris", extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == " Paris"


def test_logprobs_have_openai_completions_shape(server):
    response = server.openai.completions.create(model=server.model, prompt=PROMPT, temperature=0, max_tokens=4,
                                                logprobs=2)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(4)]
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 2 and top[token] == value == max(top.values())


def test_echo_returns_the_prompt_with_its_logprobs(server, engine):
    response = server.openai.completions.create(model=server.model, prompt=PROMPT, temperature=0, max_tokens=3,
                                                echo=True, logprobs=1)
    choice = response.choices[0]
    num_prompt_tokens = len(engine.tokenizer.encode(PROMPT))
    assert choice.text.startswith(PROMPT + " Paris")
    assert len(choice.logprobs.tokens) == num_prompt_tokens + 3
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert all(value is not None for value in choice.logprobs.token_logprobs[1:])
    streamed = "".join(chunk.choices[0].text for chunk in server.openai.completions.create(
        model=server.model, prompt=PROMPT, temperature=0, max_tokens=3, echo=True, stream=True))
    assert streamed == choice.text


def test_echo_logprobs_stay_aligned_when_the_prompt_is_cached(server, engine):
    prompt = "The quick brown fox jumps over the lazy dog. " * 6  # several full KV blocks
    num_prompt_tokens = len(engine.tokenizer.encode(prompt))
    for _ in range(2):  # the second request finds the prompt's blocks in the prefix cache
        response = server.openai.completions.create(model=server.model, prompt=prompt, temperature=0,
                                                    max_tokens=2, echo=True, logprobs=1)
        logprobs = response.choices[0].logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == num_prompt_tokens + 2
        assert "".join(logprobs.tokens[:num_prompt_tokens]) == prompt
        assert logprobs.token_logprobs[0] is None and None not in logprobs.token_logprobs[-3:]


def test_seed_makes_sampling_reproducible(server):
    def sample() -> list[str]:
        response = server.openai.completions.create(model=server.model, prompt="Once upon a time", n=2,
                                                    temperature=1.0, seed=99, max_tokens=12)
        return [choice.text for choice in response.choices]
    first = sample()
    assert first == sample()
    assert first[0] != first[1]  # the samples of one request draw from different seeds
