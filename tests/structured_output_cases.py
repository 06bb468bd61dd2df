"""Fifty structured-output requests for SmolLM2 (JSON schemas, regexes, choice lists), shared by the engine and
HTTP tests and by benchmarks/structured_output_bench.py. Each case has a prompt, the constraint (vLLM's
`structured_outputs` names) and a `check(text)` that raises when the text does not satisfy it.

Strings and arrays are bounded so that a 135M model's greedy output ends within CASE_MAX_TOKENS."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

CASE_MAX_TOKENS = 96


@dataclass(frozen=True)
class Case:
    name: str
    prompt: str
    kind: str  # "json" | "regex" | "choice"
    spec: object  # the schema dict, the regex or the list of choices

    @property
    def structured_outputs(self) -> dict:
        return {self.kind: self.spec}

    def check(self, text: str) -> None:
        """Raises (AssertionError or jsonschema.ValidationError) when `text` does not satisfy the constraint."""
        if self.kind == "json":
            import jsonschema
            jsonschema.validate(json.loads(text), self.spec)
        elif self.kind == "regex":
            assert re.fullmatch(self.spec, text), f"{text!r} does not match {self.spec!r}"
        else:
            assert text in self.spec, f"{text!r} is not one of {self.spec!r}"


def _string(max_length: int = 16, **extra) -> dict:
    return {"type": "string", "minLength": 1, "maxLength": max_length, **extra}


def _object(properties: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False, **extra}


_SCHEMAS: list[tuple[str, str, dict]] = [
    ("person", "A person as JSON:", _object({"name": _string(), "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 120}})),
    ("city", "A city and its country as JSON:", _object({"city": _string(), "country": _string()})),
    ("book", "A book as JSON:", _object({"title": _string(24), "year": {"type": "integer", "minimum": 1450,
                                                                        "maximum": 2030}})),
    ("flag", "Is the sky blue? Answer as JSON:", _object({"answer": {"type": "boolean"}})),
    ("color", "Your favourite colour as JSON:", _object({"color": {"enum": ["red", "green", "blue"]}})),
    ("rating", "Rate the movie Jaws as JSON:", _object({"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                                        "verdict": {"enum": ["good", "bad"]}})),
    ("point", "A point in the plane as JSON:", _object({"x": {"type": "integer", "minimum": -100, "maximum": 100},
                                                        "y": {"type": "integer", "minimum": -100, "maximum": 100}})),
    ("tags", "Three tags for a cooking blog as JSON:",
     _object({"tags": {"type": "array", "items": _string(12), "minItems": 1, "maxItems": 3}})),
    ("scores", "Test scores as JSON:",
     _object({"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                         "minItems": 2, "maxItems": 4}})),
    ("address", "An address as JSON:",
     _object({"street": _string(20), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    ("user", "A user account as JSON:",
     _object({"username": _string(12, pattern="^[a-z][a-z0-9_]*$"), "active": {"type": "boolean"}})),
    ("order", "An order with its customer as JSON:",
     _object({"id": {"type": "integer", "minimum": 1, "maximum": 9999},
              "customer": _object({"name": _string(12), "vip": {"type": "boolean"}})})),
    ("weather", "Today's weather as JSON:",
     _object({"sky": {"enum": ["sunny", "cloudy", "rainy"]},
              "celsius": {"type": "integer", "minimum": -30, "maximum": 45}})),
    ("priority", "A task and its priority as JSON:",
     _object({"task": _string(20), "priority": {"enum": ["low", "medium", "high"]}})),
    ("const", "A versioned record as JSON:", _object({"version": {"const": 2}, "name": _string(10)})),
    ("optional", "A product, price optional, as JSON:",
     _object({"product": _string(), "price": {"type": "integer", "minimum": 0, "maximum": 1000}},
             required=["product"])),
    ("nullable", "A middle name or null as JSON:",
     _object({"middle_name": {"anyOf": [_string(10), {"type": "null"}]}})),
    ("union", "An id, number or text, as JSON:",
     _object({"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, _string(8)]}})),
    ("defs", "Two points as JSON:",
     {"$defs": {"p": _object({"x": {"type": "integer", "minimum": 0, "maximum": 9},
                              "y": {"type": "integer", "minimum": 0, "maximum": 9}})},
      **_object({"a": {"$ref": "#/$defs/p"}, "b": {"$ref": "#/$defs/p"}})}),
    ("nested_array", "A team and its members as JSON:",
     _object({"team": _string(12), "members": {"type": "array", "maxItems": 2, "minItems": 1,
                                              "items": _object({"name": _string(10),
                                                                "role": {"enum": ["dev", "ops"]}})}})),
    ("date", "A date as JSON:", _object({"date": {"type": "string", "pattern": r"^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}})),
    ("phone", "A phone number as JSON:", _object({"phone": {"type": "string", "pattern": r"^\+[0-9]{2} [0-9]{6}$"}})),
    ("matrix", "A 2x2 matrix of digits as JSON:",
     _object({"rows": {"type": "array", "minItems": 2, "maxItems": 2,
                       "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                 "items": {"type": "integer", "minimum": 0, "maximum": 9}}}})),
    ("array_root", "A list of two animals as JSON:",
     {"type": "array", "items": _string(10), "minItems": 2, "maxItems": 2}),
    ("enum_array", "The primary colours as JSON:",
     _object({"colors": {"type": "array", "items": {"enum": ["red", "yellow", "blue"]},
                         "minItems": 1, "maxItems": 3}})),
    ("percent", "A discount as JSON:", _object({"percent": {"type": "integer", "exclusiveMinimum": 0,
                                                            "exclusiveMaximum": 100}})),
    ("status", "An HTTP status as JSON:",
     _object({"code": {"enum": [200, 404, 500]}, "ok": {"type": "boolean"}})),
    ("event", "An event as JSON:",
     _object({"name": _string(16), "day": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
              "hour": {"type": "integer", "minimum": 0, "maximum": 23}})),
    ("inventory", "An inventory line as JSON:",
     _object({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
              "count": {"type": "integer", "minimum": 0, "maximum": 500}})),
    ("recipe", "A recipe as JSON:",
     _object({"dish": _string(16), "steps": {"type": "array", "items": _string(16), "minItems": 1,
                                            "maxItems": 2}})),
    ("one_of_shape", "A shape as JSON:",
     {"oneOf": [_object({"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1, "maximum": 9}}),
                _object({"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 9}})]}),
    ("geo", "A location as JSON:",
     _object({"place": _string(12), "coords": _object({"lat": {"type": "integer", "minimum": -90, "maximum": 90},
                                                       "lon": {"type": "integer", "minimum": -180,
                                                               "maximum": 180}})})),
    ("language", "A programming language as JSON:",
     _object({"language": {"enum": ["python", "rust", "go", "java"]}, "typed": {"type": "boolean"}})),
    ("pair", "A key-value pair as JSON:", _object({"key": _string(8), "value": _string(8)})),
    ("bounded_number", "A temperature as JSON:",
     _object({"kelvin": {"type": "integer", "minimum": 0, "maximum": 400}})),
]

_REGEXES: list[tuple[str, str, str]] = [
    ("year", "The year the Berlin wall fell:", r"(19|20)[0-9]{2}"),
    ("yes_no", "Is water wet? Answer:", r"(yes|no)"),
    ("ipv4", "An IPv4 address:", r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])"),
    ("time", "A time of day:", r"([01][0-9]|2[0-3]):[0-5][0-9]"),
    ("word", "One lowercase word for happy:", r"[a-z]{2,10}"),
    ("hex_color", "A colour in hex:", r"#[0-9a-f]{6}"),
    ("email", "An email address:", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"),
    ("sentence", "A short sentence:", r"[A-Z][a-z]{1,8}( [a-z]{1,8}){1,3}\."),
]

_CHOICES: list[tuple[str, str, list[str]]] = [
    ("sentiment", "I love this film! The sentiment is", ["positive", "negative", "neutral"]),
    ("animal", "The animal that barks is the", ["dog", "cat", "cow"]),
    ("capital", "The capital of France is", ["Paris", "London", "Rome"]),
    ("boolean", "2 + 2 = 4 is", ["true", "false"]),
    ("planet", "The largest planet is", ["Jupiter", "Mars", "Earth", "Venus"]),
    ("size", "An elephant is", ["small", "medium", "large"]),
    ("with_space", "Say hello:", ["hello world", "goodbye world"]),
]

CASES: list[Case] = (
    [Case(name, prompt, "json", schema) for name, prompt, schema in _SCHEMAS]
    + [Case(name, prompt, "regex", regex) for name, prompt, regex in _REGEXES]
    + [Case(name, prompt, "choice", choices) for name, prompt, choices in _CHOICES]
)
assert len(CASES) == 50 and len({c.name for c in CASES}) == 50
