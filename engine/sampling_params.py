"""Per-request sampling parameters, with vLLM's names and defaults, validated at construction.

These bounds are the only ones: the HTTP app, the Python handle and the Serve handle all build a
SamplingParams, so a value one door refuses every door refuses. What depends on the model (token ids inside
the vocabulary) is checked by `check_for_model`, which the engine calls when it takes a request.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from engine.structured_output.params import StructuredOutputError, StructuredOutputsParams

__all__ = ["SamplingParams", "SamplingParamsError", "StructuredOutputsParams"]

MAX_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
# A positive temperature below this is sampled at this temperature: dividing logits by a tinier one
# overflows to inf and the softmax to NaN (vLLM clamps the same way).
MIN_POSITIVE_TEMPERATURE = 1e-2


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (the sampled one is always added)
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    # A constraint on the output (JSON schema, regex, choice, grammar); a mapping of its fields is taken too.
    structured_outputs: StructuredOutputsParams | None = None

    @classmethod
    def from_dict(cls, values: dict) -> "SamplingParams":
        """From a mapping of field names (a handle call's request), refusing names that are not fields."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise SamplingParamsError(f"unknown sampling parameter(s) {unknown}; valid ones are {sorted(names)}",
                                      unknown[0])
        return cls(**values)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._require(self.stop is None or isinstance(self.stop, (list, tuple)), "stop",
                      "must be a string or a list of strings")
        self._require(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)),
                      "stop_token_ids", "must be a list of token ids")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._require(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}]")
        self._require(_is_finite(self.temperature) and self.temperature >= 0, "temperature",
                      "must be a finite number >= 0")
        if 0 < self.temperature < MIN_POSITIVE_TEMPERATURE:
            self.temperature = MIN_POSITIVE_TEMPERATURE
        self._require(_is_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        self._require(_is_int(self.top_k) and 0 <= self.top_k <= INT32_MAX, "top_k",
                      f"must be -1, 0 (disabled) or a positive integer up to {INT32_MAX}")
        self._require(_is_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        self._require(self.seed is None or (_is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX), "seed",
                      "must be None or a 64-bit integer")
        self._require(self.max_tokens is None or (_is_int(self.max_tokens) and 1 <= self.max_tokens <= INT64_MAX),
                      "max_tokens", "must be None or an integer >= 1")
        self._require(_is_int(self.min_tokens) and 0 <= self.min_tokens <= INT64_MAX, "min_tokens",
                      "must be an integer >= 0")
        if self.max_tokens is not None:
            self._require(self.min_tokens <= self.max_tokens, "min_tokens", "must not exceed max_tokens")
        self._require(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"may hold at most {MAX_STOP_STRINGS} strings")
        self._require(all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS and _is_unicode(s)
                          for s in self.stop), "stop",
                      f"must be non-empty strings of valid Unicode, of at most {MAX_STOP_STRING_CHARS} characters")
        self._require(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
                      f"may hold at most {MAX_STOP_TOKEN_IDS} ids")
        self._require(all(_is_int(t) and 0 <= t <= INT32_MAX for t in self.stop_token_ids), "stop_token_ids",
                      "must be non-negative token ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            self._require(value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS), name,
                          f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            self._require(_is_finite(value) and -2 <= value <= 2, name, "must be in [-2, 2]")
        self._require(_is_finite(self.repetition_penalty) and 0 < self.repetition_penalty <= 2**16,
                      "repetition_penalty", "must be a finite number > 0")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            self._require(isinstance(getattr(self, name), bool), name, "must be true or false")
        if self.structured_outputs is not None:
            try:
                self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
            except StructuredOutputError as exc:
                raise SamplingParamsError(str(exc), exc.param) from None

    def check_for_model(self, vocab_size: int) -> None:
        """What depends on the model: token ids inside its vocabulary."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise SamplingParamsError(f"SamplingParams.stop_token_ids {bad[:5]} are outside the vocabulary "
                                      f"[0, {vocab_size})", "stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def _require(self, ok: bool, name: str, requirement: str) -> None:
        if not ok:
            value = repr(getattr(self, name))
            value = value if len(value) <= 80 else value[:77] + "..."
            raise SamplingParamsError(f"SamplingParams.{name} {requirement} (got {value})", name)


def _is_unicode(text: str) -> bool:
    """No lone surrogates: generated text never holds one, and it cannot be sent back as UTF-8."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value) -> bool:
    if _is_int(value):  # any int, however large (math.isfinite would overflow converting it)
        return True
    return isinstance(value, float) and math.isfinite(value)
