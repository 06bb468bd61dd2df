"""Per-request sampling parameters, with vLLM's names and defaults, validated at construction."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names it."""


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._require(_is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1")
        self._require(_is_number(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0")
        self._require(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        self._require(_is_int(self.top_k) and self.top_k >= 0, "top_k", "must be -1, 0 (disabled) or a positive integer")
        self._require(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        self._require(self.seed is None or _is_int(self.seed), "seed", "must be an integer or None")
        self._require(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
                      "max_tokens", "must be an integer >= 1 or None")
        self._require(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None:
            self._require(self.min_tokens <= self.max_tokens, "min_tokens", "must not exceed max_tokens")
        self._require(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        self._require(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                      "must be non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            self._require(value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS), name,
                          f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            self._require(_is_number(value) and -2 <= value <= 2, name, "must be in [-2, 2]")
        self._require(_is_number(self.repetition_penalty) and self.repetition_penalty > 0,
                      "repetition_penalty", "must be > 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def _require(self, ok: bool, name: str, requirement: str) -> None:
        if not ok:
            raise SamplingParamsError(f"SamplingParams.{name} {requirement} (got {getattr(self, name)!r})")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
