"""One rank's model runner: loads the model shard, owns the KV cache, keeps per-request state between
steps, turns a step plan into model inputs, runs the model and samples."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from engine import kernels
from engine.config import EngineConfig
from engine.core.scheduler_output import LogprobsLists, RunnerOutput, SchedulerOutput
from engine.forward_context import forward_context
from engine.kernels.attention import CommonAttentionMetadata
from engine.kernels.sampling import step_seed
from engine.layers.attention import Attention
from engine.layers.sampler import Sampler, SamplingBatch, compute_logprobs
from engine.loader import ModelSource, build_model
from engine.parallel import get_parallel_state
from engine.runner.device import resolve_dtype
from engine.runner.kv_cache import kv_cache_budget_bytes
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _RunnerRequest:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class _StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: object
    logits_indices: torch.Tensor  # hidden-state rows that sample
    sampling_requests: list[_RunnerRequest]
    # request -> (hidden rows, target token ids) for prompt logprobs computed this step
    prompt_logprob_rows: dict[str, tuple[list[int], list[int]]]


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, device: torch.device, max_model_len: int,
                 eos_token_ids: frozenset[int] = frozenset(), show_progress: bool = True) -> None:
        self.config = config
        self.device = device
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.block_size = config.block_size
        self.dtype = resolve_dtype(config.dtype, source.hf_config, device)
        self.kernel_backend = kernels.activate(config.kernel_backend, device)
        self.attn_backend = self.kernel_backend.attention
        torch.manual_seed(config.seed)
        self.model = build_model(source, self.dtype, device, config.seed, show_progress)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.sampler = Sampler()
        self.requests: dict[str, _RunnerRequest] = {}
        self.is_driver = get_parallel_state().tp_rank == 0
        self.num_kv_blocks = 0
        logger.info("model loaded: %s, dtype %s, device %s, kernels %s", type(self.model).__name__,
                    self.dtype, device, self.kernel_backend.name)

    # ---- KV cache ---------------------------------------------------------------------------------
    def kv_cache_bytes_per_block(self) -> int:
        element_size = torch.tensor([], dtype=self.dtype).element_size()
        total = 0
        for layer in self.attention_layers:
            shape = self.attn_backend.kv_cache_shape(1, self.block_size, layer.num_kv_heads, layer.head_size)
            total += int(np.prod(shape)) * element_size
        return total

    def determine_num_kv_blocks(self) -> int:
        """KV blocks this rank can hold: `num_kv_blocks` if given, else what the memory budget allows,
        capped at what max_num_seqs full-length sequences could ever use."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda" and self.config.kv_cache_memory_bytes is None:
            self.profile_run()
        budget = kv_cache_budget_bytes(self.config, self.device)
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        return int(min(budget // self.kv_cache_bytes_per_block(), blocks_per_seq * self.config.max_num_seqs + 1))

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward pass over a worst-case batch, so that the peak activation memory is known."""
        num_tokens = min(self.config.max_num_batched_tokens or 8192, self.max_model_len * self.config.max_num_seqs)
        num_seqs = max(1, min(self.config.max_num_seqs, num_tokens))
        lens = [num_tokens // num_seqs] * num_seqs
        lens[-1] += num_tokens - sum(lens)
        starts = np.concatenate(([0], np.cumsum(lens))).tolist()
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        metadata = self._attention_metadata(0, starts, lens, [0] * num_seqs, [[]] * num_seqs,
                                            torch.zeros(num_tokens, dtype=torch.int64))
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        with forward_context(metadata, self.block_size):
            hidden = self.model(input_ids, positions)
        logits = self.model.compute_logits(hidden[torch.tensor(starts[1:], device=self.device) - 1])
        del hidden, logits
        torch.cuda.synchronize(self.device)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_kv_blocks = num_blocks
        for layer in self.attention_layers:
            shape = self.attn_backend.kv_cache_shape(num_blocks, self.block_size, layer.num_kv_heads, layer.head_size)
            # Zeroed: masked-out slots are multiplied by zero probabilities, and garbage could be NaN.
            layer.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    # ---- one step -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput | None:
        self._update_states(scheduled)
        if scheduled.is_empty:
            return RunnerOutput() if self.is_driver else None
        inputs = self._prepare_inputs(scheduled)
        with forward_context(inputs.attn_metadata, self.block_size):
            hidden = self.model(inputs.input_ids, inputs.positions)
        output = RunnerOutput()
        if inputs.sampling_requests:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            batch = self._sampling_batch(inputs.sampling_requests)
            sampled, logprobs = self.sampler(logits, batch)
            sampled_ids = sampled.tolist()
            for row, (request, token_id) in enumerate(zip(inputs.sampling_requests, sampled_ids)):
                request.token_ids.append(token_id)
                output.request_ids.append(request.request_id)
                if logprobs is not None and request.params.logprobs is not None:
                    output.logprobs[request.request_id] = _slice_logprobs(logprobs, row, request.params.logprobs)
            output.sampled_token_ids = sampled_ids
        for request_id, (rows, targets) in inputs.prompt_logprob_rows.items():
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
            num_top = self.requests[request_id].params.prompt_logprobs
            output.prompt_logprobs[request_id] = compute_logprobs(
                logits, torch.tensor(targets, device=self.device), num_top)
        return output if self.is_driver else None

    def _update_states(self, scheduled: SchedulerOutput) -> None:
        for request_id in scheduled.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in scheduled.new_requests:
            self.requests[new.request_id] = _RunnerRequest(
                new.request_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                list(new.block_ids), new.num_computed_tokens)
        for cached in scheduled.cached_requests:
            request = self.requests[cached.request_id]
            assert request.num_computed_tokens == cached.num_computed_tokens, (
                f"runner and scheduler disagree on {cached.request_id}: "
                f"{request.num_computed_tokens} != {cached.num_computed_tokens}")
            request.block_ids.extend(cached.new_block_ids)

    def _prepare_inputs(self, scheduled: SchedulerOutput) -> _StepInputs:
        counts = scheduled.num_scheduled_tokens
        # Single-token sequences first: attention backends batch them as decodes.
        order = sorted(counts, key=lambda request_id: counts[request_id] != 1)
        num_decodes = sum(1 for request_id in order if counts[request_id] == 1)
        input_ids, positions, slots = [], [], []
        starts, seq_lens, computed, block_tables = [0], [], [], []
        logits_indices, sampling_requests, prompt_rows = [], [], {}
        size = self.block_size
        for request_id in order:
            request, n = self.requests[request_id], counts[request_id]
            start = request.num_computed_tokens
            input_ids.extend(request.token_ids[start:start + n])
            pos = np.arange(start, start + n)
            positions.append(pos)
            slots.append(np.asarray(request.block_ids, dtype=np.int64)[pos // size] * size + pos % size)
            computed.append(start)
            seq_lens.append(start + n)
            block_tables.append(request.block_ids)
            if request.params.prompt_logprobs is not None and start < request.num_prompt_tokens - 1:
                last = min(start + n, request.num_prompt_tokens - 1)
                rows = list(range(starts[-1], starts[-1] + last - start))
                prompt_rows[request_id] = (rows, request.token_ids[start + 1:last + 1])
            starts.append(starts[-1] + n)
            if start + n == len(request.token_ids):
                logits_indices.append(starts[-1] - 1)
                sampling_requests.append(request)
            request.num_computed_tokens += n
        device = self.device
        metadata = self._attention_metadata(num_decodes, starts, seq_lens, computed, block_tables,
                                            torch.from_numpy(np.concatenate(slots)))
        return _StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64).to(device, non_blocking=True),
            positions=torch.from_numpy(np.concatenate(positions)).to(device, non_blocking=True),
            attn_metadata=metadata,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64).to(device, non_blocking=True),
            sampling_requests=sampling_requests,
            prompt_logprob_rows=prompt_rows,
        )

    def _attention_metadata(self, num_decodes, starts, seq_lens, computed, block_tables, slot_mapping):
        device = self.device
        max_blocks = max((len(b) for b in block_tables), default=0)
        table = np.zeros((len(block_tables), max(max_blocks, 1)), dtype=np.int32)
        for row, blocks in enumerate(block_tables):
            table[row, :len(blocks)] = blocks
        common = CommonAttentionMetadata(
            num_seqs=len(seq_lens),
            num_decodes=num_decodes,
            num_tokens=starts[-1],
            query_start_loc=torch.tensor(starts, dtype=torch.int32).to(device, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True),
            block_table=torch.from_numpy(table).to(device, non_blocking=True),
            slot_mapping=slot_mapping.to(device, non_blocking=True),
            max_query_len=max(b - a for a, b in zip(starts, starts[1:])),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
            num_computed_tokens_cpu=computed,
        )
        return self.attn_backend.build_metadata(common, self.block_size)

    def _sampling_batch(self, requests: list[_RunnerRequest]) -> SamplingBatch:
        params, seeds, prompts, outputs, suppressed = [], [], [], [], []
        for request in requests:
            p = request.params
            num_outputs = len(request.token_ids) - request.num_prompt_tokens
            params.append(p)
            seeds.append(step_seed(p.seed or 0, num_outputs))
            needs_history = p.has_penalties
            prompts.append(request.token_ids[:request.num_prompt_tokens] if needs_history else [])
            outputs.append(request.token_ids[request.num_prompt_tokens:] if needs_history else [])
            if num_outputs < p.min_tokens:
                suppressed.append(sorted(set(p.stop_token_ids) | self.eos_token_ids))
            else:
                suppressed.append([])
        return SamplingBatch(params, seeds, prompts, outputs, suppressed)


def _slice_logprobs(lists: LogprobsLists, row: int, num_top: int) -> LogprobsLists:
    return LogprobsLists([lists.token_ids[row][:num_top + 1]], [lists.logprobs[row][:num_top + 1]], [lists.ranks[row]])
