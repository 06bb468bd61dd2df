"""Tool calling and reasoning on /v1/chat/completions over real HTTP with the real openai client.

SmolLM2's own chat template ignores `tools`, so these apps serve it with TOOLS_TEMPLATE below, a Hermes-style
ChatML template that lists the tools, writes earlier calls as `<tool_call>` blocks and tool results as
`<tool_response>` turns, and closes the reasoning when `enable_thinking` is false (as Qwen3's does).

`auto` and reasoning run on scripted model outputs (ScriptedClient: the family formats are not SmolLM2's to
write), as do constrained outputs of thinking models (response_format, forced calls, and /v1/messages's forced
tools with thinking, which run on this route): the constraint the engine gets starts after the reasoning, which
comes back apart; `required` and a named function run on the real SmolLM2, whose output structured output
forces into calls that validate."""
from __future__ import annotations

import copy
import dataclasses
import json

import jsonschema
import openai
import pytest

from deployments.openai import build_openai_app
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

MODEL = "smollm2"
TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You may call functions. Their signatures:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one by writing <tool_call>
{"name": <function-name>, "arguments": <arguments-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

CITY = {"type": "string", "enum": ["Paris", "London", "Tokyo"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city over the next days",
    "parameters": {"type": "object", "properties": {"city": CITY, "days": {"type": "integer", "minimum": 1,
                                                                          "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": CITY}, "required": ["city"],
                   "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
QWEN3_CODER_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def with_tools_template(tokenizer: Tokenizer) -> Tokenizer:
    hf = copy.deepcopy(tokenizer.hf)
    hf.chat_template = TOOLS_TEMPLATE
    return Tokenizer(hf, set(tokenizer.eos_token_ids))


class ScriptedClient:
    """The engine client interface answering every request with `script`: the text of each step, the last step
    ending with the EOS token (whose text is in the output when special tokens are kept, as the engine does)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = 8192
        self.is_healthy = True
        self.script: list[str] = []
        self.requests: list[tuple[list[int], SamplingParams]] = []
        self.eos_id = min(tokenizer.eos_token_ids)

    async def generate(self, prompt, params: SamplingParams, request_id=None):
        self.requests.append((prompt, params))
        eos_text = self.tokenizer.decode([self.eos_id], skip_special_tokens=False)
        texts, ids = [""] * params.n, [[] for _ in range(params.n)]
        for number, piece in enumerate(self.script):
            last = number == len(self.script) - 1
            new_ids = [42] + ([self.eos_id] if last else [])
            piece += eos_text if last and not params.skip_special_tokens else ""
            outputs = []
            for index in range(params.n):
                texts[index] += piece
                ids[index] += new_ids
                outputs.append(CompletionOutput(index, texts[index], list(ids[index]), "stop" if last else None,
                                                new_text=piece, new_token_ids=new_ids))
            yield RequestOutput(request_id, None, list(prompt), outputs, finished=last)

    def abort(self, request_id) -> None:
        pass

    def stats(self) -> dict:
        return {}


@pytest.fixture(scope="module")
def tools_tokenizer(engine) -> Tokenizer:
    return with_tools_template(engine.tokenizer)


@pytest.fixture(scope="module")
def scripted(tools_tokenizer, serve_app):
    """Per parser pair, a server over one ScriptedClient: served(tool_call_parser, reasoning_parser)."""
    client = ScriptedClient(tools_tokenizer)
    servers, stack = {}, []

    def served(tool_call_parser: str = "hermes", reasoning_parser: str = "none"):
        key = (tool_call_parser, reasoning_parser)
        if key not in servers:
            context = serve_app(build_openai_app(client, MODEL, tool_call_parser=tool_call_parser,
                                                 reasoning_parser=reasoning_parser))
            servers[key] = context.__enter__()
            stack.append(context)
        return servers[key]

    yield client, served
    for context in reversed(stack):
        context.__exit__(None, None, None)


def chat(served, stream: bool, **fields):
    """The message, finish reason and (streamed) chunks of one chat request, the stream added up as a client
    does: content and reasoning joined, each call from its first delta (id, type, name) and argument pieces."""
    fields.setdefault("messages", QUESTION)
    result = served.openai.chat.completions.create(model=MODEL, stream=stream, max_tokens=60, **fields)
    if not stream:
        choice = result.choices[0]
        message = choice.message
        calls = [(call.function.name, call.function.arguments) for call in message.tool_calls or []]
        reasoning = getattr(message, "reasoning_content", None)
        return {"content": message.content, "reasoning": reasoning, "calls": calls}, choice.finish_reason, None
    chunks = list(result)
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for piece in delta.tool_calls or []:
                if piece.index not in calls:
                    assert piece.id and piece.type == "function" and piece.function.name, piece
                    calls[piece.index] = [piece.function.name, ""]
                else:
                    assert piece.id is None and not piece.function.name, piece
                calls[piece.index][1] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    message = {"content": content or None, "reasoning": reasoning or None,
               "calls": [tuple(calls[index]) for index in sorted(calls)]}
    return message, finish, chunks


# ---- auto, on scripted outputs -------------------------------------------------------------------------------
@pytest.mark.parametrize("parser, call", [("hermes", HERMES_CALL), ("qwen3_coder", QWEN3_CODER_CALL)])
@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_familys_calls_into_tool_calls(scripted, parser, call, stream):
    client, served = scripted
    client.script = ["Let me look", " that up.\n"] + [call[i:i + 9] for i in range(0, len(call), 9)]
    message, finish, _ = chat(served(parser), stream, tools=TOOLS)
    assert finish == "tool_calls"
    assert message["content"] == "Let me look that up."
    assert [(name, json.loads(arguments)) for name, arguments in message["calls"]] == [
        ("get_weather", {"city": "Paris", "days": 3})]
    assert client.requests[-1][1].skip_special_tokens is False  # the markers may be special tokens


def test_auto_streamed_and_whole_give_the_same_message(scripted):
    client, served = scripted
    client.script = ["Two calls:\n", HERMES_CALL, "\n", HERMES_CALL.replace("get_weather", "get_time")]
    whole, whole_finish, _ = chat(served(), False, tools=TOOLS)
    streamed, stream_finish, chunks = chat(served(), True, tools=TOOLS)
    assert streamed == whole and stream_finish == whole_finish == "tool_calls"
    assert [name for name, _ in whole["calls"]] == ["get_weather", "get_time"]
    assert all(chunk.id == chunks[0].id for chunk in chunks)


def test_parallel_tool_calls_false_returns_the_first_call(scripted):
    client, served = scripted
    client.script = [HERMES_CALL, "\n", HERMES_CALL.replace("get_weather", "get_time")]
    for stream in (False, True):
        message, _, _ = chat(served(), stream, tools=TOOLS, parallel_tool_calls=False)
        assert [name for name, _ in message["calls"]] == ["get_weather"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_malformed_call_comes_back_as_content(scripted, stream):
    client, served = scripted
    client.script = ["<tool_call>\n{\"name\": get_weather}\n", "</tool_call>"]
    message, finish, _ = chat(served(), stream, tools=TOOLS)
    assert message == {"content": "<tool_call>\n{\"name\": get_weather}\n</tool_call>", "reasoning": None,
                       "calls": []}
    assert finish == "stop"


def test_tool_choice_none_leaves_the_text_as_content(scripted):
    client, served = scripted
    client.script = [HERMES_CALL]
    message, finish, _ = chat(served(), False, tools=TOOLS, tool_choice="none")
    assert message["content"] == HERMES_CALL and message["calls"] == [] and finish == "stop"
    assert client.requests[-1][1].skip_special_tokens is True  # nothing is parsed: nothing changes


def test_without_a_parser_auto_returns_plain_text(scripted):
    client, served = scripted
    client.script = [HERMES_CALL]
    message, finish, _ = chat(served("none"), True, tools=TOOLS)
    assert message["content"] == HERMES_CALL and finish == "stop"


# ---- reasoning, on scripted outputs ----------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_content_is_split_from_the_answer(scripted, stream):
    client, served = scripted
    client.script = ["<thi", "nk>\nThe user asks", " about Paris.\n</th", "ink>\n\nIt is sunny."]
    message, finish, _ = chat(served("none", "qwen3"), stream)
    assert message == {"content": "It is sunny.", "reasoning": "The user asks about Paris.", "calls": []}
    assert finish == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_deepseek_r1_output_starts_inside_the_reasoning(scripted, stream):
    client, served = scripted
    client.script = ["Paris is in France", ".</think>", "Paris."]
    message, _, _ = chat(served("none", "deepseek_r1"), stream)
    assert (message["reasoning"], message["content"]) == ("Paris is in France.", "Paris.")


@pytest.mark.parametrize("stream", [False, True])
def test_calls_are_read_from_the_answer_after_the_reasoning(scripted, stream):
    client, served = scripted
    client.script = ["<think>I need the weather.</think>\n\n", HERMES_CALL]
    message, finish, _ = chat(served("hermes", "qwen3"), stream, tools=TOOLS)
    assert message["reasoning"] == "I need the weather." and message["content"] is None
    assert [name for name, _ in message["calls"]] == ["get_weather"] and finish == "tool_calls"


def test_chat_template_kwargs_reach_the_template_and_switch_thinking_off(scripted, tools_tokenizer):
    client, served = scripted
    client.script = ["<think>x</think> Sunny."]
    message, _, _ = chat(served("none", "qwen3"), False,
                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert tools_tokenizer.decode(client.requests[-1][0], skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert message == {"content": "<think>x</think> Sunny.", "reasoning": None, "calls": []}


# ---- constrained outputs after the reasoning, on scripted outputs ------------------------------------------------
ANSWER_SCHEMA = {"type": "object", "properties": {"city": CITY}, "required": ["city"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
REQUIRED_CALL = '[{"name": "get_time", "arguments": {"city": "Tokyo"}}]'


def sent_constraint(client):
    """The structured-output constraint of the last request the engine got."""
    return client.requests[-1][1].structured_outputs


def pieces(text: str, size: int = 6) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_of_a_thinking_model_starts_after_its_reasoning(scripted, stream):
    client, served = scripted
    client.script = pieces('<think>\nThe user means Paris.\n</think>\n\n{"city": "Paris"}')
    message, finish, _ = chat(served("none", "qwen3"), stream, response_format=RESPONSE_FORMAT)
    assert message == {"content": '{"city": "Paris"}', "reasoning": "The user means Paris.", "calls": []}
    assert finish == "stop"
    constraint = sent_constraint(client)
    # TOOLS_TEMPLATE, like Qwen3's, leaves the model to open its reasoning: it may, or answer at once.
    assert (constraint.reasoning_start, constraint.reasoning_end) == ("<think>", "</think>")
    assert constraint.json == ANSWER_SCHEMA and not constraint.reasoning_tags_are_special_tokens


def test_an_output_that_starts_inside_its_reasoning_gets_no_start_tag(scripted):
    client, served = scripted
    client.script = ['Paris.</think>{"city": "Paris"}']
    message, _, _ = chat(served("none", "deepseek_r1"), False, response_format=RESPONSE_FORMAT)
    assert (message["reasoning"], message["content"]) == ("Paris.", '{"city": "Paris"}')
    assert (sent_constraint(client).reasoning_start, sent_constraint(client).reasoning_end) == (None, "</think>")


@pytest.mark.parametrize("reasoning_parser, fields", [
    ("qwen3", {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}),  # the prompt closes it
    ("none", {}),  # no reasoning parser: nothing says where reasoning would end
])
def test_without_reasoning_the_constraint_holds_from_the_first_token(scripted, reasoning_parser, fields):
    client, served = scripted
    client.script = ['{"city": "Paris"}']
    message, _, _ = chat(served("none", reasoning_parser), False, response_format=RESPONSE_FORMAT, **fields)
    assert message == {"content": '{"city": "Paris"}', "reasoning": None, "calls": []}
    assert sent_constraint(client).reasoning_end is None and sent_constraint(client).reasoning_start is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_of_a_thinking_model_comes_after_its_reasoning(scripted, stream):
    client, served = scripted
    client.script = pieces("<think>Tokyo time needed.</think>\n\n" + REQUIRED_CALL)
    message, finish, _ = chat(served("hermes", "qwen3"), stream, tools=TOOLS, tool_choice="required")
    assert message == {"content": None, "reasoning": "Tokyo time needed.",
                       "calls": [("get_time", '{"city": "Tokyo"}')]}
    assert finish == "tool_calls" and sent_constraint(client).reasoning_end == "</think>"
    client.script = pieces('<think>Paris, 3 days.</think>{"city": "Paris", "days": 3}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    message, finish, _ = chat(served("hermes", "qwen3"), stream, tools=TOOLS, tool_choice=named)
    assert message == {"content": None, "reasoning": "Paris, 3 days.",
                       "calls": [("get_weather", '{"city": "Paris", "days": 3}')]}
    assert finish == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_thinking_with_a_forced_tool_thinks_then_calls(scripted, stream):
    client, served = scripted
    client.script = pieces("<think>Tokyo time needed.</think>\n\n" + REQUIRED_CALL)
    body = {"model": MODEL, "max_tokens": 64, "messages": QUESTION, "stream": stream,
            "tools": [{"name": tool["function"]["name"], "input_schema": tool["function"]["parameters"]}
                      for tool in TOOLS],
            "tool_choice": {"type": "any"}, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    response = served("hermes", "qwen3").post("/v1/messages", json=body)
    assert response.status_code == 200, response.text
    assert (sent_constraint(client).reasoning_start, sent_constraint(client).reasoning_end) == ("<think>", "</think>")
    if stream:
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
        blocks = [event["content_block"]["type"] for event in events if event["type"] == "content_block_start"]
        inputs = "".join(event["delta"]["partial_json"] for event in events
                         if event["type"] == "content_block_delta" and event["delta"]["type"] == "input_json_delta")
        assert blocks == ["thinking", "tool_use"] and json.loads(inputs) == {"city": "Tokyo"}
    else:
        content = response.json()["content"]
        assert [block["type"] for block in content] == ["thinking", "tool_use"]
        assert content[0]["thinking"] == "Tokyo time needed."
        assert (content[1]["name"], content[1]["input"]) == ("get_time", {"city": "Tokyo"})
        assert response.json()["stop_reason"] == "tool_use"
    body["thinking"] = {"type": "disabled"}
    client.script = [REQUIRED_CALL]
    assert served("hermes", "qwen3").post("/v1/messages", json=body).status_code == 200
    assert sent_constraint(client).reasoning_end is None  # the template closed the reasoning


# ---- the conversation's tool history ---------------------------------------------------------------------------
def test_tool_calls_and_results_round_trip_into_the_template(scripted, tools_tokenizer):
    client, served = scripted
    client.script = ["It is sunny."]
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny"}'}]
    message, _, _ = chat(served(), False, tools=TOOLS, messages=history)
    assert message["content"] == "It is sunny."
    prompt = tools_tokenizer.decode(client.requests[-1][0], skip_special_tokens=False)
    assert prompt == tools_tokenizer.apply_chat_template(
        [QUESTION[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
         {"role": "tool", "content": '{"forecast": "sunny"}', "tool_call_id": "call_1"}], tools=TOOLS)
    assert f"<|im_start|>assistant\n{HERMES_CALL}<|im_end|>" in prompt
    assert '<tool_response>\n{"forecast": "sunny"}\n</tool_response>' in prompt
    assert json.dumps(WEATHER) in prompt  # the tools are listed


# ---- bad requests ----------------------------------------------------------------------------------------------
ANSWERED = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}]
BAD = [
    ("duplicate names", {"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ("invalid schema", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools.0.function.parameters"),
    ("not a function tool", {"tools": [{"type": "retrieval"}]}, "tools.0"),
    ("unknown named function", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("unknown tool_choice", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ("required without tools", {"tool_choice": "required"}, "tool_choice"),
    ("tool result for no call", {"messages": ANSWERED + [{"role": "tool", "tool_call_id": "call_2", "content": "1"}]},
     "messages.2.tool_call_id"),
    ("tool result without id", {"messages": QUESTION + [{"role": "tool", "content": "1"}]}, "messages.1.tool_call_id"),
    ("tool calls on a user turn", {"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls"),
    ("arguments not a string", {"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]}]}, "messages.0.tool_calls"),
    ("reserved template kwarg", {"chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs.add_generation_prompt"),
    ("template kwargs not an object", {"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
]


@pytest.mark.parametrize("fields, param", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_tool_requests_get_a_400_naming_the_field(scripted, fields, param):
    client, served = scripted
    client.script = ["unused"]
    for stream in (False, True):
        response = served(). post("/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "stream": stream,
                                                                **fields})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"].startswith(param), error
        assert error["type"] == "invalid_request_error"


def test_the_openai_client_sees_an_unknown_tool_as_a_bad_request(scripted):
    _, served = scripted
    with pytest.raises(openai.BadRequestError, match="nope"):
        served().openai.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                                tool_choice={"type": "function", "function": {"name": "nope"}})


# ---- required and named, forced by structured output on SmolLM2 ------------------------------------------------
HAS_STRUCTURED_OUTPUT = "structured_outputs" in {field.name for field in dataclasses.fields(SamplingParams)}
needs_structured_output = pytest.mark.skipif(not HAS_STRUCTURED_OUTPUT,
                                             reason="the engine has no structured output (SamplingParams)")


class TemplatedClient:
    """The real engine behind an app whose tokenizer has TOOLS_TEMPLATE."""

    def __init__(self, engine, tokenizer: Tokenizer) -> None:
        self.engine, self.tokenizer, self.max_model_len = engine, tokenizer, engine.max_model_len

    @property
    def is_healthy(self) -> bool:
        return self.engine.is_healthy

    def generate(self, prompt, params, request_id=None):
        return self.engine.generate(prompt, params, request_id)

    def abort(self, request_id) -> None:
        self.engine.abort(request_id)

    def stats(self) -> dict:
        return self.engine.stats()


@pytest.fixture(scope="module")
def smollm2_tools(engine, tools_tokenizer, serve_app):
    with serve_app(build_openai_app(TemplatedClient(engine, tools_tokenizer), MODEL)) as served:
        yield served


def assert_valid_calls(calls, names=SCHEMAS) -> None:
    assert calls, "no tool call"
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@needs_structured_output
@pytest.mark.parametrize("stream", [False, True])
def test_required_always_answers_with_calls_that_validate(smollm2_tools, stream):
    for question in (QUESTION, [{"role": "user", "content": "Tell me a joke."}]):
        message, finish, _ = chat(smollm2_tools, stream, messages=question, tools=TOOLS, tool_choice="required",
                                  temperature=0)
        assert_valid_calls(message["calls"])
        assert finish == "tool_calls" and message["content"] is None


@needs_structured_output
def test_required_with_parallel_tool_calls_false_makes_one_call(smollm2_tools):
    message, _, _ = chat(smollm2_tools, False, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                         temperature=0.8, seed=1)
    assert len(message["calls"]) == 1
    assert_valid_calls(message["calls"])


@needs_structured_output
@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_always_called_with_valid_arguments(smollm2_tools, stream):
    choice = {"type": "function", "function": {"name": "get_time"}}
    message, finish, _ = chat(smollm2_tools, stream, tools=TOOLS, tool_choice=choice, temperature=0)
    assert [name for name, _ in message["calls"]] == ["get_time"]
    assert_valid_calls(message["calls"], {"get_time"})
    assert finish == "stop"  # as OpenAI and vLLM end a forced named call
