"""What every tool-call parser returns, and the streaming machinery they share.

A parser is a small state machine over the text it has been fed. Each state reads from the start of the
unread text and either consumes a piece it can decide on (emitting deltas) or waits: no state decides from
where a chunk happens to end, so any chunking of one output gives the same deltas in total, and `parse(text)`
is just the stream fed whole. A call counts from the moment its header (the function's name) is read: its
name delta goes out then, and its arguments follow in fragments. Text that does not form a call header is
content, returned as written."""
from __future__ import annotations

import secrets
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from .scanning import find_first, partial_suffix
from .schema import ToolSchemas

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments_json: str
    type: Literal["function"] = "function"


@dataclass(slots=True)
class ParsedToolCalls:
    content: str | None
    calls: list[ToolCall]
    reasoning_content: str | None = None  # only from parsers that read reasoning themselves (harmony)


@dataclass(slots=True)
class FunctionDelta:
    name: str | None = None
    arguments: str | None = None


@dataclass(slots=True)
class ToolCallDelta:
    index: int
    function: FunctionDelta
    id: str | None = None
    type: Literal["function"] | None = None


@dataclass(slots=True)
class DeltaMessage:
    """One piece of a streamed assistant message, in OpenAI's delta shape: content text, reasoning text, or
    tool-call pieces (a call's first piece has its index, id, type and name; later ones argument text)."""
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The delta as OpenAI's JSON, without unset fields."""
        result: dict[str, Any] = {key: value for key, value in (("content", self.content),
                                                                ("reasoning_content", self.reasoning_content))
                                  if value is not None}
        if self.tool_calls:
            result["tool_calls"] = [_without_none({"index": call.index, "id": call.id, "type": call.type,
                                                   "function": _without_none({"name": call.function.name,
                                                                              "arguments": call.function.arguments})})
                                    for call in self.tool_calls]
        return result


def _without_none(fields: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in fields.items() if value is not None}


def collect(deltas: Iterable[DeltaMessage]) -> ParsedToolCalls:
    """The whole message that a sequence of deltas adds up to."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        if delta.content:
            content.append(delta.content)
        if delta.reasoning_content:
            reasoning.append(delta.reasoning_content)
        for piece in delta.tool_calls:
            call = calls.get(piece.index)
            if call is None:
                call = calls[piece.index] = ToolCall(id=piece.id or "", name="", arguments_json="")
            if piece.function.name:
                call.name += piece.function.name
            if piece.function.arguments:
                call.arguments_json += piece.function.arguments
    return ParsedToolCalls(content="".join(content) or None, calls=[calls[i] for i in sorted(calls)],
                           reasoning_content="".join(reasoning) or None)


def _kind(delta: DeltaMessage) -> tuple | None:
    """What a parser's delta carries, for joining neighbours: content, reasoning, or one call's argument
    text; None for a call's first piece, which stays alone."""
    if delta.tool_calls:
        piece = delta.tool_calls[0]
        return None if piece.id is not None else ("arguments", piece.index)
    return ("content",) if delta.content is not None else ("reasoning",)


def _merged(deltas: list[DeltaMessage]) -> list[DeltaMessage]:
    """Neighbouring deltas of one kind joined into one (each delta a parser emits carries one thing)."""
    merged: list[DeltaMessage] = []
    for delta in deltas:
        kind = _kind(delta)
        if merged and kind is not None and _kind(merged[-1]) == kind:
            last = merged[-1]
            if kind[0] == "content":
                last.content += delta.content
            elif kind[0] == "reasoning":
                last.reasoning_content += delta.reasoning_content
            else:
                last.tool_calls[0].function.arguments += delta.tool_calls[0].function.arguments
            continue
        merged.append(delta)
    return merged


class ToolParser:
    """Reads one assistant output: `feed` each new piece of text, `finish` at its end; or `parse` a whole text.

    Subclasses set `_state` to a method that reads from `self._buffer` and returns True when it consumed text
    or moved to another state, False when it must wait for more (once `_eof` is set, states consume all)."""

    name: ClassVar[str] = ""
    # The markers of most formats are special tokens: chat.py decodes with skip_special_tokens=False.
    needs_special_tokens: ClassVar[bool] = True
    # True for formats whose channels carry the reasoning too (harmony): feed it the raw output, no reasoning
    # parser in front; its deltas carry reasoning_content.
    reads_reasoning: ClassVar[bool] = False
    # Whitespace between content and a call is layout, not content.
    trims_around_calls: ClassVar[bool] = True
    # Markers that may start a call, for the default content state.
    start_markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: list[Any] | None = None) -> None:
        self.tools = ToolSchemas(tools)
        self._buffer = ""
        self._eof = False
        self._out: list[DeltaMessage] = []
        self._num_calls = 0
        self._held_whitespace = ""
        self._after_call = False
        self._state: Callable[[], bool] = self._read_content

    # ---- the interface ------------------------------------------------------------------------------------
    def feed(self, text: str) -> list[DeltaMessage]:
        assert not self._eof, "feed after finish"
        self._buffer += text
        return self._run()

    def finish(self) -> list[DeltaMessage]:
        self._eof = True
        deltas = self._run()
        assert not self._buffer, f"{type(self).__name__} left {self._buffer!r} unread at the end"
        if self._held_whitespace and not self._num_calls:
            deltas.append(DeltaMessage(content=self._held_whitespace))
        self._held_whitespace = ""
        return _merged(deltas)

    def parse(self, text: str) -> ParsedToolCalls:
        """The calls and content of a whole output (a fresh reader of the same kind; this one is untouched)."""
        reader = type(self)(self.tools.tools)
        return collect(reader.feed(text) + reader.finish())

    def _run(self) -> list[DeltaMessage]:
        while self._state():
            pass
        deltas, self._out = self._out, []
        return _merged(deltas)

    # ---- what states emit ----------------------------------------------------------------------------------
    def _consume(self, size: int) -> str:
        taken, self._buffer = self._buffer[:size], self._buffer[size:]
        return taken

    def _emit_content(self, text: str) -> None:
        if self.trims_around_calls:
            if self._after_call:
                text = text.lstrip()
                if not text:
                    return
                self._after_call = False
            text = self._held_whitespace + text
            body = text.rstrip()
            self._held_whitespace = text[len(body):]
            text = body
        if text:
            self._out.append(DeltaMessage(content=text))

    def _emit_reasoning(self, text: str) -> None:
        if text:
            self._out.append(DeltaMessage(reasoning_content=text))

    def _begin_call(self, name: str, call_id: str | None = None) -> None:
        self._held_whitespace = ""
        self._after_call = False
        self._out.append(DeltaMessage(tool_calls=[ToolCallDelta(
            index=self._num_calls, id=call_id or new_call_id(), type="function",
            function=FunctionDelta(name=name, arguments=""))]))
        self._num_calls += 1

    def _emit_arguments(self, text: str) -> None:
        if text:
            self._out.append(DeltaMessage(tool_calls=[ToolCallDelta(
                index=self._num_calls - 1, function=FunctionDelta(arguments=text))]))

    def _end_call(self) -> None:
        self._after_call = True

    # ---- the shared states ---------------------------------------------------------------------------------
    def _read_content(self) -> bool:
        """Content up to the next start marker, which moves the parser to `_start(marker)`."""
        hit = find_first(self._buffer, self.start_markers)
        if hit is None:
            keep = 0 if self._eof else partial_suffix(self._buffer, self.start_markers)
            size = len(self._buffer) - keep
            if size <= 0:
                return False
            self._emit_content(self._consume(size))
            return True
        index, marker = hit
        if index:
            self._emit_content(self._consume(index))
        self._state = self._start(marker)
        return True

    def _start(self, marker: str) -> Callable[[], bool]:
        """The state that reads a call (or section) beginning with `marker`, which is still unread."""
        raise NotImplementedError

    def _read_between_calls(self, openers: tuple[str, ...], closers: tuple[str, ...]) -> str | bool | None:
        """Inside a block of calls, between two: text up to the next opener or closer is content unless it is
        only whitespace. Returns the opener found (still unread), True when a closer ended the block (back to
        content), None when there is nothing more to read yet."""
        hit = find_first(self._buffer, openers + closers)
        if hit is None and not self._eof:
            return None
        text = self._consume(hit[0] if hit else len(self._buffer))
        if text.strip():
            self._emit_content(text)
        if hit is None:
            return None
        if hit[1] in closers:
            self._consume(len(hit[1]))
            self._state = self._read_content
            return True
        return hit[1]

    def _not_a_call(self, size: int) -> bool:
        """The first `size` characters began like a call and are not one: they are content."""
        self._emit_content(self._consume(size))
        self._state = self._read_content
        return True

    def _pass_through(self, end_markers: tuple[str, ...], emit: Callable[[str], None],
                      trailing: str = "") -> str | None:
        """Emits text up to the first end marker, holding back what could start one and a run of the
        `trailing` characters at its end (dropped when an end marker follows). Returns the marker once it is
        consumed, "" at the end of the output, None to wait for more."""
        hit = find_first(self._buffer, end_markers)
        if hit is None and not self._eof:
            text = self._buffer[:len(self._buffer) - partial_suffix(self._buffer, end_markers)]
            emit(self._consume(len(text.rstrip(trailing))))
            return None
        text = self._consume(hit[0] if hit else len(self._buffer))
        emit(text.rstrip(trailing))
        return self._consume(len(hit[1])) if hit else ""
