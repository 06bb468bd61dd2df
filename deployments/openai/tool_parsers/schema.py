"""The request's tools as the parsers need them: each function's parameter schemas, and the typing of
parameter values that a format writes as bare text (GLM, MiniMax, Qwen3-Coder, DeepSeek's DSML) by the
JSON type the schema gives them, as vLLM does ("3" -> 3 for an integer, "true" -> true, JSON for objects)."""
from __future__ import annotations

import ast
import json
from typing import Any, Literal

STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
_NULL_WORDS = {"null", "none", "nil"}
# Non-string types tried in this order for a union ("integer | string" reads "3" as 3).
_TYPE_ORDER = ("integer", "number", "boolean", "object", "array")
_TYPE_ALIASES = {"int": "integer", "float": "number", "bool": "boolean", "dict": "object", "list": "array",
                 "arr": "array", "str": "string", "text": "string"}


class ToolSchemas:
    """The `tools` of a chat request (OpenAI's shape, as dicts or pydantic models), by function name."""

    def __init__(self, tools: list[Any] | None) -> None:
        self.tools = tools
        self._properties: dict[str, dict[str, Any]] = {}
        for tool in tools or []:
            tool = tool.model_dump() if hasattr(tool, "model_dump") else tool
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                parameters = function.get("parameters") or {}
                properties = parameters.get("properties") if isinstance(parameters, dict) else None
                self._properties[function["name"]] = properties if isinstance(properties, dict) else {}

    def parameter(self, function: str, name: str) -> dict[str, Any] | None:
        """The schema of one parameter; None when the function or the parameter is not declared."""
        schema = self._properties.get(function, {}).get(name)
        return schema if isinstance(schema, dict) else None


def schema_types(schema: dict[str, Any]) -> set[str]:
    """The JSON types a parameter schema admits (type, type lists, enum values, anyOf/oneOf/allOf)."""
    types: set[str] = set()
    declared = schema.get("type")
    for name in ([declared] if isinstance(declared, str) else declared if isinstance(declared, list) else []):
        if isinstance(name, str):
            name = name.strip().lower()
            types.add(_TYPE_ALIASES.get(name, "integer" if name.startswith(("int", "uint", "long", "short"))
                                        else "number" if name.startswith(("num", "float", "double"))
                                        else name))
    for value in schema.get("enum") or []:
        types.add("null" if value is None else "boolean" if isinstance(value, bool) else
                  "integer" if isinstance(value, int) else "number" if isinstance(value, float) else
                  "string" if isinstance(value, str) else "array" if isinstance(value, list) else "object")
    for key in ("anyOf", "oneOf", "allOf"):
        for option in schema.get(key) or []:
            if isinstance(option, dict):
                types |= schema_types(option)
    if not types and ("properties" in schema):
        types.add("object")
    return types


def is_plain_string(schema: dict[str, Any] | None, unknown: Literal["string", "json"]) -> bool:
    """Whether a value is kept as raw text whatever it reads like (so it can stream as it comes)."""
    if schema is None:
        return unknown == "string"
    types = schema_types(schema)
    return types <= STRING_TYPES and bool(types)


def typed_value(raw: str, schema: dict[str, Any] | None, unknown: Literal["string", "json"]) -> Any:
    """`raw` as the JSON value its schema calls for; a value that does not read as its type stays a string.
    A parameter with no schema is a string (`unknown="string"`) or read as JSON when it parses
    (`unknown="json"`)."""
    if schema is None:
        return _loose_json(raw) if unknown == "json" else raw
    types = schema_types(schema)
    if not types:
        return _loose_json(raw)
    text = raw.strip()
    if "null" in types and text.lower() in _NULL_WORDS:
        return None
    if types <= STRING_TYPES:
        return raw
    if text.lower() in _NULL_WORDS and not types & STRING_TYPES:
        return None
    for name in _TYPE_ORDER:
        if name in types:
            value = _as_type(text, name)
            if value is not _NO_VALUE:
                return value
    return raw if types & STRING_TYPES else _loose_json(raw)


_NO_VALUE = object()


def _as_type(text: str, name: str) -> Any:
    try:
        if name == "integer":
            return int(text)
        if name == "number":
            number = float(text)
            return int(number) if number.is_integer() and "e" not in text.lower() and "." not in text else number
        if name == "boolean":
            return {"true": True, "false": False}.get(text.lower(), _NO_VALUE)
        value = _loose_json(text)
        wanted = dict if name == "object" else list
        return value if isinstance(value, wanted) else _NO_VALUE
    except (ValueError, OverflowError):
        return _NO_VALUE


def _loose_json(text: str) -> Any:
    """JSON if it parses, else a Python literal (templates render dicts with Jinja's `string`), else the text."""
    stripped = text.strip()
    try:
        return json.loads(stripped)
    except ValueError:
        pass
    if stripped[:1] in ("{", "[", "(", "'", '"') or stripped in ("True", "False", "None"):
        try:
            value = ast.literal_eval(stripped)
            json.dumps(value)
            return value
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
    return text
