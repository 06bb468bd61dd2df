"""Qwen3, Qwen3-Next and Qwen2.5 (vLLM's `hermes`): each call a JSON object in its own block,
`<tool_call>\n{"name": N, "arguments": {...}}\n</tool_call>`, blocks one after another
(agentic_and_spec_formats.md A.2, from the Qwen3 chat template)."""
from __future__ import annotations

from collections.abc import Callable

from .json_calls import JsonCallParser, call_from_json, read_call_header
from .scanning import find_first, partial_suffix

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(JsonCallParser):
    name = "hermes"
    start_markers = (START,)

    def _start(self, marker: str) -> Callable[[], bool]:
        return self._read_header

    def _read_header(self) -> bool:
        return self._open_call(read_call_header(self._buffer, len(START), self._eof), self._read_whole_block)

    def _read_arguments(self) -> bool:
        end, closed = self._scanner.scan(self._buffer)
        self._emit_arguments(self._consume(end))
        if closed or self._buffer or self._eof:  # closed, stopped at a stray `<`, or cut off
            self._state = self._read_block_end
            return True
        return False

    def _read_block_end(self) -> bool:
        """What follows the arguments up to `</tool_call>` (the object's `}`) is dropped."""
        hit = find_first(self._buffer, (END, START))
        if hit is None:
            keep = 0 if self._eof else partial_suffix(self._buffer, (END, START))
            self._consume(len(self._buffer) - keep)
            if not self._eof:
                return False
        else:
            index, marker = hit
            self._consume(index + (len(marker) if marker == END else 0))
        self._end_call()
        self._state = self._read_content
        return True

    def _read_whole_block(self) -> bool:
        """A block whose object does not start with its name: a call only if the whole block parses."""
        end = self._buffer.find(END, len(START))
        if end == -1:
            return False if not self._eof else self._not_a_call(len(START))
        call = call_from_json(self._buffer[len(START):end].strip())
        if call is None:
            return self._not_a_call(len(START))
        self._consume(end + len(END))
        self._begin_call(call[0])
        self._emit_arguments(call[1])
        self._end_call()
        self._state = self._read_content
        return True
