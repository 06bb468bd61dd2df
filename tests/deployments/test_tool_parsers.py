"""The tool-call parsers (deployments/openai/tool_parsers): each family's own format, written by hand from
agentic_and_spec_formats.md, read back into calls; streaming cut anywhere adds up to the whole parse; broken
calls come back as content; the registry and its `auto` choice."""
from __future__ import annotations

import json
import random
import re

import pytest

from deployments.openai.tool_parsers import (TOOL_PARSERS, DeltaMessage, collect, default_tool_parser,
                                             get_tool_parser, tool_parser_class, tool_parser_names)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "ratio": {"type": "number"}, "filters": {"type": "object"}, "tags": {"type": "array"},
        "note": {"type": ["string", "null"]}, "code": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
NESTED = {"city": "Zürich \"Altstadt\" 東京 🌤", "filters": {"a": [1, {"b": None}], "c": "x}y{"}}
CODE = "def f():\n    return \"</parameter>\" + '\\n'\n"  # code that writes the format's own closing tag


def dsml_param(name: str, value: str, string: bool) -> str:
    return f'<｜DSML｜parameter name="{name}" string="{"true" if string else "false"}">{value}</｜DSML｜parameter>'


# Per family: (name, model output, expected content, expected [(function, arguments)]). Arguments compare as
# JSON values; the raw text of JSON-argument formats is also checked to pass through unchanged.
CASES: dict[str, list[tuple[str, str, str | None, list[tuple[str, dict]]]]] = {
    "hermes": [
        ("one call", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
         None, [("get_weather", {"city": "Paris"})]),
        ("several calls", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
         None, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
        ("text before", "Let me check.\n\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
         "Let me check.", [("get_time", {})]),
        ("nested unicode quotes", '<tool_call>\n{"name": "get_weather", "arguments": '
         + json.dumps(NESTED, ensure_ascii=False) + "}\n</tool_call>", None, [("get_weather", NESTED)]),
        ("arguments before name", '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>',
         None, [("get_weather", {"city": "Oslo"})]),
        ("malformed", "Hmm <tool_call>\n{not json}\n</tool_call> done",
         "Hmm <tool_call>\n{not json}\n</tool_call> done", []),
        ("unclosed header", 'x <tool_call>\n{"name": "get_wea', 'x <tool_call>\n{"name": "get_wea', []),
        ("no call", "Plain answer with a < sign and {braces}.\n", "Plain answer with a < sign and {braces}.\n", []),
    ],
    "llama3_json": [
        ("one call", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
         [("get_weather", {"city": "Paris"})]),
        ("several calls", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
         '{"name": "get_time", "arguments": {}}', None, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
        ("nested unicode quotes", '{"name": "get_weather", "parameters": ' + json.dumps(NESTED, ensure_ascii=False)
         + "}", None, [("get_weather", NESTED)]),
        ("name after parameters", '{"parameters": {"city": "Oslo"}, "name": "get_weather"}', None,
         [("get_weather", {"city": "Oslo"})]),
        ("text before", 'Sure: {"name": "get_time", "parameters": {}}', 'Sure: {"name": "get_time", "parameters": {}}',
         []),
        ("malformed", '{"name": "get_weather", "parameters": oops}', '{"name": "get_weather", "parameters": oops}', []),
        ("a JSON answer", '{"answer": 42, "name": "x"}', '{"answer": 42, "name": "x"}', []),
        ("built-in tool", '<|python_tag|>brave_search.call(query="x")', '<|python_tag|>brave_search.call(query="x")',
         []),
    ],
    "deepseek_v3": [
        ("one call", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
         '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None, [("get_weather", {"city": "Paris"})]),
        ("several calls with text before", "I will look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
         'get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
         "get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "I will look.",
         [("get_weather", {"city": "Paris"}), ("get_time", {})]),
        ("nested unicode quotes", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
         + json.dumps(NESTED, ensure_ascii=False) + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", None,
         [("get_weather", NESTED)]),
        ("malformed", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
         "<｜tool▁calls▁end｜>", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{}"
         "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", []),
    ],
    "deepseek_v31": [
        ("one call", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
         "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", None, [("get_weather", {"city": "Paris"})]),
        ("several calls with text before", 'Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>'
         '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜>'
         "<｜tool▁calls▁end｜>", "Checking.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
        ("nested unicode quotes", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
         + json.dumps(NESTED, ensure_ascii=False) + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", None,
         [("get_weather", NESTED)]),
        ("malformed", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get weather now<｜tool▁sep｜>{}<｜tool▁call▁end｜>",
         "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get weather now<｜tool▁sep｜>{}<｜tool▁call▁end｜>", []),
    ],
    "kimi_k2": [
        ("one call", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
         '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>', None, [("get_weather", {"city": "Paris"})]),
        ("several calls with text before", "Let me see. <|tool_calls_section_begin|><|tool_call_begin|>"
         'functions.get_weather:3<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>'
         "functions.get_time:4<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
         "Let me see.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
        ("nested unicode quotes", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
         "<|tool_call_argument_begin|>" + json.dumps(NESTED, ensure_ascii=False)
         + "<|tool_call_end|><|tool_calls_section_end|>", None, [("get_weather", NESTED)]),
        ("malformed", "<|tool_calls_section_begin|><|tool_call_begin|>get_weather<|tool_call_argument_begin|>{}"
         "<|tool_call_end|><|tool_calls_section_end|>",
         "<|tool_calls_section_begin|><|tool_call_begin|>get_weather<|tool_call_argument_begin|>{}<|tool_call_end|>"
         "<|tool_calls_section_end|>", []),
    ],
    "glm45": [
        ("one call", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
         None, [("get_weather", {"city": "Paris"})]),
        ("several calls with text before, GLM-4.7 layout", "Checking.<tool_call>get_weather<arg_key>city</arg_key>"
         "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
         "<tool_call>get_time</tool_call>", "Checking.", [("get_weather", {"city": "Paris", "days": 3}),
                                                          ("get_time", {})]),
        ("typed by schema", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>3</arg_value>\n"
         "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>metric</arg_key>\n<arg_value>true</arg_value>\n"
         "<arg_key>filters</arg_key>\n<arg_value>" + json.dumps(NESTED["filters"]) + "</arg_value>\n"
         "<arg_key>extra</arg_key>\n<arg_value>[1, 2]</arg_value>\n</tool_call>", None,
         [("get_weather", {"city": "3", "days": 3, "metric": True, "filters": NESTED["filters"], "extra": [1, 2]})]),
        ("unicode, quotes and newlines kept in a string", "<tool_call>get_weather\n<arg_key>city</arg_key>\n"
         "<arg_value>" + NESTED["city"] + "\n line 2 </arg_value>\n</tool_call>", None,
         [("get_weather", {"city": NESTED["city"] + "\n line 2 "})]),
        ("malformed", "<tool_call>\n\n</tool_call> and <tool_call>get weather", "<tool_call>\n\n</tool_call> and "
         "<tool_call>get weather", []),
    ],
    "minimax_m2": [
        ("one call", '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
         "</invoke>\n</minimax:tool_call>", None, [("get_weather", {"city": "Paris"})]),
        ("several calls with text before", 'Sure.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
         '<parameter name="city">Paris</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n'
         '<invoke name="get_time">\n</invoke>\n</minimax:tool_call>', "Sure.",
         [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
        ("typed by schema", '<minimax:tool_call>\n<invoke name="get_weather">\n'
         '<parameter name="ratio">0.5</parameter>\n<parameter name="metric">false</parameter>\n<parameter name="note">null</parameter>\n'
         '<parameter name="tags">["a", "b"]</parameter>\n<parameter name="extra">3</parameter>\n</invoke>\n'
         "</minimax:tool_call>", None,
         [("get_weather", {"ratio": 0.5, "metric": False, "note": None, "tags": ["a", "b"], "extra": "3"})]),
        ("unicode, quotes and code", '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">\n'
         + NESTED["city"] + '\n</parameter>\n<parameter name="code">' + CODE + "</parameter>\n</invoke>\n"
         "</minimax:tool_call>", None, [("get_weather", {"city": NESTED["city"], "code": CODE.strip()})]),
        ("malformed", '<minimax:tool_call>\n<invoke nom="get_weather">\n</invoke>\n</minimax:tool_call>',
         '<minimax:tool_call>\n<invoke nom="get_weather">\n</invoke>\n</minimax:tool_call>', []),
    ],
    "qwen3_coder": [
        ("one call", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
         "</tool_call>", None, [("get_weather", {"city": "Paris"})]),
        ("several calls with text before", "I'll check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
         "Paris\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
         "<function=get_time>\n</function>\n</tool_call>", "I'll check both.",
         [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
        ("typed by schema, code kept", "<tool_call>\n<function=get_weather>\n<parameter=days>\n7\n</parameter>\n"
         "<parameter=filters>\n{'a': [1, None]}\n</parameter>\n<parameter=note>\nNone\n</parameter>\n"
         "<parameter=code>\n" + CODE + "\n</parameter>\n<parameter=extra>\n3\n</parameter>\n</function>\n</tool_call>",
         None, [("get_weather", {"days": 7, "filters": {"a": [1, None]}, "note": None, "code": CODE,
                                 "extra": "3"})]),
        ("unicode and quotes", "<tool_call>\n<function=get_weather>\n<parameter=city>\n" + NESTED["city"]
         + "\n</parameter>\n</function>\n</tool_call>", None, [("get_weather", {"city": NESTED["city"]})]),
        ("bare function", "<function=get_time>\n</function>", None, [("get_time", {})]),
        ("malformed", "<tool_call>\n<function get_weather>\n</function>\n</tool_call>",
         "<tool_call>\n<function get_weather>\n</function>\n</tool_call>", []),
    ],
    "deepseek_v32": [
        ("one call", '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n' + dsml_param("city", "Paris", True)
         + "\n</｜DSML｜invoke>\n</｜DSML｜function_calls>", None, [("get_weather", {"city": "Paris"})]),
        ("several calls with text before, V4 block", "Let me check.\n\n<｜DSML｜tool_calls>\n"
         '<｜DSML｜invoke name="get_weather">\n' + dsml_param("city", "杭州", True) + "\n" + dsml_param("days", "3", False) + '\n</｜DSML｜invoke>\n'
         '<｜DSML｜invoke name="get_time">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>', "Let me check.",
         [("get_weather", {"city": "杭州", "days": 3}), ("get_time", {})]),
        ("JSON and raw strings", '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
         + dsml_param("filters", json.dumps(NESTED["filters"]), False) + "\n" + dsml_param("city", "7", True) + "\n"
         + dsml_param("code", CODE, True) + "\n</｜DSML｜invoke>\n</｜DSML｜function_calls>", None,
         [("get_weather", {"filters": NESTED["filters"], "city": "7", "code": CODE})]),
        ("malformed", '<｜DSML｜function_calls>\n<｜DSML｜invoke>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>',
         '<｜DSML｜function_calls>\n<｜DSML｜invoke>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>', []),
    ],
    "openai": [
        ("one call", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
         "<|call|>", None, [("get_weather", {"city": "Paris"})]),
        ("reasoning, preamble, then a call", "<|channel|>analysis<|message|>User wants weather.<|end|>"
         "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_weather"
         '<|channel|>commentary json<|message|>' + json.dumps(NESTED, ensure_ascii=False), "Checking.",
         [("get_weather", NESTED)]),
        ("final answer", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>"
         "Paris is sunny.<|return|>", "Paris is sunny.", []),
        ("malformed", "no harmony framing at all", "no harmony framing at all", []),
    ],
}
SAMPLES = [(parser, label, text) for parser, cases in CASES.items() for label, text, _, _ in cases]


def sample_id(sample) -> str:
    return f"{sample[0]}: {sample[1]}"


def key(result):
    return result.content, [(call.name, call.arguments_json) for call in result.calls]


def streamed(parser_name: str, pieces: list[str]) -> list[DeltaMessage]:
    parser = get_tool_parser(parser_name)(TOOLS)
    deltas = [delta for piece in pieces for delta in parser.feed(piece)]
    return deltas + parser.finish()


@pytest.mark.parametrize("parser_name,label,text,content,calls",
                         [(p, *case) for p, cases in CASES.items() for case in cases],
                         ids=[f"{p}: {case[0]}" for p, cases in CASES.items() for case in cases])
def test_whole_output_parses_to_its_calls_and_content(parser_name, label, text, content, calls):
    result = get_tool_parser(parser_name)(TOOLS).parse(text)
    assert result.content == content
    assert [(call.name, json.loads(call.arguments_json)) for call in result.calls] == calls
    for call in result.calls:
        assert call.type == "function"
        assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id) or parser_name == "kimi_k2"


def test_json_argument_formats_pass_the_arguments_through_as_written():
    written = '{"city":  "Paris" ,"x":[1,2]}'
    result = get_tool_parser("hermes")().parse(f'<tool_call>\n{{"name": "f", "arguments": {written}}}\n</tool_call>')
    assert result.calls[0].arguments_json == written


def test_kimi_calls_keep_the_models_own_id():
    text = CASES["kimi_k2"][1][1]
    assert [call.id for call in get_tool_parser("kimi_k2")().parse(text).calls] == [
        "functions.get_weather:3", "functions.get_time:4"]


@pytest.mark.parametrize("sample", SAMPLES, ids=sample_id)
def test_streaming_cut_at_every_boundary_adds_up_to_the_whole_parse(sample):
    parser_name, _, text = sample
    whole = key(get_tool_parser(parser_name)(TOOLS).parse(text))
    for cut in range(len(text) + 1):
        assert key(collect(streamed(parser_name, [text[:cut], text[cut:]]))) == whole, f"cut at {cut}"
    assert key(collect(streamed(parser_name, list(text)))) == whole, "one character at a time"


@pytest.mark.parametrize("sample", SAMPLES, ids=sample_id)
def test_streaming_in_random_chunks_adds_up_to_the_whole_parse(sample):
    parser_name, _, text = sample
    whole = key(get_tool_parser(parser_name)(TOOLS).parse(text))
    rng = random.Random(text)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert key(collect(streamed(parser_name, pieces))) == whole, pieces


@pytest.mark.parametrize("sample", [s for s in SAMPLES if s[0] != "openai"], ids=sample_id)
def test_streamed_calls_send_id_and_name_first_then_argument_fragments(sample):
    parser_name, _, text = sample
    seen: dict[int, int] = {}
    for delta in streamed(parser_name, list(text)):
        assert delta.content is None or not delta.tool_calls
        for piece in delta.tool_calls:
            if piece.index not in seen:
                assert piece.index == len(seen), "calls are numbered in order"
                assert piece.id and piece.type == "function" and piece.function.name
                assert piece.function.arguments == ""
                seen[piece.index] = 0
            else:
                assert piece.id is None and piece.type is None and piece.function.name is None
                assert piece.function.arguments
                seen[piece.index] += 1


def test_long_arguments_stream_in_many_fragments():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + "a" * 200 + '"}}\n</tool_call>'
    deltas = streamed("hermes", [text[i:i + 10] for i in range(0, len(text), 10)])
    assert sum(1 for d in deltas for piece in d.tool_calls if piece.function.arguments) > 10
    string_value = "<tool_call>\n<function=get_weather>\n<parameter=code>\n" + "x = 1\n" * 50 + "</parameter>\n" \
        "</function>\n</tool_call>"
    deltas = streamed("qwen3_coder", [string_value[i:i + 10] for i in range(0, len(string_value), 10)])
    assert sum(1 for d in deltas for piece in d.tool_calls if piece.function.arguments) > 10


def test_delta_to_dict_is_openais_shape():
    deltas = streamed("hermes", ['<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'])
    first = deltas[0].to_dict()
    assert first == {"tool_calls": [{"index": 0, "id": first["tool_calls"][0]["id"], "type": "function",
                                     "function": {"name": "get_time", "arguments": ""}}]}
    assert deltas[1].to_dict() == {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
    assert DeltaMessage(content="hi").to_dict() == {"content": "hi"}


def test_output_without_calls_is_its_own_content_exactly():
    text = "  Two lines,\n\n with <tags> and {\"json\": 1} and trailing space  \n"
    for name, parser_class in TOOL_PARSERS.items():
        result = parser_class(TOOLS).parse(text)
        assert (result.content, result.calls) == (text, []), name


def test_output_cut_off_inside_a_call_never_raises():
    for parser_name, cases in CASES.items():
        for _, text, _, _ in cases:
            for cut in range(len(text)):
                get_tool_parser(parser_name)(TOOLS).parse(text[:cut])


def test_parse_leaves_a_streaming_parser_untouched():
    parser = get_tool_parser("hermes")(TOOLS)
    parser.feed("Hello <tool_")
    parser.parse("other text")
    assert collect(parser.feed('call>\n{"name": "get_time", "arguments": {}}\n</tool_call>') + parser.finish()) \
        .calls[0].name == "get_time"


def test_tools_may_be_pydantic_models():
    from pydantic import BaseModel

    class Tool(BaseModel):
        type: str
        function: dict

    tools = [Tool(**tool) for tool in TOOLS]
    text = "<tool_call>get_weather<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
    assert json.loads(get_tool_parser("glm45")(tools).parse(text).calls[0].arguments_json) == {"days": 3}


# ---- the registry --------------------------------------------------------------------------------------------
def test_every_family_has_a_parser_by_vllms_name():
    assert set(CASES) <= set(TOOL_PARSERS)


def test_an_unknown_parser_name_is_refused_with_the_names():
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'.*hermes.*llama3_json"):
        get_tool_parser("nope")
    assert tool_parser_names()[0] == "auto"


@pytest.mark.parametrize("config,template,expected", [
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, None, "llama3_json"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "{{ '<tool_call>' }}", "hermes"),
    ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, None, "hermes"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}, "<function=", "qwen3_coder"),
    ({"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"}, None, "hermes"),
    ({"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe"}, None, "qwen3_coder"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}, None, "deepseek_v3"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"},
     "'<｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>'", "deepseek_v31"),
    ({"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32"}, None, "deepseek_v32"),
    ({"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}, None, "deepseek_v32"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2"}, None, "kimi_k2"),
    ({"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25"}, None, "kimi_k2"),
    ({"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe"}, None, "glm45"),
    ({"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa"}, None, "glm45"),
    ({"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2"}, None, "minimax_m2"),
    ({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"}, None, "openai"),
    ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}, None, None),
    ({"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4"}, None, None),
])
def test_auto_picks_the_parser_from_the_model(config, template, expected):
    assert default_tool_parser(config, template) == expected
    found = tool_parser_class("auto", config, template)
    assert found is (None if expected is None else TOOL_PARSERS[expected])


def test_auto_reads_a_transformers_config():
    from transformers import Qwen3Config
    assert default_tool_parser(Qwen3Config(architectures=["Qwen3ForCausalLM"])) == "hermes"


# ---- agreement with the families' chat templates -------------------------------------------------------------
# The assistant-turn part of each family's published chat template, copied verbatim (only the loop around it
# added): what the template teaches the model to write must read back as the same calls. No full template
# ships in this repository; DeepSeek-V3.2 ships none (a Python encoder), gpt-oss renders through harmony.
TEMPLATE_EXCERPTS = {
    # Qwen3-0.6B's template (ye-NX/llama.cpp:models/templates/Qwen-Qwen3-0.6B.jinja), its tool-call loop
    "hermes": r'''{%- for message in messages %}{%- if message.role == "assistant" %}{%- set content = message.content %}{{- '<|im_start|>' + message.role + '\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}{%- endif %}{%- endfor %}
''',
    # Qwen3-Coder's template (wbpxre150/llama.cpp:models/templates/Qwen3-Coder.jinja)
    "qwen3_coder": r'''{%- for message in messages %}{%- if message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content is defined and message.content is string and message.content | trim | length > 0 %}
            {{- '\n' + message.content | trim + '\n' }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
            {%- if tool_call.arguments is defined %}
                {%- for args_name, args_value in tool_call.arguments|items %}
                    {{- '<parameter=' + args_name + '>\n' }}
                    {%- set args_value = args_value if args_value is string else args_value | string %}
                    {{- args_value }}
                    {{- '\n</parameter>\n' }}
                {%- endfor %}
            {%- endif %}
            {{- '</function>\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}{%- endif %}{%- endfor %}
''',
    # DeepSeek-R1's template (ggml-org/llama.cpp:models/templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja)
    "deepseek_v3": r'''{%- set ns = namespace(is_first=false) -%}{%- for message in messages -%}
  {%- if message['role'] == 'assistant' and message['tool_calls'] -%}
    {%- for tool in message['tool_calls']-%}
      {%- if not ns.is_first -%}
        {{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}
        {%- set ns.is_first = true -%}
      {%- else -%}
        {{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}
      {%- endif -%}
    {%- endfor -%}
    {{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}
  {%- endif -%}{%- endfor -%}
''',
    # DeepSeek-V3.1's template (ggml-org/llama.cpp:models/templates/deepseek-ai-DeepSeek-V3.1.jinja)
    "deepseek_v31": r'''{%- set ns = namespace(is_first=false) -%}{%- for message in messages -%}
  {%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] is not none -%}{{'<｜Assistant｜></think>'}}
    {%- for tool in message['tool_calls'] -%}
      {%- if not ns.is_first -%}
        {%- if message['content'] is none -%}{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}
          {%- else -%}{{message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}
        {%- endif -%}
        {%- set ns.is_first = true -%}
        {%- else -%}{{'<｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}
      {%- endif -%}
    {%- endfor -%}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}
  {%- endif -%}{%- endfor -%}
''',
    # GLM-4.5's template (ggml-org/llama.cpp:models/templates/glm_4_5.jinja)
    "glm45": r'''{% for m in messages %}{%- if m.role == 'assistant' -%}
<|assistant|>{{ '\n<think></think>' }}
{%- if m.content.strip() -%}
{{ '\n' + m.content.strip() }}
{%- endif -%}
{% if m.tool_calls %}
{% for tc in m.tool_calls %}
{%- if tc.function %}
    {%- set tc_obj = tc.function %}
{%- else %}
    {%- set tc_obj = tc %}
{%- endif %}
{{ '\n<tool_call>' + tc_obj.name }}
{%- if tc_obj.arguments is mapping -%}
    {%- for k, v in tc_obj.arguments.items() -%}

<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson if v is not string else v }}</arg_value>
    {%- endfor -%}
{%- endif -%}
</tool_call>{% endfor %}
{% endif %}{%- endif -%}{%- endfor -%}
''',
    # MiniMax-M2's template (ggml-org/llama.cpp:models/templates/unsloth-MiniMax-M2.jinja)
    "minimax_m2": r'''{%- for message in messages -%}{%- if message.role == 'assistant' -%}
        {{- ']~b]ai' ~ '\n' }}
        {%- if message.content -%}
            {{- message.content }}
        {%- endif -%}
        {%- if message.tool_calls -%}
            {{- '\n' ~ '<minimax:tool_call>' ~ '\n' }}

            {%- for tool_call in message.tool_calls -%}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<invoke name="' + tool_call.name + '">\n' }}
                {%- if tool_call.arguments is defined and tool_call.arguments is mapping -%}
                {% set _args = tool_call.arguments %}
                {%- for k, v in _args|items %}
                {{- '<parameter name="' + k + '">' }}
                {{- v | tojson | string if v is not string else v }}
                {{- '</parameter>' }}
                {% endfor %}{%- endif -%}
                {{- '</invoke>' ~ '\n' }}
            {%- endfor -%}

            {{- '</minimax:tool_call>'}}
        {%- endif -%}
        {{- '[e~[' ~ '\n' }}{%- endif -%}{%- endfor -%}
''',
    # Kimi-K2-Thinking's template (ggml-org/llama.cpp:models/templates/Kimi-K2-Thinking.jinja)
    "kimi_k2": r'''{%- set tool_call_counter = namespace(value=0) -%}
{%- macro render_toolcalls(message) -%}
  <|tool_calls_section_begin|>
  {%- for tool_call in message['tool_calls'] -%}
    {%- if tool_call['id'] is defined -%}
      {%- set formatted_id = tool_call['id'] -%}
    {%- else -%}
      {%- set formatted_id = 'functions.' + tool_call['function']['name'] + ':' + (tool_call_counter.value | string) -%}
      {%- set tool_call_counter.value = tool_call_counter.value + 1 -%}
    {%- endif -%}
    <|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>{% if tool_call['function']['arguments'] is string %}{{ tool_call['function']['arguments'] }}{% else %}{{ tool_call['function']['arguments'] | tojson }}{% endif %}<|tool_call_end|>
  {%- endfor -%}
  <|tool_calls_section_end|>
{%- endmacro -%}
{%- for message in messages -%}{%- if message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>
    <think></think>{{message.content}}
    {%- if message.get('tool_calls') -%}
      {{render_toolcalls(message)}}
    {%- endif -%}<|im_end|>{%- endif -%}{%- endfor -%}
''',
}


@pytest.mark.parametrize("parser_name", sorted(set(TOOL_PARSERS) - {"qwen3_xml", "glm47", "deepseek_v4"}))
@pytest.mark.parametrize("content", ["", "Let me check."])
def test_calls_rendered_by_the_chat_template_parse_back(parser_name, content):
    if parser_name not in TEMPLATE_EXCERPTS:
        pytest.skip(f"no chat template for {parser_name} here")
    from transformers.utils.chat_template_utils import _compile_jinja_template
    template = _compile_jinja_template(TEMPLATE_EXCERPTS[parser_name])
    calls = [("get_weather", {"city": "Zürich \"Altstadt\"", "days": 3, "filters": {"a": [1, None]}}),
             ("get_time", {})]

    def render(arguments_as_text: bool) -> str:
        message = {"role": "assistant", "content": content, "tool_calls": [
            {"type": "function", "function": {"name": name,
                                              "arguments": json.dumps(arguments) if arguments_as_text else arguments}}
            for name, arguments in calls]}
        return template.render(messages=[message])

    try:
        rendered = render(arguments_as_text=False)
    except TypeError:  # DeepSeek's templates concatenate the arguments as a JSON string
        rendered = render(arguments_as_text=True)
    result = get_tool_parser(parser_name)(TOOLS).parse(rendered)
    assert [(call.name, json.loads(call.arguments_json)) for call in result.calls] == calls, rendered
    if content in rendered:
        assert content in result.content
