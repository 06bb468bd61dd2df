"""Constraints as llguidance grammars, and their checks: the library's own (which names the keywords it does not
implement) and ours for the JSON-schema keywords it would accept without enforcing them. A constraint after a
thinking model's reasoning is the same grammar, named by a first one that lets free text run to the reasoning's end.

llguidance was chosen by measurement (docs/ARCHITECTURE.md, "Structured output"): its grammars are ready in
about a millisecond where xgrammar's compile takes seconds for real-world schemas, and it refuses, by name, the
keywords it does not implement where xgrammar ignores several of them."""
from __future__ import annotations

import copy
import json

from engine.structured_output.cache import LRUCache
from engine.structured_output.params import StructuredOutputError, StructuredOutputsParams

# Keywords llguidance 1.9 accepts without enforcing them (found by benchmarks/structured_output_libraries.py's
# probes: a document breaking the keyword is accepted), with what to write instead.
UNENFORCED_KEYWORDS = {
    "nullable": 'OpenAPI\'s "nullable" is not JSON Schema; allow null with "type": [..., "null"] or '
                'anyOf [..., {"type": "null"}]',
}
# Keywords whose value is one subschema, a map of names to subschemas, or a list of subschemas. Every other
# keyword's value is data (enum, const, default, examples, ...) and is not searched for keywords.
_SUBSCHEMA = ("additionalProperties", "items", "contains", "propertyNames", "not", "if", "then", "else",
              "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems", "items")


def _subschemas(schema: dict):
    """(path suffix, subschema) of every subschema directly inside `schema`."""
    for key in _SUBSCHEMA:
        if isinstance(schema.get(key), dict):
            yield f"/{key}", schema[key]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, value in schema[key].items():
                if isinstance(value, dict):
                    yield f"/{key}/{name}", value
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for index, value in enumerate(schema[key]):
                if isinstance(value, dict):
                    yield f"/{key}/{index}", value


def unenforced_keywords(schema, path: str = "") -> list[tuple[str, str]]:
    """(JSON pointer, keyword) of every keyword in UNENFORCED_KEYWORDS, in document order."""
    if not isinstance(schema, dict):
        return []
    found = [(path or "/", key) for key in schema if key in UNENFORCED_KEYWORDS]
    for suffix, subschema in _subschemas(schema):
        found += unenforced_keywords(subschema, path + suffix)
    return found


def without_additional_properties(schema):
    """A copy where every object schema that does not say otherwise takes no properties beyond its own."""
    schema = copy.deepcopy(schema)

    def close(node) -> None:
        if not isinstance(node, dict):
            return
        if ("properties" in node or node.get("type") == "object") and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for _, subschema in _subschemas(node):
            close(subschema)
    close(schema)
    return schema


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for `params` (not yet checked: see `check_grammar`). Whatever the library
    cannot take (a value it cannot serialize, such as a lone surrogate in a schema) is a StructuredOutputError
    naming the field, never a bare ValueError."""
    constraint = constraint_grammar_text(params)
    return constraint if params.reasoning_end is None else with_reasoning(constraint, params)


def constraint_grammar_text(params: StructuredOutputsParams) -> str:
    """The grammar of the constraint alone, the reasoning before it left out."""
    try:
        return _grammar_text(params)
    except StructuredOutputError:
        raise
    except ValueError as exc:
        raise StructuredOutputError(f"structured_outputs.{params.kind} cannot be used: {exc}",
                                    f"structured_outputs.{params.kind}") from None


def _grammar_text(params: StructuredOutputsParams) -> str:
    from llguidance import LLMatcher, grammar_from
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else params.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        unenforced = unenforced_keywords(schema)
        if unenforced:
            pointer, keyword = unenforced[0]
            raise StructuredOutputError(f"the JSON schema uses the keyword {keyword!r} (at {pointer}), which "
                                        f"structured output does not enforce: {UNENFORCED_KEYWORDS[keyword]}",
                                        f"structured_outputs.{kind}")
        if params.disable_additional_properties:
            schema = without_additional_properties(schema)
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        # "lenient" would let a schema's own "x-guidance" options ignore unimplemented keywords: never.
        return LLMatcher.grammar_from_json_schema(schema, defaults=options, overrides={"lenient": False})
    if kind == "regex":
        return LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return grammar_from("choice", params.choice)
    try:
        return grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as exc:
        raise StructuredOutputError(f"structured_outputs.grammar is not a valid grammar: {exc}",
                                    "structured_outputs.grammar") from None


# ---- reasoning before the constraint ----------------------------------------------------------------------------
REASONING_GRAMMAR = "reasoning_then_constraint"
CONSTRAINT_GRAMMAR = "constraint"
# Whitespace the output may write between the reasoning's end and the constraint ("</think>\n\n{...}"): the
# reasoning parsers drop it as layout. Bounded, so that a model cannot stall in it.
MAX_LAYOUT_CHARS = 4


def with_reasoning(constraint: str, params: StructuredOutputsParams) -> str:
    """`constraint` (an llguidance grammar: Lark text, or the JSON of a top-level grammar) preceded by free
    reasoning that runs up to and including the first `reasoning_end`: a top-level grammar whose first grammar
    (where matching starts) is the reasoning, and which names the constraint's own grammar unchanged (`@name`).
    In text the end is the first place the tag appears (a lazy lexeme); as a special token, the token itself,
    which no text can stand for. End of sequence is refused until the constraint is complete."""
    if constraint.lstrip().startswith("{"):
        top = json.loads(constraint)
    else:
        top = {"grammars": [{"lark_grammar": constraint}], "max_tokens": None}
    assert len(top["grammars"]) == 1, top["grammars"]  # each kind makes one grammar: nothing refers by index
    first = top["grammars"][0]
    first["name"] = first.get("name") or CONSTRAINT_GRAMMAR
    assert first["name"] != REASONING_GRAMMAR
    start, end = params.reasoning_start, params.reasoning_end
    if params.reasoning_tags_are_special_tokens:  # grammars name special tokens as <...>, outside any lexeme
        reasoning = f"{start or ''} thought {end}".strip()
        thought = "thought: /(?s:.*)/"
    else:
        reasoning = f"{_literal(start) if start else ''} thought".strip()
        thought = f"thought[lazy]: /(?s:.*){_regex_escape(end)}/"  # `lazy`: ends at the tag's first appearance
    lark = "\n".join([
        f"start: reasoning{'?' if start else ''} @{first['name']}",
        f"reasoning: {reasoning} layout?",
        thought,
        rf"layout: /[ \t\r\n]{{1,{MAX_LAYOUT_CHARS}}}/",
    ])
    top["grammars"].insert(0, {"name": REASONING_GRAMMAR, "lark_grammar": lark})
    return json.dumps(top)


def _regex_escape(text: str) -> str:
    """`text` as a literal inside a Lark regex (`/.../`, Rust's regex syntax): ASCII letters and digits as they are,
    every other character as its code point (Python's re.escape puts a backslash before `<`, which Rust's
    regex reads as a word boundary)."""
    return "".join(char if char.isascii() and char.isalnum() else f"\\x{{{ord(char):X}}}" for char in text)


def _literal(text: str) -> str:
    return f"/{_regex_escape(text)}/"


def check_grammar(params: StructuredOutputsParams) -> None:
    """Raises StructuredOutputError naming what is wrong with the constraint, in the library's words, then
    with the reasoning before it. Checks are remembered per constraint (a few milliseconds at worst for large
    schemas; usually under 0.1 ms)."""
    error = _checked(params.constraint_key, params, _check_constraint)
    if error:
        raise StructuredOutputError(error, f"structured_outputs.{params.kind}")
    if params.reasoning_end is not None:
        error = _checked(params.key, params, _check_with_reasoning)
        if error:
            raise StructuredOutputError(error, "structured_outputs.reasoning_end")


_CHECKED: LRUCache[str] = LRUCache(256)  # constraint key -> error message ("" if none)


def _checked(key: tuple, params: StructuredOutputsParams, check) -> str:
    return _CHECKED.get_or_make(key, lambda: check(params)) if params.cacheable else check(params)


def _check_constraint(params: StructuredOutputsParams) -> str:
    from llguidance import LLMatcher
    try:
        grammar = constraint_grammar_text(params)
    except StructuredOutputError as exc:
        return str(exc)
    error = LLMatcher.validate_grammar(grammar, None)
    if not error:
        return ""
    what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice list",
            "grammar": "grammar"}[params.kind]
    return f"the {what} in structured_outputs.{params.kind} is not supported or not valid: {error.strip()}"


def _check_with_reasoning(params: StructuredOutputsParams) -> str:
    """The constraint is valid: what is left to go wrong is the reasoning's tags."""
    from llguidance import LLMatcher
    error = LLMatcher.validate_grammar(grammar_text(params), None)
    tags = f"reasoning_start {params.reasoning_start!r}, " if params.reasoning_start is not None else ""
    return (f"the reasoning before the constraint ({tags}reasoning_end {params.reasoning_end!r}) cannot be used: "
            f"{error.strip()}") if error else ""
