"""The reasoning parsers' interface, and the one most families share: reasoning between `<think>` and
`</think>`, the answer after it.

Where the reasoning starts is the chat template's business, so the parser is told the rendered prompt: a
prompt that ends by opening `<think>` (DeepSeek-R1, Qwen3.5, GLM-4.7/5, MiniMax-M2, Kimi-K2.5) puts the
output inside the reasoning from its first token; one that ends by closing it (thinking switched off through
`chat_template_kwargs`) leaves only an answer. Without a prompt the family's default holds: the output
either starts inside the reasoning, or opens it itself with `<think>` as its first words (Qwen3's hybrid
template, GLM-4.5, Kimi-K2-Thinking).

Streaming decides only on text already seen (a tag cut across chunks is held back until it is whole), so any
chunking gives the same split as the whole text.

The same reading of the prompt tells structured output where a constrained answer starts (`reasoning_tags`):
after the reasoning's end tag, so that the model reasons first. The parser of such an output ends the reasoning
at that tag only (`end_tag_only`), as the grammar does."""
from __future__ import annotations

from typing import Any, ClassVar

from ..tool_parsers.scanning import FAIL, NEED, expect, find_first, partial_suffix, skip_whitespace


class ReasoningParser:
    """Splits one output into reasoning and answer: `feed` each new piece (-> reasoning delta, content
    delta), `finish` at its end; or `parse` a whole output (-> reasoning or None, content or None). With
    `end_tag_only` the reasoning ends at its end tag alone, never at a family's implicit end (a tool-call
    marker): structured output's grammar holds the reasoning open until that tag."""

    name: ClassVar[str] = ""

    def __init__(self, prompt: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                 end_tag_only: bool = False) -> None:
        self.prompt = prompt
        self.chat_template_kwargs = chat_template_kwargs
        self.end_tag_only = end_tag_only

    def feed(self, text: str) -> tuple[str, str]:
        raise NotImplementedError

    def finish(self) -> tuple[str, str]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """A fresh parser of the same kind and prompt reads the whole text; this one is untouched."""
        reader = type(self)(self.prompt, self.chat_template_kwargs, self.end_tag_only)
        reasoning, content = reader.feed(text)
        more_reasoning, more_content = reader.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None

    def reasoning_tags(self) -> tuple[str | None, str] | None:
        """Where this output's reasoning is, for a constraint to start after it: (the tag that may open the
        reasoning, None when the output starts inside it; the tag that ends it), or None when the output has no
        reasoning to write (thinking switched off or closed by the prompt) or no tags mark it."""
        return None

    def thinking_switched_off(self) -> bool:
        """Whether chat_template_kwargs turn thinking off (Qwen's and GLM's `enable_thinking`, DeepSeek's and
        Kimi's `thinking`)."""
        kwargs = self.chat_template_kwargs or {}
        return kwargs.get("enable_thinking", True) is False or kwargs.get("thinking", True) is False


class ThinkReasoningParser(ReasoningParser):
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    # Whether, with no prompt to tell, the output starts inside the reasoning (the template opened it).
    starts_in_reasoning: ClassVar[bool] = False
    # Markers that end the reasoning without its end tag and begin the answer (a tool call section).
    implicit_ends: ClassVar[tuple[str, ...]] = ()

    def __init__(self, prompt: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                 end_tag_only: bool = False) -> None:
        super().__init__(prompt, chat_template_kwargs, end_tag_only)
        tail = (prompt or "").rstrip()
        self._reasons = not (tail.endswith(self.end_tag)
                             or (not tail.endswith(self.start_tag) and self.thinking_switched_off()))
        self._inside = tail.endswith(self.start_tag) or self.starts_in_reasoning
        self._state = self._read_opening if self._reasons else self._read_answer
        self._buffer = ""
        self._eof = False
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._reasoning_started = False
        self._held_whitespace = ""
        self._answer_started = True

    def reasoning_tags(self) -> tuple[str | None, str] | None:
        if not self._reasons:
            return None
        return (None if self._inside else self.start_tag), self.end_tag

    def feed(self, text: str) -> tuple[str, str]:
        assert not self._eof, "feed after finish"
        self._buffer += text
        return self._run()

    def finish(self) -> tuple[str, str]:
        self._eof = True
        result = self._run()
        assert not self._buffer, f"{type(self).__name__} left {self._buffer!r} unread at the end"
        return result

    def _run(self) -> tuple[str, str]:
        while self._state():
            pass
        reasoning, content = "".join(self._reasoning), "".join(self._content)
        self._reasoning, self._content = [], []
        return reasoning, content

    def _consume(self, size: int) -> str:
        taken, self._buffer = self._buffer[:size], self._buffer[size:]
        return taken

    def _read_opening(self) -> bool:
        """The output's first words: `<think>` (after any whitespace) opens the reasoning."""
        pos = skip_whitespace(self._buffer, 0)
        if pos == len(self._buffer) and not self._eof:
            return False
        opened = expect(self._buffer, pos, self.start_tag, self._eof) if pos < len(self._buffer) else FAIL
        if opened is NEED:
            return False
        if opened is not FAIL:
            self._consume(opened)
            self._state = self._read_reasoning
        elif self._inside:
            self._state = self._read_reasoning
        else:
            self._state = self._read_answer
        return True

    def _read_reasoning(self) -> bool:
        markers = (self.end_tag,) + (() if self.end_tag_only else self.implicit_ends)
        hit = find_first(self._buffer, markers)
        if hit is None:
            size = len(self._buffer) - (0 if self._eof else partial_suffix(self._buffer, markers))
            self._take_reasoning(self._consume(size))
            return False
        self._take_reasoning(self._consume(hit[0]))
        if hit[1] == self.end_tag:
            self._consume(len(self.end_tag))
            self._answer_started = False  # the whitespace after </think> is layout
        self._state = self._read_answer
        return True

    def _take_reasoning(self, text: str) -> None:
        if not self._reasoning_started:
            text = text.lstrip()
            self._reasoning_started = bool(text)
        text = self._held_whitespace + text
        body = text.rstrip()
        self._held_whitespace = text[len(body):]
        if body:
            self._reasoning.append(body)

    def _read_answer(self) -> bool:
        if not self._buffer:
            return False
        text = self._consume(len(self._buffer))
        if not self._answer_started:
            text = text.lstrip()
            self._answer_started = bool(text)
        if text:
            self._content.append(text)
        return True
