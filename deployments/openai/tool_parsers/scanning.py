"""Text scanning that decides only on text already seen: every reader answers NEED (wait for more text) until
the answer cannot change, so a stream cut anywhere reads the same as the whole text."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass


class _Need:
    def __repr__(self) -> str:
        return "NEED"


class _Fail:
    def __repr__(self) -> str:
        return "FAIL"


NEED = _Need()  # the answer depends on text not seen yet
FAIL = _Fail()  # the text cannot be what the reader looks for


def partial_suffix(text: str, markers: tuple[str, ...] | list[str]) -> int:
    """Length of the longest end of `text` that could begin one of `markers` (held back while streaming)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(text), len(marker) - 1), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def find_first(text: str, markers: tuple[str, ...] | list[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest occurrence of any marker at or after `start` (the longest marker wins a tie)."""
    best: tuple[int, str] | None = None
    for marker in markers:
        index = text.find(marker, start)
        if index != -1 and (best is None or index < best[0] or (index == best[0] and len(marker) > len(best[1]))):
            best = (index, marker)
    return best


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def expect(text: str, pos: int, literal: str, eof: bool):
    """Position after `literal` at `pos`; NEED when the text ends inside a prefix of it; FAIL otherwise."""
    available = text[pos:pos + len(literal)]
    if available == literal:
        return pos + len(literal)
    if literal.startswith(available) and not eof:
        return NEED
    return FAIL


def expect_any(text: str, pos: int, literals: tuple[str, ...], eof: bool):
    """(position after, literal) for the literal found at `pos`; NEED or FAIL as `expect`."""
    need = False
    for literal in literals:
        result = expect(text, pos, literal, eof)
        if isinstance(result, int):
            return result, literal
        need = need or result is NEED
    return NEED if need else FAIL


def read_tag(text: str, pos: int, pattern: re.Pattern, terminator: str, eof: bool, limit: int = 512):
    """A tag from `pos` through the first `terminator`, matched whole against `pattern`: (match, end) or
    NEED/FAIL. Tags are short, so one that runs past `limit` characters is not one."""
    end = text.find(terminator, pos, pos + limit)
    if end == -1:
        return FAIL if eof or len(text) - pos >= limit else NEED
    end += len(terminator)
    match = pattern.fullmatch(text, pos, end)
    return (match, end) if match else FAIL


def read_json_string(text: str, pos: int, eof: bool):
    """(decoded string, end) for the JSON string starting at `pos`, or NEED/FAIL."""
    if pos >= len(text):
        return FAIL if eof else NEED
    if text[pos] != '"':
        return FAIL
    index = pos + 1
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2
            continue
        if char == '"':
            try:
                return json.loads(text[pos:index + 1]), index + 1
            except ValueError:
                return FAIL
        if char == "\n":
            return FAIL
        index += 1
    return FAIL if eof else NEED


@dataclass(slots=True)
class JsonScanner:
    """Follows a JSON value character by character (strings, escapes, nesting) to find where it ends. It
    checks no grammar beyond that: the text is the model's, passed through as written."""
    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def scan(self, text: str, start: int = 0) -> tuple[int, bool]:
        """(index after the consumed text, whether the value closed there). Stops early, before a `<` outside
        a string: no JSON value holds one, and it starts the next marker in every format."""
        index = start
        while index < len(text):
            char = text[index]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return index + 1, True
            elif char == "<":
                return index, False
            index += 1
        return index, False


def read_until(text: str, pos: int, terminator: str, eof: bool, limit: int = 512):
    """(text from `pos` to `terminator`, index after it), NEED, or FAIL when it is not within `limit`."""
    end = text.find(terminator, pos, pos + limit + len(terminator))
    if end == -1:
        return FAIL if eof or len(text) - pos >= limit + len(terminator) else NEED
    return text[pos:end], end + len(terminator)


def is_function_name(name: str) -> bool:
    """A name a model may call: not empty, no whitespace, quotes or markup (which mean a broken header)."""
    return bool(name) and len(name) <= 256 and not any(char.isspace() or char in "<>{}\"'" for char in name)
