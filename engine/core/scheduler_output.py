"""The plain-data step plan a scheduler hands to model runners, and what a runner hands back.

A runner keeps per-request state between steps, so a request's tokens and sampling parameters travel
once (when it is first scheduled or resumed after preemption); later steps only send block-id deltas.
Runners sample identically on every rank, so sampled tokens never travel back down.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from engine.structured_output.manager import StepGrammar


@dataclass
class NewRequestData:
    request_id: str
    token_ids: list[int]  # prompt + any output tokens generated before a preemption
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]  # in the first paged cache group
    num_computed_tokens: int  # prefix-cache hit: KV already in these blocks
    group_block_ids: list[list[int]] = field(default_factory=list)  # in the other groups, in order
    state_slot: int = -1  # its state-pool slot (-1: the model keeps no per-request state)


@dataclass
class CachedRequestData:
    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int  # before this step, for a consistency check on the runner
    new_group_block_ids: list[list[int]] = field(default_factory=list)  # the other groups' new blocks


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Requests the runners must forget before this step (finished, aborted or preempted).
    finished_request_ids: set[str] = field(default_factory=set)
    # Lockstep data parallelism (engine/lockstep.py): a rank with nothing to run still runs a forward pass of
    # padding rows (no cache writes, no sampling), so that its MoE layers take part in the other ranks'
    # token exchanges.
    dummy: bool = False
    # Expert parallelism across DP ranks: the most tokens any DP rank runs in this step (every rank's MoE
    # exchanges pad to it; 0: this step's own count), and how every rank runs it (engine/lockstep.py: None
    # without lockstep, each rank's own choice; else the group's DECODE_GRAPH, PROMPT_GRAPHS or EAGER).
    ep_num_tokens: int = 0
    ep_mode: int | None = None
    # Structured output: the token masks of the rows that sample under a grammar (filled while the forward
    # pass runs; a plan sent to other ranks carries them filled).
    structured_output: StepGrammar | None = None
    # Speculative decoding: the drafts each verifying request runs after its newest token (its scheduled
    # count is 1 + len(drafts)); the step samples every drafted position and one more.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # A model drafter drafts after this step only for these requests (the others' speculation is paused).
    draft_request_ids: set[str] = field(default_factory=set)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class LogprobsLists:
    """Logprobs of a run of positions: per position the chosen token first, then the top-k tokens."""
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]  # rank of the chosen token among all tokens (1 = most likely)


@dataclass
class RunnerOutput:
    """Per sampled request: its new tokens (one; with drafts, the kept drafts and the target's next token), and
    logprobs where asked (one position per new token). Only the TP leader returns one."""
    request_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # A model drafter's drafts for each request's next step (speculative decoding with MTP).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Prompt positions computed this step (a chunk at a time); position i scores prompt token i + 1.
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
