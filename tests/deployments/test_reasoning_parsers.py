"""The reasoning parsers (deployments/openai/reasoning_parsers): each thinking family's output split into
reasoning and answer, with the prompt saying where the output starts; streaming cut anywhere (tags cut across
chunks included) gives the same split; the tags a constraint after the reasoning waits for; the registry and its
`auto` choice."""
from __future__ import annotations

import random

import pytest

from deployments.openai.reasoning_parsers import (REASONING_PARSERS, default_reasoning_parser, get_reasoning_parser,
                                                  reasoning_parser_class, reasoning_parser_names)

QWEN_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
HARMONY_TOOL_CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                     '{"city": "Paris"}<|call|>')

# (parser, label, prompt, chat_template_kwargs, output, reasoning, content)
CASES = [
    ("deepseek_r1", "the template opened <think>", "<｜User｜>Hi<｜Assistant｜><think>\n", None,
     "The user greets.\n</think>\n\nHello!", "The user greets.", "Hello!"),
    ("deepseek_r1", "no prompt: the output starts inside", None, None,
     "Think 1 < 2.</think>Answer", "Think 1 < 2.", "Answer"),
    ("deepseek_r1", "the model repeats <think>", None, None, "<think>\nx\n</think>\ny", "x", "y"),
    ("deepseek_r1", "cut off while thinking", None, None, "Still thinking about <thi", "Still thinking about <thi",
     None),
    ("deepseek_v3", "V3.1 thinking on", "<｜User｜>Hi<｜Assistant｜><think>", None, "ok</think>Hi", "ok", "Hi"),
    ("deepseek_v3", "V3.1 thinking off", "<｜User｜>Hi<｜Assistant｜></think>", None, "Hi </think> there", None,
     "Hi </think> there"),
    ("qwen3", "hybrid, thinking on", QWEN_PROMPT, None, "<think>\nLet me see.\n</think>\n\nHello!", "Let me see.",
     "Hello!"),
    ("qwen3", "hybrid, no reasoning written", QWEN_PROMPT, None, "Hello, no tags here.\n", None,
     "Hello, no tags here.\n"),
    ("qwen3", "enable_thinking false in the prompt", QWEN_PROMPT + "<think>\n\n</think>\n\n", None,
     "<think>not reasoning</think> answer", None, "<think>not reasoning</think> answer"),
    ("qwen3", "enable_thinking false without a prompt", None, {"enable_thinking": False}, "<think>x</think>y",
     None, "<think>x</think>y"),
    ("qwen3", "Qwen3.5: the template opened <think>", QWEN_PROMPT + "<think>\n", None,
     "Reasoning 東京 \"q\"\n</think>\n\nAnswer 🌤", "Reasoning 東京 \"q\"", "Answer 🌤"),
    ("qwen3", "Qwen3.5: a tool call ends the reasoning", QWEN_PROMPT + "<think>\n", None,
     "I need the weather.\n<tool_call>\n<function=get_weather>\n</function>\n</tool_call>", "I need the weather.",
     "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>"),
    ("qwen3", "empty reasoning", QWEN_PROMPT, None, "<think>\n\n</think>\n\nHi", None, "Hi"),
    ("glm45", "GLM-4.5: the model writes <think>", "[gMASK]<sop><|user|>\nHi<|assistant|>", None,
     "<think>Plan.</think>\nDone.", "Plan.", "Done."),
    ("glm45", "GLM-4.7/5: the template opened <think>", "[gMASK]<sop><|user|>Hi<|assistant|><think>", None,
     "Plan.</think>Done.", "Plan.", "Done."),
    ("glm45", "GLM-4.7/5 thinking off", "[gMASK]<sop><|user|>Hi<|assistant|></think>", None, "Done.", None, "Done."),
    ("minimax_m2", "the template opened <think>", "]~b]ai\n<think>\n", None,
     "Check units.\n</think>\n\n3 km", "Check units.", "3 km"),
    ("minimax_m2", "no prompt: the output starts inside", None, None, "a</think>b", "a", "b"),
    ("kimi_k2", "K2-Thinking writes <think>", "<|im_assistant|>assistant<|im_middle|>", None,
     "<think>Hmm.</think>Sure.", "Hmm.", "Sure."),
    ("kimi_k2", "K2-Instruct does not think", "<|im_assistant|>assistant<|im_middle|>", None,
     "Sure ◁think▷ not a tag.", None, "Sure ◁think▷ not a tag."),
    ("kimi_k2", "K2.5 thinking off", "<|im_assistant|>assistant<|im_middle|><think></think>", None, "Sure.", None,
     "Sure."),
    ("kimi_k2", "a tool-call section ends the reasoning", "<|im_assistant|>assistant<|im_middle|><think>", None,
     "Need data<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0", "Need data",
     "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"),
    ("openai", "analysis then final", None, None,
     "<|channel|>analysis<|message|>User asks. 2 < 3.<|end|><|start|>assistant<|channel|>final<|message|>"
     "Yes.<|return|>", "User asks. 2 < 3.", "Yes."),
    ("openai", "a preamble is content, a tool call is not", None, None,
     "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary<|message|>"
     "Checking.<|end|>" + HARMONY_TOOL_CALL, "Need weather.", "Checking."),
    ("openai", "cut off in the analysis", None, None, "<|channel|>analysis<|message|>Hmm <|en", "Hmm <|en", None),
]
IDS = [f"{case[0]}: {case[1]}" for case in CASES]


def make(parser_name: str, prompt, kwargs):
    return get_reasoning_parser(parser_name)(prompt, kwargs)


def streamed(parser_name: str, prompt, kwargs, pieces: list[str]) -> list[tuple[str, str]]:
    parser = make(parser_name, prompt, kwargs)
    return [parser.feed(piece) for piece in pieces] + [parser.finish()]


def joined(deltas: list[tuple[str, str]]) -> tuple[str | None, str | None]:
    return "".join(r for r, _ in deltas) or None, "".join(c for _, c in deltas) or None


@pytest.mark.parametrize("parser_name,label,prompt,kwargs,output,reasoning,content", CASES, ids=IDS)
def test_whole_output_splits_into_reasoning_and_answer(parser_name, label, prompt, kwargs, output, reasoning,
                                                       content):
    assert make(parser_name, prompt, kwargs).parse(output) == (reasoning, content)


@pytest.mark.parametrize("parser_name,label,prompt,kwargs,output,reasoning,content", CASES, ids=IDS)
def test_streaming_cut_at_every_boundary_gives_the_same_split(parser_name, label, prompt, kwargs, output, reasoning,
                                                              content):
    for cut in range(len(output) + 1):
        deltas = streamed(parser_name, prompt, kwargs, [output[:cut], output[cut:]])
        assert joined(deltas) == (reasoning, content), f"cut at {cut}"
    assert joined(streamed(parser_name, prompt, kwargs, list(output))) == (reasoning, content)


@pytest.mark.parametrize("parser_name,label,prompt,kwargs,output,reasoning,content", CASES, ids=IDS)
def test_streaming_in_random_chunks_gives_the_same_split(parser_name, label, prompt, kwargs, output, reasoning,
                                                         content):
    rng = random.Random(output)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(output)), min(len(output) - 1, rng.randint(1, 8))))
        pieces = [output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)])]
        assert joined(streamed(parser_name, prompt, kwargs, pieces)) == (reasoning, content), pieces


def test_reasoning_streams_before_the_answer_is_known():
    parser = make("deepseek_r1", None, None)
    assert parser.feed("Step one. ") == ("Step one.", "")
    assert parser.feed("Step two.</th") == (" Step two.", "")
    assert parser.feed("ink>\n\nAns") == ("", "Ans")
    assert parser.feed("wer") == ("", "wer")
    assert parser.finish() == ("", "")


def test_without_a_reasoning_section_the_answer_is_the_output_exactly():
    text = "  Plain answer\n with </think> inside and trailing space \n"
    for name in ("qwen3", "glm45", "kimi_k2", "deepseek_v3"):
        assert make(name, QWEN_PROMPT, None).parse(text) == (None, text), name


def test_parse_leaves_a_streaming_parser_untouched():
    parser = make("qwen3", QWEN_PROMPT, None)
    assert parser.feed("<think>a") == ("a", "")
    assert parser.parse("<think>x</think>y") == ("x", "y")
    assert parser.feed("b</think>c") == ("b", "c")


# ---- where a constraint starts ----------------------------------------------------------------------------------
# (parser, label, prompt, chat_template_kwargs, reasoning_tags): the same reading of the prompt as the split's
TAG_CASES = [
    ("deepseek_r1", "the template opened <think>", "<｜User｜>Hi<｜Assistant｜><think>\n", None, (None, "</think>")),
    ("deepseek_r1", "no prompt: the output starts inside", None, None, (None, "</think>")),
    ("deepseek_v3", "V3.1 thinking off", "<｜User｜>Hi<｜Assistant｜></think>", None, None),
    ("deepseek_v3", "V3.1/V3.2 thinking switched off", "<｜User｜>Hi<｜Assistant｜>", {"thinking": False}, None),
    ("qwen3", "hybrid: the model may open its reasoning", QWEN_PROMPT, None, ("<think>", "</think>")),
    ("qwen3", "Qwen3.5: the template opened <think>", QWEN_PROMPT + "<think>\n", None, (None, "</think>")),
    ("qwen3", "enable_thinking false in the prompt", QWEN_PROMPT + "<think>\n\n</think>\n\n", None, None),
    ("qwen3", "enable_thinking false without a prompt", None, {"enable_thinking": False}, None),
    ("glm45", "GLM-4.5: the model writes <think>", "[gMASK]<sop><|user|>\nHi<|assistant|>", None,
     ("<think>", "</think>")),
    ("glm45", "GLM-4.7/5 thinking off", "[gMASK]<sop><|user|>Hi<|assistant|></think>", None, None),
    ("minimax_m2", "the template opened <think>", "]~b]ai\n<think>\n", None, (None, "</think>")),
    ("kimi_k2", "K2-Thinking writes <think>", "<|im_assistant|>assistant<|im_middle|>", None,
     ("<think>", "</think>")),
    ("kimi_k2", "K2.5 thinking off", "<|im_assistant|>assistant<|im_middle|><think></think>", None, None),
    ("openai", "harmony channels are no tags", None, None, None),
]


@pytest.mark.parametrize("parser_name,label,prompt,kwargs,tags", TAG_CASES,
                         ids=[f"{case[0]}: {case[1]}" for case in TAG_CASES])
def test_reasoning_tags_say_where_a_constrained_answer_starts(parser_name, label, prompt, kwargs, tags):
    assert make(parser_name, prompt, kwargs).reasoning_tags() == tags


def test_with_end_tag_only_a_familys_implicit_end_stays_reasoning():
    """Under a constraint the grammar lets the reasoning run to </think>: a <tool_call> before it is reasoning."""
    output = "Need the weather.\n<tool_call>\n{}\n</tool_call></think>\n\n[]"
    parser = get_reasoning_parser("qwen3")(QWEN_PROMPT + "<think>\n", None, end_tag_only=True)
    assert parser.parse(output) == ("Need the weather.\n<tool_call>\n{}\n</tool_call>", "[]")
    deltas = [parser.feed(piece) for piece in output] + [parser.finish()]
    assert joined(deltas) == parser.parse(output)


# ---- the registry --------------------------------------------------------------------------------------------
def test_every_thinking_family_has_a_parser_by_vllms_name():
    for name in ("deepseek_r1", "qwen3", "glm45", "minimax_m2", "kimi_k2", "openai"):
        assert name in REASONING_PARSERS


def test_an_unknown_parser_name_is_refused_with_the_names():
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'.*deepseek_r1.*qwen3"):
        get_reasoning_parser("nope")
    assert reasoning_parser_names()[0] == "auto"


R1_TEMPLATE_TAIL = "{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"
V31_TEMPLATE_TAIL = "{% if not thinking %}{{'</think>'}}{% else %}{{'<think>'}}{% endif %}"


@pytest.mark.parametrize("config,template,expected", [
    ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, None, "qwen3"),
    ({"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"}, None, "qwen3"),
    ({"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe"}, None, "qwen3"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}, None, "deepseek_v3"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}, R1_TEMPLATE_TAIL, "deepseek_r1"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}, V31_TEMPLATE_TAIL, "deepseek_v3"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}, "{{ messages }}", None),
    ({"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32"}, None, "deepseek_v3"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2"}, None, "kimi_k2"),
    ({"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe"}, None, "glm45"),
    ({"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa"}, None, "glm45"),
    ({"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2"}, None, "minimax_m2"),
    ({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"}, None, "openai"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, None, None),
    ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}, None, None),
])
def test_auto_picks_the_parser_from_the_model(config, template, expected):
    assert default_reasoning_parser(config, template) == expected
    found = reasoning_parser_class("auto", config, template)
    assert found is (None if expected is None else REASONING_PARSERS[expected])


# ---- harmony's own reader as the oracle, where its vocabulary file is at hand --------------------------------
def test_harmony_reading_agrees_with_openai_harmony():
    harmony = pytest.importorskip("openai_harmony")
    try:
        encoding = harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as exc:  # it downloads o200k_base.tiktoken unless TIKTOKEN_ENCODINGS_BASE holds it
        pytest.skip(f"openai-harmony cannot load its vocabulary here: {exc}")
    messages = [
        harmony.Message.from_role_and_content(harmony.Role.ASSISTANT, "Need weather 2 < 3.").with_channel("analysis"),
        harmony.Message.from_role_and_content(harmony.Role.ASSISTANT, "Checking.").with_channel("commentary"),
        harmony.Message.from_role_and_content(harmony.Role.ASSISTANT, '{"city": "Paris"}').with_channel(
            "commentary").with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
    ]
    tokens = encoding.render_conversation(harmony.Conversation.from_messages(messages))
    text = encoding.decode(tokens).removeprefix("<|start|>assistant")
    parsed = encoding.parse_messages_from_completion_tokens(tokens)
    expected_reasoning = "".join(m.content[0].text for m in parsed if m.channel == "analysis")
    assert make("openai", None, None).parse(text) == (expected_reasoning, "Checking.")
    from deployments.openai.tool_parsers import get_tool_parser
    call = get_tool_parser("openai")().parse(text).calls[0]
    assert (call.name, call.arguments_json) == (parsed[-1].recipient.removeprefix("functions."),
                                                parsed[-1].content[0].text)
