"""Continuous-batching scheduler: a token budget per step shared by decodes and (chunked) prefills.

Each step serves, in this order: running decodes (a token each), short prefills (running ones, then
waiting requests admitted in arrival order), then long prefills. When the KV cache is full, the newest
running request not yet scheduled in the step is preempted: its blocks are freed and it goes back to the
front of the queue to be recomputed later. A request with structured output waits (keeping its place, not
holding up the others) until its grammar is compiled; its matcher takes each token it samples, and its
grammar's end ends it.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from engine.core.block_manager import BlockManager, KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler_output import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput
from engine.structured_output.manager import StructuredOutputManager


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    # A prefill with more tokens left than this is "long": short prefills go first, and the oldest long one
    # keeps this many tokens of each step's budget (more when nothing else wants them). None: half the budget.
    long_prefill_token_threshold: int | None = None
    # Cache positions past a step's tokens to give blocks for: a model drafter (MTP, EAGLE3) writes its own
    # entries for drafts 2..k there. Non-zero only with one, which also reads each step's draft_request_ids.
    lookahead_tokens: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager | KVCacheManager,
                 structured_output: StructuredOutputManager | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.structured_output = structured_output
        self.num_constrained = 0  # unfinished requests with a grammar: none, and no step scans for them
        # Prefills with more tokens left than this are long (see schedule); default half the budget.
        self.long_prefill_threshold = (config.long_prefill_token_threshold
                                       or max(1, config.max_num_batched_tokens // 2))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._forget_on_runners: set[str] = set()
        self.num_preemptions = 0
        # Speculative decoding: verify rows (a request's step with drafts), drafts run, drafts kept.
        self.num_spec_verifies = 0
        self.num_spec_draft_tokens = 0
        self.num_spec_accepted_tokens = 0

    # ---- requests in and out -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.num_constrained += request.grammar is not None

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason: str | int | None = None) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        assert status.finished
        request.status, request.stop_reason = status, stop_reason
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.block_manager.free(request)
        self._forget_on_runners.add(request_id)
        if request.grammar is not None:
            request.grammar.cancel()
            self.num_constrained -= 1

    def abort_requests(self, request_ids) -> None:
        for request_id in request_ids:
            self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decodes first (a token each), then prefills: short ones (at most `long_prefill_token_threshold`
        tokens left) before long ones, so that neither a running stream nor a short prompt waits behind a
        long prompt for more than one step. The oldest running long prefill keeps a share of the budget
        (the threshold), so a stream of short prompts cannot starve it."""
        out = SchedulerOutput(finished_request_ids=self._forget_on_runners)
        self._forget_on_runners = set()
        threshold = self.long_prefill_threshold
        self._budget = self.config.max_num_batched_tokens
        decodes, short, long = [], [], []
        for request in self.running:
            num_tokens = request.num_tokens_to_compute
            (decodes if num_tokens <= 1 else short if num_tokens <= threshold else long).append(request)

        preempted = self._schedule_running(decodes, out)
        reserve = min(threshold, self._budget) if long else 0
        self._budget -= reserve
        preempted |= self._schedule_running(short, out)
        if not preempted:
            self._admit_waiting(out, long_ones=False)
        self._budget += reserve
        preempted |= self._schedule_running(long, out)
        if not preempted:
            self._admit_waiting(out, long_ones=True)

        constrained = []
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            request = self.requests[request_id]
            if self.config.lookahead_tokens and not request.spec_paused:  # a model drafter drafts for it
                out.draft_request_ids.add(request_id)
            request.num_computed_tokens += num_tokens
            num_drafts = len(out.spec_token_ids.get(request_id, ()))
            if request.num_computed_tokens == request.num_tokens + request.num_pending_tokens + num_drafts:
                if request.grammar is not None:
                    constrained.append(request)
                request.num_pending_tokens += 1  # this step samples its next token
        if constrained:
            # A row whose previous token is still being sampled (a step launched ahead) needs it in its
            # matcher before its mask: the step waits for the previous one (LLMEngine.step).
            out.structured_output = self.structured_output.step_grammar(
                [r.request_id for r in constrained], [r.grammar.matcher for r in constrained],
                waits_for_previous_step=any(r.num_pending_tokens > 1 for r in constrained),
                drafts=[out.spec_token_ids.get(r.request_id, []) for r in constrained])
        return out

    # ---- structured output ----------------------------------------------------------------------
    def grammars_compiling(self) -> list:
        """The grammars that waiting requests wait for."""
        if not self.num_constrained:
            return []
        return [r.grammar for r in self.waiting if r.grammar is not None and not r.grammar.compiled]

    def take_failed(self) -> list[Request]:
        """The waiting requests whose grammar failed, finished now (each with its `error`)."""
        if not self.num_constrained:
            return []
        failed = [r for r in self.waiting if r.grammar is not None and r.grammar.compiled and r.grammar.error]
        for request in failed:
            request.error = request.grammar.error
            self.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED)
        return failed

    def _advance_grammar(self, request: Request, token_id: int) -> tuple[RequestStatus | None, int | None]:
        """The sampled token into the request's matcher: the grammar's end stops the request."""
        matcher = request.grammar.matcher
        if not matcher.accept_tokens([token_id]):
            request.error = (f"the sampled token {token_id} is not allowed by the request's structured-output "
                             f"grammar: {matcher.error or 'refused'}")
            return RequestStatus.FINISHED_ABORTED, None
        if matcher.is_terminated:
            return RequestStatus.FINISHED_STOPPED, None
        return None, None

    def _schedule_running(self, requests: list[Request], out: SchedulerOutput) -> bool:
        """Schedule running requests in order within the budget. When the KV cache is full, the newest
        request not yet scheduled this step is preempted. Returns whether any was."""
        preempted = False
        for request in requests:
            if self._budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            drafts, request.spec_token_ids = request.spec_token_ids, []
            if request.num_tokens_to_compute != 1 or request.num_pending_tokens:
                drafts = []  # drafts follow the newest token, and only a decode has it as its one input
            num_tokens = min(request.num_tokens_to_compute + len(drafts), self._budget)
            if num_tokens == 0 or request.will_finish_by_length:
                continue
            drafts = drafts[:num_tokens - 1]
            num_old_blocks = [len(group.block_ids) for group in request.groups]
            lookahead = self._lookahead(request.num_computed_tokens + num_tokens)
            while not self.block_manager.allocate(request, num_tokens + lookahead):
                victim = next(r for r in reversed(self.running) if r.request_id not in out.num_scheduled_tokens)
                self.running.remove(victim)
                self._preempt(victim, out)
                preempted = True
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            new_blocks = [group.block_ids[num_old:] for group, num_old in
                          zip(request.groups, num_old_blocks + [0] * (len(request.groups) - len(num_old_blocks)))]
            out.cached_requests.append(CachedRequestData(
                request.request_id, new_blocks[0], request.num_computed_tokens, new_blocks[1:]))
            out.num_scheduled_tokens[request.request_id] = num_tokens
            if drafts:
                out.spec_token_ids[request.request_id] = drafts
            self._budget -= num_tokens
        return preempted

    def _admit_waiting(self, out: SchedulerOutput, long_ones: bool) -> None:
        """Admit waiting requests in arrival order: the short ones (all their tokens within the threshold) or
        one long one, unless a long prefill is under way. A request that cannot be admitted (no blocks, no
        budget) keeps its place. Only the request being admitted has its prefix-cache hit looked up: this
        runs every step, over every waiting request."""
        threshold = self.long_prefill_threshold
        if long_ones and any(r.num_tokens_to_compute > max(threshold, out.num_scheduled_tokens.get(r.request_id, 0))
                             for r in self.running):
            return  # a long prefill is under way and continues next step
        for request in list(self.waiting):
            if self._budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if request.num_pending_tokens or (request.num_tokens > threshold) != long_ones:
                continue  # preempted while a launched step samples for it; or of the other kind
            if request.grammar is not None and (not request.grammar.compiled or request.grammar.error):
                continue  # its grammar is compiling (or failed: take_failed ends it)
            cached = self.block_manager.find_cached_prefix(request)
            num_cached_tokens = len(cached) * self.block_manager.block_size
            num_tokens = request.num_tokens - num_cached_tokens
            if num_tokens > self._budget:
                if not self.config.enable_chunked_prefill:
                    return
                num_tokens = self._budget
            lookahead = self._lookahead(num_cached_tokens + num_tokens)
            if not self.block_manager.allocate(request, num_tokens + lookahead, cached):
                return
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached_tokens
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            out.new_requests.append(NewRequestData(
                request.request_id, list(request.token_ids), request.num_prompt_tokens,
                request.sampling_params, list(request.block_ids), num_cached_tokens,
                [list(group.block_ids) for group in request.groups[1:]],
                -1 if request.state_slot is None else request.state_slot))
            out.num_scheduled_tokens[request.request_id] = num_tokens
            self._budget -= num_tokens
            if long_ones:
                return

    def _lookahead(self, num_tokens_after_step: int) -> int:
        lookahead = self.config.lookahead_tokens
        return max(0, min(lookahead, self.config.max_model_len - num_tokens_after_step)) if lookahead else 0

    def update_from_output(self, scheduled: SchedulerOutput, output: RunnerOutput) -> list[Request]:
        """Append sampled tokens, apply token-level stop conditions, cache newly computed blocks.
        Returns the requests that got a token this step (finished ones included)."""
        for request_id in scheduled.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is not None:
                self.block_manager.cache_computed_blocks(request)
        updated = []
        for request_id, token_ids in zip(output.request_ids, output.sampled_token_ids):
            request = self.requests.get(request_id)
            if request is None:  # finished or aborted while the step ran
                continue
            request.num_pending_tokens -= 1
            drafts = scheduled.spec_token_ids.get(request_id)
            if drafts:
                self._record_verify(request, len(drafts), len(token_ids) - 1)
            updated.append(request)
            for token_id in token_ids:  # the kept drafts end where a stop condition does
                request.append_token(token_id)
                status, reason = self._check_stop(request, token_id)
                if status is None and request.grammar is not None:
                    status, reason = self._advance_grammar(request, token_id)
                if status is not None:
                    self.finish_request(request_id, status, reason)
                    break
        return updated

    def _record_verify(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A verify step kept `num_accepted` of `num_drafts` drafts: the cache positions of the others are
        stale (they are written over as the request goes on; its blocks stay its own)."""
        request.num_computed_tokens -= num_drafts - num_accepted
        self.num_spec_verifies += 1
        self.num_spec_draft_tokens += num_drafts
        self.num_spec_accepted_tokens += num_accepted
        mean = request.spec_mean_accepted
        request.spec_mean_accepted = num_accepted if mean < 0 else 0.7 * mean + 0.3 * num_accepted
        request.spec_recent_verifies += 1

    def spec_stats(self) -> dict:
        """Speculative decoding's counters: verify rows, drafts run and kept, the acceptance rate and the
        mean number of tokens a verify row emits (kept drafts + 1)."""
        return spec_rates({"spec_verifies": self.num_spec_verifies, "spec_draft_tokens": self.num_spec_draft_tokens,
                           "spec_accepted_tokens": self.num_spec_accepted_tokens})

    def _check_stop(self, request: Request, token_id: int) -> tuple[RequestStatus | None, int | None]:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token_id
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """`request` has left `running`: free its blocks and put it first in line to be recomputed."""
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.spec_token_ids = []
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.finished_request_ids.add(request.request_id)
        out.num_scheduled_tokens.pop(request.request_id, None)


def spec_rates(counters: dict) -> dict:
    """`counters` (spec_verifies, spec_draft_tokens, spec_accepted_tokens: one engine's, or sums over DP
    ranks) with the rates that follow from them."""
    verifies, drafts, accepted = (counters["spec_verifies"], counters["spec_draft_tokens"],
                                  counters["spec_accepted_tokens"])
    return {**counters, "spec_acceptance_rate": accepted / drafts if drafts else 0.0,
            "spec_mean_accepted_length": 1 + accepted / verifies if verifies else 0.0}
