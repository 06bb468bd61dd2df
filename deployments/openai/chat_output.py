"""How a chat choice's output becomes the assistant message: the reasoning parser splits off
`reasoning_content`, then the tool parser reads `tool_calls` from the answer (tool_choice auto), or the JSON
readers below read the forced output of `required` and named choices (tool_calls.py). A constrained output
(those choices, response_format) of a thinking model reasons first: its constraint starts after the reasoning's
end tag (structured_output.after_reasoning), and only the answer after it is read as the JSON. Each choice is
read as a stream of text pieces; the whole message is that stream's deltas added up, so a streamed response and
a whole one always agree. Text that does not form a call stays content: a malformed output is never an error."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.outputs import CompletionOutput
from engine.sampling_params import SamplingParams

from .reasoning_parsers import ReasoningParser, reasoning_parser_class, reasoning_parser_names
from .structured_output import after_reasoning
from .tool_calls import ToolPlan
from .tool_parsers import DeltaMessage, ToolParser, collect, tool_parser_class, tool_parser_names
from .tool_parsers.json_calls import JsonCallParser, read_call_header
from .tool_parsers.scanning import FAIL, NEED, expect, skip_whitespace
from .tool_protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall

OFF = "none"


def check_parser_names(tool_call_parser: str, reasoning_parser: str) -> None:
    """Refuse unknown names at start-up (the serve flags and AppConfig), naming the choices."""
    for flag, name, names in (("tool_call_parser", tool_call_parser, tool_parser_names()),
                              ("reasoning_parser", reasoning_parser, reasoning_parser_names())):
        if name != OFF and name not in names:
            raise ValueError(f"unknown {flag} {name!r}; choose one of: {', '.join([*names, OFF])}")


@dataclass(frozen=True)
class ChatParsers:
    """The parsers a server runs, chosen once at start-up."""
    tool_parser: type[ToolParser] | None = None
    reasoning_parser: type[ReasoningParser] | None = None

    @classmethod
    def resolve(cls, tool_call_parser: str = "auto", reasoning_parser: str = "auto", model_config=None,
                chat_template: str | None = None) -> "ChatParsers":
        """The classes that `--tool-call-parser` and `--reasoning-parser` name: "auto" is the model's own
        (from its config and chat template; none when it has none), "none" turns a parser off."""
        check_parser_names(tool_call_parser, reasoning_parser)
        tool = None if tool_call_parser == OFF else tool_parser_class(tool_call_parser, model_config, chat_template)
        reasoning = (None if reasoning_parser == OFF
                     else reasoning_parser_class(reasoning_parser, model_config, chat_template))
        return cls(tool, reasoning)


@dataclass(slots=True)
class MessageParts:
    """A whole assistant message, or a streamed delta of one (then tool_calls are DeltaToolCall pieces)."""
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list | None = None


class ChatOutputReader:
    """Reads the choices of one chat request. `active` is False when nothing is parsed: the plain text is
    then the answer, as without tools. `params` are the request's sampling parameters as the parsers need
    them: markers that are special tokens in many vocabularies are kept in the text, and a constraint starts
    after the reasoning where the prompt leaves the output reasoning to write (checking the grammar this
    makes may take milliseconds: build a constrained request's reader off the event loop)."""

    def __init__(self, parsers: ChatParsers, plan: ToolPlan, params: SamplingParams, tokenizer,
                 prompt: str | None = None, chat_template_kwargs: dict | None = None) -> None:
        self.plan = plan
        self.tokenizer = tokenizer
        self.prompt = prompt
        self.chat_template_kwargs = chat_template_kwargs
        self.tool_parser = parsers.tool_parser if plan.mode == "auto" else None
        reads_reasoning = self.tool_parser is not None and self.tool_parser.reads_reasoning
        reasoning_parser = parsers.reasoning_parser if not reads_reasoning else None
        self.constrained = plan.constraint is not None or getattr(params, "structured_outputs", None) is not None
        if self.constrained and reasoning_parser is not None:
            params = after_reasoning(params, reasoning_parser(prompt, chat_template_kwargs), tokenizer)
            constraint = getattr(params, "structured_outputs", None)
            if constraint is None or constraint.reasoning_end is None:
                reasoning_parser = None  # the constraint holds from the first token: there is no reasoning to read
        self.reasoning_parser = reasoning_parser
        self.active = plan.mode in ("required", "named") or self.tool_parser is not None \
            or self.reasoning_parser is not None
        needs_special_tokens = self.reasoning_parser is not None or (
            self.tool_parser is not None and self.tool_parser.needs_special_tokens)
        if needs_special_tokens and params.skip_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        self.params = params
        self._readers: dict[int, ChoiceReader] = {}

    def new_reader(self) -> ChoiceReader:
        if self.plan.mode == "named":
            tools: ToolParser | None = NamedCallReader(self.plan.function_name)
        elif self.plan.mode == "required":
            tools = RequiredCallsReader(self.plan.tools)
        else:
            tools = self.tool_parser(self.plan.tools) if self.tool_parser is not None else None
        # Under a constraint the grammar ends the reasoning at its end tag only: so does the parser.
        reasoning = (self.reasoning_parser(self.prompt, self.chat_template_kwargs, end_tag_only=self.constrained)
                     if self.reasoning_parser is not None else None)
        return ChoiceReader(reasoning, tools, None if self.plan.parallel_tool_calls else 1)

    # ---- whole ------------------------------------------------------------------------------------------
    def message(self, completion: CompletionOutput) -> tuple[MessageParts, str | None]:
        """The assistant message of a finished choice and its finish reason."""
        reader = self.new_reader()
        deltas = reader.feed(self._visible(completion, completion.text), final=True)
        parsed = collect(deltas)
        calls = [ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments_json))
                 for call in parsed.calls] or None
        return (MessageParts(parsed.content, parsed.reasoning_content, calls),
                self.finish_reason(completion.finish_reason, bool(calls)))

    # ---- streamed ---------------------------------------------------------------------------------------
    def delta(self, completion: CompletionOutput) -> tuple[MessageParts | None, bool]:
        """The delta of one streamed step of a choice (None when it adds nothing yet) and whether the choice
        has called a tool so far."""
        reader = self._readers.get(completion.index)
        if reader is None:
            reader = self._readers[completion.index] = self.new_reader()
        text = self._visible(completion, completion.new_text)
        deltas = reader.feed(text, final=completion.finished)
        return _merged_delta(deltas), reader.num_calls > 0

    def finish_reason(self, engine_reason: str | None, called: bool) -> str | None:
        """"tool_calls" when an auto or required choice ended by itself with calls; a named function's call
        ends with "stop" (as OpenAI and vLLM say), a cut-off output with "length"."""
        if engine_reason == "stop" and called and self.plan.mode in ("auto", "required"):
            return "tool_calls"
        return engine_reason

    def _visible(self, completion: CompletionOutput, text: str) -> str:
        """`text` without the special token that ended the output (an EOS such as <|im_end|>), which is kept in
        the text when special tokens are."""
        if (self.params.skip_special_tokens or completion.finish_reason != "stop"
                or isinstance(completion.stop_reason, str) or not completion.token_ids):
            return text
        last = completion.token_ids[-1]
        if last not in self.tokenizer.all_special_ids and last not in self.tokenizer.eos_token_ids:
            return text
        piece = self.tokenizer.decode([last], skip_special_tokens=False)
        return text[:-len(piece)] if piece and text.endswith(piece) else text


def _merged_delta(deltas: list[DeltaMessage]) -> MessageParts | None:
    """One step's parser deltas as one chunk delta: texts joined, a call's pieces joined (its first piece
    keeps the id, type and name), calls in order."""
    if not deltas:
        return None
    content = "".join(delta.content or "" for delta in deltas)
    reasoning = "".join(delta.reasoning_content or "" for delta in deltas)
    calls: dict[int, DeltaToolCall] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            call = calls.get(piece.index)
            if call is None:
                calls[piece.index] = DeltaToolCall(
                    index=piece.index, id=piece.id, type=piece.type,
                    function=DeltaFunctionCall(name=piece.function.name, arguments=piece.function.arguments))
            elif piece.function.arguments:
                call.function.arguments = (call.function.arguments or "") + piece.function.arguments
    if not (content or reasoning or calls):
        return None
    return MessageParts(content or None, reasoning or None, [calls[i] for i in sorted(calls)] or None)


class ChoiceReader:
    """One choice's text through the reasoning parser, then its answer through the call reader; with
    `max_calls` (parallel_tool_calls false) later calls are dropped."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, max_calls: int | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.max_calls = max_calls
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> list[DeltaMessage]:
        deltas: list[DeltaMessage] = []
        content = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if final:
                more_reasoning, more_content = self.reasoning.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
            if reasoning:
                deltas.append(DeltaMessage(reasoning_content=reasoning))
        if self.tools is None:
            if content:
                deltas.append(DeltaMessage(content=content))
            return deltas
        answer = self.tools.feed(content) if content else []
        if final:
            answer += self.tools.finish()
        return deltas + self._limited(answer)

    def _limited(self, deltas: list[DeltaMessage]) -> list[DeltaMessage]:
        kept = []
        for delta in deltas:
            if delta.tool_calls:
                index = delta.tool_calls[0].index
                if self.max_calls is not None and index >= self.max_calls:
                    continue
                self.num_calls = max(self.num_calls, index + 1)
            kept.append(delta)
        return kept


class NamedCallReader(ToolParser):
    """The output of a named tool_choice: the named function's arguments object, as written (the constraint
    makes it one). The call starts with the object's first character (whitespace before it is layout; an
    output cut in its reasoning has no call); each piece of text is an argument fragment."""
    name = "named"
    needs_special_tokens = False

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.function_name = function_name
        self._state = self._read_arguments

    def _read_arguments(self) -> bool:
        if not self._num_calls:
            self._consume(len(self._buffer) - len(self._buffer.lstrip()))
            if self._buffer:
                self._begin_call(self.function_name)
        if not self._buffer:
            return False
        self._emit_arguments(self._consume(len(self._buffer)))
        return True


class RequiredCallsReader(JsonCallParser):
    """The output of tool_choice "required": `[{"name": N, "arguments": {...}}, ...]` (the constraint makes it
    so). A call starts once its name is read; its arguments pass through as written. Whatever is not a call
    (an output cut before the array opened) is content."""
    name = "required"
    needs_special_tokens = False

    def __init__(self, tools=None) -> None:
        super().__init__(tools)
        self._state = self._read_open

    def _read_open(self) -> bool:
        pos = skip_whitespace(self._buffer, 0)
        opened = expect(self._buffer, pos, "[", self._eof) if pos < len(self._buffer) else NEED
        if opened is NEED:
            return False
        if opened is FAIL:
            self._state = self._read_rest
        else:
            self._consume(opened)
            self._state = self._read_item
        return True

    def _read_item(self) -> bool:
        pos = skip_whitespace(self._buffer, 0)
        if pos == len(self._buffer):
            self._consume(pos)
            return False
        if self._buffer[pos] in ",]":
            if self._consume(pos + 1)[-1] == "]":
                self._state = self._read_rest  # the array's end; the constraint leaves nothing after it
            return True
        return self._open_call(read_call_header(self._buffer, pos, self._eof), self._read_rest)

    def _read_arguments(self) -> bool:
        end, closed = self._scanner.scan(self._buffer)
        self._emit_arguments(self._consume(end))
        if closed:
            self._end_call()
            self._state = self._read_call_end
            return True
        if self._buffer:  # a `<` outside a string: not the constrained JSON
            self._state = self._read_rest
            return True
        return False

    def _read_call_end(self) -> bool:
        """The `}` closing the call object."""
        pos = skip_whitespace(self._buffer, 0)
        closed = expect(self._buffer, pos, "}", self._eof) if pos < len(self._buffer) else NEED
        if closed is NEED:
            if self._eof:
                self._consume(pos)
            return False
        if closed is FAIL:
            self._state = self._read_rest
        else:
            self._consume(closed)
            self._state = self._read_item
        return True

    def _read_rest(self) -> bool:
        if not self._buffer:
            return False
        self._emit_content(self._consume(len(self._buffer)))
        return True
