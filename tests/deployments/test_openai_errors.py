"""Bad requests get OpenAI's error body with the right status, before anything reaches the engine; failures
of one request (the engine's or the server's) never hurt the others."""
from __future__ import annotations

import json

import openai
import pytest
import requests

from engine.errors import EngineDeadError, InvalidRequestError

MODEL = "smollm2"
LONG_TEXT = "hello " * 9000  # more tokens than SmolLM2's 8192-token context
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def completion(**fields) -> str:
    return json.dumps({"model": MODEL, "prompt": "hi", **fields})


def chat(**fields) -> str:
    return json.dumps({"model": MODEL, "messages": USER, **fields})


# (name, path, raw body, expected status, a word the message or param must contain)
BAD_REQUESTS = [
    ("not json", COMPLETIONS, '{"model": "smollm2", "prompt": ', 400, "JSON"),
    ("body is a list", COMPLETIONS, "[]", 400, ""),
    ("prompt missing", COMPLETIONS, json.dumps({"model": MODEL}), 400, "prompt"),
    ("prompt a number", COMPLETIONS, completion(prompt=5), 400, "prompt"),
    ("prompt mixes text and ids", COMPLETIONS, completion(prompt=["a", 1]), 400, "prompt"),
    ("prompt empty", COMPLETIONS, completion(prompt=""), 400, "prompt"),
    ("prompt ids outside vocabulary", COMPLETIONS, completion(prompt=[1, 10**9]), 400, "vocabulary"),
    ("prompt longer than the context", COMPLETIONS, completion(prompt=LONG_TEXT), 400, "context length"),
    ("max_tokens beyond the context", COMPLETIONS, completion(max_tokens=100_000), 400, "context length"),
    ("negative max_tokens", COMPLETIONS, completion(max_tokens=-1), 400, "max_tokens"),
    ("max_tokens a string", COMPLETIONS, completion(max_tokens="10"), 400, "max_tokens"),
    ("temperature -1", COMPLETIONS, completion(temperature=-1), 400, "temperature"),
    ("top_p 0", COMPLETIONS, completion(top_p=0), 400, "top_p"),
    ("n 0", COMPLETIONS, completion(n=0), 400, "n"),
    ("logprobs 50", COMPLETIONS, completion(logprobs=50), 400, "logprobs"),
    ("stop a number", COMPLETIONS, completion(stop=5), 400, "stop"),
    ("stop an empty string", COMPLETIONS, completion(stop=[""]), 400, "stop"),
    ("presence_penalty 3", COMPLETIONS, completion(presence_penalty=3), 400, "presence_penalty"),
    ("seed a string", COMPLETIONS, completion(seed="abc"), 400, "seed"),
    ("min_tokens above max_tokens", COMPLETIONS, completion(min_tokens=20, max_tokens=5), 400, "min_tokens"),
    ("top_k -5", COMPLETIONS, completion(top_k=-5), 400, "top_k"),
    ("stream_options without stream", COMPLETIONS, completion(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("logit_bias", COMPLETIONS, completion(logit_bias={"50": 10}), 400, "logit_bias"),
    ("stream not a boolean", COMPLETIONS, completion(stream="yes"), 400, "stream"),
    ("unknown model", COMPLETIONS, completion(model="gpt-9"), 404, "does not exist"),
    ("messages empty", CHAT, chat(messages=[]), 400, "messages"),
    ("messages not a list", CHAT, chat(messages="hi"), 400, "messages"),
    ("message role missing", CHAT, chat(messages=[{"content": "hi"}]), 400, "role"),
    ("message role unknown", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "role"),
    ("message content a number", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "content"),
    ("image content part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400, "image input is not supported"),
    ("file content part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "file", "file": {}}]}]), 400,
     "'file'"),
    ("messages longer than the context", CHAT, chat(messages=[{"role": "user", "content": LONG_TEXT}]), 400,
     "context length"),
    ("top_logprobs 30", CHAT, chat(logprobs=True, top_logprobs=30), 400, "top_logprobs"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("logprobs an integer in chat", CHAT, chat(logprobs=3), 400, "logprobs"),
    ("max_completion_tokens 0", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("n too large", CHAT, chat(n=1000), 400, "n"),
    ("tools with an invalid schema", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objekt"}}}]), 400, "tools.0.function.parameters"),
    ("tools repeating a name", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2), 400,
     "tools.1.function.name"),
    ("unknown model in chat", CHAT, chat(model="gpt-9"), 404, "does not exist"),
]


def assert_openai_error(response: requests.Response, status: int, word: str = "") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert word in error["message"] or word in (error["param"] or ""), error
    return error


@pytest.mark.parametrize("path, body, status, word", [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_request_gets_openai_error(server, path, body, status, word):
    assert_openai_error(server.post(path, data=body), status, word)


def test_bad_requests_never_reach_the_engine_and_the_server_carries_on(server, idle_engine, wait_idle):
    before = idle_engine.stats()
    for _, path, body, status, _ in BAD_REQUESTS:
        assert server.post(path, data=body).status_code == status
    assert idle_engine.stats()["prompt_tokens"] == before["prompt_tokens"]
    response = server.openai.chat.completions.create(model=server.model, messages=USER, max_tokens=3)
    assert response.choices[0].message.content
    stats = wait_idle(idle_engine)
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


@pytest.mark.parametrize("part, kind", [
    (IMAGE, "image"), ({"type": "input_image", "image_url": "http://x/y.png"}, "image"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio"),
    ({"type": "video_url", "video_url": {"url": "http://x/y.mp4"}}, "video"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_media_part_is_refused_naming_the_text_stack_served(server, part, kind, stream):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    error = assert_openai_error(server.post(CHAT, data=chat(messages=messages, stream=stream)), 400)
    assert error["message"] == f"this server serves the text stack of {MODEL} only; {kind} input is not supported"
    assert error["param"] == "messages.1.content" and error["type"] == "invalid_request_error"


def test_openai_client_sees_the_image_refusal_as_bad_request(server):
    with pytest.raises(openai.BadRequestError, match="image input is not supported"):
        server.openai.chat.completions.create(model=server.model, max_tokens=3, messages=[
            {"role": "user", "content": [{"type": "text", "text": "Describe it."}, IMAGE]}])


def test_unknown_route_and_wrong_method_get_openai_errors(server):
    assert_openai_error(server.get("/v1/nothing"), 404)
    assert_openai_error(server.get(COMPLETIONS), 405)


def test_validation_error_names_the_field(server):
    error = assert_openai_error(server.post(COMPLETIONS, data=completion(temperature=-5)), 400)
    assert error["param"] == "temperature" and error["type"] == "invalid_request_error"


VOCAB = 49152  # SmolLM2's
# The requests that killed the engine, crashed the server or were silently ignored before issue 18, and their
# neighbours: (name, path, raw body, status, a word of the message or the param). Raw bodies, so that NaN,
# huge integers and escaped lone surrogates reach the server as a hostile client sends them.
KNOWN_KILLERS = [
    ("top_k 2**70", COMPLETIONS, completion(top_k=2**70), 400, "top_k"),
    ("top_k 2**70 streamed chat", CHAT, chat(top_k=2**70, stream=True), 400, "top_k"),
    ("top_k 2**63", CHAT, chat(top_k=2**63), 400, "top_k"),
    ("stop id = vocab with min_tokens", COMPLETIONS, completion(min_tokens=1, stop_token_ids=[VOCAB]), 400,
     "stop_token_ids"),
    ("stop id = vocab, no min_tokens", CHAT, chat(stop_token_ids=[VOCAB]), 400, "stop_token_ids"),
    ("stop id 2**70", COMPLETIONS, completion(min_tokens=1, stop_token_ids=[2**70]), 400, "stop_token_ids"),
    ("seed 2**64", COMPLETIONS, completion(seed=2**64), 400, "seed"),
    ("n 2**40", COMPLETIONS, completion(n=2**40), 400, "n"),
    ("max_tokens 2**70", COMPLETIONS, completion(max_tokens=2**70), 400, "max_tokens"),
    ("min_tokens 2**70", CHAT, chat(min_tokens=2**70), 400, "min_tokens"),
    ("temperature NaN", COMPLETIONS, '{"model": "smollm2", "prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("top_p Infinity", CHAT, json.dumps({"model": MODEL, "messages": USER})[:-1] + ', "top_p": Infinity}', 400,
     "top_p"),
    ("repetition_penalty -Infinity", COMPLETIONS,
     '{"model": "smollm2", "prompt": "hi", "repetition_penalty": -Infinity}', 400, "repetition_penalty"),
    ("lone surrogate prompt", COMPLETIONS, '{"model": "smollm2", "prompt": "hi \\ud800 there"}', 400, "surrogate"),
    ("lone surrogate in a prompt list", COMPLETIONS, '{"model": "smollm2", "prompt": ["ok", "\\udfff"]}', 400,
     "surrogate"),
    ("lone surrogate message", CHAT,
     '{"model": "smollm2", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages"),
    ("lone surrogate model", CHAT, '{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', 404,
     "does not exist"),
    ("lone surrogate stop", COMPLETIONS, '{"model": "smollm2", "prompt": "hi", "stop": ["\\ud800"]}', 400, "stop"),
    ("guided_json of an unknown type", CHAT, chat(guided_json={"type": "objekt"}), 400, "guided_json"),
    ("guided_choice empty", COMPLETIONS, completion(guided_choice=[]), 400, "guided_choice"),
    ("two constraints", CHAT, chat(response_format={"type": "json_object"}, guided_regex="a+"), 400, "guided_regex"),
    ("response_format json_schema without a schema", COMPLETIONS, completion(response_format={"type": "json_schema"}),
     400, "response_format"),
    ("tool_choice required without tools", CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    ("tool_choice a function without tools", CHAT, chat(tool_choice={"type": "function", "function": {"name": "f"}}),
     400, "tool_choice"),
    ("tool result answering no call", CHAT,
     chat(messages=USER + [{"role": "tool", "tool_call_id": "x", "content": "1"}]), 400, "messages.1.tool_call_id"),
    ("use_beam_search", COMPLETIONS, completion(use_beam_search=True), 400, "use_beam_search"),
    ("prompt_logprobs", COMPLETIONS, completion(prompt_logprobs=1), 400, "prompt_logprobs"),
    ("continuous usage stats", COMPLETIONS, completion(stream=True, stream_options={"continuous_usage_stats": True}),
     400, "continuous_usage_stats"),
    ("1000 stop strings", COMPLETIONS, completion(stop=["a"] * 1000), 400, "stop"),
]


@pytest.mark.parametrize("path, body, status, word", [case[1:] for case in KNOWN_KILLERS],
                         ids=[case[0] for case in KNOWN_KILLERS])
def test_a_known_killer_gets_a_clear_error(server, path, body, status, word):
    assert_openai_error(server.post(path, data=body), status, word)


def test_the_known_killers_leave_the_engine_serving(server, idle_engine, wait_idle):
    for _, path, body, status, _ in KNOWN_KILLERS:
        assert server.post(path, data=body).status_code == status
    assert idle_engine.is_healthy
    response = server.openai.completions.create(model=server.model, prompt="The capital of France is",
                                                max_tokens=4, temperature=0)
    assert "Paris" in response.choices[0].text
    stats = wait_idle(idle_engine)
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_settings_that_do_nothing_are_accepted(server):
    for body in (chat(tool_choice="none", max_tokens=1), chat(tools=[], max_tokens=1),
                 chat(response_format={"type": "text"}, max_tokens=1), completion(use_beam_search=False, max_tokens=1),
                 chat(modalities=["text"], max_tokens=1), chat(temperature=5, max_tokens=1)):
        assert server.post(CHAT if "messages" in body else COMPLETIONS, data=body).status_code == 200, body


def test_body_without_content_type_still_parses(server):
    response = requests.post(f"{server.base_url}{COMPLETIONS}", data=completion(max_tokens=1), timeout=30)
    assert response.status_code == 200, response.text


def test_engine_that_is_not_healthy_gets_503(controllable):
    client, served = controllable
    client.healthy = False
    assert_openai_error(served.get("/health"), 503)
    assert_openai_error(served.post(COMPLETIONS, data=completion(max_tokens=1)), 503)
    client.healthy = True
    assert served.get("/health").status_code == 200


def test_engine_dead_error_gets_503(controllable):
    client, served = controllable
    client.failure = EngineDeadError("the engine step loop failed")
    assert_openai_error(served.post(COMPLETIONS, data=completion(max_tokens=1)), 503, "engine")
    assert_openai_error(served.post(CHAT, data=chat(max_tokens=1, stream=True)), 503, "engine")


def test_engine_refusing_a_streaming_request_still_gets_a_400_status(controllable):
    client, served = controllable
    client.failure = InvalidRequestError("the prompt is not acceptable")
    assert_openai_error(served.post(CHAT, data=chat(max_tokens=1, stream=True)), 400, "not acceptable")


def test_engine_failing_mid_stream_sends_an_error_event(controllable, idle_engine, wait_idle):
    client, served = controllable
    client.failure_after_first_output = EngineDeadError("the engine step loop failed")
    stream = served.openai.chat.completions.create(model=served.model, messages=USER, max_tokens=20, stream=True)
    with pytest.raises(openai.APIError, match="engine"):
        list(stream)
    stats = wait_idle(idle_engine)
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_unexpected_failure_is_500_and_other_requests_carry_on(controllable, idle_engine, wait_idle):
    client, served = controllable
    with served.post(COMPLETIONS, data=completion(max_tokens=30, ignore_eos=True, stream=True, logprobs=0),
                     stream=True) as running:
        events = running.iter_lines()
        first = next(line for line in events if line)  # the request is in flight
        client.failure = RuntimeError("something broke")
        assert_openai_error(served.post(COMPLETIONS, data=completion(max_tokens=1)), 500, "something broke")
        assert_openai_error(served.post(CHAT, data=chat(max_tokens=1, stream=True)), 500, "something broke")
        client.failure = None
        lines = [first] + [line for line in events if line]
    assert lines[-1] == b"data: [DONE]"
    chunks = [json.loads(line.removeprefix(b"data: ")) for line in lines[:-1]]
    assert sum(len(chunk["choices"][0]["logprobs"]["tokens"]) for chunk in chunks) == 30
    assert served.post(COMPLETIONS, data=completion(max_tokens=1)).status_code == 200
    wait_idle(idle_engine)
