"""Anthropic's Messages API (POST /v1/messages) as pydantic models: the request, strict about its own fields
(one it does not know is a 400 naming it) and lenient inside content blocks, which clients send back as the
server returned them; and Anthropic's error body `{"type": "error", "error": {"type": ..., "message": ...}}`."""
from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


# ---- requests ---------------------------------------------------------------------------------------------
class _Part(BaseModel):
    """A part of the request below its top level: strict about types; fields it does not know (cache_control,
    citations, a response block's caller) are ignored, so a client can send a reply's blocks back as they came."""
    model_config = ConfigDict(strict=True, extra="ignore")


class TextBlock(_Part):
    type: Literal["text"]
    text: str


# Block types that carry input no model served here reads; accepted by the schema only to be refused by name.
MEDIA_BLOCK_TYPES = ("image", "document", "search_result", "container_upload")


class MediaBlock(_Part):
    type: Literal[MEDIA_BLOCK_TYPES]


class ToolUseBlock(_Part):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Part):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | MediaBlock, Field(discriminator="type")]] | None = None
    is_error: bool = False


class ThinkingBlock(_Part):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # this server signs nothing; a signature sent back is ignored


class RedactedThinkingBlock(_Part):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[TextBlock | MediaBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
                         | RedactedThinkingBlock, Field(discriminator="type")]


class InputMessage(_Part):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolDefinition(_Part):
    """A client tool. Anthropic's server tools (web search, code execution, ...) have other types: refused."""
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None

    @field_validator("type")
    @classmethod
    def _client_tools_only(cls, value: str | None) -> str | None:
        if value not in (None, "custom"):
            raise ValueError(f"tools of type {value!r} (Anthropic's server tools) are not supported by this server; "
                             "give custom tools with a name and an input_schema")
        return value


class ToolChoice(_Part):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_with_tool(self) -> "ToolChoice":
        if self.type == "tool" and self.name is None:
            raise ValueError('tool_choice of type "tool" needs the name of the tool to call')
        return self


class ThinkingConfig(_Part):
    """Reasoning on or off, through the chat template's `enable_thinking`. The budget is not enforced: the
    reasoning counts against max_tokens."""
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = None

    @model_validator(mode="after")
    def _budget(self) -> "ThinkingConfig":
        if self.type == "enabled" and (self.budget_tokens is None or self.budget_tokens < 1):
            raise ValueError('thinking of type "enabled" needs budget_tokens, a positive integer')
        return self


class MessagesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str
    max_tokens: int
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    thinking: ThinkingConfig | None = None
    # Accepted and ignored: they change nothing a single server does (metadata.user_id is for Anthropic's abuse
    # tracking; the prefix cache works without cache_control; there is one service tier).
    metadata: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    service_tier: str | None = None


# ---- errors -----------------------------------------------------------------------------------------------
# Anthropic's error types by HTTP status. 503 (the engine is down; Serve replaces the replica) keeps its status,
# which Anthropic's clients retry like their 529.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                529: "overloaded_error"}
# The chat route's OpenAI error types, for errors that arrive inside its event stream without a status.
STATUS_OF_OPENAI_TYPE = {"invalid_request_error": 400, "rate_limit_error": 429, "internal_server_error": 500,
                         "service_unavailable_error": 503}


def error_body(status: int, message: str, code: str | None = None) -> dict:
    """`code`: the OpenAI error code the request guard gives, for which Anthropic's body has no place."""
    error_type = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": error_type, "message": message}}


class MessagesError(Exception):
    """An error to send as Anthropic's error body."""

    def __init__(self, status_code: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.status_code, self.message)

    def response(self) -> Response:
        # ASCII: a message that quotes the client's input (a lone surrogate in a model name) still renders.
        content = json.dumps(self.body(), ensure_ascii=True, separators=(",", ":"))
        return Response(content, status_code=self.status_code, headers=self.headers, media_type="application/json")


def invalid_request(message: str, field: str | None = None) -> MessagesError:
    """A 400 whose message starts with the field it is about (Anthropic's errors have no `param`)."""
    named = field is None or field in message or re.sub(r"\.(\d+)", r"[\1]", field) in message
    return MessagesError(400, message if named else f"{field}: {message}")
