"""POST /v1/messages (Anthropic's Messages API) over real HTTP with the real `anthropic` client, against SmolLM2
on the chat-completions path: text, system prompts, streaming events, stop reasons, tools, thinking, auth and
Anthropic's error bodies."""
from __future__ import annotations

import json
import re

import anthropic
import jsonschema
import pytest
import requests

from deployments.openai import build_openai_app
from deployments.openai.messages import ChatTranslation
from deployments.openai.messages_protocol import MessagesRequest
from deployments.openai.messages_stream import MessageTranslator
from engine.errors import EngineDeadError, RequestFailedError

MODEL = "smollm2"
KEY = "sk-ant-test-0123456789"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # this client version sends sampling fields through extra_body


def client_of(served, api_key: str = "x") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.base_url, api_key=api_key, max_retries=0, timeout=60)


def assert_anthropic_error(response: requests.Response, status: int, error_type: str, word: str = "") -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == error_type, body
    assert word in body["error"]["message"], body
    return body["error"]["message"]


def without_ids(message) -> dict:
    """A reply as the client reads it, less what differs between two requests: the message's and calls' ids."""
    dumped = message.model_dump(exclude={"id"})
    for block in dumped["content"]:
        block.pop("id", None)
    return dumped


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return client_of(server)


# ---- text ---------------------------------------------------------------------------------------------------
def test_a_text_message_answers_with_the_chat_routes_greedy_text(client, server, engine):
    reply = client.messages.create(model=MODEL, max_tokens=40, messages=QUESTION, extra_body=GREEDY)
    chat = server.openai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0)
    assert [block.type for block in reply.content] == ["text"]
    assert reply.content[0].text == chat.choices[0].message.content and "Paris" in reply.content[0].text
    assert reply.id.startswith("msg_") and reply.type == "message" and reply.role == "assistant"
    assert reply.model == MODEL
    assert (reply.stop_reason, reply.stop_sequence) == ("end_turn", None)
    assert reply.usage.input_tokens == len(engine.tokenizer.encode_chat(QUESTION)) == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens


def test_a_system_prompt_is_the_chat_system_message_whether_string_or_blocks(client, server, engine):
    system = "You answer in one word."
    as_string = client.messages.create(model=MODEL, max_tokens=20, system=system, messages=QUESTION,
                                       extra_body=GREEDY)
    blocks = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
    as_blocks = client.messages.create(model=MODEL, max_tokens=20, messages=QUESTION, extra_body=GREEDY,
                                       system=blocks)
    chat_messages = [{"role": "system", "content": system}] + QUESTION
    chat = server.openai.chat.completions.create(model=MODEL, messages=chat_messages, max_tokens=20, temperature=0)
    assert as_string.content[0].text == as_blocks.content[0].text == chat.choices[0].message.content
    assert as_string.usage.input_tokens == len(engine.tokenizer.encode_chat(chat_messages))


def test_text_blocks_and_earlier_turns_reach_the_template(client, server):
    history = [{"role": "user", "content": [{"type": "text", "text": "Hi!"}]},
               {"role": "assistant", "content": [{"type": "text", "text": "Hello! How can I help?"}]},
               {"role": "user", "content": "What is the capital of France?"}]
    reply = client.messages.create(model=MODEL, max_tokens=20, messages=history, extra_body=GREEDY)
    chat = server.openai.chat.completions.create(model=MODEL, max_tokens=20, temperature=0, messages=[
        {"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"}, QUESTION[0]])
    assert reply.content[0].text == chat.choices[0].message.content
    assert reply.usage.input_tokens == chat.usage.prompt_tokens


# ---- streaming ----------------------------------------------------------------------------------------------
def test_a_stream_sends_anthropics_events_in_order(client):
    events = list(client.messages.create(model=MODEL, max_tokens=30, messages=QUESTION, stream=True,
                                         extra_body=GREEDY))
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) == {"content_block_delta"}
    start = events[0].message
    assert start.content == [] and start.stop_reason is None and start.usage.input_tokens > 0
    assert events[1].content_block.type == "text" and events[1].content_block.text == ""
    assert all(event.index == 0 and event.delta.type == "text_delta" for event in events[2:-3])
    assert events[-2].delta.stop_reason == "end_turn" and events[-2].usage.output_tokens > 0


def test_the_streamed_message_equals_the_whole_one(client):
    for fields in ({"max_tokens": 40}, {"max_tokens": 6}, {"max_tokens": 40, "stop_sequences": ["Paris"]}):
        whole = client.messages.create(model=MODEL, messages=QUESTION, extra_body=GREEDY, **fields)
        with client.messages.stream(model=MODEL, messages=QUESTION, extra_body=GREEDY, **fields) as stream:
            text = "".join(stream.text_stream)
            streamed = stream.get_final_message()
        assert without_ids(streamed) == without_ids(whole), fields
        assert text == whole.content[0].text
        assert streamed.id.startswith("msg_") and streamed.id != whole.id


# ---- stop reasons -------------------------------------------------------------------------------------------
def test_a_stop_sequence_ends_the_message_and_is_named(client):
    whole = client.messages.create(model=MODEL, max_tokens=40, messages=QUESTION, extra_body=GREEDY)
    answer = whole.content[0].text
    assert "Paris" in answer
    reply = client.messages.create(model=MODEL, max_tokens=40, messages=QUESTION, extra_body=GREEDY,
                                   stop_sequences=["nowhere", "Paris"])
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", "Paris")
    assert reply.content[0].text == answer[:answer.index("Paris")]


def test_max_tokens_cuts_the_message(client):
    reply = client.messages.create(model=MODEL, max_tokens=3, messages=QUESTION, extra_body=GREEDY)
    assert (reply.stop_reason, reply.stop_sequence) == ("max_tokens", None)
    assert reply.usage.output_tokens == 3


def aborted(served) -> float:
    text = requests.get(f"{served.base_url}/metrics", timeout=30).text
    lines = [line for line in text.splitlines() if line.startswith("atom_ray:request_success_total") and "abort" in line]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_a_client_that_leaves_aborts_its_request_streamed_or_not(server, idle_engine, wait_idle):
    body = {"model": MODEL, "max_tokens": 2000, "messages": [{"role": "user", "content": "Tell me a long story."}]}
    before = aborted(server)
    with requests.post(f"{server.base_url}/v1/messages", json={**body, "stream": True}, stream=True,
                       timeout=60) as response:
        assert next(line for line in response.iter_lines() if line) == b"event: message_start"
    with pytest.raises(requests.Timeout):
        requests.post(f"{server.base_url}/v1/messages", json=body, timeout=1.5)
    stats = wait_idle(idle_engine)
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert aborted(server) == before + 2  # and the metrics count both, as for the chat route


# ---- tools ---------------------------------------------------------------------------------------------------
CITY = {"type": "string", "enum": ["Paris", "London", "Tokyo"]}
WEATHER = {"name": "get_weather", "description": "The weather in a city over the next days", "input_schema": {
    "type": "object", "properties": {"city": CITY, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}
TIME = {"name": "get_time", "description": "The local time in a city", "input_schema": {
    "type": "object", "properties": {"city": CITY}, "required": ["city"], "additionalProperties": False}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["name"]: tool["input_schema"] for tool in TOOLS}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


def assert_valid_calls(reply, names=tuple(SCHEMAS)) -> list:
    calls = [block for block in reply.content if block.type == "tool_use"]
    assert calls, reply.content
    for call in calls:
        assert call.name in names and call.id
        jsonschema.validate(call.input, SCHEMAS[call.name])
    assert reply.stop_reason == "tool_use"
    return calls


@pytest.mark.parametrize("tool_choice, names", [({"type": "any"}, tuple(SCHEMAS)),
                                                ({"type": "tool", "name": "get_time"}, ("get_time",))])
def test_a_forced_tool_choice_calls_a_tool_with_input_that_validates(client, tool_choice, names):
    reply = client.messages.create(model=MODEL, max_tokens=60, messages=WEATHER_QUESTION, tools=TOOLS,
                                   tool_choice=tool_choice, extra_body=GREEDY)
    assert_valid_calls(reply, names)
    with client.messages.stream(model=MODEL, max_tokens=60, messages=WEATHER_QUESTION, tools=TOOLS,
                                tool_choice=tool_choice, extra_body=GREEDY) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert without_ids(streamed) == without_ids(reply)
    assert any(event.type == "content_block_delta" and event.delta.type == "input_json_delta" for event in events)


def test_disable_parallel_tool_use_makes_one_call(client):
    reply = client.messages.create(model=MODEL, max_tokens=80, messages=WEATHER_QUESTION, tools=TOOLS,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                   extra_body={"temperature": 0.8, "top_k": 20})
    assert len(assert_valid_calls(reply)) == 1


def test_a_tool_result_continues_the_conversation_as_the_chat_route_would(client, server):
    called = client.messages.create(model=MODEL, max_tokens=60, messages=WEATHER_QUESTION, tools=TOOLS,
                                    tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    (call,) = assert_valid_calls(called, ("get_weather",))
    conversation = WEATHER_QUESTION + [called.to_param(), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "Sunny, 24 C"}]},
        {"type": "text", "text": "Summarize it."}]}]
    reply = client.messages.create(model=MODEL, max_tokens=30, messages=conversation, tools=TOOLS, extra_body=GREEDY)
    assert [block.type for block in reply.content] == ["text"] and reply.content[0].text
    assert reply.stop_reason in ("end_turn", "max_tokens")
    chat = server.openai.chat.completions.create(
        model=MODEL, max_tokens=30, temperature=0, tools=[
            {"type": "function", "function": {"name": tool["name"], "description": tool["description"],
                                              "parameters": tool["input_schema"]}} for tool in TOOLS],
        messages=WEATHER_QUESTION + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps(call.input)}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"},
            {"role": "user", "content": "Summarize it."}])
    assert reply.content[0].text == chat.choices[0].message.content
    assert reply.usage.input_tokens == chat.usage.prompt_tokens


def test_tool_choice_none_answers_in_text(client):
    reply = client.messages.create(model=MODEL, max_tokens=10, messages=WEATHER_QUESTION, tools=TOOLS,
                                   tool_choice={"type": "none"}, extra_body=GREEDY)
    assert [block.type for block in reply.content] == ["text"] and reply.stop_reason == "max_tokens"


def test_tool_use_and_tool_result_blocks_become_the_chat_requests_calls_and_tool_messages():
    conversation = [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Two tools.", "signature": "sig"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 1}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": True},
            {"type": "text", "text": "And tomorrow?"}]}]
    body = MessagesRequest.model_validate({"model": MODEL, "max_tokens": 5, "system": "Be brief.",
                                           "messages": conversation, "tools": TOOLS, "stop_sequences": ["END"],
                                           "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                                           "thinking": {"type": "enabled", "budget_tokens": 1024}})
    chat = ChatTranslation(body).chat_request()
    assert [message.to_template_dict() for message in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": "Let me look."},
        {"role": "tool", "content": "Sunny"},
        {"role": "tool", "content": "Error: boom"},
        {"role": "user", "content": "And tomorrow?"}]
    assert chat.messages[2].reasoning_content == "Two tools."
    calls = [(call.id, call.function.name, json.loads(call.function.arguments)) for call in chat.messages[2].tool_calls]
    assert calls == [("toolu_1", "get_weather", {"city": "Paris", "days": 1}),
                     ("toolu_2", "get_time", {"city": "Paris"})]
    assert [chat.messages[3].tool_call_id, chat.messages[4].tool_call_id] == ["toolu_1", "toolu_2"]
    assert [tool.function.parameters for tool in chat.tools] == [WEATHER["input_schema"], TIME["input_schema"]]
    assert (chat.tool_choice, chat.parallel_tool_calls, chat.stop) == ("required", False, ["END"])
    assert chat.chat_template_kwargs == {"enable_thinking": True}


# ---- thinking -----------------------------------------------------------------------------------------------
def test_the_reasoning_parsers_output_becomes_a_thinking_block(engine, serve_app):
    # deepseek_r1's output starts inside the reasoning: SmolLM2, which never closes it, only "thinks".
    with serve_app(build_openai_app(engine, MODEL, reasoning_parser="deepseek_r1")) as served:
        thinker = client_of(served)
        reply = thinker.messages.create(model=MODEL, max_tokens=6, messages=QUESTION, extra_body=GREEDY,
                                        thinking={"type": "enabled", "budget_tokens": 1024})
        with thinker.messages.stream(model=MODEL, max_tokens=6, messages=QUESTION, extra_body=GREEDY,
                                     thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
            deltas = [event.delta.type for event in stream if event.type == "content_block_delta"]
            streamed = stream.get_final_message()
    assert [block.type for block in reply.content] == ["thinking"] and reply.content[0].thinking
    assert reply.stop_reason == "max_tokens"
    assert set(deltas) == {"thinking_delta"}
    assert without_ids(streamed) == without_ids(reply)


def test_reasoning_text_and_calls_stream_as_blocks_that_add_up_to_the_message():
    translator = MessageTranslator("msg_1", MODEL, 7)
    def call(**piece) -> dict:
        return {"tool_calls": [{"index": 0, **piece}]}

    deltas = [{"role": "assistant", "content": ""}, {"reasoning_content": "Need "}, {"reasoning_content": "weather."},
              {"content": "Checking."},
              call(id="call_1", type="function", function={"name": "get_time", "arguments": ""}),
              call(function={"arguments": '{"city": '}), call(function={"arguments": '"Paris"}'})]
    chunks = [{"choices": [{"index": 0, "delta": delta}]} for delta in deltas]
    chunks[-1]["choices"][0]["finish_reason"] = "tool_calls"
    chunks.append({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}})
    data = b"".join(f"data: {json.dumps(chunk)}\n\n".encode() for chunk in chunks) + b"data: [DONE]\n\n"
    events = translator.start()
    for cut in range(0, len(data), 50):  # the chat stream's bytes in arbitrary pieces
        events += translator.feed_bytes(data[cut:cut + 50])
    assert [(event["type"], event.get("index")) for event in events] == [
        ("message_start", None),
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("message_delta", None), ("message_stop", None)]
    assert [event["delta"]["type"] for event in events if event["type"] == "content_block_delta"] == [
        "thinking_delta", "thinking_delta", "text_delta", "input_json_delta", "input_json_delta"]
    assert translator.message == {
        "id": "msg_1", "type": "message", "role": "assistant", "model": MODEL,
        "content": [{"type": "thinking", "thinking": "Need weather.", "signature": ""},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "call_1", "name": "get_time", "input": {"city": "Paris"}}],
        "stop_reason": "tool_use", "stop_sequence": None, "usage": {"input_tokens": 7, "output_tokens": 9}}
    snapshot = anthropic.types.Message.model_validate(translator.message)  # the client's own model reads it
    assert snapshot.content[2].input == {"city": "Paris"}


# ---- auth ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed(engine, serve_app):
    with serve_app(build_openai_app(engine, MODEL, api_key=KEY)) as served:
        yield served


def post_message(served, headers: dict | None = None, **fields) -> requests.Response:
    body = {"model": MODEL, "max_tokens": 3, "messages": QUESTION, **fields}
    return requests.post(f"{served.base_url}/v1/messages", json=body, headers=headers, timeout=60)


def test_without_the_key_the_route_is_401_in_anthropics_shape(keyed):
    assert_anthropic_error(post_message(keyed), 401, "authentication_error", "x-api-key")
    assert_anthropic_error(post_message(keyed, {"x-api-key": "sk-wrong"}), 401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError) as raised:
        client_of(keyed, "sk-wrong").messages.create(model=MODEL, max_tokens=3, messages=QUESTION)
    assert raised.value.body["error"]["type"] == "authentication_error"


def test_the_key_serves_as_x_api_key_or_bearer_token(keyed):
    assert post_message(keyed, {"x-api-key": KEY}).json()["type"] == "message"
    assert post_message(keyed, {"Authorization": f"Bearer {KEY}"}).json()["type"] == "message"
    reply = client_of(keyed, KEY).messages.create(model=MODEL, max_tokens=3, messages=QUESTION)
    assert reply.usage.output_tokens == 3
    # The OpenAI routes take the x-api-key header too, and keep OpenAI's error body without a key.
    assert requests.get(f"{keyed.base_url}/v1/models", headers={"x-api-key": KEY}, timeout=30).status_code == 200
    assert requests.get(f"{keyed.base_url}/v1/models", timeout=30).json()["error"]["code"] == "invalid_api_key"


# ---- bad requests -------------------------------------------------------------------------------------------
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
CALLED = [QUESTION[0], {"role": "assistant", "content": [
    {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"city": "Paris"}}]}]
TIME_TOOL = {"name": "get_time", "description": "The local time in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
# (name, fields replacing those of a valid request, the field the message must name)
BAD_REQUESTS = [
    ("no max_tokens", {"max_tokens": None}, "max_tokens"),
    ("max_tokens 0", {"max_tokens": 0}, "max_tokens"),
    ("max_tokens a string", {"max_tokens": "5"}, "max_tokens"),
    ("no messages", {"messages": []}, "messages"),
    ("an unknown field", {"frequency_penalty": 1}, "frequency_penalty"),
    ("a role of OpenAI's", {"messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
    ("an image block", {"messages": [{"role": "user", "content": [IMAGE, {"type": "text", "text": "?"}]}]},
     "messages.0.content.0"),
    ("an image in a tool result", {"messages": CALLED + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [IMAGE]}]}]}, "messages.2.content.0.content.0"),
    ("a document block", {"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]},
     "messages.0.content.0"),
    ("an unknown block type", {"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages.0.content"),
    ("a tool_use block from the user", {"messages": [{"role": "user", "content": CALLED[1]["content"]}]},
     "messages.0.content.0"),
    ("a tool_result answering no tool_use", {"messages": QUESTION + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "12:00"}]}]}, "messages.1.content.0.tool_use_id"),
    ("a tool_result answering another call", {"messages": CALLED + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "12:00"}]}]}, "messages.2.content.0.tool_use_id"),
    ("an unknown tool in tool_choice", {"tools": [TIME_TOOL], "tool_choice": {"type": "tool", "name": "get_weather"}},
     "tool_choice.name"),
    ("tool_choice tool without a name", {"tools": [TIME_TOOL], "tool_choice": {"type": "tool"}}, "tool_choice"),
    ("an input_schema that is not a schema", {"tools": [{"name": "f", "input_schema": {"type": "objekt"}}]},
     "tools.0.input_schema"),
    ("a server tool", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
    ("thinking without a budget", {"thinking": {"type": "enabled"}}, "thinking"),
    ("a prefill", {"messages": QUESTION + [{"role": "assistant", "content": "The capital is"}]}, "messages.1"),
    ("temperature -1", {"temperature": -1}, "temperature"),
    ("an empty stop sequence", {"stop_sequences": [""]}, "stop_sequences"),
    ("max_tokens past the context", {"max_tokens": 100_000}, "max_tokens"),
]


@pytest.mark.parametrize("fields, field", [case[1:] for case in BAD_REQUESTS], ids=[case[0] for case in BAD_REQUESTS])
def test_a_bad_request_is_400_naming_the_field(server, fields, field):
    body = {"model": MODEL, "max_tokens": 5, "messages": QUESTION, **fields}
    body = {key: value for key, value in body.items() if value is not None}
    for stream in (False, True):
        response = requests.post(f"{server.base_url}/v1/messages", json={**body, "stream": stream}, timeout=60)
        message = assert_anthropic_error(response, 400, "invalid_request_error")
        assert field in message or re.sub(r"\.(\d+)", r"[\1]", field) in message, message


def test_the_client_raises_bad_request_for_an_image(client):
    with pytest.raises(anthropic.BadRequestError, match="image input is not supported"):
        client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [IMAGE]}])


def test_other_errors_have_anthropics_types(server):
    assert_anthropic_error(post_message(server, model="claude-9"), 404, "not_found_error", "claude-9")
    response = requests.post(f"{server.base_url}/v1/messages", data=b'{"model": ', timeout=30,
                             headers={"Content-Type": "application/json"})
    assert_anthropic_error(response, 400, "invalid_request_error", "JSON")
    response = requests.get(f"{server.base_url}/v1/messages", timeout=30)
    assert_anthropic_error(response, 405, "invalid_request_error", "POST")


def test_a_body_over_the_cap_is_413_in_anthropics_shape(engine, serve_app):
    with serve_app(build_openai_app(engine, MODEL, max_request_body_bytes=1000)) as served:
        response = post_message(served, system="x" * 2000)
        assert_anthropic_error(response, 413, "request_too_large", "1000 bytes")


def test_a_dead_engine_is_503_overloaded_and_a_failure_midstream_an_error_event(controllable):
    client_state, served = controllable
    client_state.healthy = False
    try:
        response = post_message(served)
        assert_anthropic_error(response, 503, "overloaded_error", "unavailable")
        assert response.headers["Retry-After"] == "1"
    finally:
        client_state.healthy = True
    client_state.failure_after_first_output = RequestFailedError("a step failed for this request")
    try:
        with pytest.raises(anthropic.APIStatusError, match="a step failed") as raised:
            list(client_of(served).messages.create(model=MODEL, max_tokens=20, messages=QUESTION, stream=True))
        assert raised.value.body["error"]["type"] == "api_error"
        response = post_message(served, max_tokens=20)
        assert_anthropic_error(response, 500, "api_error", "a step failed")
    finally:
        client_state.failure_after_first_output = None
    client_state.failure = EngineDeadError("the engine died")
    try:
        assert_anthropic_error(post_message(served), 503, "overloaded_error", "the engine died")
    finally:
        client_state.failure = None


def test_a_request_past_the_pending_limit_is_429_rate_limit_error(limited_server, idle_engine):
    with requests.post(f"{limited_server.base_url}/v1/messages", stream=True, timeout=60, json={
            "model": MODEL, "max_tokens": 200, "messages": QUESTION, "stream": True}) as held:
        assert held.status_code == 200
        response = post_message(limited_server)
        assert_anthropic_error(response, 429, "rate_limit_error")
        assert response.headers["Retry-After"] == "1"
