"""The answer of POST /v1/messages: the chat route's event stream (chat.completion.chunk payloads) read as
Anthropic's events: message_start, then per content block (thinking, text, tool_use) content_block_start,
its deltas (thinking_delta, text_delta, input_json_delta) and content_block_stop, then message_delta (stop
reason, usage) and message_stop. A whole message is those events added up, so a streamed reply and a whole one
always agree."""
from __future__ import annotations

import copy
import json

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from .messages_protocol import STATUS_OF_OPENAI_TYPE, MessagesError
from .serving import CLIENT_CLOSED_REQUEST
from .streams import ClientDisconnected, until_disconnected

_DELTA_OF_BLOCK = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking"),
                   "tool_use": ("input_json_delta", "partial_json")}


class MessageTranslator:
    """Turns the chat stream's payloads into Anthropic's events and keeps `message`, what they add up to."""

    def __init__(self, message_id: str, model: str, input_tokens: int) -> None:
        self.message = {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
                        "stop_reason": None, "stop_sequence": None,
                        "usage": {"input_tokens": input_tokens, "output_tokens": 0}}
        self.error: MessagesError | None = None
        self.done = False
        self._open: tuple[str, int | None] | None = None  # the open block's type and, for a call, its chat index
        self._arguments: dict[int, str] = {}  # a tool_use block's input JSON so far, by block index
        self._finish_reason: str | None = None
        self._matched_stop: str | None = None
        self._buffer = b""

    def start(self) -> list[dict]:
        started = copy.deepcopy(self.message)
        return [{"type": "message_start", "message": started}]

    def feed_bytes(self, data: bytes) -> list[dict]:
        """The events of the chat stream's bytes so far (whole `data: ...` events; a partial one waits)."""
        self._buffer += data
        *complete, self._buffer = self._buffer.split(b"\n\n")
        events = []
        for raw in complete:
            payload = raw.decode().removeprefix("data: ")
            if payload == "[DONE]":
                events += self._finish()
            elif payload:
                events += self.feed(json.loads(payload))
        return events

    def feed(self, chunk: dict) -> list[dict]:
        if "error" in chunk:
            return self._fail(chunk["error"])
        events = []
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._add("thinking", None, delta["reasoning_content"])
            if delta.get("content"):
                events += self._add("text", None, delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._add_call(call)
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
                stop_reason = choice.get("stop_reason")
                self._matched_stop = stop_reason if isinstance(stop_reason, str) else None
        if chunk.get("usage"):
            self.message["usage"] = {"input_tokens": chunk["usage"]["prompt_tokens"],
                                     "output_tokens": chunk["usage"]["completion_tokens"]}
        return events

    # ---- blocks -----------------------------------------------------------------------------------------
    def _add(self, kind: str, call_index: int | None, text: str) -> list[dict]:
        events = [] if self._open == (kind, call_index) else self._start_block(kind, call_index)
        index = len(self.message["content"]) - 1
        delta_type, field = _DELTA_OF_BLOCK[kind]
        block = self.message["content"][index]
        if kind == "tool_use":
            self._arguments[index] += text
        else:
            block[kind] += text
        return events + [{"type": "content_block_delta", "index": index, "delta": {"type": delta_type, field: text}}]

    def _add_call(self, call: dict) -> list[dict]:
        function = call.get("function") or {}
        events = []
        if call.get("id"):  # a call's first piece: its id and name
            events += self._start_block("tool_use", call["index"], call["id"], function.get("name") or "")
        if function.get("arguments"):
            events += self._add("tool_use", call["index"], function["arguments"])
        return events

    def _start_block(self, kind: str, call_index: int | None, call_id: str = "", name: str = "") -> list[dict]:
        events = self._stop_block()
        block = {"type": kind, "text": ""} if kind == "text" else (
            {"type": kind, "thinking": "", "signature": ""} if kind == "thinking" else
            {"type": kind, "id": call_id, "name": name, "input": {}})
        index = len(self.message["content"])
        self.message["content"].append(block)
        if kind == "tool_use":
            self._arguments[index] = ""
        self._open = (kind, call_index)
        return events + [{"type": "content_block_start", "index": index, "content_block": copy.deepcopy(block)}]

    def _stop_block(self) -> list[dict]:
        if self._open is None:
            return []
        index = len(self.message["content"]) - 1
        if index in self._arguments:
            self.message["content"][index]["input"] = _arguments_object(self._arguments.pop(index))
        self._open = None
        return [{"type": "content_block_stop", "index": index}]

    # ---- the end ----------------------------------------------------------------------------------------
    def _finish(self) -> list[dict]:
        if self.error is not None or self.done:
            return []
        self.done = True
        events = self._stop_block()
        called = any(block["type"] == "tool_use" for block in self.message["content"])
        stop_reason, stop_sequence = _stop_reason(self._finish_reason, self._matched_stop, called)
        self.message["stop_reason"], self.message["stop_sequence"] = stop_reason, stop_sequence
        usage = self.message["usage"]
        return events + [
            {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
             "usage": {"input_tokens": usage["input_tokens"], "output_tokens": usage["output_tokens"]}},
            {"type": "message_stop"}]

    def _fail(self, error: dict) -> list[dict]:
        """An error after the stream started: Anthropic's error event, which ends the stream."""
        status = STATUS_OF_OPENAI_TYPE.get(error.get("type"), 500)
        self.error = MessagesError(status, str(error.get("message") or "The request failed"))
        return [self.error.body()]


def _stop_reason(finish_reason: str | None, matched_stop: str | None, called: bool) -> tuple[str, str | None]:
    if called and finish_reason in ("tool_calls", "stop"):  # a named tool_choice's call ends with "stop"
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop" and matched_stop is not None:
        return "stop_sequence", matched_stop
    return "end_turn", None


def _arguments_object(text: str) -> dict:
    """A call's input: its arguments object ({} when the output was cut before the object closed)."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def sse(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=True, separators=(',', ':'))}\n\n".encode()


class MessagesResponse(Response):
    """Plays the chat route's stream response, which aborts its engine request and frees its admission however
    it ends, through a MessageTranslator: its body as Anthropic's events, or collected into one message."""

    def __init__(self, chat_stream: StreamingResponse, translator: MessageTranslator, stream: bool) -> None:
        super().__init__(status_code=200)
        self.chat_stream = chat_stream
        self.translator = translator
        self.stream = stream

    async def __call__(self, scope, receive, send) -> None:
        if self.stream:
            await self.chat_stream(scope, receive, self._translating(send))
            return
        try:
            await until_disconnected(Request(scope, receive), self.chat_stream(scope, receive, self._collect))
        except ClientDisconnected:
            await Response(status_code=CLIENT_CLOSED_REQUEST)(scope, receive, send)
            return
        translator = self.translator
        if translator.error is not None:
            response = translator.error.response()
        elif not translator.done:
            response = MessagesError(500, "The chat stream ended without finishing the message").response()
        else:
            response = Response(json.dumps(translator.message, ensure_ascii=True, separators=(",", ":")),
                                media_type="application/json")
        await response(scope, receive, send)

    def _translating(self, send):
        translator = self.translator

        async def translated(message) -> None:
            if message["type"] == "http.response.start":
                await send(message)
                await send({"type": "http.response.body", "body": b"".join(map(sse, translator.start())),
                            "more_body": True})
            elif message["type"] == "http.response.body":
                body = b"".join(map(sse, translator.feed_bytes(message.get("body", b""))))
                more = message.get("more_body", False)
                if body or not more:
                    await send({"type": "http.response.body", "body": body, "more_body": more})
            else:
                await send(message)

        return translated

    async def _collect(self, message) -> None:
        if message["type"] == "http.response.body":
            self.translator.feed_bytes(message.get("body", b""))
