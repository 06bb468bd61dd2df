"""Structured output: constraints on what a request generates (a JSON schema, a regex, a choice list, a grammar),
enforced by masking each step's logits with the tokens the constraint allows next (llguidance)."""
from engine.structured_output.matcher import GrammarMatcher
from engine.structured_output.params import StructuredOutputError, StructuredOutputsParams

__all__ = ["GrammarMatcher", "StructuredOutputError", "StructuredOutputsParams"]
