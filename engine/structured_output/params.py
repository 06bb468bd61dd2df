"""What a request asks its output to be (vLLM's `StructuredOutputsParams` names): a JSON schema, any JSON object,
a regex, one of a list of strings, or a grammar; for a thinking model, that after its free reasoning. Checked once
at construction, the grammar library included (engine/structured_output/grammar.py), so every door that builds a
SamplingParams refuses the same requests."""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, fields

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_CHOICES = 1024
# Constraints longer than this (as text) are checked and compiled each time rather than cached: a cache of a few
# hundred entries must not hold a few hundred request bodies of megabytes.
MAX_CACHED_SPEC_CHARS = 1 << 16
REASONING_FIELDS = ("reasoning_start", "reasoning_end")
# How llguidance's grammars name a special token: its text, which must read `<...>` (no `[`: `<[12]>` is an id).
SPECIAL_TOKEN_NAME = re.compile(r"<[^<>\s\[][^<>\s]*>")


class StructuredOutputError(ValueError):
    """A structured-output constraint cannot be used; the message says why, `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema, as a dict or as its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # a Lark grammar (llguidance's dialect) or a GBNF grammar (llama.cpp's)
    json_object: bool | None = None  # any JSON object
    # JSON only: no whitespace between tokens, or whitespace matching this regex; objects without
    # "additionalProperties" take none (JSON Schema's default allows any).
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    disable_additional_properties: bool = False
    # Free reasoning before the constraint (a thinking model's): the output reasons until `reasoning_end` (the
    # text that closes its reasoning, "</think>"), then follows the constraint. With `reasoning_start` ("<think>")
    # the output either opens its reasoning with it or skips reasoning and follows the constraint at once;
    # without it the output starts inside the reasoning (the prompt opened it). With
    # `reasoning_tags_are_special_tokens` the tags are matched as those special tokens of the vocabulary rather
    # than as text (llguidance lets a special token through only where a grammar names it).
    reasoning_start: str | None = None
    reasoning_end: str | None = None
    reasoning_tags_are_special_tokens: bool = False

    @classmethod
    def from_value(cls, value) -> "StructuredOutputsParams":
        """From a StructuredOutputsParams or a mapping of its field names (a handle call's request)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise StructuredOutputError(f"structured_outputs must be a StructuredOutputsParams or a mapping, not "
                                        f"{type(value).__name__}", "structured_outputs")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise StructuredOutputError(f"unknown structured_outputs field(s) {unknown}; valid ones are "
                                        f"{sorted(names)}", f"structured_outputs.{unknown[0]}")
        return cls(**value)

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", list(self.choice))
        kinds = self.kinds
        if len(kinds) != 1:
            got = f"got {', '.join(kinds)}" if kinds else "got none"
            raise StructuredOutputError(f"structured_outputs takes exactly one of {', '.join(KINDS)} ({got})",
                                        f"structured_outputs.{kinds[1] if kinds else 'json'}")
        self._check_shapes()
        from engine.structured_output.grammar import check_grammar
        check_grammar(self)

    @property
    def kinds(self) -> list[str]:
        """The kinds of constraint that are set (a valid object has exactly one)."""
        return [kind for kind in KINDS if getattr(self, kind) not in (None, False)]

    @property
    def kind(self) -> str:
        return self.kinds[0]

    @functools.cached_property
    def spec_text(self) -> str:
        """The constraint as text: the schema's JSON (keys sorted), the regex, the grammar, the choices' JSON."""
        if self.kind == "json":
            return self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
        if self.kind == "choice":
            return json.dumps(self.choice)
        return "" if self.kind == "json_object" else getattr(self, self.kind)

    @property
    def constraint_key(self) -> tuple:
        """What identifies the constraint itself, the reasoning before it left out."""
        return (self.kind, self.spec_text, self.disable_any_whitespace, self.whitespace_pattern,
                self.disable_additional_properties)

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (its cache key)."""
        return (*self.constraint_key, self.reasoning_start, self.reasoning_end,
                self.reasoning_tags_are_special_tokens)

    @property
    def cacheable(self) -> bool:
        return len(self.spec_text) <= MAX_CACHED_SPEC_CHARS

    def _check_shapes(self) -> None:
        kind = self.kind
        param = f"structured_outputs.{kind}"
        if kind == "json":
            if not isinstance(self.json, (str, dict)):
                raise StructuredOutputError("structured_outputs.json must be a JSON schema (an object, or its JSON "
                                            f"text), not {type(self.json).__name__}", param)
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as exc:
                    raise StructuredOutputError(f"structured_outputs.json is not valid JSON: {exc}", param) from None
                if not isinstance(schema, (dict, bool)):
                    raise StructuredOutputError("structured_outputs.json must be a JSON schema object", param)
        elif kind == "json_object":
            if self.json_object is not True:
                raise StructuredOutputError("structured_outputs.json_object must be true or unset", param)
        elif kind == "choice":
            if (not isinstance(self.choice, list) or not self.choice or len(self.choice) > MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise StructuredOutputError(f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} "
                                            "non-empty strings", param)
        elif not isinstance(getattr(self, kind), str) or not getattr(self, kind):
            raise StructuredOutputError(f"structured_outputs.{kind} must be a non-empty string", param)
        json_only = {"disable_any_whitespace": self.disable_any_whitespace,
                     "whitespace_pattern": self.whitespace_pattern,
                     "disable_additional_properties": self.disable_additional_properties}
        for name, value in json_only.items():
            if value not in (None, False) and kind not in ("json", "json_object"):
                raise StructuredOutputError(f"structured_outputs.{name} applies to json and json_object only",
                                            f"structured_outputs.{name}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise StructuredOutputError(f"structured_outputs.{name} must be true or false",
                                            f"structured_outputs.{name}")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise StructuredOutputError("structured_outputs.whitespace_pattern must be a regex string",
                                        "structured_outputs.whitespace_pattern")
        self._check_reasoning()

    def _check_reasoning(self) -> None:
        for name in REASONING_FIELDS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise StructuredOutputError(f"structured_outputs.{name} must be a non-empty string (the text of a "
                                            "reasoning tag) or unset", f"structured_outputs.{name}")
        if self.reasoning_start is not None and self.reasoning_end is None:
            raise StructuredOutputError("structured_outputs.reasoning_start needs reasoning_end: the constraint "
                                        "starts where the reasoning ends", "structured_outputs.reasoning_start")
        special = self.reasoning_tags_are_special_tokens
        if not isinstance(special, bool):
            raise StructuredOutputError("structured_outputs.reasoning_tags_are_special_tokens must be true or false",
                                        "structured_outputs.reasoning_tags_are_special_tokens")
        if special and self.reasoning_end is None:
            raise StructuredOutputError("structured_outputs.reasoning_tags_are_special_tokens needs reasoning_end",
                                        "structured_outputs.reasoning_tags_are_special_tokens")
        for name in REASONING_FIELDS if special else ():
            value = getattr(self, name)
            if value is not None and not SPECIAL_TOKEN_NAME.fullmatch(value):
                raise StructuredOutputError(f"structured_outputs.{name} {value!r} cannot name a special token: "
                                            "special tokens are matched by their text, which must read <...> "
                                            "without whitespace", f"structured_outputs.{name}")
