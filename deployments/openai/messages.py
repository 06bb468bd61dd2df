"""POST /v1/messages, Anthropic's Messages API, over the chat-completions path: the request becomes a chat
request (system and text turns as messages, tool_use blocks as an assistant's tool_calls, tool_result blocks
as tool messages, tools and tool_choice as OpenAI's, thinking as the template's enable_thinking), which runs
through the chat route's own handler as a stream (same admission, templating, parsers, engine and metrics);
that stream, read as Anthropic's events, is the reply (messages_stream.py). Every error, FastAPI's own
included, is Anthropic's error body, naming the field of the Anthropic request."""
from __future__ import annotations

import json
import re

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .chat import create_chat_completion
from .chat_output import ChatParsers
from .errors import from_exception, validation_message
from .messages_protocol import (MEDIA_BLOCK_TYPES, InputMessage, MessagesError, MessagesRequest, TextBlock,
                                ToolResultBlock, ToolUseBlock, invalid_request)
from .messages_stream import MessagesResponse, MessageTranslator
from .protocol import ChatCompletionRequest
from .serving import ServingContext

_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


async def create_message(ctx: ServingContext, body: MessagesRequest, raw_request: Request,
                         parsers: ChatParsers | None = None) -> Response:
    """The reply to one Messages request, or Anthropic's error for it."""
    translation = ChatTranslation(body)
    try:
        chat_body = translation.chat_request()
        counted = _PromptCounter(ctx)
        chat_response = await create_chat_completion(counted, chat_body, raw_request, parsers)
    except MessagesError as exc:
        return exc.response()
    except Exception as exc:
        return translation.error(from_exception(exc)).response()
    if not isinstance(chat_response, StreamingResponse):  # the chat route's error, or a client that left
        return translation.error_response(chat_response)
    message_id = "msg_" + counted.response_id.removeprefix("chatcmpl-")
    translator = MessageTranslator(message_id, ctx.served_model_name, counted.num_prompt_tokens)
    return MessagesResponse(chat_response, translator, body.stream)


class _PromptCounter:
    """The serving context as the chat handler sees it, noting the prompt's length and the response id on their
    way to the engine: Anthropic's message_start carries both before the first token."""

    def __init__(self, ctx: ServingContext) -> None:
        self._ctx = ctx
        self.num_prompt_tokens = 0
        self.response_id = ""

    def __getattr__(self, name: str):
        return getattr(self._ctx, name)

    async def run(self, ticket, raw_request, arrival_time, prompts, params, response_id, *args, **kwargs):
        self.num_prompt_tokens, self.response_id = len(prompts[0]), response_id
        return await self._ctx.run(ticket, raw_request, arrival_time, prompts, params, response_id, *args, **kwargs)


class ChatTranslation:
    """One Messages request as a chat-completions request, and the chat path's errors in its terms."""

    def __init__(self, body: MessagesRequest) -> None:
        self.body = body
        self.origins: list[str] = []  # chat message index -> the Anthropic field it came from

    def chat_request(self) -> ChatCompletionRequest:
        body = self.body
        request = {"model": body.model, "messages": self._messages(), "max_tokens": body.max_tokens,
                   "stream": True, "stream_options": {"include_usage": True}}
        for field in ("temperature", "top_p", "top_k"):
            if getattr(body, field) is not None:
                request[field] = getattr(body, field)
        if body.stop_sequences is not None:
            request["stop"] = body.stop_sequences
        if body.tools:
            request["tools"] = [{"type": "function", "function": {
                "name": tool.name, "parameters": tool.input_schema,
                **({"description": tool.description} if tool.description is not None else {})}}
                for tool in body.tools]
        if body.tool_choice is not None:
            request.update(self._tool_choice())
        if body.thinking is not None:
            request["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
        try:
            return ChatCompletionRequest.model_validate(request)
        except ValidationError as exc:
            message, param = validation_message(RequestValidationError(exc.errors()))
            raise self.error(MessagesError(400, message), param) from None

    # ---- the conversation -------------------------------------------------------------------------------
    def _messages(self) -> list[dict]:
        messages: list[dict] = []
        if self.body.system:
            system = self.body.system
            parts = [{"type": "text", "text": system}] if isinstance(system, str) else [
                {"type": "text", "text": block.text} for block in system]
            self._append(messages, "system", {"role": "system", "content": parts})
        call_ids: set[str] = set()
        for index, message in enumerate(self.body.messages):
            if message.role == "user":
                self._user_turn(messages, index, message, call_ids)
            else:
                self._assistant_turn(messages, index, message, call_ids)
        if self.body.messages[-1].role == "assistant":
            raise invalid_request("the conversation ends with an assistant message, a prefill for the reply to "
                                  "continue, which this server does not support; end it with a user message",
                                  f"messages.{len(self.body.messages) - 1}")
        return messages

    def _append(self, messages: list[dict], origin: str, message: dict) -> None:
        messages.append(message)
        self.origins.append(origin)

    def _user_turn(self, messages: list[dict], index: int, message: InputMessage, call_ids: set[str]) -> None:
        """Tool results first (each a tool message), then the turn's text, as one user message."""
        texts, answered = [], False
        for number, block in enumerate(_blocks(message)):
            field = f"messages.{index}.content.{number}"
            if isinstance(block, ToolResultBlock):
                if block.tool_use_id not in call_ids:
                    raise invalid_request(f"tool_result answers tool_use_id {block.tool_use_id!r}, which no "
                                          "tool_use block of an earlier assistant message has",
                                          f"{field}.tool_use_id")
                self._append(messages, field, {"role": "tool", "tool_call_id": block.tool_use_id,
                                               "content": self._tool_result_text(block, field)})
                answered = True
            elif isinstance(block, TextBlock):
                texts.append({"type": "text", "text": block.text})
            else:
                self._refuse(block, field, "user")
        if texts or not answered:
            self._append(messages, f"messages.{index}", {"role": "user", "content": texts})

    def _assistant_turn(self, messages: list[dict], index: int, message: InputMessage, call_ids: set[str]) -> None:
        texts, reasoning, calls = [], [], []
        for number, block in enumerate(_blocks(message)):
            if isinstance(block, TextBlock):
                texts.append({"type": "text", "text": block.text})
            elif isinstance(block, ToolUseBlock):
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input)}})
                call_ids.add(block.id)
            elif block.type == "thinking":
                reasoning.append(block.thinking)
            elif block.type != "redacted_thinking":  # encrypted reasoning of another server: nothing to read
                self._refuse(block, f"messages.{index}.content.{number}", "assistant")
        turn = {"role": "assistant", "content": texts}
        if calls:
            turn["tool_calls"] = calls
        if reasoning:
            turn["reasoning_content"] = "\n".join(reasoning)
        self._append(messages, f"messages.{index}", turn)

    def _tool_result_text(self, block: ToolResultBlock, field: str) -> str:
        content = block.content
        if isinstance(content, list):
            for number, part in enumerate(content):
                if part.type != "text":
                    self._refuse(part, f"{field}.content.{number}", "user")
            content = "\n".join(part.text for part in content)
        # Chat templates have no notion of a failed call: the model reads it in the result itself.
        return f"Error: {content or ''}" if block.is_error else content or ""

    def _refuse(self, block, field: str, role: str) -> None:
        if block.type in MEDIA_BLOCK_TYPES:
            raise invalid_request(f"this server serves the text stack of {self.body.model} only; {block.type} "
                                  "input is not supported", field)
        raise invalid_request(f"{role} messages cannot hold {block.type} blocks", f"{field}.type")

    def _tool_choice(self) -> dict:
        choice = self.body.tool_choice
        names = [tool.name for tool in self.body.tools or ()]
        if choice.type == "tool":
            if choice.name not in names:
                raise invalid_request(f"tool_choice names the tool {choice.name!r}, which is not among the "
                                      f"request's tools ({', '.join(names) or 'none given'})", "tool_choice.name")
            fields = {"tool_choice": {"type": "function", "function": {"name": choice.name}}}
        else:
            fields = {"tool_choice": _TOOL_CHOICES[choice.type]}
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
        return fields

    # ---- errors -----------------------------------------------------------------------------------------
    def error(self, openai_error, param: str | None = None) -> MessagesError:
        """The chat path's error (an OpenAIError, or a MessagesError with the chat `param`) in Anthropic's shape,
        naming the Anthropic request's field."""
        chat_param = param if param is not None else getattr(openai_error, "param", None)
        param = self._field(chat_param)
        message = _ANTHROPIC_NAMES.sub(_anthropic_name, openai_error.message)
        if chat_param is not None:  # the engine's own words name its parameter: SamplingParams.stop
            message = message.replace(f"SamplingParams.{chat_param}", param)
        if openai_error.status_code == 400:
            return invalid_request(message, param)
        return MessagesError(openai_error.status_code, message, openai_error.headers)

    def error_response(self, chat_response: Response) -> Response:
        """The chat handler's error response (OpenAI's body) as Anthropic's; other responses pass through."""
        if chat_response.status_code < 400 or not chat_response.body:  # a client that left: nobody reads it
            return chat_response
        error = json.loads(chat_response.body)["error"]
        headers = {key: value for key, value in chat_response.headers.items() if key.lower() == "retry-after"}
        openai_error = MessagesError(chat_response.status_code, error["message"], headers or None)
        return self.error(openai_error, error.get("param")).response()

    def _field(self, param: str | None) -> str | None:
        """A chat request's field as the Messages request's."""
        if param is None:
            return None
        match = re.fullmatch(r"messages\.(\d+)(\..*)?", param)
        if match and int(match.group(1)) < len(self.origins):
            return self.origins[int(match.group(1))]
        match = re.fullmatch(r"tools\.(\d+)\.function\.(name|parameters)(\..*)?", param)
        if match:
            return f"tools.{match.group(1)}.{_TOOL_FIELDS[match.group(2)]}{match.group(3) or ''}"
        return {"stop": "stop_sequences", "chat_template_kwargs": "thinking",
                "parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}.get(param.split(".")[0], param)


# A chat tool's fields as an Anthropic tool's; in messages they appear as tools[0].function.parameters.
_TOOL_FIELDS = {"name": "name", "parameters": "input_schema"}
_ANTHROPIC_NAMES = re.compile(r"tools\[(\d+)\]\.function\.(name|parameters)")


def _anthropic_name(match: re.Match) -> str:
    return f"tools[{match.group(1)}].{_TOOL_FIELDS[match.group(2)]}"


def _blocks(message: InputMessage) -> list:
    return [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content


# ---- the route --------------------------------------------------------------------------------------------
class MessagesRoute(APIRoute):
    """A route whose every error, FastAPI's own included (a body that does not validate, a wrong method), is
    Anthropic's error body rather than the app's OpenAI one."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                return validation_error(exc).response()
            except StarletteHTTPException as exc:
                return MessagesError(exc.status_code, str(exc.detail), getattr(exc, "headers", None)).response()

        return handle

    async def handle(self, scope, receive, send) -> None:
        if self.methods and scope["method"] not in self.methods:
            error = MessagesError(405, f"{scope['method']} is not allowed on {self.path}; use POST",
                                  {"Allow": ", ".join(sorted(self.methods))})
            return await error.response()(scope, receive, send)
        await super().handle(scope, receive, send)


def validation_error(exc: RequestValidationError) -> MessagesError:
    """A body that does not validate: a field this API does not have, one missing or of the wrong type."""
    unknown = [str(error["loc"][-1]) for error in exc.errors()
               if error.get("type") == "extra_forbidden" and len(error.get("loc", ())) == 2]
    if unknown:
        return invalid_request(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: "
                               "not a Messages API field that this server takes", unknown[0])
    message, param = validation_message(exc)
    return invalid_request(message.removeprefix("Invalid request: "), param)
