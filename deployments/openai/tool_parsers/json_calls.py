"""Calls written as one JSON object, `{"name": NAME, "arguments": {...}}` ("parameters" in Llama's prompt),
as Llama 3.x and the hermes-style `<tool_call>` blocks of Qwen write them.

The usual key order (name first, then the arguments object) streams: the call starts once the name is read
and the arguments pass through as the model writes them. Any other order is read whole once the object ends
and becomes a call only if it parses."""
from __future__ import annotations

import json
from typing import Any

from .scanning import FAIL, NEED, expect, expect_any, read_json_string, skip_whitespace

ARGUMENT_KEYS = ('"arguments"', '"parameters"')


def read_call_header(text: str, pos: int, eof: bool):
    """For the object starting at `pos`: (name, index of the arguments' `{`), NEED or FAIL."""
    steps = ("{", '"name"', ":", None, ",", ARGUMENT_KEYS, ":")
    name = None
    for step in steps:
        pos = skip_whitespace(text, pos)
        if pos >= len(text):
            return FAIL if eof else NEED
        if step is None:
            result = read_json_string(text, pos, eof)
            if result is NEED or result is FAIL:
                return result
            name, pos = result
            continue
        result = expect_any(text, pos, step, eof) if isinstance(step, tuple) else expect(text, pos, step, eof)
        if result is NEED or result is FAIL:
            return result
        pos = result[0] if isinstance(result, tuple) else result
    pos = skip_whitespace(text, pos)
    if pos >= len(text):
        return FAIL if eof else NEED
    if text[pos] != "{" or not name:
        return FAIL
    return name, pos


def call_from_json(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) when `text` is one JSON object naming a function and its arguments."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments: Any = value.get("arguments", value.get("parameters"))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)
