"""The speculative configuration, with vLLM's `speculative_config` names: `method`, `num_speculative_tokens`,
`model`, `prompt_lookup_min` / `prompt_lookup_max` (n-gram), `disable_by_batch_size`."""
from __future__ import annotations

from dataclasses import dataclass, fields

from engine.config import ConfigError

# Methods that are built (and vLLM's other names for them), and the ones vLLM users may name that are not
# (yet): refused by name.
METHODS = ("ngram", "mtp", "eagle3")
ALIASES = {"deepseek_mtp": "mtp"}
NOT_YET = {"eagle": "EAGLE (1/2) drafters", "draft_model": "separate draft models",
           "medusa": "Medusa heads"}
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # a draft checkpoint (EAGLE3): not used by "ngram"
    # n-gram prompt lookup: the longest suffix of a request's tokens (prompt_lookup_max tokens down to
    # prompt_lookup_min) that occurred before proposes the tokens that followed it then.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # No request speculates while more than this many run (speculation costs compute a full batch lacks).
    disable_by_batch_size: int | None = None
    # Per request, the drafts shrink to about what it has been accepting (mean accepted + 1) and grow back
    # when it accepts them all; False keeps num_speculative_tokens.
    adaptive: bool = True

    @classmethod
    def from_value(cls, value) -> "SpeculativeConfig | None":
        """From a SpeculativeConfig, a mapping of its field names (vLLM's `speculative_config`), or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a mapping, not {type(value).__name__}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ConfigError(f"unknown speculative_config field(s) {unknown}; valid ones are {names}")
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise ConfigError(f"speculative_config.{required} is required")
        return cls(**value)

    def __post_init__(self) -> None:
        if self.method in ALIASES:
            object.__setattr__(self, "method", ALIASES[self.method])
        if self.method in NOT_YET:
            raise ConfigError(f"speculative_config.method {self.method!r}: {NOT_YET[self.method]} are not built "
                              f"yet; the methods available are {list(METHODS)}")
        if self.method not in METHODS:
            raise ConfigError(f"speculative_config.method must be one of {list(METHODS)} (got {self.method!r})")
        self._int("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        self._int("prompt_lookup_min", 1)
        self._int("prompt_lookup_max", self.prompt_lookup_min)
        if self.disable_by_batch_size is not None:
            self._int("disable_by_batch_size", 1)
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"speculative_config.adaptive must be true or false (got {self.adaptive!r})")
        if self.method == "ngram" and self.model is not None:
            raise ConfigError("speculative_config.model is not used by method 'ngram' (it drafts from the "
                              "request's own tokens); leave it out")
        if self.method == "eagle3" and not isinstance(self.model, str):
            raise ConfigError("speculative_config.model is required for method 'eagle3': the folder of the EAGLE3 "
                              "draft checkpoint")
        if self.method == "mtp" and self.model is not None:
            raise ConfigError("speculative_config.model is not used by method 'mtp' (it drafts with the "
                              "checkpoint's own multi-token-prediction layer); leave it out")

    @property
    def lookahead_tokens(self) -> int:
        """Cache positions past a step's tokens that its drafting writes (a model drafter's own cache entries
        for drafts 2..k), which the scheduler gives blocks for."""
        return self.num_speculative_tokens if self.method in ("mtp", "eagle3") else 0

    def _int(self, name: str, low: int, high: int | None = None) -> None:
        value = getattr(self, name)
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)
        if not ok:
            bound = f"from {low} to {high}" if high is not None else f">= {low}"
            raise ConfigError(f"speculative_config.{name} must be an integer {bound} (got {value!r})")
