"""Llama 3.1 / 3.3 JSON tool calls (vLLM's `llama3_json`): the reply is the call itself,
`{"name": N, "parameters": {...}}` ("arguments" also read), optionally after `<|python_tag|>`; several calls
are separated by `;` (agentic_and_spec_formats.md A.1, after meta-llama's prompt_format.md and vLLM's parser).
A reply that does not start with a call object is content; the built-in tools' Python syntax is content."""
from __future__ import annotations

from .json_calls import JsonCallParser, call_from_json, read_call_header
from .scanning import FAIL, NEED, JsonScanner, expect, skip_whitespace

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(JsonCallParser):
    name = "llama3_json"

    def __init__(self, tools=None) -> None:
        super().__init__(tools)
        self._state = self._read_reply_start
        self._skipped = ""  # the whitespace and tag before an object, content again if it is not a call

    def _read_reply_start(self) -> bool:
        pos = skip_whitespace(self._buffer, 0)
        if pos < len(self._buffer):
            tag = expect(self._buffer, pos, PYTHON_TAG, self._eof)
            if tag is NEED:
                return False
            if tag is not FAIL:
                pos = skip_whitespace(self._buffer, tag)
        if pos >= len(self._buffer) and not self._eof:
            return False
        if pos < len(self._buffer) and self._buffer[pos] == "{":
            self._skipped = self._consume(pos)
            self._state = self._read_object
        else:
            self._state = self._read_plain_content
        return True

    def _read_plain_content(self) -> bool:
        if not self._buffer:
            return False
        self._emit_content(self._skipped + self._consume(len(self._buffer)))
        self._skipped = ""
        return True

    def _read_object(self) -> bool:
        header = read_call_header(self._buffer, 0, self._eof)
        if header is not NEED and header is not FAIL:
            self._skipped = ""  # a call: what came before it is not content
        return self._open_call(header, self._read_whole_object)

    def _read_arguments(self) -> bool:
        end, closed = self._scanner.scan(self._buffer)
        self._emit_arguments(self._consume(end))
        if closed:
            self._scanner = JsonScanner(depth=1)  # the rest of the call's object, dropped
            self._state = self._read_object_end
            return True
        if self._buffer or self._eof:  # a stray `<`, or cut off: the rest is content
            self._end_call()
            self._state = self._read_plain_content
            return True
        return False

    def _read_object_end(self) -> bool:
        end, closed = self._scanner.scan(self._buffer)
        self._consume(end)
        if closed:
            self._end_call()
            self._state = self._read_separator
            return True
        if self._buffer or self._eof:
            self._end_call()
            self._state = self._read_plain_content
            return True
        return False

    def _read_separator(self) -> bool:
        """After a call: `;` (or only whitespace) and another object, or the end; anything else is content."""
        pos = skip_whitespace(self._buffer, 0)
        if pos < len(self._buffer) and self._buffer[pos] == ";":
            pos = skip_whitespace(self._buffer, pos + 1)
        if pos >= len(self._buffer):
            if self._eof:
                self._consume(len(self._buffer))
            return False
        if self._buffer[pos] == "{":
            self._skipped = self._consume(pos)
            self._state = self._read_object
        else:
            self._state = self._read_plain_content
        return True

    def _read_whole_object(self) -> bool:
        """An object whose name does not come first: a call only if it parses whole."""
        scanner = JsonScanner()
        end, closed = scanner.scan(self._buffer)
        if not closed:
            if not self._buffer[end:] and not self._eof:
                return False
            self._state = self._read_plain_content
            return True
        call = call_from_json(self._buffer[:end])
        if call is None:
            self._state = self._read_plain_content
            return True
        self._consume(end)
        self._skipped = ""
        self._begin_call(call[0])
        self._emit_arguments(call[1])
        self._end_call()
        self._state = self._read_separator
        return True
