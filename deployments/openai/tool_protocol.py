"""OpenAI's tool-calling shapes as pydantic models: the request's `tools`, `tool_choice` and the calls of earlier
assistant turns, and the `tool_calls` of responses and stream deltas. Types only; what they must satisfy beyond
their types (unique names, valid schemas, results that answer a call) is checked in tool_calls.py."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class StrictRequest(BaseModel):
    """A request body part: strict about types (no "5" for 5), fields it does not know are ignored."""
    model_config = ConfigDict(strict=True, extra="ignore")


# ---- requests ---------------------------------------------------------------------------------------------
class FunctionDefinition(StrictRequest):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # required and named choices always follow the schema; auto never is forced


class ChatTool(StrictRequest):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictRequest):
    name: str


class NamedToolChoice(StrictRequest):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(StrictRequest):
    name: str
    arguments: str  # JSON text, as the server returned it


class MessageToolCall(StrictRequest):
    """A call in an earlier assistant turn of the conversation."""
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


# ---- responses --------------------------------------------------------------------------------------------
class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed call: its first piece has the id, type and name; later ones argument text."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None
