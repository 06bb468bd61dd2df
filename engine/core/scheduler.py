"""Continuous-batching scheduler: a token budget per step shared by decodes and (chunked) prefills.

Each step first serves running requests oldest first (a decode needs one token, an unfinished prefill its
next chunk), then admits waiting requests. When the KV cache is full, the newest running request is
preempted: its blocks are freed and it goes back to the front of the queue to be recomputed later.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from engine.core.block_manager import BlockManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler_output import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._forget_on_runners: set[str] = set()
        self.num_preemptions = 0

    # ---- requests in and out -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        self.waiting.append(request)

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
        out = SchedulerOutput(finished_request_ids=self._forget_on_runners)
        self._forget_on_runners = set()
        budget = self.config.max_num_batched_tokens
        preempted = False

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_tokens = min(request.num_tokens_to_compute, budget)
            if num_tokens == 0 or request.will_finish_by_length:
                index += 1
                continue
            num_old_blocks = len(request.block_ids)
            while not self.block_manager.allocate(request, num_tokens):
                victim = self.running.pop()
                self._preempt(victim, out)
                preempted = True
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            out.cached_requests.append(CachedRequestData(
                request.request_id, request.block_ids[num_old_blocks:], request.num_computed_tokens))
            out.num_scheduled_tokens[request.request_id] = num_tokens
            budget -= num_tokens
            index += 1

        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            if request.num_pending_tokens:  # preempted while a launched step samples for it
                break
            cached = self.block_manager.find_cached_prefix(request)
            num_cached_tokens = len(cached) * self.block_manager.block_size
            num_tokens = request.num_tokens - num_cached_tokens
            if num_tokens > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_tokens = budget
            if not self.block_manager.allocate(request, num_tokens, cached):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached_tokens
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            out.new_requests.append(NewRequestData(
                request.request_id, list(request.token_ids), request.num_prompt_tokens,
                request.sampling_params, list(request.block_ids), num_cached_tokens))
            out.num_scheduled_tokens[request.request_id] = num_tokens
            budget -= num_tokens

        for request_id, num_tokens in out.num_scheduled_tokens.items():
            request = self.requests[request_id]
            request.num_computed_tokens += num_tokens
            if request.num_computed_tokens == request.num_tokens + request.num_pending_tokens:
                request.num_pending_tokens += 1  # this step samples its next token
        return out

    def update_from_output(self, scheduled: SchedulerOutput, output: RunnerOutput) -> list[Request]:
        """Append sampled tokens, apply token-level stop conditions, cache newly computed blocks.
        Returns the requests that got a token this step (finished ones included)."""
        for request_id in scheduled.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is not None:
                self.block_manager.cache_computed_blocks(request)
        updated = []
        for request_id, token_id in zip(output.request_ids, output.sampled_token_ids):
            request = self.requests.get(request_id)
            if request is None:  # finished or aborted while the step ran
                continue
            request.num_pending_tokens -= 1
            request.append_token(token_id)
            updated.append(request)
            status, reason = self._check_stop(request, token_id)
            if status is not None:
                self.finish_request(request_id, status, reason)
        return updated

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
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.finished_request_ids.add(request.request_id)
        out.num_scheduled_tokens.pop(request.request_id, None)
