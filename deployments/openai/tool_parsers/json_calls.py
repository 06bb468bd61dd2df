"""Calls written as one JSON object, `{"name": NAME, "arguments": {...}}` ("parameters" in Llama's prompt),
as Llama 3.x and the hermes-style `<tool_call>` blocks of Qwen write them.

The usual key order (name first, then the arguments object) streams: the call starts once the name is read
and the arguments pass through as the model writes them. Any other order is read whole once the object ends
and becomes a call only if it parses."""
from __future__ import annotations

import json
from typing import Any

from collections.abc import Callable

from .base import ToolParser
from .scanning import FAIL, NEED, JsonScanner, expect, expect_any, read_json_string, skip_whitespace

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


class JsonCallParser(ToolParser):
    """A parser whose calls are such objects: `_open_call` starts one from `read_call_header`'s result and
    hands its arguments to the subclass's `_read_arguments` state."""

    def _open_call(self, header, otherwise: Callable[[], bool]) -> bool:
        """A header begins the call (its name out) and reads its arguments with a fresh scanner; FAIL moves
        to `otherwise`; NEED waits for more text."""
        if header is NEED:
            return False
        if header is FAIL:
            self._state = otherwise
            return True
        name, arguments_start = header
        self._consume(arguments_start)
        self._begin_call(name)
        self._scanner = JsonScanner()
        self._state = self._read_arguments
        return True


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
