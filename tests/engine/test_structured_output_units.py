"""Structured output's pieces on their own: the constraint's checks, the grammar matcher (rollback included), the
token-mask op, and the compile cache."""
from __future__ import annotations

import pickle

import pytest
import torch

from engine import SamplingParams, SamplingParamsError
from engine.kernels.sampling import apply_token_bitmask
from engine.layers.sampler import apply_bitmask
from engine.sampling_params import StructuredOutputsParams
from engine.structured_output import StructuredOutputError
from engine.structured_output.grammar import unenforced_keywords, without_additional_properties
from structured_output_testing import compiled, manager  # noqa: F401  (manager: a fixture)


def allowed_tokens(manager, matcher) -> set[int]:
    bitmask = manager.fill([matcher])[0]
    bits = ((bitmask.unsqueeze(1) >> torch.arange(32)) & 1).flatten()[:manager.vocab_size]
    return set(torch.nonzero(bits).flatten().tolist())


# ---- the constraint's checks --------------------------------------------------------------------------------
@pytest.mark.parametrize("constraint, param, words", [
    ({"json": {"type": "object"}, "regex": "a"}, "structured_outputs.regex", "exactly one"),
    ({}, "structured_outputs.json", "got none"),
    ({"json": {"type": "objekt"}}, "structured_outputs.json", "objekt"),
    ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
    ({"json": {"type": "array", "uniqueItems": True}}, "structured_outputs.json", "uniqueItems"),
    ({"json": {"properties": {"a": {"type": "string", "nullable": True}}}}, "structured_outputs.json", "nullable"),
    ({"regex": "[a-"}, "structured_outputs.regex", "unclosed character class"),
    ({"grammar": "start: foo"}, "structured_outputs.grammar", "unknown name"),
    ({"choice": []}, "structured_outputs.choice", "non-empty"),
    ({"regex": "a+", "whitespace_pattern": " "}, "structured_outputs.whitespace_pattern", "json"),
])
def test_a_bad_constraint_is_refused_naming_the_problem(constraint, param, words):
    with pytest.raises(SamplingParamsError, match=words) as raised:
        SamplingParams(structured_outputs=constraint)
    assert raised.value.param == param
    assert isinstance(raised.value, ValueError)


def test_a_mapping_becomes_structured_outputs_params():
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    assert SamplingParams.from_dict({"structured_outputs": {"regex": "a+"}}).structured_outputs.kind == "regex"


def test_keywords_the_library_would_ignore_are_found_where_they_are():
    schema = {"type": "object", "properties": {"a": {"anyOf": [{"type": "string", "nullable": True}]}},
              "enum": [{"nullable": True}]}  # inside data, the word is not a keyword
    assert unenforced_keywords(schema) == [("/properties/a/anyOf/0", "nullable")]


def test_disable_additional_properties_closes_every_object_that_says_nothing():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}},
                                               "b": {"type": "object", "additionalProperties": True}}}
    closed = without_additional_properties(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["b"]["additionalProperties"] is True
    assert "additionalProperties" not in schema  # the caller's schema is untouched


# ---- the matcher ------------------------------------------------------------------------------------------------
def test_rolling_back_k_tokens_restores_the_earlier_state(manager, smollm2):
    tokenizer = smollm2.get_tokenizer()
    matcher = compiled(manager, json={"type": "object", "properties": {"city": {"type": "string"}},
                                      "required": ["city"], "additionalProperties": False})
    start = allowed_tokens(manager, matcher)
    prefix = tokenizer.encode('{"city": "Par', add_special_tokens=False)
    assert matcher.accept_tokens(prefix[:2])
    middle = allowed_tokens(manager, matcher)
    assert matcher.accept_tokens(prefix[2:])
    assert matcher.num_accepted == len(prefix)
    matcher.rollback(len(prefix) - 2)
    assert allowed_tokens(manager, matcher) == middle
    matcher.rollback(2)
    assert allowed_tokens(manager, matcher) == start and matcher.num_accepted == 0
    # A rolled-back matcher takes another continuation, to the end.
    assert matcher.accept_tokens(tokenizer.encode('{"city": "Rome"}', add_special_tokens=False))
    assert matcher.is_accepting
    with pytest.raises(ValueError, match="roll back"):
        matcher.rollback(matcher.num_accepted + 1)


def test_validate_tokens_counts_the_acceptable_prefix_without_moving(manager, smollm2):
    tokenizer = smollm2.get_tokenizer()
    matcher = compiled(manager, regex="[0-9]+ apples")
    tokens = tokenizer.encode("12 apples", add_special_tokens=False) + tokenizer.encode("!", add_special_tokens=False)
    assert matcher.validate_tokens(tokens) == len(tokens) - 1
    assert matcher.num_accepted == 0 and not matcher.is_accepting


def test_a_refused_token_puts_the_matcher_in_error(manager, smollm2):
    matcher = compiled(manager, choice=["yes", "no"])
    assert not matcher.accept_tokens(smollm2.get_tokenizer().encode("maybe", add_special_tokens=False))
    assert matcher.error


def test_a_finished_choice_allows_only_the_end_of_sequence(manager, smollm2):
    matcher = compiled(manager, choice=["Paris", "London"])
    assert matcher.accept_tokens(smollm2.get_tokenizer().encode("Paris", add_special_tokens=False))
    assert matcher.is_terminated
    assert allowed_tokens(manager, matcher) == set(smollm2.engine.eos_token_ids)


def test_each_request_gets_its_own_matcher_from_one_cached_grammar(manager):
    first = compiled(manager, regex="(ab)+")
    hits = manager.grammars.hits
    second = compiled(manager, regex="(ab)+")
    assert manager.grammars.hits == hits + 1
    assert first is not second and first.llmatcher is not second.llmatcher


def test_a_huge_constraint_is_compiled_but_not_cached(manager):
    regex = "(" + "|".join(f"option-{i:05d}" for i in range(6000)) + ")"  # about 80 KB of constraint
    cached = len(manager.grammars)
    matcher = compiled(manager, regex=regex)
    assert len(manager.grammars) == cached
    assert matcher.validate_tokens([]) == 0 and not matcher.is_accepting


def test_a_grammar_the_tokenizer_cannot_serve_fails_its_request(manager):
    grammar = manager.request(StructuredOutputsParams(grammar='start: "a" <|no_such_token|>'))
    with pytest.raises(StructuredOutputError, match="no_such_token"):
        grammar._future.result(timeout=60)
    assert grammar.compiled and "no_such_token" in grammar.error


def test_a_plan_sent_to_other_ranks_carries_its_masks_filled(manager, smollm2):
    """Tensor-parallel peers get the plan pickled: its StepGrammar arrives with the leader's masks."""
    first, second = compiled(manager, choice=["Paris", "Rome"]), compiled(manager, regex="[0-9]+")
    step = manager.step_grammar(["a", "b"], [first, second], waits_for_previous_step=False)
    peer = pickle.loads(pickle.dumps(step))
    assert torch.equal(peer.bitmask(), manager.fill([first, second]))
    bitmask, rows = peer.rows_for(["free", "b"])
    assert rows == [1] and torch.equal(bitmask, step.bitmask()[1:])


# ---- the mask op ------------------------------------------------------------------------------------------------
def test_bitmask_masks_only_the_listed_rows_and_the_tokens_past_the_mask():
    torch.manual_seed(0)
    vocab, width = 70, 2  # the mask covers 64 tokens: 64..69 are masked whatever the bits say
    logits = torch.randn(5, vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, width), dtype=torch.int32)
    rows = [3, 1]
    expected = logits.clone()
    for mask_row, row in enumerate(rows):
        for token in range(vocab):
            word = token // 32
            if word >= width or not (int(bitmask[mask_row, word]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    apply_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)


def test_an_all_ones_mask_leaves_its_row_exact():
    logits = torch.randn(2, 64)
    before = logits.clone()
    apply_token_bitmask(logits, torch.full((2, 2), -1, dtype=torch.int32))
    assert torch.equal(logits, before)
