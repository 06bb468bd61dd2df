"""Structured output, the library choice (issue 28): xgrammar against llguidance on this CPU with the packaged
SmolLM2 tokenizer (49152 tokens). Compile time of real-world-like JSON schemas, a regex and a choice list
(median, worst); the time to fill one step's token masks for a batch of 64 requests; install weight; and, per
JSON-schema keyword, whether the library enforces it, refuses the schema, or accepts it and ignores the
keyword (probed with a document that breaks only that keyword).

Only the engine's library is a dependency; install the other beside it to compare, e.g.

    pip install --no-deps --target /tmp/so_xg xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
    pip install --no-deps --target /tmp/so_llg llguidance==1.9.1
    python -m benchmarks.structured_output_bench --libraries --path /tmp/so_xg --path /tmp/so_llg
"""
from __future__ import annotations

import importlib.metadata
import json
import random
import statistics
import time
from pathlib import Path

BATCH = 64
FILL_STEPS = 24


def _string(max_length: int = 32, **extra) -> dict:
    return {"type": "string", "maxLength": max_length, **extra}


# Larger schemas in the style of tool arguments and API payloads seen in practice, beside the 35 test schemas.
REAL_WORLD_SCHEMAS: dict[str, dict] = {
    "github_issue": {
        "type": "object", "required": ["title", "labels", "assignees", "state"],
        "properties": {
            "title": _string(80), "body": _string(500),
            "labels": {"type": "array", "items": {"enum": ["bug", "feature", "docs", "question"]}, "maxItems": 4},
            "assignees": {"type": "array", "items": _string(39, pattern="^[a-zA-Z0-9-]+$"), "maxItems": 3},
            "state": {"enum": ["open", "closed"]}, "milestone": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}},
    "calendar_event": {
        "type": "object", "required": ["summary", "start", "end"],
        "properties": {
            "summary": _string(100), "location": _string(100),
            "start": {"$ref": "#/$defs/time"}, "end": {"$ref": "#/$defs/time"},
            "attendees": {"type": "array", "items": {"$ref": "#/$defs/person"}, "maxItems": 10},
            "reminders": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 40320}}},
        "$defs": {"time": {"type": "object", "required": ["date"], "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}}},
            "person": {"type": "object", "required": ["email"], "properties": {
                "email": {"type": "string", "pattern": "^[^@]+@[^@]+$"}, "optional": {"type": "boolean"}}}}},
    "invoice": {
        "type": "object", "required": ["number", "currency", "lines", "total"],
        "properties": {
            "number": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
            "currency": {"enum": ["EUR", "USD", "GBP", "JPY"]},
            "lines": {"type": "array", "minItems": 1, "maxItems": 50, "items": {
                "type": "object", "required": ["sku", "quantity", "unit_price"], "properties": {
                    "sku": _string(20), "description": _string(200),
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 10000},
                    "unit_price": {"type": "number", "minimum": 0}}}},
            "total": {"type": "number", "minimum": 0}, "paid": {"type": "boolean"}}},
    "tool_call_union": {
        "anyOf": [
            {"type": "object", "required": ["name", "arguments"], "properties": {
                "name": {"const": "get_weather"}, "arguments": {"type": "object", "required": ["city"], "properties": {
                    "city": _string(), "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
            {"type": "object", "required": ["name", "arguments"], "properties": {
                "name": {"const": "search"}, "arguments": {"type": "object", "required": ["query"], "properties": {
                    "query": _string(200), "max_results": {"type": "integer", "minimum": 1, "maximum": 50}}}}},
            {"type": "object", "required": ["name", "arguments"], "properties": {
                "name": {"const": "send_email"}, "arguments": {"type": "object", "required": ["to", "body"],
                                                               "properties": {
                    "to": {"type": "array", "items": _string(100), "minItems": 1}, "subject": _string(120),
                    "body": _string(2000)}}}}]},
    "recursive_tree": {
        "$ref": "#/$defs/node",
        "$defs": {"node": {"type": "object", "required": ["name"], "properties": {
            "name": _string(30), "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 5}}}}},
    "product_catalog": {
        "type": "object", "required": ["products"],
        "properties": {"products": {"type": "array", "items": {
            "type": "object", "required": ["id", "name", "price", "tags"], "properties": {
                "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"}, "name": _string(60),
                "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 100000},
                "tags": {"type": "array", "items": _string(20), "maxItems": 8},
                "dimensions": {"type": "object", "properties": {
                    "w": {"type": "number"}, "h": {"type": "number"}, "d": {"type": "number"}}},
                "stock": {"anyOf": [{"type": "integer", "minimum": 0}, {"const": "unlimited"}]}}}}}},
    "sql_query_plan": {
        "type": "object", "required": ["table", "columns", "where"],
        "properties": {
            "table": {"type": "string", "pattern": "^[a-z_][a-z0-9_]*$"},
            "columns": {"type": "array", "items": {"type": "string", "pattern": "^[a-z_][a-z0-9_]*$"}, "minItems": 1},
            "where": {"type": "array", "items": {"type": "object", "required": ["column", "op", "value"],
                                                 "properties": {
                "column": _string(), "op": {"enum": ["=", "!=", "<", ">", "<=", ">=", "like"]},
                "value": {"type": ["string", "number", "boolean", "null"]}}}},
            "limit": {"type": "integer", "minimum": 1, "maximum": 1000},
            "order_by": {"type": "object", "properties": {"column": _string(), "desc": {"type": "boolean"}}}}},
    "resume": {
        "type": "object", "required": ["name", "experience"],
        "properties": {
            "name": _string(60), "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9.]+$"},
            "skills": {"type": "array", "items": _string(30), "maxItems": 20},
            "experience": {"type": "array", "items": {"type": "object", "required": ["company", "from"],
                                                      "properties": {
                "company": _string(60), "title": _string(60),
                "from": {"type": "integer", "minimum": 1950, "maximum": 2030},
                "to": {"anyOf": [{"type": "integer", "minimum": 1950, "maximum": 2030}, {"type": "null"}]}}}},
            "education": {"type": "array", "items": {"type": "object", "properties": {
                "school": _string(80), "degree": {"enum": ["BSc", "MSc", "PhD", "other"]}}}}}},
}

REGEX = r"[A-Z][a-z]{2,12} [0-9]{1,4}(\.[0-9]{2})? (EUR|USD)"
CHOICE = ["positive", "negative", "neutral", "mixed"]

# keyword -> (schema, a document that satisfies it, a document that breaks only this keyword)
KEYWORD_PROBES: dict[str, tuple[dict, str, str]] = {
    "minLength": ({"type": "string", "minLength": 3}, '"abc"', '"a"'),
    "maxLength": ({"type": "string", "maxLength": 3}, '"abc"', '"abcdef"'),
    "pattern": ({"type": "string", "pattern": "^[0-9]+$"}, '"123"', '"12a"'),
    "pattern+maxLength": ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, '"abc"', '"abcdef"'),
    "format:email": ({"type": "string", "format": "email"}, '"a@b.co"', '"not an email"'),
    "format:date-time": ({"type": "string", "format": "date-time"}, '"2024-01-02T03:04:05Z"', '"yesterday"'),
    "format:uuid": ({"type": "string", "format": "uuid"}, '"123e4567-e89b-12d3-a456-426614174000"', '"x"'),
    "format:ipv4": ({"type": "string", "format": "ipv4"}, '"10.0.0.1"', '"10.0.0"'),
    "minimum": ({"type": "integer", "minimum": 5}, "7", "3"),
    "maximum": ({"type": "integer", "maximum": 5}, "3", "7"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 5}, "6", "5"),
    "number minimum": ({"type": "number", "minimum": 1.5}, "2.5", "0.5"),
    "multipleOf": ({"type": "integer", "multipleOf": 5}, "10", "7"),
    "enum": ({"enum": ["a", "b"]}, '"a"', '"c"'),
    "const": ({"const": 42}, "42", "43"),
    "minItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1,2]", "[1]"),
    "maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 2}, "[1,2]", "[1,2,3]"),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,2]", "[1,1]"),
    "contains": ({"type": "array", "contains": {"const": 1}}, "[1]", "[2]"),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, "[1]", '["a"]'),
    "additionalProperties:false": ({"type": "object", "properties": {"a": {"type": "integer"}},
                                    "additionalProperties": False}, '{"a":1}', '{"a":1,"b":2}'),
    "additionalProperties:schema": ({"type": "object", "additionalProperties": {"type": "integer"}},
                                    '{"a":1}', '{"a":"x"}'),
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, '{"a":1}', "{}"),
    "patternProperties": ({"type": "object", "patternProperties": {"^x": {"type": "integer"}},
                           "additionalProperties": False}, '{"x1":1}', '{"x1":"s"}'),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}, '{"ab":1}', '{"A1":1}'),
    "minProperties": ({"type": "object", "minProperties": 1}, '{"a":1}', "{}"),
    "maxProperties": ({"type": "object", "maxProperties": 1}, '{"a":1}', '{"a":1,"b":2}'),
    "dependentRequired": ({"type": "object", "dependentRequired": {"a": ["b"]}}, '{"a":1,"b":2}', '{"a":1}'),
    "if/then/else": ({"type": "integer", "if": {"minimum": 10}, "then": {"maximum": 20}, "else": {"maximum": 5}},
                     "15", "7"),
    "not": ({"type": "integer", "not": {"const": 3}}, "4", "3"),
    "allOf": ({"allOf": [{"type": "integer", "minimum": 0}, {"maximum": 9}]}, "5", "12"),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, "true", '"s"'),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "1", "true"),
    "$ref/$defs": ({"$defs": {"i": {"type": "integer"}}, "$ref": "#/$defs/i"}, "1", '"s"'),
    "type list": ({"type": ["integer", "null"]}, "null", '"s"'),
}


def _median_worst(values: list[float]) -> dict:
    return {"median_ms": round(statistics.median(values) * 1e3, 3), "worst_ms": round(max(values) * 1e3, 3)}


def install_weight(distributions: list[str]) -> dict:
    """Size on disk of each distribution's installed files, in MB."""
    sizes = {}
    for name in distributions:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        total = 0
        for file in dist.files or []:
            path = Path(dist.locate_file(file))
            if path.is_file():
                total += path.stat().st_size
        sizes[name] = round(total / 1e6, 1)
    return sizes


class XGrammar:
    name = "xgrammar"
    distributions = ["xgrammar", "apache-tvm-ffi"]

    def __init__(self, hf_tokenizer, vocab_size: int, eos: list[int]) -> None:
        import xgrammar
        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=eos)
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher()
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec):
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(spec))
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def allocate(self, rows: int):
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matchers, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def advance(self, matcher, token: int) -> None:
        matcher.accept_token(token)
        if matcher.is_terminated():  # a finished walk starts over
            matcher.reset()

    def accepts_document(self, compiled, text: str) -> bool:
        matcher = self.matcher(compiled)
        return matcher.accept_string(text) and matcher.is_completed()


class LLGuidance:
    name = "llguidance"
    distributions = ["llguidance"]

    def __init__(self, hf_tokenizer, vocab_size: int, eos: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.executor = llguidance.LLExecutor()
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec):
        matcher_class = self.llg.LLMatcher
        if kind == "json":
            grammar = matcher_class.grammar_from_json_schema(spec, defaults={"whitespace_flexible": True})
        elif kind == "regex":
            grammar = matcher_class.grammar_from_regex(spec)
        else:
            grammar = self.llg.grammar_from("choice", spec)
        matcher = matcher_class(self.tokenizer, grammar, log_level=0)  # builds the lexer and parser
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)

    def allocate(self, rows: int):
        return self.llg.torch.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matchers, bitmask) -> None:
        self.llg.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def advance(self, matcher, token: int) -> None:
        matcher.consume_token(token)
        if matcher.is_stopped():  # a finished walk starts over
            matcher.reset()

    def accepts_document(self, grammar, text: str) -> bool:
        matcher = self.matcher(grammar)
        tokens = self.tokenizer.tokenize_str(text)
        return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


def _allowed(bitmask_row, vocab_size: int) -> list[int]:
    import numpy as np
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits).tolist()


def measure_library(library, specs: list[tuple[str, str, object]], seed: int = 0) -> dict:
    """Compile every spec twice (the second, warm figure is the one reported: the first pays one-off set-up),
    then run FILL_STEPS mask fills of a batch of BATCH matchers over those grammars, each matcher taking a
    random allowed token after each fill."""
    compile_s, compiled, failures = {}, {}, {}
    for name, kind, spec in specs:
        try:
            library.compile(kind, spec)
            start = time.perf_counter()
            compiled[name] = library.compile(kind, spec)
            compile_s[name] = time.perf_counter() - start
        except Exception as exc:  # refused: recorded, not fatal
            failures[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
    json_times = [t for (name, kind, _), t in ((s, compile_s[s[0]]) for s in specs if s[0] in compile_s)
                  if kind == "json"]
    names = list(compiled)
    rng = random.Random(seed)
    matchers = [library.matcher(compiled[names[i % len(names)]]) for i in range(BATCH)]
    bitmask = library.allocate(BATCH)
    fill_s = []
    for _ in range(FILL_STEPS):
        start = time.perf_counter()
        library.fill(matchers, bitmask)
        fill_s.append(time.perf_counter() - start)
        for row, matcher in enumerate(matchers):
            allowed = _allowed(bitmask[row], library.vocab_size)
            if allowed:
                library.advance(matcher, rng.choice(allowed))
    return {
        "json_schema_compile": _median_worst(json_times),
        "compile_ms": {name: round(t * 1e3, 3) for name, t in compile_s.items()},
        "refused": failures,
        "mask_fill_batch64": _median_worst(fill_s),
        "mask_fill_per_row_us": round(statistics.median(fill_s) / BATCH * 1e6, 1),
    }


def probe_keywords(library) -> dict[str, str]:
    """Per keyword: 'enforced', 'refused' (the schema does not compile) or 'IGNORED' (it compiles and accepts a
    document that breaks the keyword); 'broken' if it rejects the document that satisfies it."""
    verdicts = {}
    for keyword, (schema, good, bad) in KEYWORD_PROBES.items():
        try:
            compiled = library.compile("json", schema)
        except Exception as exc:
            verdicts[keyword] = f"refused ({str(exc).splitlines()[0][:80]})"
            continue
        if not library.accepts_document(compiled, good):
            verdicts[keyword] = "broken (refuses a valid document)"
        elif library.accepts_document(compiled, bad):
            verdicts[keyword] = "IGNORED"
        else:
            verdicts[keyword] = "enforced"
    return verdicts


def compare(hf_tokenizer, vocab_size: int, eos: list[int], test_specs: list[tuple[str, str, object]]) -> dict:
    """Both libraries' figures (a library that does not import is skipped and said so)."""
    specs = ([(name, "json", schema) for name, schema in REAL_WORLD_SCHEMAS.items()] + test_specs
             + [("regex", "regex", REGEX), ("choice", "choice", CHOICE)])
    results = {}
    for library_class in (XGrammar, LLGuidance):
        try:
            start = time.perf_counter()
            library = library_class(hf_tokenizer, vocab_size, eos)
            setup_s = time.perf_counter() - start
        except ImportError as exc:
            results[library_class.name] = {"skipped": f"not importable: {exc}"}
            continue
        result = measure_library(library, specs)
        result["tokenizer_setup_ms"] = round(setup_s * 1e3, 1)
        result["install_mb"] = install_weight(library_class.distributions)
        result["keywords"] = probe_keywords(library)
        results[library_class.name] = result
    return results
