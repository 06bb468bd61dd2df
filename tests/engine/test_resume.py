"""A resumed request (engine/resume.py: a request continued after the engine that ran it failed, with the
tokens it had delivered) continues with exactly what an undisturbed run produces next: greedy and seeded
tokens, penalties that count the delivered tokens as outputs, a stop string that begins before the resume,
n > 1 with a finished sample, logprobs of the new tokens, a grammar that takes the delivered tokens first;
and a continuation that no longer fits is refused naming why."""
from __future__ import annotations

import itertools

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.resume import ResumedSample, ResumeState

PROMPT = "The capital of France is"
_ids = itertools.count()


def run(engine, prompt, params: SamplingParams, resume: ResumeState | None = None):
    """One request through the engine alone: (final output, every delta's new tokens and text per sample)."""
    request_id = f"resume-test-{next(_ids)}"
    engine.add_request(request_id, prompt, params, resume=resume)
    streamed: dict[int, tuple[list[int], str]] = {}
    while True:
        for output in engine.step():
            assert output.request_id == request_id
            for completion in output.outputs:
                tokens, text = streamed.get(completion.index, ([], ""))
                streamed[completion.index] = (tokens + completion.new_token_ids, text + completion.new_text)
            if output.finished:
                return output, streamed


def resumed_after(engine, prompt, params: SamplingParams, full, cut: int):
    """The request again, resumed with the first `cut` tokens of each of `full`'s samples delivered."""
    samples = []
    for completion in full.outputs:
        text = engine.tokenizer.decode(completion.token_ids[:cut])
        samples.append(ResumedSample(completion.index, tuple(completion.token_ids[:cut]), len(text)))
    return run(engine, prompt, params, ResumeState(tuple(samples)))


@pytest.fixture(scope="module")
def engine(llama_dir):
    """A tiny model in float32, where a prefill and a decode give the same greedy tokens (in bfloat16 they
    need not, which no resume can change)."""
    llm = LLM(str(llama_dir), dtype="float32", show_progress=False)
    yield llm.engine
    llm.shutdown()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=40, seed=99, max_tokens=20, ignore_eos=True, frequency_penalty=1.5,
                   presence_penalty=1.0, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, seed=5, max_tokens=20, min_tokens=16),
], ids=["greedy", "seeded", "seeded-with-penalties", "seeded-min-tokens"])
def test_a_resumed_request_continues_with_the_undisturbed_tokens(engine, params):
    full, _ = run(engine, PROMPT, params)
    for cut in (1, 7, 13):
        resumed, streamed = resumed_after(engine, PROMPT, params, full, cut)
        assert resumed.outputs[0].token_ids == full.outputs[0].token_ids
        assert streamed[0][0] == full.outputs[0].token_ids[cut:]  # only what is new, nothing repeated
        assert resumed.outputs[0].finish_reason == full.outputs[0].finish_reason
        assert resumed.prompt_token_ids == full.prompt_token_ids


def test_a_seeded_resume_draws_each_position_with_its_own_seed(engine):
    """Without its output offset a resumed sample would draw its next token with position 0's seed: the seeded
    tokens then differ from an undisturbed run's (checked here, so the test above can fail)."""
    params = SamplingParams(temperature=1.5, seed=77, max_tokens=16, ignore_eos=True)
    full, _ = run(engine, PROMPT, params)
    cut = 6
    as_new_prompt, _ = run(engine, engine.tokenizer.encode(PROMPT) + full.token_ids[:cut],
                           SamplingParams(temperature=1.5, seed=77, max_tokens=16 - cut, ignore_eos=True))
    resumed, _ = resumed_after(engine, PROMPT, params, full, cut)
    assert resumed.token_ids[cut:] == full.token_ids[cut:]
    assert as_new_prompt.token_ids != full.token_ids[cut:]


def test_a_stop_string_that_starts_before_the_resume_ends_it_where_an_undisturbed_run_does(engine):
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full, _ = run(engine, PROMPT, plain)
    cut = 8
    delivered_text = engine.tokenizer.decode(full.token_ids[:cut])
    stop = full.text[len(delivered_text) - 3:len(delivered_text) + 3]  # begins in the delivered text
    assert stop not in full.text[:len(delivered_text) - 1] and stop not in PROMPT
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    undisturbed, undisturbed_streamed = run(engine, PROMPT, params)
    held_back = len(stop) - 1  # the delivered text's tail may begin the stop string: never sent
    sent = len(delivered_text) - held_back
    resumed, streamed = run(engine, PROMPT, params, ResumeState((ResumedSample(0, tuple(full.token_ids[:cut]), sent),)))
    assert resumed.finish_reason == undisturbed.finish_reason == "stop" and resumed.stop_reason == stop
    assert resumed.text == undisturbed.text
    assert undisturbed_streamed[0][1][:sent] + streamed[0][1] == undisturbed.text


def test_n_samples_resume_only_those_unfinished_each_with_its_seed(engine):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=14, ignore_eos=True)
    full, _ = run(engine, PROMPT, params)
    cut = 5
    samples = tuple(ResumedSample(c.index, tuple(c.token_ids[:cut]), 0) for c in full.outputs if c.index != 1)
    resumed, streamed = run(engine, PROMPT, params, ResumeState(samples))
    assert [c.index for c in resumed.outputs] == [0, 2]
    for completion in resumed.outputs:
        assert completion.token_ids == full.outputs[completion.index].token_ids
        assert streamed[completion.index][0] == full.outputs[completion.index].token_ids[cut:]


def test_logprobs_of_a_resumed_request_cover_its_new_tokens(engine):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    full, _ = run(engine, PROMPT, params)
    cut = 4
    resumed, _ = resumed_after(engine, PROMPT, params, full, cut)
    assert len(resumed.logprobs) == len(full.token_ids) - cut
    for new, old, token_id in zip(resumed.logprobs, full.logprobs[cut:], full.token_ids[cut:]):
        assert set(new) == set(old)
        assert new[token_id].logprob == pytest.approx(old[token_id].logprob, abs=1e-3)


def test_a_grammar_takes_the_delivered_tokens_before_the_new_ones(engine):
    constraint = {"regex": r"(Paris|Lyon|Nice), (France|Italy)\."}
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=constraint)
    full, _ = run(engine, PROMPT, params)
    assert full.finish_reason == "stop" and full.text in ("Paris, France.", "Lyon, France.", "Nice, France.",
                                                          "Paris, Italy.", "Lyon, Italy.", "Nice, Italy.")
    resumed, _ = resumed_after(engine, PROMPT, params, full, 2)
    assert resumed.token_ids == full.token_ids and resumed.text == full.text and resumed.error is None


def test_delivered_tokens_the_grammar_refuses_fail_the_request_alone(engine):
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs={"choice": ["yes", "no"]})
    refused = tuple(engine.tokenizer.encode(" maybe"))
    output, _ = run(engine, PROMPT, params, ResumeState((ResumedSample(0, refused, 0),)))
    assert output.finished and "refuses" in output.error


def test_a_continuation_that_no_longer_fits_is_refused_naming_why(engine):
    prompt = engine.tokenizer.encode(PROMPT)
    delivered = tuple([42] * (engine.max_model_len - len(prompt)))
    too_long = r"already generated make \d+ but the context length \(max_model_len\)"
    with pytest.raises(InvalidRequestError, match=too_long):
        engine.add_request("too-long", PROMPT, SamplingParams(max_tokens=None),
                           resume=ResumeState((ResumedSample(0, delivered, 0),)))
    with pytest.raises(InvalidRequestError, match="distinct samples"):
        engine.add_request("bad-index", PROMPT, SamplingParams(n=2),
                           resume=ResumeState((ResumedSample(2, (1,), 0),)))
    assert not engine.has_unfinished_requests()
