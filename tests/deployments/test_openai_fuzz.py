"""Fuzzing the OpenAI routes (and Anthropic's /v1/messages) with cases schemathesis generates from the app's own
/openapi.json, sent over real HTTP to the real engine: whatever a client sends, the answer is a success or a 4xx
in the route's error format (OpenAI's; Anthropic's on /v1/messages), never a 5xx, and afterwards the engine
still serves, idle with every KV block free."""
from __future__ import annotations

import copy
import json
import math
import re

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, assume, settings
from hypothesis import strategies as st

from deployments.openai import build_openai_app

MODEL = "smollm2"
VOCAB_SIZE = 49152  # SmolLM2's: the first token id outside the vocabulary
HUGE = 2**70  # past int64, which a tensor index or a C long cannot hold
INT64_MAX = 2**63 - 1
CONTEXT_LEN = 8192  # SmolLM2's: a longer token budget is refused before any work
MAX_N = 128  # the server's limit on n
MAX_CHEAP_TOKENS = 8
MAX_CHEAP_N = 2
# Cases per route in Hypothesis' generate phase. Before it come schemathesis' coverage cases (each field at its
# bounds, just past them and of every wrong type: about 330 per generation route, most refused at once) and
# the hostile examples below (about 55 per generation route).
MAX_GENERATED_CASES = 150
REQUEST_TIMEOUT = 60
MAX_STREAM_EVENTS = 100_000

# Values a hostile client controls that a schema-driven generator does not produce on its own: lone surrogates
# (escaped as "\ud800" in the body), unknown fields, empty lists, NaN and infinities (Python's json writes
# them), ints past int64, token ids outside the vocabulary. Each dict is merged into a valid, cheap request of
# each route, after the route's own fields below.
HOSTILE_FIELDS = [
    {"model": "\ud800"},
    {"stop": "\ud800"},
    {"stop": ["\ud800", ""]},
    {"user": "\ud800"},
    {"stream": True, "stop": "\ud800"},
    {"unknown_field": {"nested": [HUGE, math.nan, "\ud800"]}},
    {"stop": []},
    {"stop_token_ids": []},
    {"logit_bias": {"50": 100}},
    {"logit_bias": {"not a token": math.nan}},
    {"stream": True, "stream_options": {"include_usage": True}, "n": 2},
    {"temperature": math.nan},
    {"temperature": math.inf},
    {"temperature": 5e-324},
    {"temperature": 1e-30},
    {"top_p": math.nan},
    {"min_p": math.nan},
    {"presence_penalty": -math.inf},
    {"frequency_penalty": math.nan},
    {"repetition_penalty": math.inf},
    {"repetition_penalty": math.nan},
    {"repetition_penalty": 1e308},
    {"repetition_penalty": 5e-324},
    {"presence_penalty": 2, "frequency_penalty": 2, "temperature": 2, "top_p": 5e-324, "min_p": 1},
    {"n": HUGE},
    {"max_tokens": HUGE},
    {"max_tokens": -1},
    {"min_tokens": HUGE},
    {"seed": HUGE},
    {"seed": -1},
    {"seed": INT64_MAX},
    {"seed": -INT64_MAX - 1},
    {"top_k": HUGE},
    {"top_k": INT64_MAX},
    {"top_k": 2**31},
    {"top_k": VOCAB_SIZE + 1},
    {"stop_token_ids": [VOCAB_SIZE]},
    {"stop_token_ids": [HUGE]},
    {"min_tokens": 1, "stop_token_ids": [VOCAB_SIZE]},
    {"min_tokens": 1, "stop_token_ids": [HUGE]},
    {"stream": True, "top_k": HUGE},
    {"stream": True, "min_tokens": 1, "stop_token_ids": [VOCAB_SIZE]},
]
COMPLETION_FIELDS = [
    {"prompt": "\ud800"},
    {"prompt": ["ok", "\ud800"]},
    {"prompt": []},
    {"prompt": [[]]},
    {"prompt": [VOCAB_SIZE]},
    {"prompt": [-1]},
    {"prompt": [[1, HUGE]]},
    {"prompt": [0], "echo": True, "logprobs": 5},
    {"logprobs": HUGE},
    {"logprobs": -1},
    {"best_of": HUGE},
    {"suffix": "\ud800"},
]
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
CHAT_FIELDS = [
    {"messages": [{"role": "user", "content": "\ud800"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
    {"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"role": "tool", "content": None}]},
    {"messages": []},
    {"max_completion_tokens": HUGE},
    {"logprobs": True, "top_logprobs": HUGE},
    {"top_logprobs": 5},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    {"tools": []},
    {"tool_choice": "auto", "tools": None},
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
    {"response_format": {"type": None}},
    {"response_format": {}},
    {"tools": [WEATHER_TOOL], "tool_choice": "required"},
    {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "stream": True},
    {"tools": [WEATHER_TOOL], "tool_choice": "required", "parallel_tool_calls": False, "n": 2, "stream": True},
    {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "\ud800"}}},
    {"tools": [{"type": "function", "function": {"name": "\ud800"}}], "tool_choice": "required"},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$schema": 5}}}]},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"enum": ["\ud800"]}}}}}], "tool_choice": "required"},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}}}], "tool_choice": "required"},
    {"tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "\ud800", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]},
        {"role": "tool", "tool_call_id": "\ud800", "content": "x"}]},
    {"messages": [{"role": "tool", "tool_call_id": "nope", "content": "x"}]},
    {"chat_template_kwargs": {"tokenize": True}},
    {"chat_template_kwargs": {"enable_thinking": False, "x": [math.nan, HUGE]}},
]
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}
CALLED = [{"role": "user", "content": "hi"},
          {"role": "assistant", "content": [{"type": "tool_use", "id": "\ud800", "name": "f", "input": {}}]}]
MESSAGES_FIELDS = [
    {"messages": [{"role": "user", "content": "\ud800"}]},
    {"messages": [{"role": "user", "content": []}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800", "cache_control": "\ud800"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "image", "source": {"data": "\ud800"}}]}]},
    {"messages": [{"role": "assistant", "content": "The capital is"}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "\ud800", "content": "x"}]}]},
    {"messages": CALLED + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "\ud800", "content": [{"type": "text", "text": "\ud800"}],
         "is_error": True}]}]},
    {"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "\ud800", "signature": 5}]}]},
    {"system": "\ud800"},
    {"system": [{"type": "text", "text": "\ud800"}]},
    {"system": []},
    {"stop_sequences": ["\ud800", ""]},
    {"stop_sequences": []},
    {"stream": True, "stop_sequences": ["\ud800"]},
    {"metadata": {"user_id": "\ud800"}},
    {"tools": []},
    {"tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "any"}},
    {"tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "tool", "name": "get_weather"}, "stream": True},
    {"tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "stream": True},
    {"tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "tool", "name": "\ud800"}},
    {"tools": [{"name": "\ud800", "input_schema": {}}], "tool_choice": {"type": "any"}},
    {"tools": [{"name": "f", "input_schema": {"$schema": 5}}]},
    {"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "("}}}}], "tool_choice": {"type": "any"}},
    {"tool_choice": {"type": "any"}},
    {"thinking": {"type": "enabled", "budget_tokens": HUGE}},
    {"thinking": {"type": "disabled"}, "stream": True},
]
CHEAP_REQUESTS = {
    "/v1/completions": ({"model": MODEL, "prompt": "Hello", "max_tokens": 4}, COMPLETION_FIELDS),
    "/v1/chat/completions": ({"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
                             CHAT_FIELDS),
    "/v1/messages": ({"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
                     MESSAGES_FIELDS),
}
ERROR_FIELDS = {"message", "type", "param", "code"}
SERVER_ERROR_TYPES = {"internal_server_error", "service_unavailable_error"}
MESSAGES_ROUTE = "/v1/messages"  # Anthropic's error body and events
ANTHROPIC_SERVER_ERROR_TYPES = {"api_error", "overloaded_error"}


def _add_hostile_examples(context, examples: list) -> None:
    """schemathesis hook: the route's own hostile fields, then HOSTILE_FIELDS, become explicit examples of each
    generation route, sent as JSON bytes so that NaN, infinities and lone surrogates reach the server as a
    client would write them."""
    operation = context.operation
    if operation.method.upper() != "POST" or operation.path not in CHEAP_REQUESTS:
        return
    base, route_fields = CHEAP_REQUESTS[operation.path]
    # Hypothesis runs explicit examples last attached first: these run in the order written.
    for fields in reversed(route_fields + HOSTILE_FIELDS):
        body = json.dumps({**base, **fields}).encode()
        examples.append(operation.Case(body=body, media_type="application/json"))


def _stream_half_of_them(context, strategy):
    """schemathesis hook: the generator seldom draws the optional `stream`; half the bodies without it stream."""
    return st.tuples(strategy, st.booleans()).map(_with_stream)


def _with_stream(drawn):
    body, stream = drawn
    if stream and isinstance(body, dict) and "stream" not in body:
        return {**body, "stream": True}
    return body


def _keep_cheap(body) -> None:
    """Bound the work an accepted request costs the CPU engine: a valid token budget above MAX_CHEAP_TOKENS (or
    none, which means the rest of the context) becomes MAX_CHEAP_TOKENS, with min_tokens lowered to fit where it
    fitted before, and a valid n above MAX_CHEAP_N becomes MAX_CHEAP_N. Invalid values (negative, past the
    context, of the wrong type) stay as generated: those are what the fuzzing is for, and the server refuses
    them before any work."""
    if not isinstance(body, dict):
        return
    budget_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    budget = body.get(budget_key)
    if budget is None or _is_int(budget) and MAX_CHEAP_TOKENS < budget <= CONTEXT_LEN:
        body[budget_key] = MAX_CHEAP_TOKENS
        min_tokens = body.get("min_tokens")
        if _is_int(min_tokens) and MAX_CHEAP_TOKENS < min_tokens <= (budget or CONTEXT_LEN):
            body["min_tokens"] = MAX_CHEAP_TOKENS
    n = body.get("n")
    if _is_int(n) and MAX_CHEAP_N < n <= MAX_N:
        body["n"] = MAX_CHEAP_N
        if body.get("best_of") == n:
            body["best_of"] = MAX_CHEAP_N


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ServerErrorResponse(AssertionError):
    """A 5xx, or a server error sent inside a stream after its 200."""


class MalformedResponse(AssertionError):
    """A 4xx without the route's error body, or a stream that does not end as the route's streams end."""


class EngineDied(AssertionError):
    """The engine stopped serving after this request."""


_FAILURE_TYPES: dict[tuple[type, str], type] = {}


def failure(kind: type[AssertionError], cause: str, message: str) -> AssertionError:
    """An exception of a subclass of `kind` named for `cause`: Hypothesis reports one failing case per
    exception type, so each distinct server error (a TypeError, a UnicodeEncodeError...) gets its own report."""
    key = (kind, cause)
    if key not in _FAILURE_TYPES:
        _FAILURE_TYPES[key] = type(f"{kind.__name__}[{cause}]", (kind,), {})
    return _FAILURE_TYPES[key](message)


def _server_error_cause(status: int, message: str) -> str:
    """"500 TypeError" for the app's "Internal server error: TypeError: ..."."""
    match = re.match(r"Internal server error: (\w+)", message)
    return f"{status} {match.group(1)}" if match else str(status)


def check_error_body(body: bytes) -> None:
    """OpenAI's error body: {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}."""
    error = json.loads(body)["error"]
    assert set(error) == ERROR_FIELDS, f"error fields {sorted(error)}, expected {sorted(ERROR_FIELDS)}"
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)


def check_anthropic_error_body(body: bytes) -> None:
    """Anthropic's error body: {"type": "error", "error": {"type": ..., "message": ...}}."""
    body = json.loads(body)
    assert body["type"] == "error", f"type {body['type']!r}, expected 'error'"
    error = body["error"]
    assert set(error) == {"type", "message"}, f"error fields {sorted(error)}, expected ['message', 'type']"
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]


def anthropic_stream_server_error(body: bytes) -> dict | None:
    """The server error inside a complete stream of Anthropic's events, if any; a stream that does not start with
    message_start and end with message_stop (or an error event) raises."""
    events = []
    for block in body.decode().split("\n\n"):
        if block:
            name, data = block.split("\n", 1)
            events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    assert events and events[0][0] == "message_start", f"the stream does not start with message_start: {events[:2]}"
    assert events[-1][0] in ("message_stop", "error"), f"the stream does not end with message_stop: {events[-3:]}"
    assert all(name == payload["type"] for name, payload in events)
    last = events[-1][1]
    return last["error"] if last["type"] == "error" and last["error"]["type"] in ANTHROPIC_SERVER_ERROR_TYPES else None


def stream_server_error(body: bytes) -> dict | None:
    """The server error inside a complete event stream, if any; a stream that is not well-formed or does not end
    with [DONE] raises."""
    payloads = [event.removeprefix("data: ") for event in body.decode().split("\n\n") if event]
    assert payloads and payloads[-1] == "[DONE]", f"the stream does not end with [DONE]: {payloads[-3:]!r}"
    for payload in payloads[:-1]:
        error = json.loads(payload).get("error")
        if error is not None and error.get("type") in SERVER_ERROR_TYPES:
            return error
    return None


class EngineWatch:
    """Whether the engine survives each case. Once a case kills it, no later case can tell anything: those of
    another route are skipped, those of the same route rejected, except that the killing case fails again
    when Hypothesis replays it."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.death: tuple[str, str, str] | None = None  # route, request body and answer of the killing case

    def check_alive(self, case, answer: str) -> None:
        if not self.engine.is_healthy:
            self.death = (case.operation.label, _body_text(case.body), answer)
            self._raise_died()

    def skip_if_dead(self, case) -> None:
        if self.death is None:
            return
        route, body, _ = self.death
        if route != case.operation.label:
            pytest.skip(f"the engine died earlier, fuzzing {route} with {body}")
        assume(_body_text(case.body) == body)
        self._raise_died()

    def _raise_died(self):
        error, answer = self.engine.error, self.death[2]
        raise failure(EngineDied, type(error).__name__, f"The engine died on this request ({error!r}); {answer}")


def _body_text(body) -> str:
    return body.decode(errors="backslashreplace") if isinstance(body, bytes) else json.dumps(body, default=repr)


@pytest.fixture(scope="module")
def engine_watch(engine) -> EngineWatch:
    return EngineWatch(engine)


def send_and_check(case, base_url: str, engine_watch: EngineWatch) -> None:
    """Send the case (reading a stream to its end) and check the answer."""
    response = case.call(base_url=base_url, timeout=REQUEST_TIMEOUT)
    status, content_type = response.status_code, response.headers.get("content-type", [""])[0]
    answer = (f"it answered {status} {response.content[:2000]!r}\n"
              f"Reproduce with:\n    {case.as_curl_command(base_url=base_url)}")
    engine_watch.check_alive(case, answer)
    if status >= 500:
        message = _error_message(response.content)
        raise failure(ServerErrorResponse, _server_error_cause(status, message), f"A server error: {answer}")
    anthropic = case.operation.path == MESSAGES_ROUTE
    if status >= 400:
        try:
            (check_anthropic_error_body if anthropic else check_error_body)(response.content)
        except (AssertionError, ValueError, KeyError, TypeError) as exc:
            raise MalformedResponse(f"Not the route's error body ({exc!r}): {answer}") from None
    elif content_type.startswith("text/event-stream"):
        if response.stream_cut_short:
            raise MalformedResponse(f"The stream was not read to its end: {answer}")
        try:
            error = (anthropic_stream_server_error if anthropic else stream_server_error)(response.content)
        except (AssertionError, ValueError, AttributeError, KeyError, TypeError) as exc:
            raise MalformedResponse(f"A broken event stream ({exc!r}): {answer}") from None
        if error is not None:
            cause = "stream " + _server_error_cause(500, error["message"])
            raise failure(ServerErrorResponse, cause, f"A server error inside the stream: {answer}")


def _error_message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return ""


def with_server_limits(openapi: dict) -> dict:
    """The app's schema plus limits the server checks but does not publish: integer fields take integers (the
    schema writes their bounds as floats, 0.0, which the strict server refuses), the model is the served one,
    prompts are not empty and token ids lie in the vocabulary. Positive cases then reach the engine, and
    negative ones probe those limits."""
    openapi = copy.deepcopy(openapi)
    _integers_stay_integers(openapi)
    models = openapi["components"]["schemas"]
    token_id = {"type": "integer", "minimum": 0, "maximum": VOCAB_SIZE - 1}
    token_ids = {"type": "array", "items": token_id, "minItems": 1}
    models["CompletionRequest"]["properties"]["prompt"]["anyOf"] = [
        {"type": "string", "minLength": 1},
        token_ids,
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        {"type": "array", "items": token_ids, "minItems": 1},
    ]
    for model in ("CompletionRequest", "ChatCompletionRequest"):
        properties = models[model]["properties"]
        properties["model"]["anyOf"] = [{"enum": [MODEL]}, {"type": "null"}]
        properties["stop_token_ids"]["anyOf"] = [{"type": "array", "items": token_id}, {"type": "null"}]
    models["MessagesRequest"]["properties"]["model"] = {"enum": [MODEL]}
    return openapi


def _integers_stay_integers(node) -> None:
    if isinstance(node, dict):
        if node.get("type") == "integer":
            for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if isinstance(node.get(key), float):
                    node[key] = int(node[key])
            # schemathesis 4.32 takes an integer's default 0 for a number's equal default 0.0 and sends 0.0.
            node.pop("default", None)
        for value in node.values():
            _integers_stay_integers(value)
    elif isinstance(node, list):
        for value in node:
            _integers_stay_integers(value)


# The schema depends on the routes and the request models only, not on the engine behind the app, so it is read
# at collection time from an app without one; the cases go to the app over the real engine (`server`).
OPENAPI = build_openai_app(None, MODEL).openapi()
schema = schemathesis.openapi.from_dict(with_server_limits(OPENAPI))
schema.config.max_stream_events = MAX_STREAM_EVENTS  # read every stream to its end (the default stops at 20)
schema.config.output.sanitization.update(enabled=False)  # it would print max_tokens & co. as "[Filtered]"
schema.hook("before_add_examples")(_add_hostile_examples)
schema.hook("before_generate_body")(_stream_half_of_them)


def test_the_fuzzed_schema_is_the_served_one(server):
    assert server.get("/openapi.json").json() == OPENAPI


@schema.parametrize()
# No shrinking: a case that kills the engine cannot be shrunk (every later case meets a dead engine), and each
# shrinking step would be another request to the CPU engine. A failure reports the request as sent.
@settings(max_examples=MAX_GENERATED_CASES, phases=[Phase.explicit, Phase.generate], derandomize=True,
          deadline=None, print_blob=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
def test_no_request_gets_a_server_error(case, server, engine_watch):
    _keep_cheap(case.body)
    engine_watch.skip_if_dead(case)
    send_and_check(case, server.base_url, engine_watch)


def test_engine_serves_and_frees_every_kv_block_after_fuzzing(server, engine, wait_idle):
    response = server.post("/v1/completions", json={"model": MODEL, "prompt": "The capital of France is",
                                                    "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"]
    stats = wait_idle(engine)
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"], stats
