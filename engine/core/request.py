"""Scheduler-side state of one request: its tokens, how many have KV computed, and its KV blocks."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # already capped by the context length
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)

    token_ids: list[int] = field(init=False)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_pending_tokens: int = 0  # tokens being sampled by launched steps, not yet appended
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of the full blocks, in order
    num_cached_blocks: int = 0  # leading blocks already registered in (or taken from) the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: str | int | None = None
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling (-1: not scheduled yet)
    num_preemptions: int = 0
    first_scheduled_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_tokens_to_compute(self) -> int:
        """Including the pending tokens: a step launched ahead feeds them from the device."""
        return len(self.token_ids) + self.num_pending_tokens - self.num_computed_tokens

    @property
    def will_finish_by_length(self) -> bool:
        """Its pending tokens already reach max_tokens: scheduling it again would be wasted work."""
        return self.num_output_tokens + self.num_pending_tokens >= self.max_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
