"""Structured output over HTTP: OpenAI's `response_format`, vLLM's `structured_outputs` object and its older
`guided_*` fields, each turned into the engine's StructuredOutputsParams (at most one constraint a request),
with errors naming the field the client sent; for a thinking model, the constraint starts after its reasoning."""
from __future__ import annotations

import dataclasses

from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.structured_output.params import SPECIAL_TOKEN_NAME

KINDS = ("json", "json_object", "regex", "choice", "grammar")
OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")


def constraint_sources(request) -> list[tuple[str, dict]]:
    """(the request field, the engine's StructuredOutputsParams fields) of each constraint `request` sets."""
    sources = []
    response_format = request.response_format
    if response_format is not None and response_format.type == "json_object":
        sources.append(("response_format", {"json_object": True}))
    elif response_format is not None and response_format.type == "json_schema":
        sources.append(("response_format.json_schema.schema", {"json": response_format.json_schema.schema_}))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(request, f"guided_{kind}")
        if value is not None:
            sources.append((f"guided_{kind}", {kind: value}))
    if request.structured_outputs is not None:
        fields = request.structured_outputs.model_dump(by_alias=True, include={"json_", *KINDS[1:], *OPTIONS})
        options = {name: fields.pop(name) for name in OPTIONS}
        kinds = [(kind, value) for kind, value in fields.items() if value not in (None, False)]
        sources += [(f"structured_outputs.{kind}", {kind: value, **options}) for kind, value in kinds]
        if not kinds:
            sources.append(("structured_outputs", options))  # the engine says what is missing
    return sources


def request_constraint(request) -> tuple[dict | None, str | None]:
    """The engine's constraint for `request` and the field it came from; two constraints are refused."""
    sources = constraint_sources(request)
    if len(sources) > 1:
        names = ", ".join(name for name, _ in sources)
        raise SamplingParamsError(f"only one structured-output constraint may be set per request (got {names})",
                                  sources[1][0])
    if not sources:
        if request.guided_whitespace_pattern is not None:
            raise SamplingParamsError("guided_whitespace_pattern needs guided_json or a json response_format",
                                      "guided_whitespace_pattern")
        return None, None
    field, params = sources[0]
    if request.guided_whitespace_pattern is not None:
        params = {**params, "whitespace_pattern": request.guided_whitespace_pattern}
    return params, field


def request_field(request, engine_param: str, constraint_field: str) -> str:
    """The request field behind the engine's structured-output parameter (its structured_outputs.json may have
    come as guided_json or response_format.json_schema.schema, say)."""
    option = engine_param.removeprefix("structured_outputs").lstrip(".")
    if option in ("", *KINDS):
        return constraint_field
    if option == "whitespace_pattern" and request.guided_whitespace_pattern is not None:
        return "guided_whitespace_pattern"
    return engine_param


def after_reasoning(params: SamplingParams, reasoning, tokenizer) -> SamplingParams:
    """`params` whose constraint (response_format, a forced tool call) starts after the output's reasoning, so
    that a thinking model reasons before its constrained answer, as vLLM has it. `reasoning` is the output's
    reasoning parser, which read the rendered prompt: the output starts inside its reasoning, may open it, or
    has none (thinking switched off). Unchanged without a constraint or reasoning, and where the tags cannot be
    matched as the vocabulary has them (one a special token and the other not, or a special token that does
    not read `<...>`: no family's)."""
    constraint = getattr(params, "structured_outputs", None)
    tags = reasoning.reasoning_tags() if constraint is not None else None
    if tags is None:
        return params
    start, end = tags
    named = [tag for tag in tags if tag is not None]
    special = [is_special_token(tokenizer, tag) for tag in named]
    if any(special) and not (all(special) and all(SPECIAL_TOKEN_NAME.fullmatch(tag) for tag in named)):
        return params  # a mixed pair, or a special token no grammar can name
    constraint = dataclasses.replace(constraint, reasoning_start=start, reasoning_end=end,
                                     reasoning_tags_are_special_tokens=all(special))
    return dataclasses.replace(params, structured_outputs=constraint)


def is_special_token(tokenizer, text: str) -> bool:
    """Whether `text` is one special token of the tokenizer's vocabulary (tokenizer.json's `special` flag, which
    the grammar library reads: such a token is not the text it decodes to)."""
    added = getattr(getattr(tokenizer, "hf", None), "added_tokens_decoder", None) or {}
    return any(token.special and token.content == text for token in added.values())
