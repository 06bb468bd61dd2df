"""The engine's side of speculative decoding: after each step, drafts for the requests that decode next
(the scheduler runs them with their newest token in one verify step)."""
from __future__ import annotations

import numpy as np

from engine.core.request import Request, RequestStatus
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import propose_ngram


# Adaptive speculation: a request whose drafts kept fewer than PAUSE_BELOW tokens a step on average over its
# last PAUSE_AFTER_VERIFIES verify steps speculates no more for PAUSE_TOKENS output tokens.
PAUSE_BELOW = 0.1
PAUSE_AFTER_VERIFIES = 4
PAUSE_TOKENS = 32


class Speculator:
    """Sets each running request's drafts after a step: `propose(running, output)`."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

    def num_drafts(self, request: Request) -> int:
        """How many tokens to draft for `request`: num_speculative_tokens, fewer where the request has been
        keeping fewer (adaptive: its mean kept drafts + 1, all again once it keeps them all), and never past
        its max_tokens or the context length (a verify step appends at most drafts + 1 tokens)."""
        k = self.config.num_speculative_tokens
        if self.config.adaptive and request.spec_mean_accepted >= 0:
            if request.spec_mean_accepted < PAUSE_BELOW and request.spec_recent_verifies >= PAUSE_AFTER_VERIFIES:
                # It keeps almost nothing: no drafts (nor, for a model drafter, drafting) for a while, then
                # a one-draft probe.
                request.spec_paused_until = request.num_output_tokens + PAUSE_TOKENS
                request.spec_recent_verifies = 0
            if request.spec_paused:
                return 0
            k = min(k, int(request.spec_mean_accepted) + 1)
        room = min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1
        return max(0, min(k, room))

    def drafting(self, running: list[Request]):
        """The running requests that decode next (their drafts cleared), none while more than
        disable_by_batch_size requests run."""
        limit = self.config.disable_by_batch_size
        enabled = limit is None or len(running) <= limit
        for request in running:
            request.spec_token_ids = []
            if (enabled and request.status is RequestStatus.RUNNING and request.num_tokens_to_compute == 1
                    and not request.num_pending_tokens):
                yield request

    @staticmethod
    def keep(request: Request, drafts: list[int]) -> None:
        """`drafts` become the request's; under a grammar, those its grammar accepts (the step's masks follow
        them: StepGrammar)."""
        if drafts and request.grammar is not None:
            drafts = drafts[:request.grammar.matcher.validate_tokens(drafts)]
        request.spec_token_ids = drafts


class DrafterSpeculator(Speculator):
    """The runner drafts with a model drafter (the MTP layer, an EAGLE3 head) after each step
    (RunnerOutput.draft_token_ids); the requests take as many as they may."""

    def propose(self, running: list[Request], output) -> None:
        drafts = output.draft_token_ids if output is not None else {}
        for request in self.drafting(running):
            k = self.num_drafts(request)
            if k and request.request_id in drafts:
                self.keep(request, drafts[request.request_id][:k])


class NgramSpeculator(Speculator):
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        super().__init__(config, max_model_len)
        # request id -> (its tokens as an array with room to grow, how many are filled): no list -> array
        # conversion of the whole context per step.
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}

    def propose(self, running: list[Request], output=None) -> None:
        """Drafts from each request's own tokens (n-gram lookup)."""
        for request in self.drafting(running):
            k = self.num_drafts(request)
            if k:
                self.keep(request, propose_ngram(self._array(request), self.config.prompt_lookup_min,
                                                 self.config.prompt_lookup_max, k))
        live = {request.request_id for request in running}
        for request_id in [r for r in self._tokens if r not in live]:
            del self._tokens[request_id]

    def _array(self, request: Request) -> np.ndarray:
        array, filled = self._tokens.get(request.request_id, (None, 0))
        tokens = request.token_ids
        if array is None or len(array) < len(tokens):
            grown = np.empty(max(2 * len(tokens), 64), dtype=np.int64)
            if array is not None:
                grown[:filled] = array[:filled]
            array = grown
        if filled > len(tokens):  # not expected (tokens only grow); start over
            filled = 0
        array[filled:len(tokens)] = tokens[filled:]
        self._tokens[request.request_id] = (array, len(tokens))
        return array[:len(tokens)]
