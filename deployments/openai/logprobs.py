"""The engine's per-position logprobs in OpenAI's two formats: the chat format (a list of tokens with their
top alternatives) and the legacy completions format (parallel lists with character offsets)."""
from __future__ import annotations

from engine.outputs import Logprob, PositionLogprobs

from .responses import CompletionLogprobs, TokenLogprob, TopLogprob

# JSON has no -inf; a token the sampler masked out reports this instead.
MIN_LOGPROB = -9999.0


def _value(logprob: Logprob) -> float:
    return max(logprob.logprob, MIN_LOGPROB)


def _text(logprob: Logprob) -> str:
    return logprob.decoded_token or ""


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(positions: list[PositionLogprobs], token_ids: list[int], num_top: int) -> list[TokenLogprob]:
    """One entry per generated token; `positions` and `token_ids` cover the same tokens."""
    entries = []
    for position, token_id in zip(positions, token_ids):
        chosen = position.get(token_id)
        if chosen is None:  # not expected: the engine always reports the sampled token
            continue
        text = _text(chosen)
        top = sorted((lp for lp in position.values() if lp.rank <= num_top), key=lambda lp: lp.rank)
        entries.append(TokenLogprob(
            token=text, logprob=_value(chosen), bytes=_bytes(text),
            top_logprobs=[TopLogprob(token=_text(lp), logprob=_value(lp), bytes=_bytes(_text(lp))) for lp in top]))
    return entries


class CompletionLogprobsBuilder:
    """Builds the completions format for one choice, piece by piece when streaming; the character offset
    runs on across pieces so that `text_offset` continues from chunk to chunk."""

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer  # decodes tokens that have no logprobs entry (the first prompt token)
        self.offset = 0
        self.current = CompletionLogprobs()

    def extend(self, positions: list[PositionLogprobs | None], token_ids: list[int]) -> None:
        """`positions[i]` is None for a token without context (the first prompt token when echoing)."""
        result = self.current
        for position, token_id in zip(positions, token_ids):
            chosen = position.get(token_id) if position is not None else None
            if chosen is not None:
                text = _text(chosen)
                result.token_logprobs.append(_value(chosen))
                result.top_logprobs.append({_text(lp): _value(lp) for lp in position.values()})
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else ""
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            result.tokens.append(text)
            result.text_offset.append(self.offset)
            self.offset += len(text)

    def take(self) -> CompletionLogprobs:
        """What was added since the last take."""
        result, self.current = self.current, CompletionLogprobs()
        return result
