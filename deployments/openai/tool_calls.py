"""Tool calling on /v1/chat/completions, the request side: what `tools`, `tool_choice` and the conversation's
tool history must satisfy beyond their types (each refusal a 400 naming the field), what the chat template is
given (transformers' apply_chat_template(messages, tools=..., **chat_template_kwargs)), and for `required` or a
named function the JSON schema that structured output enforces, so the call always parses and validates.

The forced output is plain JSON, not the family's own call format (as vLLM does): a named function's output is
its arguments object; `required` gives an array of `{"name": ..., "arguments": {...}}` objects
(chat_output.py reads both back)."""
from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

from engine.sampling_params import SamplingParams

from .errors import bad_request
from .tool_parsers.scanning import is_function_name

# Arguments of apply_chat_template that the server sets itself: not a request's to change.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"})
ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tools: `mode` "none" when it gives none or says so; `tools` as the template
    and the parsers take them (OpenAI's dicts); the named function; `constraint` the StructuredOutputsParams
    fields that force the call (required and named)."""
    mode: ToolMode = "none"
    tools: list[dict] | None = None
    function_name: str | None = None
    parallel_tool_calls: bool = True
    constraint: dict | None = None


def plan_tools(body) -> ToolPlan:
    """The request's tools, checked: unique callable names, valid parameter schemas, a tool_choice that names
    a given function, a forced choice only with tools."""
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    choice = body.tool_choice
    parallel = body.parallel_tool_calls is not False
    seen: dict[str, int] = {}
    for index, tool in enumerate(tools):
        function = tool["function"]
        name = function["name"]
        if not is_function_name(name) or not _is_unicode(name):
            raise bad_request(f"tools[{index}].function.name {name!r} is not a function name: it must be 1 to 256 "
                              "characters without whitespace, quotes or <>{}", f"tools.{index}.function.name")
        if name in seen:
            raise bad_request(f"tools[{index}] repeats the function name {name!r} of tools[{seen[name]}]; "
                              "names must be unique", f"tools.{index}.function.name")
        seen[name] = index
        _check_parameters(function.get("parameters"), index)
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice in ("none", "auto"):
            return ToolPlan(parallel_tool_calls=parallel)
        raise bad_request("tool_choice forces a tool call, but the request gives no tools", "tool_choice")
    if choice in ("none", "auto"):
        return ToolPlan(choice, tools, parallel_tool_calls=parallel)
    if choice == "required":
        return ToolPlan("required", tools, parallel_tool_calls=parallel,
                        constraint={"json": required_calls_schema(tools, parallel)})
    name = choice.function.name
    if name not in seen:
        raise bad_request(f"tool_choice names the function {name!r}, which is not among the request's tools "
                          f"({', '.join(seen)})", "tool_choice")
    parameters = arguments_schema(tools[seen[name]]["function"].get("parameters"))
    return ToolPlan("named", tools, name, parallel, constraint={"json": parameters})


def _is_unicode(text: str) -> bool:
    """Whether `text` is valid Unicode (a lone surrogate, which JSON can carry, is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_parameters(schema: dict | None, index: int) -> None:
    if schema is None:
        return
    param, where_said = f"tools.{index}.function.parameters", f"tools[{index}].function.parameters"
    from jsonschema import SchemaError
    from jsonschema.validators import validator_for
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(part) for part in exc.absolute_path)
        raise bad_request(f"{where_said} is not a valid JSON schema"
                          f"{f' (at {where})' if where else ''}: {exc.message}", param) from None
    except Exception as exc:  # the checker itself trips on some values (a "$schema" that is not a string)
        raise bad_request(f"{where_said} is not a valid JSON schema: {exc}", param) from None
    declared = schema.get("type", "object")
    if declared != "object" and not (isinstance(declared, list) and "object" in declared):
        raise bad_request(f"{where_said} must describe an object (the call's arguments), not type {declared!r}", param)


def arguments_schema(parameters: dict | None) -> dict:
    """The schema a call's arguments follow: the function's parameters, an object when it declares none."""
    if not parameters:
        return {"type": "object"}
    return parameters if "type" in parameters else {"type": "object", **parameters}


def required_calls_schema(tools: list[dict], parallel: bool = True) -> dict:
    """An array of one or more calls (one when `parallel` is off), each `{"name": N, "arguments": {...}}` with N
    one of the tools and its arguments following that tool's parameters. Each tool's `$defs` (`definitions`)
    move to the root, where its `#/$defs/...` references point; two tools defining one name differently are
    refused."""
    definitions: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
    options = []
    for index, tool in enumerate(tools):
        function = tool["function"]
        arguments = copy.deepcopy(arguments_schema(function.get("parameters")))
        for keyword, merged in definitions.items():
            for name, definition in (arguments.pop(keyword, None) or {}).items():
                if name in merged and merged[name] != definition:
                    raise bad_request(f"tools[{index}].function.parameters.{keyword}.{name} differs from another "
                                      f"tool's definition of {name!r}; rename one of them",
                                      f"tools.{index}.function.parameters")
                merged[name] = definition
        options.append({"type": "object", "properties": {"name": {"type": "string", "enum": [function["name"]]},
                                                         "arguments": arguments},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update({keyword: merged for keyword, merged in definitions.items() if merged})
    return schema


def forced_params(params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    """`params` with the constraint that forces the plan's call; a schema structured output cannot take is a
    400 naming the tool whose parameters it came from."""
    if plan.constraint is None:
        return params
    if getattr(params, "structured_outputs", None) is not None:
        raise bad_request(f"tool_choice {plan.mode!r} constrains the output to a tool call; it cannot be combined "
                          "with response_format, structured_outputs or guided_* constraints", "tool_choice")
    try:
        return dataclasses.replace(params, structured_outputs=plan.constraint)
    except ValueError as exc:  # SamplingParamsError, or the grammar library refusing a value
        param = "tools"
        if plan.mode == "named":
            index = next(i for i, tool in enumerate(plan.tools) if tool["function"]["name"] == plan.function_name)
            param = f"tools.{index}.function.parameters"
        raise bad_request(f"the tool's parameters cannot be enforced ({param}): {exc}", param) from None


# ---- the conversation and the template ----------------------------------------------------------------------
def template_messages(messages) -> list[dict]:
    """The conversation as chat templates take it: assistant turns with their `tool_calls` (arguments as
    objects, which most templates write with `tojson`; text that is not a JSON object stays text), tool
    results with their `tool_call_id`, each of which must answer a call of an earlier assistant turn."""
    call_ids: set[str] = set()
    rendered = []
    for index, message in enumerate(messages):
        entry = message.to_template_dict()
        tool_calls = getattr(message, "tool_calls", None)
        if tool_calls:
            if message.role != "assistant":
                raise bad_request(f"messages[{index}] has tool_calls, which only assistant messages carry",
                                  f"messages.{index}.tool_calls")
            entry["tool_calls"] = [{"id": call.id, "type": "function",
                                    "function": {"name": call.function.name,
                                                 "arguments": _arguments_value(call.function.arguments)}}
                                   for call in tool_calls]
            call_ids.update(call.id for call in tool_calls)
        reasoning = getattr(message, "reasoning_content", None)
        if reasoning is not None and message.role == "assistant":
            entry["reasoning_content"] = reasoning
        if message.role == "tool":
            call_id = getattr(message, "tool_call_id", None)
            if call_id is None:
                raise bad_request(f"messages[{index}] is a tool result without tool_call_id; it must name the "
                                  "call it answers", f"messages.{index}.tool_call_id")
            if call_id not in call_ids:
                raise bad_request(f"messages[{index}].tool_call_id {call_id!r} answers no tool call of an earlier "
                                  "assistant message", f"messages.{index}.tool_call_id")
            entry["tool_call_id"] = call_id
        rendered.append(entry)
    return rendered


def _arguments_value(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def template_kwargs(plan: ToolPlan, chat_template_kwargs: dict | None) -> dict:
    """The keyword arguments of apply_chat_template: the request's chat_template_kwargs and the tools."""
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {reserved[0]!r}: the server sets it (use the "
                          "request's own fields)", f"chat_template_kwargs.{reserved[0]}")
    if plan.tools:
        kwargs["tools"] = plan.tools
    return kwargs


def render_prompt(tokenizer, messages: list[dict], kwargs: dict) -> tuple[str, list[int]]:
    """The rendered conversation (the reasoning parser reads where it ends) and its token ids, as
    Tokenizer.encode_chat makes them."""
    text = tokenizer.apply_chat_template(messages, True, **kwargs)
    return text, tokenizer.encode(text, add_special_tokens=False)
