"""Structured output end to end with the packaged SmolLM2: every output satisfies its constraint, whatever else
the batch holds, however the steps run (ahead of their tokens, after a preemption), with n > 1 and cut-offs."""
from __future__ import annotations

import json
import math
import re
import threading

import pytest

from engine import LLM, RequestFailedError, SamplingParams
from structured_output_cases import CASE_MAX_TOKENS, CASES

FREE_PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "My favourite food is"]


def constrained(case, **overrides) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": CASE_MAX_TOKENS,
                             "structured_outputs": case.structured_outputs, **overrides})


def check_all(cases, outputs) -> None:
    for case, output in zip(cases, outputs):
        for completion in output.outputs:
            assert completion.finish_reason == "stop", (case.name, completion.text)
            case.check(completion.text)


def test_fifty_schemas_regexes_and_choices_all_validate(smollm2):
    outputs = smollm2.generate([case.prompt for case in CASES], [constrained(case) for case in CASES])
    check_all(CASES, outputs)


def test_each_of_n_samples_follows_the_constraint_on_its_own(smollm2):
    cases = [c for c in CASES if c.name in ("person", "tags", "union", "ipv4", "sentence", "planet")]
    outputs = smollm2.generate([case.prompt for case in cases],
                               [constrained(case, n=4, temperature=1.0, seed=7) for case in cases])
    check_all(cases, outputs)
    texts = [completion.text for output in outputs for completion in output.outputs]
    assert len(set(texts)) > len(cases)  # sampled: the children differ


def test_max_tokens_cuts_a_constrained_output_with_finish_reason_length(smollm2):
    case = next(c for c in CASES if c.name == "nested_array")
    output = smollm2.generate([case.prompt], constrained(case, max_tokens=6))[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 6
    with pytest.raises(json.JSONDecodeError):
        json.loads(output.text)


def test_a_stop_string_still_ends_a_constrained_output(smollm2):
    case = next(c for c in CASES if c.name == "city")
    full = smollm2.generate([case.prompt], constrained(case))[0].text
    output = smollm2.generate([case.prompt], constrained(case, stop=[","]))[0]
    assert output.finish_reason == "stop" and output.stop_reason == ","
    assert output.text == full[:full.index(",")]


def test_free_requests_get_the_same_tokens_beside_constrained_ones(smollm2):
    free = SamplingParams(temperature=0, max_tokens=24)
    alone = smollm2.generate(FREE_PROMPTS, free)
    cases = CASES[::5]
    mixed = smollm2.generate(FREE_PROMPTS + [c.prompt for c in cases], [free] * len(FREE_PROMPTS)
                             + [constrained(c) for c in cases])
    assert [o.token_ids for o in mixed[:len(FREE_PROMPTS)]] == [o.token_ids for o in alone]
    check_all(cases, mixed[len(FREE_PROMPTS):])


@pytest.mark.parametrize("samples_after_forward", [True, False])
def test_steps_launched_ahead_wait_for_the_tokens_a_mask_needs(smollm2, monkeypatch, samples_after_forward):
    """A GPU launches step N+1 before step N's tokens reach the host; a step with constrained rows collects step N
    between its forward pass and its sampling (one rank), or before its launch (TP peers need the masks with the
    plan). Forced here on the CPU: the outputs are those of synchronous steps."""
    cases = CASES[1::4]
    city = next(c for c in CASES if c.name == "city")
    prompts = FREE_PROMPTS + [c.prompt for c in cases] + [city.prompt]
    params = [SamplingParams(temperature=0, max_tokens=16)] * len(FREE_PROMPTS) + [constrained(c) for c in cases] \
        + [constrained(city, stop=[","])]  # detokenized while the next step's masks fill: its stop still ends it
    synchronous = smollm2.generate(prompts, params)
    assert synchronous[-1].finish_reason == "stop"
    engine = smollm2.engine
    executor = engine.executor
    launches = {"callback": 0, "plain": 0}
    execute_async = executor.execute_async

    def counting(scheduled, before_sampling=None):
        launches["callback" if before_sampling is not None else "plain"] += 1
        return execute_async(scheduled, before_sampling)
    monkeypatch.setattr(executor, "execute_async", counting)
    monkeypatch.setattr(type(executor), "samples_after_forward", property(lambda self: samples_after_forward))
    engine._run_ahead = True
    try:
        ahead = smollm2.generate(prompts, params)
    finally:
        engine._run_ahead = False
    assert [o.token_ids for o in ahead] == [o.token_ids for o in synchronous]
    assert [o.finish_reason for o in ahead] == [o.finish_reason for o in synchronous]
    check_all(cases, ahead[len(FREE_PROMPTS):-1])
    assert (launches["callback"] > 0) == samples_after_forward, launches


def test_logprobs_are_those_of_the_masked_distribution(smollm2):
    prompt = "The first letter of the alphabet is the letter"
    output = smollm2.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=5,
                                                       structured_outputs={"choice": ["A", "B"]}))[0]
    first = output.logprobs[0]
    allowed = {token: lp.logprob for token, lp in first.items() if lp.logprob > -9999.0}
    assert len(allowed) == 2 and len(first) == 5  # "A" and "B" are one token each; the others have no probability
    assert math.isclose(sum(math.exp(v) for v in allowed.values()), 1.0, abs_tol=1e-3)
    free = smollm2.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=20))[0].logprobs[0]
    token = output.token_ids[0]
    if token in free:  # renormalised over two tokens, the chosen one is likelier than in the free distribution
        assert allowed[token] > free[token].logprob


def test_a_request_waits_for_its_grammar_without_holding_up_others(smollm2):
    engine = smollm2.engine
    manager = engine.structured_output
    release = threading.Event()
    compile_ = manager._compile

    def slow_compile(params):
        release.wait(timeout=60)
        return compile_(params)
    manager._compile = slow_compile
    try:
        constraint = {"regex": "(slow )+grammar"}  # a key no other test compiles
        engine.add_request("waits", "Say it:", SamplingParams(temperature=0, max_tokens=8,
                                                              structured_outputs=constraint))
        engine.add_request("free", "Hello", SamplingParams(temperature=0, max_tokens=4))
        finished = {}
        while "free" not in finished:
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert engine.scheduler.num_waiting == 1  # still compiling, still in line
    finally:
        release.set()
        manager._compile = compile_
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    waited = finished["waits"]
    if waited.finish_reason == "stop":
        assert re.fullmatch("(slow )+grammar", waited.text), waited.text
    else:
        assert waited.finish_reason == "length" and waited.text.startswith("slow"), waited.text


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(smollm2):
    bad = SamplingParams(max_tokens=4, structured_outputs={"grammar": 'start: "a" <|no_such_token|>'})
    with pytest.raises(RequestFailedError, match="no_such_token"):
        smollm2.generate(["Hello"], bad)
    after = smollm2.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))[0]
    assert "Paris" in after.text


@pytest.fixture(scope="module")
def tiny_cache_llm():
    """Room for about three short sequences, and 32 tokens a step: the scheduler preempts (and recomputes) while
    constrained requests run, and prefills long prompts in chunks."""
    llm = LLM("smollm2-135m", show_progress=False, num_kv_blocks=12, max_model_len=192, max_num_seqs=8,
              max_num_batched_tokens=32)
    yield llm
    llm.shutdown()


def test_preemption_keeps_constrained_outputs_valid(tiny_cache_llm):
    """A preempted request keeps its matcher (its output tokens stay); recomputing its KV does not touch it."""
    cases = [c for c in CASES if c.name in ("order", "defs", "nested_array", "recipe", "geo")]
    outputs = tiny_cache_llm.generate([c.prompt for c in cases], [constrained(c) for c in cases])
    assert tiny_cache_llm.engine.stats()["num_preemptions"] > 0
    check_all(cases, outputs)


def test_chunked_prefill_masks_only_the_sampling_chunk(tiny_cache_llm, smollm2):
    """A prompt prefilled over several steps samples (and is masked) once, after its last chunk."""
    cases = [c for c in CASES if c.name in ("person", "hex_color")]
    prompts = ["Here is a record of a person that we keep on file for later use. " * 4 + cases[0].prompt,
               "Colours are written in hex with a hash sign and six digits in web pages. " * 4 + cases[1].prompt]
    assert min(len(smollm2.get_tokenizer().encode(p)) for p in prompts) > 64  # at least three chunks
    outputs = tiny_cache_llm.generate(prompts, [constrained(c) for c in cases])
    check_all(cases, outputs)
