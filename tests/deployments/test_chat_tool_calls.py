"""Tool calling's request side (deployments/openai/tool_calls.py) and how a choice's output is read
(chat_output.py), without a server: the schema that forces `required` calls, the readers of forced outputs cut
anywhere, the reasoning and tool parsers in a row, finish reasons, the end-of-sequence token the parsers'
decoding keeps, and constrained outputs of thinking models, whose constraint starts after their reasoning."""
from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest

from deployments.openai.chat_output import (ChatOutputReader, ChatParsers, RequiredCallsReader, check_parser_names)
from deployments.openai.errors import OpenAIError
from deployments.openai.reasoning_parsers import get_reasoning_parser
from deployments.openai.structured_output import after_reasoning
from deployments.openai.tool_calls import ToolPlan, forced_params, plan_tools, required_calls_schema, template_kwargs
from deployments.openai.tool_parsers import HermesToolParser, collect, get_tool_parser
from deployments.openai.tool_protocol import ChatTool, NamedToolChoice
from engine.outputs import CompletionOutput
from engine.sampling_params import SamplingParams

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
EOS_ID = 2


def body(tools=TOOLS, tool_choice=None, parallel_tool_calls=None):
    return SimpleNamespace(tools=[ChatTool.model_validate(tool) for tool in tools] if tools is not None else None,
                           tool_choice=(NamedToolChoice.model_validate(tool_choice) if isinstance(tool_choice, dict)
                                        else tool_choice), parallel_tool_calls=parallel_tool_calls)


def refusal(**fields) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        plan_tools(body(**fields))
    assert caught.value.status_code == 400
    return caught.value


# ---- the request ---------------------------------------------------------------------------------------------
def test_tools_default_to_auto_and_no_tools_to_none():
    assert plan_tools(body()).mode == "auto"
    assert plan_tools(body(tools=None)).mode == "none"
    assert plan_tools(body(tools=[], tool_choice="auto")).mode == "none"
    assert plan_tools(body(tool_choice="none")).tools == TOOLS[:1] + [TOOLS[1]]


@pytest.mark.parametrize("fields, param", [
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$schema": 5}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_wether"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
])
def test_bad_tools_are_refused_naming_the_field(fields, param):
    assert refusal(**fields).param == param


def test_a_named_choice_forces_the_functions_arguments():
    plan = plan_tools(body(tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert (plan.mode, plan.function_name) == ("named", "get_time")
    assert plan.constraint["json"] == {"type": "object"}  # no parameters declared: any object


@pytest.mark.parametrize("parallel", [True, False])
def test_the_required_schema_takes_calls_of_the_tools_only(parallel):
    plan = plan_tools(body(tool_choice="required", parallel_tool_calls=parallel))
    schema = plan.constraint["json"]
    jsonschema.validators.validator_for(schema).check_schema(schema)
    good = [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]
    jsonschema.validate(good[:1], schema)
    assert jsonschema.Draft202012Validator(schema).is_valid(good) == parallel
    for bad in ([], [{"name": "get_weather", "arguments": {"days": 2}}], [{"name": "other", "arguments": {}}],
                [{"name": "get_time", "arguments": {}, "extra": 1}], {"name": "get_time", "arguments": {}}):
        assert not jsonschema.Draft202012Validator(schema).is_valid(bad), bad


def test_required_schema_moves_each_tools_definitions_to_the_root():
    with_defs = {"type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}},
                 "$defs": {"Place": {"type": "string", "enum": ["Paris"]}}}
    tools = [{"type": "function", "function": {"name": "a", "parameters": with_defs}},
             {"type": "function", "function": {"name": "b", "parameters": with_defs}}]
    schema = required_calls_schema(tools)
    assert schema["$defs"] == {"Place": {"type": "string", "enum": ["Paris"]}}
    jsonschema.validate([{"name": "b", "arguments": {"place": "Paris"}}], schema)
    assert not jsonschema.Draft202012Validator(schema).is_valid([{"name": "b", "arguments": {"place": "Rome"}}])
    clash = json.loads(json.dumps(tools))
    clash[1]["function"]["parameters"]["$defs"]["Place"] = {"type": "integer"}
    assert refusal(tools=clash, tool_choice="required").param == "tools.1.function.parameters"


def test_chat_template_kwargs_pass_through_but_may_not_set_what_the_server_sets():
    plan = plan_tools(body())
    assert template_kwargs(plan, {"enable_thinking": False}) == {"enable_thinking": False, "tools": plan.tools}
    with pytest.raises(OpenAIError) as caught:
        template_kwargs(plan, {"tools": []})
    assert caught.value.param == "chat_template_kwargs.tools"


def test_parser_names_are_checked_at_start_up():
    check_parser_names("hermes", "none")
    with pytest.raises(ValueError, match="unknown tool_call_parser 'hermez'.*hermes"):
        check_parser_names("hermez", "auto")
    with pytest.raises(ValueError, match="unknown reasoning_parser"):
        ChatParsers.resolve("auto", "deepseek")


def test_app_args_refuse_an_unknown_parser_naming_it():
    from deployments.serve_app import build_app
    with pytest.raises(ValueError, match="(?s)invalid atom-ray app args.*unknown reasoning_parser 'qwen'"):
        build_app({"reasoning_parser": "qwen"})


def test_serve_flags_reach_the_app_args(monkeypatch):
    from atom_ray import cli
    seen = {}
    monkeypatch.setattr("atom_ray.serving.serve_until_interrupted", lambda options, app_args: seen.update(app_args))
    cli.main(["serve", "--tool-call-parser", "qwen3_coder", "--reasoning-parser", "none"])
    assert (seen["tool_call_parser"], seen["reasoning_parser"]) == ("qwen3_coder", "none")
    cli.main(["serve"])
    assert (seen["tool_call_parser"], seen["reasoning_parser"]) == ("auto", "auto")


def test_auto_parsers_come_from_the_model_and_none_turns_them_off():
    qwen3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    assert ChatParsers.resolve("auto", "auto", qwen3, "<tool_call>") == ChatParsers(
        HermesToolParser, get_reasoning_parser("qwen3"))
    assert ChatParsers.resolve("none", "none", qwen3) == ChatParsers()
    assert ChatParsers.resolve("auto", "auto", None, None) == ChatParsers()


# ---- reading outputs -------------------------------------------------------------------------------------------
class FakeTokenizer:
    all_special_ids = frozenset({EOS_ID})
    eos_token_ids = frozenset({EOS_ID})

    def decode(self, token_ids, skip_special_tokens=True):
        return "<|im_end|>" if token_ids == [EOS_ID] else "x"


def reader(plan: ToolPlan, parsers=ChatParsers(), prompt=None, params=None) -> ChatOutputReader:
    """A reader of outputs decoded with their special tokens (an EOS at the end of each, as the engine writes
    it then)."""
    return ChatOutputReader(parsers, plan, params or SamplingParams(skip_special_tokens=False), FakeTokenizer(),
                            prompt)


def completion(text: str, finish_reason="stop", eos=True) -> CompletionOutput:
    token_ids = [7] * 3 + ([EOS_ID] if eos else [])
    return CompletionOutput(0, text + ("<|im_end|>" if eos else ""), token_ids, finish_reason)


def streamed(output_reader: ChatOutputReader, pieces: list[str], finish_reason="stop"):
    """The deltas of a stream of `pieces` (the last step also brings the EOS token) and the last finish reason."""
    deltas, finish, ids, text = [], None, [], ""
    for number, piece in enumerate(pieces):
        last = number == len(pieces) - 1
        ids = ids + [7] + ([EOS_ID] if last else [])
        piece += "<|im_end|>" if last else ""
        text += piece
        step = CompletionOutput(0, text, ids, finish_reason if last else None, new_text=piece, new_token_ids=[7])
        delta, called = output_reader.delta(step)
        finish = output_reader.finish_reason(step.finish_reason, called)
        deltas.append(delta)
    return [delta for delta in deltas if delta is not None], finish


def joined(deltas) -> dict:
    """Stream deltas added up as a client does."""
    message = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for delta in deltas:
        message["content"] += delta.content or ""
        message["reasoning_content"] += delta.reasoning_content or ""
        for piece in delta.tool_calls or []:
            call = message["tool_calls"].setdefault(piece.index, {"name": "", "arguments": ""})
            if piece.id is not None:
                assert not call["name"] and piece.function.name, "the first piece of a call has id and name"
            call["name"] += piece.function.name or ""
            call["arguments"] += piece.function.arguments or ""
    return message


REQUIRED_OUTPUT = ('[{"name": "get_weather", "arguments": {"city": "Par}is"}}, '
                   '{"name": "get_time", "arguments": {}}]')


@pytest.mark.parametrize("cut", range(len(REQUIRED_OUTPUT) + 1))
def test_required_output_cut_anywhere_reads_as_the_whole(cut):
    whole = RequiredCallsReader().parse(REQUIRED_OUTPUT)
    assert [(c.name, json.loads(c.arguments_json)) for c in whole.calls] == [
        ("get_weather", {"city": "Par}is"}), ("get_time", {})]
    parser = RequiredCallsReader()
    pieces = collect(parser.feed(REQUIRED_OUTPUT[:cut]) + parser.feed(REQUIRED_OUTPUT[cut:]) + parser.finish())
    assert [(c.name, c.arguments_json) for c in pieces.calls] == [(c.name, c.arguments_json) for c in whole.calls]
    assert pieces.content is None


def test_a_required_output_that_is_no_array_is_content():
    assert RequiredCallsReader().parse("I cannot").content == "I cannot"


def test_required_calls_end_with_tool_calls_and_stream_the_same():
    plan = plan_tools(body(tool_choice="required"))
    message, finish = reader(plan).message(completion(REQUIRED_OUTPUT))
    assert finish == "tool_calls" and message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Par}is"}), ("get_time", {})]
    pieces = [REQUIRED_OUTPUT[i:i + 7] for i in range(0, len(REQUIRED_OUTPUT), 7)]
    deltas, stream_finish = streamed(reader(plan), pieces)
    calls = joined(deltas)["tool_calls"]
    assert stream_finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls]


def test_a_named_call_is_the_arguments_as_written_and_ends_with_stop():
    plan = plan_tools(body(tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    message, finish = reader(plan).message(completion(' {"city": "Oslo"}'))
    assert finish == "stop"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("get_weather",
                                                                                      '{"city": "Oslo"}')]
    cut, cut_finish = reader(plan).message(completion('{"city": "Os', "length", eos=False))
    assert cut_finish == "length" and cut.tool_calls[0].function.arguments == '{"city": "Os'


HERMES_OUTPUT = ('<think>Which city?</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": '
                 '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("size", [1, 3, 17, len(HERMES_OUTPUT)])
def test_reasoning_then_calls_stream_as_the_whole_message(size):
    parsers = ChatParsers(HermesToolParser, get_reasoning_parser("qwen3"))
    plan = plan_tools(body())
    message, finish = reader(plan, parsers).message(completion(HERMES_OUTPUT))
    assert (message.reasoning_content, message.content, finish) == ("Which city?", "Checking.", "tool_calls")
    assert [c.function.name for c in message.tool_calls] == ["get_weather", "get_time"]
    deltas, stream_finish = streamed(reader(plan, parsers), [HERMES_OUTPUT[i:i + size]
                                                             for i in range(0, len(HERMES_OUTPUT), size)])
    whole = joined(deltas)
    assert (whole["reasoning_content"], whole["content"], stream_finish) == ("Which city?", "Checking.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in whole["tool_calls"].values()] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls]


def test_parallel_tool_calls_false_keeps_the_first_call():
    plan = plan_tools(body(parallel_tool_calls=False))
    message, _ = reader(plan, ChatParsers(HermesToolParser)).message(completion(HERMES_OUTPUT.split("</think>")[1]))
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]


def test_calls_in_the_reasoning_are_not_calls():
    parsers = ChatParsers(HermesToolParser, get_reasoning_parser("deepseek_r1"))
    text = 'Maybe <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>?</think>No call needed.'
    message, finish = reader(plan_tools(body()), parsers).message(completion(text))
    assert message.tool_calls is None and finish == "stop"
    assert message.content == "No call needed." and message.reasoning_content.startswith("Maybe <tool_call>")


# ---- constrained outputs after the reasoning ----------------------------------------------------------------------
QWEN_PROMPT = "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"


def test_no_reasoning_is_read_from_an_output_constrained_from_its_first_token():
    parsers = ChatParsers(None, get_reasoning_parser("qwen3"))
    closed = QWEN_PROMPT + "<think>\n\n</think>\n\n"  # enable_thinking false: the prompt closed the reasoning
    output_reader = reader(ToolPlan(), parsers, closed, SamplingParams(structured_outputs={"json_object": True}))
    assert output_reader.active is False and output_reader.params.structured_outputs.reasoning_end is None


def forced_reader(plan: ToolPlan, parser: str, prompt=None, kwargs=None) -> ChatOutputReader:
    """The reader of a forced choice's output, with the constraint the route gives it (forced_params)."""
    params = forced_params(SamplingParams(), plan)
    return ChatOutputReader(ChatParsers(None, get_reasoning_parser(parser)), plan, params, FakeTokenizer(), prompt,
                            kwargs)


@pytest.mark.parametrize("parser, prompt, kwargs, tags", [
    ("qwen3", QWEN_PROMPT, None, ("<think>", "</think>")),  # the model may open its reasoning, or answer at once
    ("qwen3", QWEN_PROMPT + "<think>\n", None, (None, "</think>")),  # Qwen3.5: the template opened it
    ("deepseek_r1", None, None, (None, "</think>")),  # R1 starts inside its reasoning
    ("kimi_k2", "<|im_assistant|>assistant<|im_middle|>", None, ("<think>", "</think>")),
])
def test_a_forced_call_of_a_thinking_model_is_constrained_after_its_reasoning(parser, prompt, kwargs, tags):
    plan = plan_tools(body(tool_choice="required"))
    output_reader = forced_reader(plan, parser, prompt, kwargs)
    constraint = output_reader.params.structured_outputs
    assert (constraint.reasoning_start, constraint.reasoning_end) == tags
    assert constraint.json == plan.constraint["json"] and not constraint.reasoning_tags_are_special_tokens
    assert output_reader.reasoning_parser is get_reasoning_parser(parser)
    assert output_reader.params.skip_special_tokens is False  # the tags may be special tokens


@pytest.mark.parametrize("parser, prompt, kwargs", [
    ("qwen3", QWEN_PROMPT + "<think>\n\n</think>\n\n", {"enable_thinking": False}),
    ("qwen3", QWEN_PROMPT, {"enable_thinking": False}),
    ("kimi_k2", "<|im_assistant|>assistant<|im_middle|><think></think>", {"thinking": False}),
    ("openai", None, None),  # gpt-oss: harmony channels, no tags for a grammar to wait for
])
def test_without_reasoning_to_write_the_constraint_holds_from_the_first_token(parser, prompt, kwargs):
    plan = plan_tools(body(tool_choice={"type": "function", "function": {"name": "get_time"}}))
    output_reader = forced_reader(plan, parser, prompt, kwargs)
    assert output_reader.params.structured_outputs.reasoning_end is None
    assert output_reader.reasoning_parser is None


REASONED_CALLS = "<think>\nWeather needs <tool_call> a city.\n</think>\n\n" + REQUIRED_OUTPUT


@pytest.mark.parametrize("size", [1, 5, len(REASONED_CALLS)])
def test_required_calls_after_the_reasoning_are_read_from_the_answer_whole_and_streamed(size):
    plan = plan_tools(body(tool_choice="required"))
    message, finish = forced_reader(plan, "qwen3", QWEN_PROMPT).message(completion(REASONED_CALLS))
    # Qwen3's <tool_call> would end the reasoning; under the grammar only </think> does.
    assert (message.reasoning_content, message.content, finish) == ("Weather needs <tool_call> a city.", None,
                                                                    "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Par}is"}), ("get_time", {})]
    deltas, stream_finish = streamed(forced_reader(plan, "qwen3", QWEN_PROMPT),
                                     [REASONED_CALLS[i:i + size] for i in range(0, len(REASONED_CALLS), size)])
    whole = joined(deltas)
    assert (whole["reasoning_content"], whole["content"], stream_finish) == (message.reasoning_content, "",
                                                                             "tool_calls")
    assert [(c["name"], c["arguments"]) for c in whole["tool_calls"].values()] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls]


def test_a_named_call_after_the_reasoning_is_its_arguments_and_a_cut_reasoning_calls_nothing():
    plan = plan_tools(body(tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    message, finish = forced_reader(plan, "deepseek_r1").message(completion('Oslo, surely.</think>\n{"city": "Oslo"}'))
    assert (message.reasoning_content, message.content, finish) == ("Oslo, surely.", None, "stop")
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("get_weather",
                                                                                      '{"city": "Oslo"}')]
    cut, cut_finish = forced_reader(plan, "deepseek_r1").message(completion("Still thinking", "length", eos=False))
    assert (cut.reasoning_content, cut.tool_calls, cut_finish) == ("Still thinking", None, "length")


def test_a_response_format_answer_after_the_reasoning_is_the_content():
    params = SamplingParams(structured_outputs={"json": WEATHER})
    output_reader = ChatOutputReader(ChatParsers(None, get_reasoning_parser("qwen3")), ToolPlan(), params,
                                     FakeTokenizer(), QWEN_PROMPT)
    assert output_reader.params.structured_outputs.reasoning_end == "</think>"
    message, finish = output_reader.message(completion('<think>Paris.</think>\n\n{"city": "Paris"}'))
    assert (message.reasoning_content, message.content, finish) == ("Paris.", '{"city": "Paris"}', "stop")
    no_reasoning, _ = output_reader.message(completion('{"city": "Paris"}'))  # skipped: the grammar allows it
    assert (no_reasoning.reasoning_content, no_reasoning.content) == (None, '{"city": "Paris"}')


class SpecialTagsParser(get_reasoning_parser("qwen3")):
    """Tags that are special tokens of SmolLM2's vocabulary, as a family's tags are in some vocabularies."""
    start_tag, end_tag = "<reponame>", "<filename>"


def test_tags_that_are_special_tokens_are_matched_as_those_tokens(engine):
    constraint = after_reasoning(SamplingParams(structured_outputs={"json_object": True}),
                                 SpecialTagsParser(QWEN_PROMPT), engine.tokenizer).structured_outputs
    assert (constraint.reasoning_start, constraint.reasoning_end, constraint.reasoning_tags_are_special_tokens) == (
        "<reponame>", "<filename>", True)
    text = after_reasoning(SamplingParams(structured_outputs={"json_object": True}),
                           get_reasoning_parser("qwen3")(QWEN_PROMPT), engine.tokenizer).structured_outputs
    assert (text.reasoning_end, text.reasoning_tags_are_special_tokens) == ("</think>", False)  # text in SmolLM2's


class MixedTagsParser(get_reasoning_parser("qwen3")):
    start_tag, end_tag = "<reponame>", "</think>"


def test_a_pair_of_one_special_token_and_one_text_tag_leaves_the_constraint_from_the_first_token(engine):
    params = SamplingParams(structured_outputs={"json_object": True})
    assert after_reasoning(params, MixedTagsParser(QWEN_PROMPT), engine.tokenizer) is params


def test_harmony_reads_the_reasoning_itself_under_auto():
    parsers = ChatParsers(get_tool_parser("openai"), get_reasoning_parser("openai"))
    text = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
    output_reader = reader(plan_tools(body()), parsers)
    assert output_reader.reasoning_parser is None  # the tool parser reads the channels
    message, finish = output_reader.message(completion(text, eos=False))
    assert (message.reasoning_content, message.content, finish) == ("Need the weather.", None, "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("get_weather",
                                                                                      '{"city": "Paris"}')]


def test_parsers_keep_special_tokens_and_drop_the_final_eos_from_the_text():
    parsers = ChatParsers(HermesToolParser, None)
    output_reader = reader(plan_tools(body()), parsers, params=SamplingParams())
    assert output_reader.params.skip_special_tokens is False
    message, finish = output_reader.message(completion("Just text."))
    assert (message.content, finish) == ("Just text.", "stop")
    plain = reader(plan_tools(body(tools=None)), parsers, params=SamplingParams())
    assert not plain.active and plain.params.skip_special_tokens is True
