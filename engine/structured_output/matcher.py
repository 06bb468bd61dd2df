"""One sequence's place in its grammar: advanced by each token it samples, rolled back for speculative steps,
and the source of its next token mask."""
from __future__ import annotations

import torch


class GrammarMatcher:
    """Wraps an llguidance LLMatcher, which never raises on a bad token: it enters an error state, which
    `error` reports (and `accept_tokens` returns False)."""

    def __init__(self, matcher) -> None:
        self._matcher = matcher
        self.num_accepted = 0  # tokens consumed so far, rollbacks deducted

    @property
    def llmatcher(self):
        return self._matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance by `token_ids`; False (and the matcher in its error state) if the grammar refuses one."""
        if not self._matcher.consume_tokens(list(token_ids)):
            return False
        self.num_accepted += len(token_ids)
        return True

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order, the grammar would accept from here (the state does not change)."""
        return self._matcher.validate_tokens(list(token_ids))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (a speculative step's rejected drafts)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_accepted} were accepted")
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"the grammar matcher could not roll back {num_tokens} tokens: {self.error}")
        self.num_accepted -= num_tokens

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and takes no further token but the end of sequence (or the matcher failed)."""
        return self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """What was accepted so far is a complete sentence of the grammar."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """The allowed next tokens into `bitmask[row]` (bit t of word t // 32 set: token t allowed)."""
        from llguidance.torch import fill_next_token_bitmask
        fill_next_token_bitmask(self._matcher, bitmask, row)
