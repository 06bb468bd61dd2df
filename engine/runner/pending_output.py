"""A launched step of a model runner (engine/runner/model_runner.py `execute_async`): its sampled ids reach the
host in the background, and recording them (with a verify step's kept drafts) updates the runner's request
state."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.core.scheduler_output import LogprobsLists, RunnerOutput
from engine.runner.input_batch import RunnerRequest
from engine.spec_decode.verify import num_accepted

if TYPE_CHECKING:
    from engine.runner.model_runner import ModelRunner


class PendingOutput:
    """A launched step. `result()` waits for its sampled ids, records them (after those of every earlier
    step) in the runner's request state, and returns the RunnerOutput (None on non-leader ranks).

    `rows`: the sampled rows of each request (1; 1 + drafts for a verify step, whose kept drafts and next
    token are found when the ids reach the host, the same on every rank); `logprobs`: of every row."""

    def __init__(self, runner: "ModelRunner", step: int, output: RunnerOutput, requests: list[RunnerRequest],
                 sampled_host: torch.Tensor | None, event, rows: list[int] | None = None,
                 logprobs: LogprobsLists | None = None) -> None:
        self._runner, self.step, self._output, self._requests = runner, step, output, requests
        self._sampled_host, self._event = sampled_host, event
        self._rows, self._logprobs = rows, logprobs
        self.verifies = any(request.spec_token_ids for request in requests)
        self.done = False

    @property
    def in_flight(self) -> bool:
        """Whether the device may still be running the step (GPUs); on CPU a launch computes it all."""
        return self._event is not None and not self.done

    def wait(self) -> None:
        """Block until the step's sampled ids are on the host (callable from any thread)."""
        if self._event is not None:
            self._event.synchronize()

    def result(self) -> RunnerOutput | None:
        self._runner.resolve_until(self.step)
        return self._output if self._runner.is_driver else None

    def _record(self) -> None:
        self.wait()
        if self._sampled_host is not None:
            ids = self._sampled_host.tolist()
            output, first = self._output, 0
            for request, rows in zip(self._requests, self._rows):
                sampled = ids[first:first + rows]
                drafts = request.spec_token_ids
                kept = num_accepted(sampled, drafts) if drafts else 0
                new = sampled[:kept + 1]
                output.sampled_token_ids.append(new)
                request.token_ids.extend(new)
                request.num_pending -= 1
                if drafts:  # the rejected drafts' cache positions are stale, written over later
                    request.num_computed_tokens -= len(drafts) - kept
                    request.spec_token_ids = []
                    if request.state_slot >= 0:  # per-request state: back to after the kept tokens
                        self._runner.keep_verified(request.state_slot, kept + 1)
                num_top = request.params.logprobs
                if self._logprobs is not None and num_top is not None:
                    output.logprobs[request.request_id] = _slice_logprobs(self._logprobs, first, len(new), num_top)
                first += rows
        self.done = True


def _slice_logprobs(lists: LogprobsLists, row: int, num_rows: int, num_top: int) -> LogprobsLists:
    rows = range(row, row + num_rows)
    return LogprobsLists([lists.token_ids[r][:num_top + 1] for r in rows],
                         [lists.logprobs[r][:num_top + 1] for r in rows],
                         [lists.ranks[r] for r in rows])
