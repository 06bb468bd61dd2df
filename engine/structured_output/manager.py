"""The engine's structured-output service: grammars compiled off the step loop (a thread pool; a request waits in
the scheduler until its grammar is ready, others do not), a bounded cache of compiled grammars keyed by the
constraint, and each step's token masks filled on the host while the device runs the forward pass.

Matchers live with the scheduler's requests (engine/core/request.py) and advance with each token the
scheduler appends; the runner only sees a step's masks (StepGrammar), which travel with the plan to the other
ranks of a tensor-parallel group."""
from __future__ import annotations

import concurrent.futures
import logging
import threading

import torch

from engine.structured_output.cache import LRUCache
from engine.structured_output.grammar import grammar_text
from engine.structured_output.matcher import GrammarMatcher
from engine.structured_output.params import StructuredOutputError, StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
COMPILE_THREADS = 2


class GrammarRequest:
    """One sequence's grammar: compiling, then ready (its own matcher) or failed (the error). `delivered`: the
    output tokens a resumed sequence already has (engine/resume.py), which its matcher takes once ready."""

    def __init__(self, future: concurrent.futures.Future, delivered: tuple[int, ...] = ()) -> None:
        self._future = future
        self._delivered = tuple(delivered)
        self.matcher: GrammarMatcher | None = None
        self.error: str | None = None
        self.waited = False  # whether the engine has held a step for it once (LLMEngine.step)

    @property
    def compiled(self) -> bool:
        """Whether compiling has ended, well (`matcher`) or not (`error`). Called on the step thread."""
        if self.matcher is None and self.error is None and self._future.done():
            try:
                matcher = self._future.result()
            except Exception as exc:  # the constraint, or the tokenizer, could not be used
                self.error = str(exc) if isinstance(exc, StructuredOutputError) else \
                    f"the grammar could not be compiled: {type(exc).__name__}: {exc}"
                return True
            if self._delivered and not matcher.accept_tokens(list(self._delivered)):
                self.error = (f"the grammar refuses the {len(self._delivered)} tokens the resumed request had "
                              f"already generated: {matcher.error or 'refused'}")
                return True
            self.matcher = matcher
        return self.matcher is not None or self.error is not None

    def cancel(self) -> None:
        self._future.cancel()


def wait_for(grammars: list[GrammarRequest], timeout_s: float, any_of: bool = False) -> None:
    """Block until `grammars` (or one of them) have compiled, or `timeout_s` has passed."""
    concurrent.futures.wait([g._future for g in grammars], timeout_s,
                            concurrent.futures.FIRST_COMPLETED if any_of else concurrent.futures.ALL_COMPLETED)


class StepGrammar:
    """The token masks of one step's rows that sample under a grammar: filled in the manager's mask thread
    (`start`, while the forward pass runs), then read by the runner (`rows_for`). A plan that crosses to other
    ranks carries the filled masks (pickling fills them), so every rank samples the same tokens."""

    def __init__(self, manager: "StructuredOutputManager", request_ids: list[str],
                 matchers: list[GrammarMatcher], waits_for_previous_step: bool,
                 drafts: list[list[int]] | None = None) -> None:
        self.request_ids = request_ids
        # Speculative decoding: a request's drafts (the grammar accepts them all) add a mask row each, the
        # mask after the drafts before it (the matcher takes them and gives them back while filling).
        self.drafts = drafts or [[] for _ in request_ids]
        # Whether some row's previous token is still being sampled: its matcher must take that token first, so
        # the engine collects the previous step before launching this one.
        self.waits_for_previous_step = waits_for_previous_step
        self._manager, self._matchers = manager, matchers
        self._future: concurrent.futures.Future | None = None
        self._bitmask: torch.Tensor | None = None

    def start(self) -> None:
        """Begin filling the masks in the background (idempotent)."""
        if self._bitmask is None and self._future is None:
            self._future = self._manager.fill_async(self._matchers, self.drafts)

    def bitmask(self) -> torch.Tensor:
        """[rows, ceil(vocab / 32)] int32 on the host, 1 + drafts rows per request id (waits for the fill)."""
        if self._bitmask is None:
            self.start()
            self._bitmask = self._future.result()
            self._future, self._matchers = None, None
        return self._bitmask

    def rows_for(self, request_ids: list[str]) -> tuple[torch.Tensor, list[int]] | None:
        """The masks of those of `request_ids` (a step's sampling rows, in order: a verify step's request once
        per sampled position) that have one, and their positions in `request_ids`; None when none has."""
        first, row = {}, 0
        for request_id, drafts in zip(self.request_ids, self.drafts):
            first[request_id] = row
            row += 1 + len(drafts)
        taken: dict[str, int] = {}
        pairs = []
        for position, request_id in enumerate(request_ids):
            if request_id in first:
                pairs.append((position, first[request_id] + taken.get(request_id, 0)))
                taken[request_id] = taken.get(request_id, 0) + 1
        if not pairs:
            return None
        bitmask = self.bitmask()
        mask_rows = [row for _, row in pairs]
        if mask_rows != list(range(bitmask.shape[0])):
            bitmask = bitmask[mask_rows]
        return bitmask, [position for position, _ in pairs]

    def __getstate__(self) -> dict:
        return {"request_ids": self.request_ids, "waits_for_previous_step": self.waits_for_previous_step,
                "drafts": self.drafts, "bitmask": self.bitmask()}

    def __setstate__(self, state: dict) -> None:
        self.request_ids, self.waits_for_previous_step = state["request_ids"], state["waits_for_previous_step"]
        self.drafts = state["drafts"]
        self._bitmask, self._manager, self._matchers, self._future = state["bitmask"], None, None, None


class StructuredOutputManager:
    """One per engine. `tokenizer` is the engine's (None: a model without one, which refuses constraints)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int],
                 max_cached_grammars: int = MAX_CACHED_GRAMMARS) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.bitmask_width = (vocab_size + 31) // 32
        self.grammars: LRUCache = LRUCache(max_cached_grammars)  # constraint key -> template LLMatcher
        self._compile_pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, "grammar-compile")
        self._mask_pool = concurrent.futures.ThreadPoolExecutor(1, "grammar-mask")
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._ll_executor = None
        self.num_compiled = 0

    # ---- compiling, off the step loop ---------------------------------------------------------------------
    def request(self, params: StructuredOutputsParams, delivered: tuple[int, ...] = ()) -> GrammarRequest:
        """`params`'s matcher for one sequence: at once from a cached grammar, else compiled in the pool while
        the request waits in the scheduler. `delivered`: a resumed sequence's tokens so far, taken first."""
        if self.tokenizer is None:
            raise StructuredOutputError("structured output needs the model's tokenizer, and this model has none "
                                        "(dummy weights from a bare config)", "structured_outputs")
        template = self.grammars.get(params.key) if params.cacheable else None
        if template is None:
            return GrammarRequest(self._compile_pool.submit(self._new_matcher, params), delivered)
        ready = concurrent.futures.Future()
        ready.set_result(GrammarMatcher(template.deep_copy()))  # microseconds
        return GrammarRequest(ready, delivered)

    def _new_matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        if not params.cacheable:
            return GrammarMatcher(self._compile(params))
        template = self.grammars.get_or_make(params.key, lambda: self._compile(params))
        return GrammarMatcher(template.deep_copy())

    def _compile(self, params: StructuredOutputsParams):
        from llguidance import LLMatcher
        matcher = LLMatcher(self._tokenizer(), grammar_text(params), log_level=0)
        if matcher.is_error():
            param = f"structured_outputs.{params.kind}"
            raise StructuredOutputError(f"{param} cannot be used with this model's tokenizer: "
                                        f"{matcher.get_error().strip()}", param)
        self.num_compiled += 1
        return matcher

    def _tokenizer(self):
        """llguidance's view of the vocabulary, built on first use (about a second for a 50k vocabulary)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf
                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self.tokenizer.hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
                except ValueError as exc:  # a slow (Python) tokenizer
                    raise StructuredOutputError(f"structured output is not available for this model: {exc}",
                                                "structured_outputs") from None
            return self._ll_tokenizer

    # ---- a step's masks -------------------------------------------------------------------------------------
    def step_grammar(self, request_ids: list[str], matchers: list[GrammarMatcher],
                     waits_for_previous_step: bool, drafts: list[list[int]] | None = None) -> StepGrammar:
        return StepGrammar(self, request_ids, matchers, waits_for_previous_step, drafts)

    def fill_async(self, matchers: list[GrammarMatcher], drafts: list[list[int]] | None = None
                   ) -> concurrent.futures.Future:
        return self._mask_pool.submit(self.fill, matchers, drafts)

    def fill(self, matchers: list[GrammarMatcher], drafts: list[list[int]] | None = None) -> torch.Tensor:
        """The next-token masks of `matchers`: a row each, filled in parallel (llguidance's executor), then a
        row after each of a matcher's `drafts` (which it takes one by one, then gives back). A failed matcher's
        rows allow every token: its request is being failed."""
        from llguidance import LLExecutor
        from llguidance.torch import fill_next_token_bitmask_par
        if self._ll_executor is None:
            self._ll_executor = LLExecutor()
        drafts = drafts or [[] for _ in matchers]
        firsts = [0]
        for request_drafts in drafts:
            firsts.append(firsts[-1] + 1 + len(request_drafts))
        bitmask = torch.full((firsts[-1], self.bitmask_width), -1, dtype=torch.int32)
        rows = [(m.llmatcher, firsts[i]) for i, m in enumerate(matchers) if m.error is None]
        if rows:
            fill_next_token_bitmask_par(self._ll_executor, rows, bitmask)
        for matcher, request_drafts, first in zip(matchers, drafts, firsts):
            taken = 0
            for j, token_id in enumerate(request_drafts):
                if matcher.error is not None or not matcher.accept_tokens([token_id]):
                    break  # the rest of its rows allow every token (its drafts were validated: not expected)
                taken += 1
                matcher.fill_bitmask(bitmask, first + 1 + j)
            if taken and matcher.error is None:
                matcher.rollback(taken)
        return bitmask

    def stats(self) -> dict:
        return {"structured_output_grammars_cached": len(self.grammars),
                "structured_output_grammar_cache_hits": self.grammars.hits,
                "structured_output_grammars_compiled": self.num_compiled}

    def shutdown(self) -> None:
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._mask_pool.shutdown(wait=False, cancel_futures=True)
