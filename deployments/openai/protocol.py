"""OpenAI's request bodies as pydantic models (responses: responses.py), and the one mapping from a request to
the engine's SamplingParams. Requests are strict about types (no "5" for 5) and ignore fields they do not know;
value ranges are the engine's own (SamplingParams), so the HTTP API and the Python handles refuse the same
values. Fields that OpenAI or vLLM define and this server cannot honour are refused when set, naming the
field, rather than silently ignored."""
from __future__ import annotations

import asyncio
from typing import Annotated, Any, Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from engine.sampling_params import SamplingParams, SamplingParamsError

from .structured_output import constraint_sources, request_constraint, request_field
from .tool_protocol import ChatTool, MessageToolCall, ToolChoice


# ---- requests ---------------------------------------------------------------------------------------------
class _StrictRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_StrictRequest):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; refused when true

    @field_validator("continuous_usage_stats")
    @classmethod
    def _no_continuous_usage(cls, value: bool) -> bool:
        if value:
            raise ValueError("stream_options.continuous_usage_stats is not supported by this server")
        return value


def _unset(value: Any) -> bool:
    return value is None or value == [] or value == {}


# Fields some client may send that this server does not honour, with what counts as leaving them unset.
_UNSUPPORTED_GENERATION_FIELDS: dict[str, Callable[[Any], bool]] = {
    "logit_bias": _unset,
    # Structured output runs on llguidance whatever a client asks for.
    "guided_decoding_backend": lambda v: v is None or v in ("auto", "guidance", "llguidance"),
    "use_beam_search": lambda v: v is None or v is False,
    "allowed_token_ids": _unset, "bad_words": _unset, "logits_processors": _unset,
    "truncate_prompt_tokens": _unset, "prompt_logprobs": _unset,
}
_UNSUPPORTED_CHAT_FIELDS: dict[str, Callable[[Any], bool]] = {
    "functions": _unset, "function_call": lambda v: v is None or v in ("none", "auto"),
    "echo": lambda v: v is None or v is False, "continue_final_message": lambda v: v is None or v is False,
    "add_generation_prompt": lambda v: v is None or v is True,
    "chat_template": _unset, "documents": _unset,
    "modalities": lambda v: v is None or v == ["text"], "audio": _unset, "prediction": _unset,
}


def _refuse_if_set(value: Any, info: ValidationInfo, table: dict[str, Callable[[Any], bool]]) -> Any:
    if not table[info.field_name](value):
        raise ValueError(f"{info.field_name} is not supported by this server (got {_short(value)})")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class JsonSchemaFormat(_StrictRequest):
    """OpenAI's `response_format.json_schema`. Output always follows the schema, whatever `strict` says."""
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_StrictRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError('response_format of type "json_schema" needs json_schema.schema (a JSON schema object)')
        return self


class StructuredOutputsRequest(_StrictRequest):
    """vLLM's `structured_outputs` object (the engine's StructuredOutputsParams)."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False  # there is one library, hence no fallback to disable
    structural_tag: Any = None

    @field_validator("structural_tag")
    @classmethod
    def _no_structural_tag(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("structured_outputs.structural_tag is not supported by this server")
        return value


class _GenerationRequest(_StrictRequest):
    """Fields shared by completions and chat completions, OpenAI's and vLLM's extras."""
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM's extras (the openai client sends them through `extra_body`).
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields; at
    # most one constraint per request.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # Refused when set (see _UNSUPPORTED_GENERATION_FIELDS).
    logit_bias: Any = None
    guided_decoding_backend: Any = None
    use_beam_search: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    truncate_prompt_tokens: Any = None
    prompt_logprobs: Any = None

    @field_validator(*_UNSUPPORTED_GENERATION_FIELDS)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_if_set(value, info, _UNSUPPORTED_GENERATION_FIELDS)

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def structured_output_sources(self) -> list[tuple[str, dict]]:
        return constraint_sources(self)

    # Where an engine parameter comes from a request field of another name, errors name the request's.
    _PARAM_NAMES: ClassVar[dict[str, str]] = {}

    async def to_sampling_params_async(self, max_tokens: int | None, logprobs: int | None,
                                       prompt_logprobs: int | None = None) -> SamplingParams:
        """to_sampling_params, off the event loop when a constraint is checked (milliseconds for large schemas)."""
        if self.structured_output_sources:
            return await asyncio.to_thread(self.to_sampling_params, max_tokens, logprobs, prompt_logprobs)
        return self.to_sampling_params(max_tokens, logprobs, prompt_logprobs)

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                           prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters for this request (max_tokens and logprobs differ per endpoint); its
        bounds are the engine's, and an error names the request's field."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        structured_outputs, structured_field = request_constraint(self)
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
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
                structured_outputs=structured_outputs,
            )
        except SamplingParamsError as exc:
            if structured_field and (exc.param or "").startswith("structured_outputs"):
                param = request_field(self, exc.param, structured_field)
                message = str(exc).replace(exc.param, param) if "." in exc.param else str(exc)
                raise SamplingParamsError(message, param) from None
            param = self._param_name(exc.param)
            message = str(exc).replace(f"SamplingParams.{exc.param}", param) if param != exc.param else str(exc)
            raise SamplingParamsError(message, param) from None

    def _param_name(self, engine_name: str | None) -> str | None:
        return self._PARAM_NAMES.get(engine_name, engine_name)


PromptInput = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_GenerationRequest):
    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    _PARAM_NAMES: ClassVar[dict[str, str]] = {"prompt_logprobs": "logprobs"}

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


# Content-part types that carry media (OpenAI's chat and Responses APIs, vLLM's) -> the kind of input.
MEDIA_PART_KINDS = {"image_url": "image", "input_image": "image", "image": "image",
                    "input_audio": "audio", "audio_url": "audio", "audio": "audio",
                    "video_url": "video", "input_video": "video", "video": "video"}


class MediaContentPart(_StrictRequest):
    """An image, audio or video part: accepted by the schema only to be refused by name (chat.py), since no
    model served here takes media (a multimodal checkpoint serves its text stack)."""
    type: Literal[tuple(MEDIA_PART_KINDS)]

    @property
    def kind(self) -> str:
        return MEDIA_PART_KINDS[self.type]


ContentPart = Annotated[TextContentPart | MediaContentPart, Field(discriminator="type")]


class ChatMessage(_StrictRequest):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # the call a tool message answers
    reasoning_content: str | None = None  # an assistant turn's reasoning, for templates that keep it

    @field_validator("content", mode="before")
    @classmethod
    def _only_text_and_media_parts(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                if isinstance(part, dict) and part.get("type") not in ("text", None, *MEDIA_PART_KINDS):
                    raise ValueError(f"content parts of type {part.get('type')!r} are not supported; "
                                     "this model takes text parts only")
        return value

    @property
    def media_kinds(self) -> list[str]:
        """The kinds of this message's media parts ("image", "audio", "video"), in order."""
        if not isinstance(self.content, list):
            return []
        return [part.kind for part in self.content if isinstance(part, MediaContentPart)]

    def to_template_dict(self) -> dict[str, str]:
        """The message as the chat template expects it (text content, 'developer' spelled 'system')."""
        content = self.content
        if isinstance(content, list):
            assert not self.media_kinds, "media parts are refused before templating"
            content = "\n".join(part.text for part in content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Tool calling (checked further in tool_calls.py) and the chat template's extra variables.
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Refused when set (see _UNSUPPORTED_CHAT_FIELDS).
    functions: Any = None
    function_call: Any = None
    echo: Any = None
    continue_final_message: Any = None
    add_generation_prompt: Any = None
    chat_template: Any = None
    documents: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None

    _PARAM_NAMES: ClassVar[dict[str, str]] = {"logprobs": "top_logprobs"}

    @field_validator(*_UNSUPPORTED_CHAT_FIELDS)
    @classmethod
    def _unsupported_in_chat(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_if_set(value, info, _UNSUPPORTED_CHAT_FIELDS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    def _param_name(self, engine_name: str | None) -> str | None:
        if engine_name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return super()._param_name(engine_name)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
