"""Structured output over HTTP (OpenAI's response_format, vLLM's structured_outputs and guided_* fields) with the
real openai client, and streamed through AsyncLLM; bad constraints get 400s that name the field."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from pydantic import BaseModel, Field

from engine import SamplingParams
from structured_output_cases import CASE_MAX_TOKENS, CASES

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON with their name and age."}]


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


def error_of(response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_response_format_json_schema_gives_content_that_validates(server):
    response = server.openai.chat.completions.create(
        model=server.model, messages=ASK_PERSON, temperature=0, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_the_openai_client_parses_a_pydantic_response_format(server):
    completion = server.openai.chat.completions.parse(
        model=server.model, messages=[{"role": "user", "content": "Name a city and its country."}],
        response_format=City, temperature=0, max_tokens=64)
    assert isinstance(completion.choices[0].message.parsed, City)


def test_a_streamed_json_schema_answer_adds_up_and_validates(server):
    stream = server.openai.chat.completions.create(
        model=server.model, messages=ASK_PERSON, temperature=0, max_tokens=64, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_response_format_json_object_gives_a_json_object(server):
    response = server.openai.chat.completions.create(
        model=server.model, messages=ASK_PERSON, temperature=0, max_tokens=96,
        response_format={"type": "json_object"})
    assert isinstance(json.loads(response.choices[0].message.content), dict)


@pytest.mark.parametrize("extra_body, check", [
    ({"guided_choice": ["Paris", "London"]}, lambda text: text in ("Paris", "London")),
    ({"guided_regex": "[0-9]{4}"}, lambda text: len(text) == 4 and text.isdigit()),
    ({"structured_outputs": {"choice": [" Paris", " Rome"]}}, lambda text: text in (" Paris", " Rome")),
    ({"guided_json": PERSON}, lambda text: jsonschema.validate(json.loads(text), PERSON) is None),
    ({"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}},
     lambda text: " " not in text.replace('": "', "").split('"name"')[0]),
])
def test_vllm_fields_constrain_a_completion(server, extra_body, check):
    response = server.openai.completions.create(model=server.model, prompt="The capital of France is",
                                                temperature=0, max_tokens=48, extra_body=extra_body)
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and check(choice.text), choice.text


def test_max_tokens_cuts_a_constrained_answer_with_length(server):
    response = server.openai.completions.create(model=server.model, prompt="A person as JSON:", temperature=0,
                                                max_tokens=3, extra_body={"guided_json": PERSON})
    assert response.choices[0].finish_reason == "length"


def test_n_streamed_completions_each_follow_the_constraint(server):
    stream = server.openai.completions.create(model=server.model, prompt="A person as JSON:", n=4, seed=3,
                                              temperature=1.0, max_tokens=64, stream=True,
                                              extra_body={"structured_outputs": {"json": PERSON}})
    texts = ["", "", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_streaming_through_async_llm_with_n_samples(engine):
    cases = [c for c in CASES if c.name in ("order", "ipv4", "planet")]

    async def stream(case):
        pieces, final = {}, None
        params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=CASE_MAX_TOKENS,
                                structured_outputs=case.structured_outputs)
        async for output in engine.generate(case.prompt, params):
            for completion in output.outputs:
                pieces[completion.index] = pieces.get(completion.index, "") + completion.new_text
            final = output
        return pieces, final

    async def all_cases():
        return await asyncio.gather(*(stream(case) for case in cases))

    for case, (pieces, final) in zip(cases, asyncio.run(all_cases())):
        assert final.finished and len(final.outputs) == 4
        for completion in final.outputs:
            assert pieces[completion.index] == completion.text
            assert completion.finish_reason == "stop"
            case.check(completion.text)


# ---- bad constraints: 400s that name the field -----------------------------------------------------------------
def chat_body(**fields) -> dict:
    return {"model": "smollm2", "messages": ASK_PERSON, "max_tokens": 8, **fields}


def completion_body(**fields) -> dict:
    return {"model": "smollm2", "prompt": "hi", "max_tokens": 8, **fields}


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/chat/completions",
     chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}),
     "response_format.json_schema.schema", "objekt"),
    ("/v1/completions", completion_body(guided_json={"type": "string", "pattern": "[a-"}), "guided_json",
     "unclosed character class"),
    ("/v1/completions", completion_body(guided_regex="(ab"), "guided_regex", "regex"),
    ("/v1/completions", completion_body(structured_outputs={"grammar": "start: nothing"}),
     "structured_outputs.grammar", "unknown name"),
    ("/v1/chat/completions", chat_body(guided_json=PERSON, guided_regex="a+"), "guided_regex", "only one"),
    ("/v1/chat/completions", chat_body(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
     "structured_outputs.regex", "only one"),
    ("/v1/completions", completion_body(guided_json={"type": "array", "uniqueItems": True}), "guided_json",
     "uniqueItems"),
    ("/v1/completions", completion_body(guided_json={"type": "object", "if": {}, "then": {}}), "guided_json", "if"),
    ("/v1/chat/completions", chat_body(structured_outputs={"json": {"type": "string", "nullable": True}}),
     "structured_outputs.json", "nullable"),
    ("/v1/completions", completion_body(guided_choice=[]), "guided_choice", "non-empty"),
    ("/v1/completions", completion_body(structured_outputs={"structural_tag": "{}"}),
     "structured_outputs.structural_tag", "not supported"),
    ("/v1/chat/completions", chat_body(response_format={"type": "json_schema"}), "response_format", "schema"),
    ("/v1/chat/completions",  # a lone surrogate the grammar library cannot serialize: a 400, not a 500
     chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
         "type": "string", "enum": ["\ud800"]}}}), "response_format.json_schema.schema", "not JSON serializable"),
])
def test_a_bad_constraint_gets_a_400_naming_the_field(server, path, body, param, words):
    error = error_of(server.post(path, json=body))
    assert error["param"] == param and words in error["message"], error


def test_bad_constraints_leave_the_engine_serving(server, idle_engine, wait_idle):
    for _ in range(3):
        error_of(server.post("/v1/completions", json=completion_body(guided_regex="[")))
    response = server.openai.completions.create(model=server.model, prompt="The capital of France is",
                                                max_tokens=4, temperature=0, extra_body={"guided_choice": [" Paris"]})
    assert response.choices[0].text == " Paris"
    stats = wait_idle(idle_engine)
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
