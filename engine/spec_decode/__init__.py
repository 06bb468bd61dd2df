"""Speculative decoding: a drafter proposes a few tokens per running request, one verify step scores them all
with the target model, and the longest prefix the target agrees with is kept, plus one token of its own."""
from engine.spec_decode.config import SpeculativeConfig  # noqa: F401
