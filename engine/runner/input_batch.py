"""A runner's per-request state, and the host-side inputs of one step built from a step plan.

A request's latest sampled tokens may still be on the device (asynchronous execution: the next step was
launched before they reached the host). Such tokens are `pending`; a step's input needs at most the
newest one, whose position in the inputs is filled on the device from the previous step's sampled ids.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.kernels.sampling import step_seed
from engine.layers.sampler import SamplingBatch
from engine.sampling_params import SamplingParams


@dataclass
class RunnerRequest:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]  # in the first paged cache group
    num_computed_tokens: int
    num_pending: int = 0  # sampled tokens not yet on the host (at most two: launched steps k-1 and k)
    pending_row: int = -1  # row of the newest pending token in its step's sampled ids
    pending_step: int = 0  # the step that samples the newest pending token
    group_block_ids: list[list[int]] = field(default_factory=list)  # in the other paged groups, in order
    state_slot: int = -1  # its state-pool slot (-1: none)
    spec_token_ids: list[int] = field(default_factory=list)  # the drafts of the step being run (none: [])

    @property
    def num_tokens(self) -> int:
        """Known tokens plus the pending ones."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens


@dataclass
class HostInputs:
    requests: list[RunnerRequest]  # batch order: single-token sequences (decodes) first
    num_decodes: int
    input_ids: np.ndarray  # int64 [tokens]; pending tokens hold 0 until filled on the device
    pending_positions: list[int]  # indices into input_ids to fill from the previous step's samples
    pending_rows: list[int]  # ...from these rows
    positions: np.ndarray  # int64 [tokens]
    slot_mapping: np.ndarray  # int64 [tokens]
    query_start_loc: list[int]
    seq_lens: list[int]
    num_computed: list[int]
    block_table: np.ndarray  # int32 [seqs, max blocks]
    logits_indices: list[int]
    sampling_requests: list[RunnerRequest]
    # Rows of logits_indices per sampling request, in order: 1, or 1 + its drafts (a verify step).
    sampling_rows: list[int] = field(default_factory=list)
    # request id -> (hidden rows, target token ids) for prompt logprobs computed this step
    prompt_logprob_rows: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    # The other paged groups' block tables and slot mappings (entry pos // ratio of each token), in order.
    group_tables: list[np.ndarray] = field(default_factory=list)
    group_slot_mappings: list[np.ndarray] = field(default_factory=list)
    state_slots: list[int] = field(default_factory=list)  # each sequence's state-pool slot (-1: none)

    @property
    def is_decode_only(self) -> bool:
        return self.num_decodes == len(self.requests) and not self.prompt_logprob_rows


def prepare_host_inputs(requests: dict[str, RunnerRequest], counts: dict[str, int], block_size: int,
                        group_ratios: tuple[int, ...] = (1,)) -> HostInputs:
    """Advances each request's num_computed_tokens by its scheduled count. `group_ratios`: tokens per entry
    of each paged cache group (the first group's table is `block_table`). A request with drafts
    (`spec_token_ids`, set for this step) runs its newest token and the drafts, and samples at each."""
    order = sorted((requests[request_id] for request_id in counts), key=lambda r: counts[r.request_id] != 1)
    num_decodes = sum(1 for r in order if counts[r.request_id] == 1)
    total = sum(counts.values())
    input_ids = np.zeros(total, dtype=np.int64)
    positions = np.empty(total, dtype=np.int64)
    tables = [np.zeros((len(order), max(len(r.block_ids) if g == 0 else len(r.group_block_ids[g - 1]) for r in order)),
                       dtype=np.int32) for g in range(len(group_ratios))]
    slot_mappings = [np.empty(total, dtype=np.int64) for _ in group_ratios]
    starts, seq_lens, computed = [0], [], []
    pending_positions, pending_rows = [], []
    logits_indices, sampling_requests, sampling_rows, prompt_rows = [], [], [], {}
    for index, request in enumerate(order):
        n, start, begin = counts[request.request_id], request.num_computed_tokens, starts[-1]
        end = begin + n
        drafts = request.spec_token_ids
        known = request.token_ids[start:start + n - len(drafts)]
        input_ids[begin:begin + len(known)] = known
        if drafts:
            assert len(known) == 1 and not request.num_pending, (request.request_id, len(known), request.num_pending)
            input_ids[begin + 1:end] = drafts
        elif len(known) < n:  # the chunk ends with the newest token, still on the device (older pending
            # tokens were inputs of earlier steps: their KV is written, only their ids are on their way)
            assert request.num_pending >= 1 and len(known) == n - 1, (request.request_id, request.num_pending)
            pending_positions.append(end - 1)
            pending_rows.append(request.pending_row)
        if n == 1:  # a decode: scalar arithmetic (numpy's per-call cost is most of a step's input work)
            positions[begin] = start
            for group, ratio in enumerate(group_ratios):
                blocks = request.block_ids if group == 0 else request.group_block_ids[group - 1]
                tables[group][index, :len(blocks)] = blocks
                entry = start // ratio
                slot_mappings[group][begin] = blocks[entry // block_size] * block_size + entry % block_size
        else:
            positions[begin:end] = np.arange(start, start + n)
            for group, ratio in enumerate(group_ratios):
                blocks = np.asarray(request.block_ids if group == 0 else request.group_block_ids[group - 1],
                                    dtype=np.int64)
                tables[group][index, :len(blocks)] = blocks
                entries = positions[begin:end] // ratio
                slot_mappings[group][begin:end] = blocks[entries // block_size] * block_size + entries % block_size
        params = request.params
        if params.prompt_logprobs is not None and start < request.num_prompt_tokens - 1:
            last = min(start + n, request.num_prompt_tokens - 1)
            prompt_rows[request.request_id] = (list(range(begin, begin + last - start)),
                                               request.token_ids[start + 1:last + 1])
        starts.append(end)
        computed.append(start)
        seq_lens.append(start + n)
        if start + n == request.num_tokens + len(drafts):
            logits_indices.extend(range(end - 1 - len(drafts), end))
            sampling_requests.append(request)
            sampling_rows.append(1 + len(drafts))
        request.num_computed_tokens += n
    return HostInputs(order, num_decodes, input_ids, pending_positions, pending_rows, positions, slot_mappings[0],
                      starts, seq_lens, computed, tables[0], logits_indices, sampling_requests, sampling_rows,
                      prompt_rows,
                      group_tables=tables[1:], group_slot_mappings=slot_mappings[1:],
                      state_slots=[r.state_slot for r in order])


def sampling_batch(requests: list[RunnerRequest], rows: list[int], eos_token_ids: frozenset[int],
                   grammar=None) -> SamplingBatch:
    """The sampler's inputs, one row per sampled position: a verify step's row j draws output position (outputs
    so far + j) as a step without speculation would, its drafts before it counting as outputs (penalties,
    min_tokens, the seed of that position: engine/spec_decode/verify.py). `grammar`: the step's StepGrammar."""
    params, seeds, prompts, outputs, suppressed, row_ids = [], [], [], [], [], []
    for request, num_rows in zip(requests, rows):
        p = request.params
        needs_history = p.has_penalties
        prompt = request.token_ids[:request.num_prompt_tokens] if needs_history else []
        history = request.token_ids[request.num_prompt_tokens:] if needs_history else []
        for j in range(num_rows):
            num_outputs = request.num_output_tokens + j  # pending tokens count: seeds match synchronous runs
            params.append(p)
            seeds.append(step_seed(p.seed or 0, num_outputs))
            prompts.append(prompt)
            outputs.append(history + request.spec_token_ids[:j] if needs_history else [])
            suppressed.append(sorted(set(p.stop_token_ids) | eos_token_ids) if num_outputs < p.min_tokens else [])
            row_ids.append(request.request_id)
    bitmask = grammar.rows_for(row_ids) if grammar is not None else None
    return SamplingBatch(params, seeds, prompts, outputs, suppressed, bitmask)
