"""gpt-oss (vLLM's `openai`): the harmony format (agentic_and_spec_formats.md A.9, openai/harmony's
docs/format.md). The output is a run of messages, `<|start|>assistant<|channel|>CHANNEL[ to=RECIPIENT]
[<|constrain|>json]<|message|>BODY<|end|>` (the first one's `<|start|>assistant` is in the prompt; `<|call|>`
and `<|return|>` end a message too). A message to `functions.NAME` is a call of NAME with the body as its
JSON arguments; the `analysis` channel is reasoning; `final` and recipient-less `commentary` (a preamble) are
content. It reads the reasoning itself (`reads_reasoning`): feed it the raw output.

The text is read directly, from the special tokens kept in it: openai-harmony's own parser works on token ids
through the o200k vocabulary file, which it downloads on first use, so it is the tests' oracle where that
file is present rather than a dependency of serving."""
from __future__ import annotations

import re
from collections.abc import Callable

from .base import ToolParser
from .scanning import FAIL, NEED, expect, find_first, is_function_name, partial_suffix, skip_whitespace

START, MESSAGE = "<|start|>", "<|message|>"
MESSAGE_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|[\s>])to=([^\s<]+)")


def read_message_header(header: str) -> tuple[str | None, str | None]:
    """(channel, recipient) of a message header such as `assistant<|channel|>commentary to=functions.f json`."""
    channel = _CHANNEL.search(header)
    recipient = _RECIPIENT.search(header)
    return (channel[1] if channel else None), (recipient[1] if recipient else None)


class HarmonyToolParser(ToolParser):
    name = "openai"
    reads_reasoning = True
    trims_around_calls = False  # bodies are returned exactly as written

    def __init__(self, tools=None) -> None:
        super().__init__(tools)
        self._state = self._read_header
        self._route: Callable[[str], None] = self._emit_content

    def _read_header(self) -> bool:
        end = self._buffer.find(MESSAGE, 0, 1024)
        if end == -1:
            if not self._eof and len(self._buffer) < 1024:
                return False
            self._state = self._read_unframed  # no harmony framing: the text is content as it is
            return True
        header = self._consume(end)
        self._consume(len(MESSAGE))
        channel, recipient = read_message_header(header.removeprefix(START))
        function = recipient.removeprefix("functions.") if recipient and recipient.startswith("functions.") \
            else None
        if function is not None and is_function_name(function):
            self._begin_call(function)
            self._route = self._emit_arguments
        elif channel == "analysis" and recipient is None:
            self._route = self._emit_reasoning
        else:
            self._route = self._emit_content
        self._in_call = function is not None and is_function_name(function)
        self._state = self._read_body
        return True

    def _read_body(self) -> bool:
        markers = MESSAGE_ENDS + (START,)
        hit = find_first(self._buffer, markers)
        if hit is None:
            size = len(self._buffer) - (0 if self._eof else partial_suffix(self._buffer, markers))
            self._route(self._consume(size))
            if not self._eof:
                return False
        else:
            self._route(self._consume(hit[0]))
            if hit[1] != START:
                self._consume(len(hit[1]))
        if self._in_call:
            self._end_call()
        self._state = self._read_between
        return True

    def _read_between(self) -> bool:
        pos = skip_whitespace(self._buffer, 0)
        if pos == len(self._buffer):
            self._consume(pos)
            return False
        start = expect(self._buffer, pos, START, self._eof)
        if start is NEED:
            return False
        self._consume(pos if start is FAIL else start)
        self._state = self._read_header
        return True

    def _read_unframed(self) -> bool:
        if not self._buffer:
            return False
        self._emit_content(self._consume(len(self._buffer)))
        return True
