"""Scheduler-side state of one request: its tokens, how many have KV computed, its KV blocks (per cache
group), its state-pool slot and, for structured output, its grammar matcher."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from engine.structured_output.manager import GrammarRequest


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


@dataclass
class GroupBlocks:
    """A request's blocks in one paged cache group, in entry order. A sliding-window group gives back
    leading blocks that no future query reads, or never takes those a prefix-cache hit's window does not
    reach: the first `num_released` ids are then stale (the list keeps their places, so that index =
    entry // block_size). `num_cached`: leading blocks already registered in (or taken from) the group's
    prefix cache."""
    block_ids: list[int] = field(default_factory=list)
    num_released: int = 0
    num_cached: int = 0


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # already capped by the context length
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    # Structured output: compiled off the step loop; the request is admitted once its matcher is ready. The
    # matcher takes every output token the scheduler appends (preemption keeps it: the outputs stay).
    grammar: GrammarRequest | None = None

    token_ids: list[int] = field(init=False)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_pending_tokens: int = 0  # tokens being sampled by launched steps, not yet appended
    groups: list[GroupBlocks] = field(default_factory=lambda: [GroupBlocks()])  # one per paged cache group
    state_slot: int | None = None  # its slot in the state pool while running (models with per-request state)
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of the full blocks, in order
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: str | int | None = None
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling (-1: not scheduled yet)
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    error: str | None = None  # why the request failed alone (its grammar), if it did
    # Speculative decoding: the drafts for its next step (engine/spec_decode), and about how many of each
    # step's drafts it has been keeping (a running mean; adaptive drafts follow it).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_mean_accepted: float = -1.0  # -1: no verify step yet
    spec_recent_verifies: int = 0  # verify steps since it last paused
    # Adaptive speculation pauses a request that keeps (almost) nothing: no drafts until it has this many
    # output tokens, then a one-draft probe.
    spec_paused_until: int = 0

    @property
    def spec_paused(self) -> bool:
        return self.num_output_tokens < self.spec_paused_until

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def block_ids(self) -> list[int]:
        """Its blocks in the first paged cache group (the full-attention one, where the model has one)."""
        return self.groups[0].block_ids

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
