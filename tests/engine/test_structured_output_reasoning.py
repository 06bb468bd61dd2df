"""Structured output after a thinking model's reasoning (StructuredOutputsParams.reasoning_start / reasoning_end):
free text up to the end tag, then the constraint unchanged, on the packaged SmolLM2's tokenizer and end to end."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from engine import SamplingParams
from engine.structured_output import StructuredOutputError, StructuredOutputsParams
from structured_output_testing import compiled, manager  # noqa: F401  (manager: a fixture)

ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}
THINK = {"reasoning_end": "</think>"}  # the output starts inside the reasoning
MAY_THINK = {"reasoning_start": "<think>", "reasoning_end": "</think>"}  # it may open it, or answer at once


@pytest.fixture(scope="module")
def encode(smollm2):
    tokenizer = smollm2.get_tokenizer()
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def completes(matcher, token_ids: list[int]) -> bool:
    """Whether the matcher takes `token_ids` and they end a sentence of its grammar."""
    return matcher.accept_tokens(token_ids) and matcher.is_accepting


def allows_end_of_sequence(manager, matcher) -> bool:
    bitmask = manager.fill([matcher])[0]
    bits = ((bitmask.unsqueeze(1) >> torch.arange(32)) & 1).flatten()[:manager.vocab_size]
    return any(bits[token] for token in manager.eos_token_ids)


# ---- the grammar ------------------------------------------------------------------------------------------------
def test_reasoning_with_angle_brackets_runs_to_the_end_tag_then_the_schema_holds(manager, encode):
    text = 'Is 1 < 2? Tags like <b> and </ or </thinking are text.\n</think>\n\n{"answer": "yes"}'
    assert completes(compiled(manager, json=ANSWER, **THINK), encode(text))
    refused = compiled(manager, json=ANSWER, **THINK)
    assert not refused.accept_tokens(encode('x</think>{"answer": "maybe"}')) and refused.error


def test_json_before_the_end_tag_is_still_reasoning(manager, encode):
    matcher = compiled(manager, json=ANSWER, **THINK)
    assert matcher.accept_tokens(encode('{"answer": "yes"}'))
    assert not matcher.is_accepting and not allows_end_of_sequence(manager, matcher)


def test_with_a_start_tag_the_output_reasons_or_answers_at_once(manager, encode):
    assert completes(compiled(manager, json=ANSWER, **MAY_THINK), encode('<think>\nHmm.\n</think>\n\n{"answer": "no"}'))
    assert completes(compiled(manager, json=ANSWER, **MAY_THINK), encode('{"answer": "no"}'))
    assert not compiled(manager, json=ANSWER, **MAY_THINK).accept_tokens(encode('Hmm.</think>{"answer": "no"}'))


@pytest.mark.parametrize("constraint, answer", [
    ({"json_object": True}, '{"a": [1, 2]}'),
    ({"regex": "[0-9]{2} apples"}, "12 apples"),
    ({"choice": ["Paris", "Rome"]}, "Rome"),
    ({"grammar": 'start: "ab"+'}, "abab"),
    ({"grammar": 'root ::= "x" [0-9]'}, "x7"),  # GBNF
])
def test_every_kind_of_constraint_follows_the_reasoning_unchanged(manager, encode, constraint, answer):
    assert completes(compiled(manager, **constraint, **THINK), encode(f"Thinking {answer}?</think>{answer}"))
    matcher = compiled(manager, **constraint, **THINK)
    assert not matcher.accept_tokens(encode("Thinking.</think>~~~")) and matcher.error


def test_a_few_whitespace_characters_may_sit_between_the_end_tag_and_the_answer(manager, encode):
    assert completes(compiled(manager, choice=["yes"], **THINK), encode("a</think> \n\nyes"))
    assert not compiled(manager, choice=["yes"], **THINK).accept_tokens(encode("a</think>" + "\n" * 12 + "yes"))


@pytest.mark.parametrize("tag, look_alike", [("◁/think▷", "◁think▷"), ("[END.]", "[ENDx]"), ("a/b\\c", "a/bc")])
def test_tags_are_matched_as_written_whatever_their_characters(manager, encode, tag, look_alike):
    assert completes(compiled(manager, choice=["ok"], reasoning_end=tag), encode(f"x{look_alike}y{tag}ok"))
    look_alike_only = compiled(manager, choice=["ok"], reasoning_end=tag)
    assert look_alike_only.accept_tokens(encode(f"x{look_alike}ok")) and not look_alike_only.is_accepting


def test_special_token_tags_are_matched_as_those_tokens_only(manager, encode):
    """SmolLM2's <reponame> and <filename> are special tokens: spelled in text they are reasoning."""
    tags = {"reasoning_start": "<reponame>", "reasoning_end": "<filename>", "reasoning_tags_are_special_tokens": True}
    assert encode("<filename>") != encode("<file") + encode("name>")
    assert completes(compiled(manager, json=ANSWER, **tags), encode('<reponame>Hm.<filename>{"answer": "yes"}'))
    spelled = compiled(manager, json=ANSWER, **tags)
    spelled_text = encode("<reponame>Hm.") + encode("<file") + encode("name>") + encode('{"answer": "yes"}')
    assert spelled.accept_tokens(spelled_text) and not spelled.is_accepting  # still reasoning
    as_text = compiled(manager, json=ANSWER, reasoning_end="<filename>")
    assert not as_text.accept_tokens(encode("Hm.<filename>"))  # a special token is no text: the grammar refuses it


# ---- the parameters ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, param", [
    ({"reasoning_start": "<think>"}, "structured_outputs.reasoning_start"),
    ({"reasoning_end": ""}, "structured_outputs.reasoning_end"),
    ({"reasoning_end": 7}, "structured_outputs.reasoning_end"),
    ({"reasoning_start": "", "reasoning_end": "</think>"}, "structured_outputs.reasoning_start"),
    ({"reasoning_tags_are_special_tokens": True}, "structured_outputs.reasoning_tags_are_special_tokens"),
    ({"reasoning_end": "</think>", "reasoning_tags_are_special_tokens": "yes"},
     "structured_outputs.reasoning_tags_are_special_tokens"),
    ({"reasoning_end": "end of thought", "reasoning_tags_are_special_tokens": True},
     "structured_outputs.reasoning_end"),
])
def test_bad_reasoning_fields_are_refused_naming_the_field(fields, param):
    with pytest.raises(StructuredOutputError) as raised:
        StructuredOutputsParams(json=ANSWER, **fields)
    assert raised.value.param == param


def test_a_bad_constraint_is_named_before_the_reasoning():
    with pytest.raises(StructuredOutputError) as raised:
        StructuredOutputsParams(regex="[a-", **THINK)
    assert raised.value.param == "structured_outputs.regex"


def test_the_reasoning_is_part_of_the_grammars_cache_key(manager):
    plain, thinking = StructuredOutputsParams(json=ANSWER), StructuredOutputsParams(json=ANSWER, **THINK)
    assert plain.constraint_key == thinking.constraint_key and plain.key != thinking.key
    assert StructuredOutputsParams(json=ANSWER, **MAY_THINK).key != thinking.key
    first, second = compiled(manager, json=ANSWER), compiled(manager, json=ANSWER, **THINK)
    assert first.llmatcher is not second.llmatcher


# ---- end to end -------------------------------------------------------------------------------------------------
# Two worked examples, so that greedy SmolLM2 closes its reasoning quickly.
FEW_SHOT = ('Q: Is Paris in France?\n<think>Paris is the capital of France.</think>{"answer": "yes"}\n'
            'Q: Is Rome in Spain?\n<think>Rome is in Italy.</think>{"answer": "no"}\n'
            'Q: Is Berlin in Germany?\n')


@pytest.mark.parametrize("prompt, tags", [(FEW_SHOT + "<think>", THINK), (FEW_SHOT, MAY_THINK)],
                         ids=["the prompt opened the reasoning", "the output may open it"])
def test_greedy_smollm2_reasons_then_answers_json_that_validates(smollm2, prompt, tags):
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs={"json": ANSWER, **tags})
    output = smollm2.generate([prompt], params)[0].outputs[0]
    assert output.finish_reason == "stop", output.text
    reasoning, separator, answer = output.text.partition("</think>")
    assert separator and reasoning.strip(), output.text
    jsonschema.validate(json.loads(answer), ANSWER)


def test_an_output_cut_in_its_reasoning_ends_with_length(smollm2):
    params = SamplingParams(temperature=0, max_tokens=3, structured_outputs={"json": ANSWER, **THINK})
    output = smollm2.generate(["Let me think about it step by step:"], params)[0].outputs[0]
    assert output.finish_reason == "length" and "</think>" not in output.text
