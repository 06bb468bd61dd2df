"""Formats that write each argument as a tagged value (Qwen3-Coder/Qwen3.5, GLM, MiniMax-M2, DeepSeek's DSML):
a block holds invokes, an invoke names the function and holds parameters, a parameter's value is bare text.

The parser builds the arguments JSON itself: `{"key": value, ...}`, each value typed by the tool's schema
(schema.py). A value the schema makes a plain string streams as it comes; any other is sent once whole.
A value's closing tag counts only when what follows it is the next structural tag, so a value may contain
its own closing tag as text (code that writes these formats)."""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import ClassVar, Literal

from .base import ToolParser
from .scanning import FAIL, NEED, expect_any, find_first, is_function_name, partial_suffix, read_tag, skip_whitespace
from .schema import is_plain_string, typed_value


def _escape(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


class XmlToolParser(ToolParser):
    block_begins: ClassVar[tuple[str, ...]]
    block_ends: ClassVar[tuple[str, ...]]
    invoke_prefixes: ClassVar[tuple[str, ...]]
    invoke_ends: ClassVar[tuple[str, ...]]
    param_prefixes: ClassVar[tuple[str, ...]]
    value_end: ClassVar[str]
    # Invokes that may appear without their block (Qwen3-Coder's bare `<function=`).
    bare_invokes: ClassVar[bool] = False
    # How a value's surrounding whitespace is trimmed: kept, one newline each side, or all.
    value_trim: ClassVar[Literal["none", "newline", "strip"]] = "none"
    # A parameter the schema does not declare: kept as text, or read as JSON when it parses.
    unknown_params: ClassVar[Literal["string", "json"]] = "string"

    @property
    def start_markers(self) -> tuple[str, ...]:
        return self.block_begins + (self.invoke_prefixes if self.bare_invokes else ())

    # The tags, whole (through their `>`): group "name" the function or the parameter's key; a parameter tag's
    # optional group "string" ("true"/"false") says whether its value is a string. GLM's overrides read others.
    invoke_tag: ClassVar[re.Pattern]
    param_tag: ClassVar[re.Pattern]

    def _invoke_header(self, text: str, pos: int):
        """For the invoke tag at `pos`: (function name, end), NEED or FAIL."""
        tag = read_tag(text, pos, self.invoke_tag, ">", self._eof)
        if tag is NEED or tag is FAIL:
            return tag
        name = tag[0]["name"].strip()
        return (name, tag[1]) if is_function_name(name) else FAIL

    def _param_header(self, text: str, pos: int):
        """For the parameter tag at `pos`: (key, end, string or not as the tag says, else None), NEED or FAIL."""
        tag = read_tag(text, pos, self.param_tag, ">", self._eof)
        if tag is NEED or tag is FAIL:
            return tag
        key, string = tag[0]["name"].strip(), tag[0].groupdict().get("string")
        return (key, tag[1], None if string is None else string == "true") if key else FAIL

    # ---- block and invoke ----------------------------------------------------------------------------------
    def _start(self, marker: str) -> Callable[[], bool]:
        self._in_block = marker in self.block_begins
        if self._in_block:
            self._block_begin = marker
            return self._read_block_begin
        return self._read_invoke_header

    def _read_block_begin(self) -> bool:
        """A block counts once its first invoke's header reads; else its begin tag is content."""
        pos = skip_whitespace(self._buffer, len(self._block_begin))
        prefix = expect_any(self._buffer, pos, self.invoke_prefixes, self._eof) if pos < len(self._buffer) else \
            (FAIL if self._eof else NEED)
        header = prefix if prefix is NEED or prefix is FAIL else self._invoke_header(self._buffer, pos)
        if header is NEED:
            return False
        if header is FAIL:
            return self._not_a_call(len(self._block_begin))
        self._consume(pos)
        self._state = self._read_invoke_header
        return True

    def _read_block(self) -> bool:
        """Between invokes (`_read_between_calls`); the block end closes the block."""
        found = self._read_between_calls(self.invoke_prefixes, self.block_ends)
        if found is None:
            return False
        if found is not True:
            self._state = self._read_invoke_header
        return True

    def _read_invoke_header(self) -> bool:
        header = self._invoke_header(self._buffer, 0)
        if header is NEED:
            return False
        if header is FAIL:  # the tag's first character as content, the rest read on
            self._emit_content(self._consume(1))
            self._state = self._after_invoke()
            return True
        name, end = header
        self._consume(end)
        self._open_call(name)
        return True

    def _open_call(self, name: str) -> None:
        self._begin_call(name)
        self._function = name
        self._num_params = 0
        self._state = self._read_body

    def _close_call(self) -> None:
        self._emit_arguments("}" if self._num_params else "{}")
        self._end_call()

    def _read_body(self) -> bool:
        pos = skip_whitespace(self._buffer, 0)
        if pos == len(self._buffer):
            self._consume(pos)
            if not self._eof:
                return False
            self._close_call()
            self._state = self._read_content
            return True
        markers = self.param_prefixes + self.invoke_ends + self.block_ends
        hit = find_first(self._buffer, markers, pos)
        if hit is None or hit[0] > pos:  # text that is no tag of the body: dropped up to the next tag
            end = hit[0] if hit else len(self._buffer) if self._eof else \
                len(self._buffer) - partial_suffix(self._buffer, markers)
            self._consume(end)
            return end > 0
        self._consume(pos)
        marker = hit[1]
        if marker in self.param_prefixes:
            self._state = self._read_param_header
            return True
        self._close_call()
        if marker in self.invoke_ends:
            self._consume(len(marker))
        self._state = self._after_invoke()
        return True

    def _after_invoke(self) -> Callable[[], bool]:
        return self._read_block if self._in_block else self._read_content

    # ---- parameters ----------------------------------------------------------------------------------------
    def _read_param_header(self) -> bool:
        header = self._param_header(self._buffer, 0)
        if header is NEED:
            return False
        if header is FAIL:  # not a parameter: dropped up to the next tag
            self._consume(1)
            self._state = self._read_body
            return True
        key, end, is_string = header
        self._consume(end)
        self._schema = self.tools.parameter(self._function, key)
        self._tag_says_string = is_string
        self._streams = is_string if is_string is not None else is_plain_string(self._schema, self.unknown_params)
        self._emit_arguments(("{" if not self._num_params else ", ") + json.dumps(key, ensure_ascii=False) + ": "
                             + ('"' if self._streams else ""))
        self._num_params += 1
        self._value: list[str] = []
        self._value_started = False
        self._held = ""
        self._state = self._read_value
        return True

    def _read_value(self) -> bool:
        end = self._structural_value_end()
        if end is None:  # cut off inside the value: what came is the value
            self._take_value_text(self._consume(len(self._buffer)))
            self._finish_value()
            self._state = self._read_body
            return True
        index, is_end = end
        if not is_end:  # the text before `index` is surely the value's; the rest waits
            self._take_value_text(self._consume(index))
            return False
        self._take_value_text(self._consume(index))
        self._consume(len(self.value_end))
        self._finish_value()
        self._state = self._read_body
        return True

    def _structural_value_end(self):
        """(index, True) at the value's real end tag; (index, False) when only the text up to `index` is
        surely the value's (a tag may be starting there); None when the output ended inside the value."""
        followers = self.param_prefixes + self.invoke_ends + self.block_ends
        search = 0
        while True:
            index = self._buffer.find(self.value_end, search)
            if index == -1:
                if self._eof:
                    return None
                return len(self._buffer) - partial_suffix(self._buffer, (self.value_end,)), False
            after = skip_whitespace(self._buffer, index + len(self.value_end))
            rest = self._buffer[after:]
            if not rest:
                return (index, True) if self._eof else (index, False)
            if any(rest.startswith(follower) for follower in followers):
                return index, True
            if not self._eof and any(follower.startswith(rest) for follower in followers):
                return index, False
            search = index + len(self.value_end)  # a closing tag written inside the value

    def _take_value_text(self, text: str) -> None:
        if not text:
            return
        if not self._value_started:
            if self.value_trim == "strip":
                text = text.lstrip()
            elif self.value_trim == "newline" and text.startswith("\n"):
                text = text[1:]
            self._value_started = self.value_trim != "strip" or bool(text)
            if not text:
                return
        if not self._streams:
            self._value.append(text)
            return
        if self.value_trim == "none":
            self._emit_arguments(_escape(text))
            return
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body):]
        self._emit_arguments(_escape(body))

    def _finish_value(self) -> None:
        if self._streams:  # the held whitespace was the value's end: trimmed as the format says
            held = "" if self.value_trim == "strip" else self._held.removesuffix("\n")
            self._emit_arguments(_escape(held) + '"')
            return
        raw = "".join(self._value)
        if self.value_trim == "newline" and raw.endswith("\n"):
            raw = raw[:-1]
        elif self.value_trim == "strip":
            raw = raw.rstrip()
        if self._tag_says_string is False:  # DSML string="false": JSON as written
            try:
                value = json.loads(raw)
            except ValueError:
                value = typed_value(raw, self._schema, "json")
        else:
            value = typed_value(raw, self._schema, self.unknown_params)
        self._emit_arguments(json.dumps(value, ensure_ascii=False))
