"""Formats whose calls sit in a section of special tokens, each call a header (the name) and raw JSON
arguments between a begin and an end token: DeepSeek-V3/R1, DeepSeek-V3.1, Kimi-K2. Subclasses give the
tokens and read the header."""
from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from .base import ToolParser
from .scanning import FAIL, NEED, expect_any, skip_whitespace


class SectionToolParser(ToolParser):
    section_begins: ClassVar[tuple[str, ...]]
    section_ends: ClassVar[tuple[str, ...]]
    call_begins: ClassVar[tuple[str, ...]]
    call_ends: ClassVar[tuple[str, ...]]
    # Characters dropped from the end of the arguments (DeepSeek-V3 closes them with a ``` fence).
    arguments_tail: ClassVar[str] = " \t\r\n"

    @property
    def start_markers(self) -> tuple[str, ...]:  # a call begin without its section is read as one too
        return self.section_begins + self.call_begins

    def _start(self, marker: str) -> Callable[[], bool]:
        self._in_section = marker in self.section_begins
        if self._in_section:
            self._section_begin = marker
            return self._read_section_begin
        self._call_begin = marker
        return self._read_call_header

    def _read_section_begin(self) -> bool:
        """A section counts once its first call's header reads; else its begin token is content."""
        pos = skip_whitespace(self._buffer, len(self._section_begin))
        begin = expect_any(self._buffer, pos, self.call_begins, self._eof) if pos < len(self._buffer) else \
            (FAIL if self._eof else NEED)
        header = begin if begin is NEED or begin is FAIL else self._read_header(self._buffer, begin[0])
        if header is NEED:
            return False
        if header is FAIL:
            return self._not_a_call(len(self._section_begin))
        self._consume(pos)
        self._call_begin = begin[1]
        self._state = self._read_call_header
        return True

    def _read_header(self, text: str, pos: int):
        """For the call header at `pos` (after the call-begin token): (name, call id or None, end), NEED or
        FAIL."""
        raise NotImplementedError

    def _read_section(self) -> bool:
        """Between calls (`_read_between_calls`); the section end closes the section."""
        found = self._read_between_calls(self.call_begins, self.section_ends)
        if found is None:
            return False
        if found is not True:
            self._call_begin = found
            self._state = self._read_call_header
        return True

    def _read_call_header(self) -> bool:
        header = self._read_header(self._buffer, len(self._call_begin))
        if header is NEED:
            return False
        if header is FAIL:  # the begin token is content
            self._emit_content(self._consume(len(self._call_begin)))
            self._state = self._between_calls()
            return True
        name, call_id, end = header
        self._consume(end)
        self._begin_call(name, call_id)
        self._state = self._read_arguments
        return True

    def _read_arguments(self) -> bool:
        marker = self._pass_through(self.call_ends + self.call_begins + self.section_ends, self._emit_arguments,
                                    trailing=self.arguments_tail)
        if marker is None:
            return False
        if marker in self.call_begins or marker in self.section_ends:  # a call without its end token
            self._buffer = marker + self._buffer
        self._end_call()
        self._state = self._between_calls() if marker else self._read_content
        return True

    def _between_calls(self) -> Callable[[], bool]:
        return self._read_section if self._in_section else self._read_content
