"""OpenAI's request and response bodies as pydantic models, and the one mapping from a request to the
engine's SamplingParams. Requests are strict (no "5" for 5) and ignore fields they do not know."""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from engine.sampling_params import MAX_LOGPROBS, SamplingParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 128


# ---- requests ---------------------------------------------------------------------------------------------
class _StrictRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_StrictRequest):
    include_usage: bool = False


class _GenerationRequest(_StrictRequest):
    """Fields shared by completions and chat completions, OpenAI's and vLLM's extras."""
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    user: str | None = None
    # Known OpenAI fields the engine cannot honour: refused when set, rather than silently ignored.
    logit_bias: dict[str, float] | None = None
    # vLLM's extras (the openai client sends them through `extra_body`).
    top_k: int | None = Field(None, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_is_strings(cls, value: Any) -> Any:
        if value is None or isinstance(value, str) and value:
            return value
        if isinstance(value, list) and all(isinstance(s, str) and s for s in value):
            return value
        raise ValueError("stop must be a non-empty string or a list of non-empty strings")

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids_are_non_negative(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(t < 0 for t in value):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None):
        if value:
            raise ValueError("logit_bias is not supported by this server")
        return value

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                           prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters for this request (max_tokens and logprobs differ per endpoint)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            skip_special_tokens=self.skip_special_tokens,
        )


PromptInput = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_GenerationRequest):
    prompt: PromptInput
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        def token_ids(item: Any) -> bool:
            return isinstance(item, list) and bool(item) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in item)
        if isinstance(value, str) or token_ids(value):
            return value
        if isinstance(value, list) and value and (all(isinstance(p, str) for p in value)
                                                  or all(token_ids(p) for p in value)):
            return value
        raise ValueError("prompt must be a string, a non-empty list of strings, a non-empty list of token ids, "
                         "or a list of token-id lists")

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo):
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of is not supported (only best_of equal to n)")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None):
        if value:
            raise ValueError("suffix is not supported by this server")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)


class TextContentPart(_StrictRequest):
    type: Literal["text"]
    text: str


class ChatMessage(_StrictRequest):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _only_text_parts(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                if isinstance(part, dict) and part.get("type") not in (None, "text"):
                    raise ValueError(f"content parts of type {part.get('type')!r} are not supported; "
                                     "this model takes text parts only")
        return value

    def to_template_dict(self) -> dict[str, str]:
        """The message as the chat template expects it (text content, 'developer' spelled 'system')."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list[Any] | None):
        if value:
            raise ValueError("tools are not supported by this server")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_format_only(cls, value: dict[str, Any] | None):
        if value is not None and value.get("type", "text") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported by this server")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- responses --------------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def _now() -> int:
    return int(time.time())


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    """A streamed completion event has the same shape as the full response, with partial choices."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "atom-ray"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
