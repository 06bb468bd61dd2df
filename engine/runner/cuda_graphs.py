"""Decode CUDA graphs: the model's forward pass captured once per batch size over fixed-address input
buffers. A decode-only step of B sequences pads to the smallest captured size >= B, copies its inputs into
that size's buffers and replays; larger or mixed batches run eagerly. Under expert parallelism every rank
of the EP group replays the same size (the largest rank's batch, padded: `padded_step_tokens`), an idle DP
rank a batch of padding rows only (`run_dummy`); the graphs' MoE layers read how many rows are real from a
device buffer, so padding rows reach no expert.

A model with several paged cache groups of one entry per token (sliding-window layers beside full ones,
Gemma 4's two head sizes) has a slot-mapping row and a block table per group in the same two buffers; each
layer reads its group's views through the captured metadata (`for_group`). Groups of several tokens per
entry (DeepSeek-V4's compressed caches) and state pools (Gated DeltaNet) stay eager: their layers say so.

Attention metadata is captured at the longest possible context (max_model_len), so backends that size
launch grids from the context (split-K decode) bake in a grid that covers every later step; shorter
contexts exit early inside the kernels.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from engine.forward_context import MoEStep, forward_context
from engine.kernels.attention import CommonAttentionMetadata
from engine.kv_cache_spec import FULL_GROUP, CacheGroupMetadata
from engine.lockstep import DECODE_GRAPH, EAGER, PROMPT_GRAPHS
from engine.runner.input_batch import HostInputs

logger = logging.getLogger(__name__)

# A step's block table goes over as whole rows of max_model_len's blocks while that is at most this many
# bytes, or while the step's widest row needs half of them.
_WHOLE_ROWS_BYTES = 64 << 10


def whole_table_rows(size: int, width: int, max_blocks: int) -> bool:
    return size * max_blocks * 4 <= _WHOLE_ROWS_BYTES or 2 * width > max_blocks


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 513, 32))
    return sorted({s for s in sizes if s <= max_num_seqs} | {min(max_num_seqs, 512)})


def padded_step_tokens(num_tokens: int, sizes: list[int], multiple: int = 64) -> int:
    """The token count a step's MoE exchanges pad `num_tokens` to: the smallest graph size that holds it,
    else the next multiple of `multiple`."""
    for size in sizes:
        if size >= num_tokens:
            return size
    return -(-num_tokens // multiple) * multiple


def step_path(mode: int | None, tokens: int, decode_only: bool, graphs, prompt_graphs,
              step_buckets: list[int]) -> tuple[str, int]:
    """How a step of `tokens` (the EP group's largest) runs: ("decode", the decode graph's size), ("prompt",
    the prompt-step chain's bucket) or ("eager", the token count its MoE exchanges pad to). `mode`: the
    lockstep group's agreement (engine/lockstep.py), which with `tokens` alone decides it, so that every DP
    rank, one with nothing to run included, takes the same path with the same exchange sizes; None without
    lockstep: this rank's own step (`decode_only`) decides."""
    if mode is None:
        mode = DECODE_GRAPH if decode_only else PROMPT_GRAPHS
    if mode == DECODE_GRAPH and graphs is not None and tokens <= graphs.max_batch:
        return "decode", graphs.padded_size(tokens)
    bucket = prompt_graphs.bucket(tokens) if prompt_graphs is not None and mode != EAGER else None
    if bucket is not None:
        return "prompt", bucket
    return "eager", padded_step_tokens(tokens, step_buckets)


def uncapturable_layers(cache_layers, layout) -> list[str]:
    """Why a model's decode steps cannot be captured: the classes of its layers that say so, or its cache
    groups of several tokens per entry / its state pool; empty where graphs can serve it."""
    eager = sorted({type(m).__name__ for m in cache_layers if not m.supports_cuda_graphs})
    if not eager and (any(g.ratio != 1 for g in layout.groups) or layout.num_state_slots):
        eager = ["a cache group of several tokens per entry or a state pool:"] + sorted(
            {type(m).__name__ for m in cache_layers})
    return eager


def pack_tokens(host: HostInputs | None, size: int, num_groups: int = 1) -> np.ndarray:
    """int64 [3 + num_groups, size]: input ids, positions, the first cache group's slot mapping (-1: a padding
    row, nothing stored), the row of the previous step's samples that each still-pending input id comes from
    (-1: none), then each further group's slot mapping."""
    batch = len(host.requests) if host is not None else 0
    tokens = np.zeros((3 + num_groups, size), dtype=np.int64)
    tokens[2, batch:] = -1
    tokens[3] = -1
    tokens[4:, batch:] = -1
    if host is not None:
        assert len(host.group_slot_mappings) == num_groups - 1, "one slot mapping per cache group"
        tokens[0, :batch], tokens[1, :batch], tokens[2, :batch] = host.input_ids, host.positions, host.slot_mapping
        tokens[3, host.pending_positions] = host.pending_rows
        for row, slots in enumerate(host.group_slot_mappings, start=4):
            tokens[row, :batch] = slots
    return tokens


def pack_tables(host: HostInputs | None, size: int, width: int, num_groups: int = 1) -> np.ndarray:
    """int32 [size + num_groups * size * width]: sequence lengths (1 for padding rows), then a [size, width]
    block table per cache group (zeros past each row's blocks)."""
    tables = np.zeros(size * (1 + num_groups * width), dtype=np.int32)
    tables[:size] = 1
    if host is not None:
        batch = len(host.requests)
        tables[:batch] = host.seq_lens
        for group, table in enumerate([host.block_table, *host.group_tables][:num_groups]):
            start = size + group * size * width
            tables[start:start + size * width].reshape(size, width)[:batch, :table.shape[1]] = table
    return tables


def fill_pending(input_ids: torch.Tensor, sources: torch.Tensor, last_sampled: torch.Tensor,
                 all_pending: bool) -> None:
    """In place: input_ids[i] = last_sampled[sources[i]] where sources[i] >= 0 (`all_pending`: every row,
    one gather, a decode step's usual case)."""
    if all_pending:
        torch.index_select(last_sampled, 0, sources, out=input_ids)
    else:
        input_ids.copy_(torch.where(sources >= 0, last_sampled[sources.clamp(min=0)], input_ids))


class DecodeGraphs:
    """Each captured size B has its own fixed-address inputs, laid out so that a step's inputs reach them in
    two host-to-device copies: int64 [3 + G, B] (input ids, positions, the first cache group's slot mapping,
    the row of the previous step's samples that a still-pending input id comes from, or -1, then the slot
    mappings of the other G - 1 groups) and int32 [B + G * B * max_blocks] (sequence lengths, then each
    group's block table; where those rows are long and mostly unused, the used columns go over and are
    placed on the device). Padding rows write nothing to any cache and attend to one token."""

    def __init__(self, model, attn_backend, block_size: int, max_model_len: int, max_batch: int,
                 device: torch.device, group_keys: list[tuple[int, int | None]] = (FULL_GROUP,)) -> None:
        assert all(ratio == 1 for ratio, _ in group_keys), "graphs hold cache groups of one entry per token"
        self.model, self.attn_backend, self.block_size = model, attn_backend, block_size
        self.group_keys = list(group_keys)
        self.num_groups = len(self.group_keys)
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.tokens = {size: torch.from_numpy(pack_tokens(None, size, self.num_groups)).to(device)
                       for size in self.sizes}
        self.tables = {size: torch.from_numpy(pack_tables(None, size, self.max_blocks, self.num_groups)).to(device)
                       for size in self.sizes}
        self.query_start_loc = torch.arange(self.max_batch + 1, dtype=torch.int32, device=device)
        self.valid_tokens = torch.zeros(1, dtype=torch.int64, device=device)  # real rows of the replayed batch
        self._valid_value = 0  # what valid_tokens holds (filled only when it changes)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _views(self, size: int):
        """(input ids, positions, slot mapping, pending source rows, seq lens, block table) of size's buffers,
        the first cache group's slot mapping and table."""
        tokens, tables = self.tokens[size], self.tables[size]
        return (*tokens[:4], tables[:size], tables[size:size * (1 + self.max_blocks)].view(size, self.max_blocks))

    def _group_views(self, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(block table [size, max_blocks], slot mapping [size]) of each cache group, in `group_keys` order."""
        tokens, tables = self.tokens[size], self.tables[size]
        area = size * self.max_blocks
        return [(tables[size + g * area:size + (g + 1) * area].view(size, self.max_blocks),
                 tokens[2] if g == 0 else tokens[3 + g]) for g in range(self.num_groups)]

    def _metadata(self, batch: int):
        seq_lens = self._views(batch)[4]
        views = self._group_views(batch)
        (block_table, slot_mapping) = views[0]
        common = CommonAttentionMetadata(
            num_seqs=batch, num_decodes=batch, num_tokens=batch,
            query_start_loc=self.query_start_loc[:batch + 1], seq_lens=seq_lens,
            block_table=block_table, slot_mapping=slot_mapping,
            max_query_len=1, max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[self.max_model_len] * batch,
            num_computed_tokens_cpu=[self.max_model_len - 1] * batch)
        # No host copy of the tables: what a captured kernel reads comes from the buffers.
        common.groups = {key: CacheGroupMetadata(1, key[1], self.block_size, table, slots, None)
                         for key, (table, slots) in zip(self.group_keys, views)}
        return self.attn_backend.build_metadata(common, self.block_size)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for batch in reversed(self.sizes):  # largest first: later graphs reuse its memory
            metadata = self._metadata(batch)
            input_ids, positions = self._views(batch)[:2]
            self._set_valid(batch)
            with forward_context(metadata, self.block_size, MoEStep(batch, self.valid_tokens)):
                self.model(input_ids, positions)  # warm-up: compile and tune
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[batch] = self.model(input_ids, positions)
            self.graphs[batch] = graph
        torch.cuda.synchronize()
        logger.info("captured decode graphs for batch sizes %s", self.sizes)

    def can_replay(self, scheduled, requests: dict) -> bool:
        """Whether a step plan (before it is launched) is a decode-only batch that a graph can run: every
        sequence one token, at most max_batch of them, and no prompt position's logprobs (those come from an
        eager pass). `requests`: the runner's state of the plan's earlier requests."""
        counts = scheduled.num_scheduled_tokens
        if len(counts) > self.max_batch or any(n != 1 for n in counts.values()):
            return False
        new = {request.request_id: request for request in scheduled.new_requests}
        for request_id in counts:
            request = new.get(request_id) or requests[request_id]
            params = request.sampling_params if request_id in new else request.params
            if params.prompt_logprobs is not None and request.num_computed_tokens < request.num_prompt_tokens - 1:
                return False
        return True

    def padded_size(self, batch: int) -> int | None:
        size = padded_step_tokens(batch, self.sizes)
        return size if size <= self.max_batch else None

    def run(self, host: HostInputs, last_sampled: torch.Tensor | None, size: int | None = None) -> torch.Tensor:
        """Hidden states [batch, hidden] of a decode-only step: its inputs in two copies into the padded size's
        buffers (`size`, at least the batch's), the input ids still on the device (`host.pending_rows` of
        `last_sampled`) filled in, then the replay."""
        batch = len(host.requests)
        size = max(size or 0, self.padded_size(batch))
        groups = self.num_groups
        self.tokens[size].copy_(torch.from_numpy(pack_tokens(host, size, groups)).pin_memory(), non_blocking=True)
        width = max(table.shape[1] for table in [host.block_table, *host.group_tables])
        if whole_table_rows(size * groups, width, self.max_blocks):
            tables = pack_tables(host, size, self.max_blocks, groups)
            self.tables[size].copy_(torch.from_numpy(tables).pin_memory(), non_blocking=True)
        else:  # long rows mostly unused (a large max_model_len): copy [size, width] a group, then place them
            staged = torch.from_numpy(pack_tables(host, size, width, groups)).pin_memory().to(
                self.tables[size].device, non_blocking=True)
            self._views(size)[4].copy_(staged[:size])
            for group, (block_table, _) in enumerate(self._group_views(size)):
                start = size + group * size * width
                block_table[:, :width].copy_(staged[start:start + size * width].view(size, width))
        if host.pending_positions:
            assert last_sampled is not None
            fill_pending(self.tokens[size][0, :batch], self.tokens[size][3, :batch], last_sampled,
                         len(host.pending_positions) == batch)
        self._set_valid(batch)
        self.graphs[size].replay()
        return self.outputs[size][:batch]

    def run_dummy(self, size: int) -> None:
        """Replay `size`'s graph over padding rows only (an idle DP rank's lockstep step): they write no
        cache entry, attend to one token of whatever block their table row names, and reach no expert."""
        self.tokens[size].copy_(torch.from_numpy(pack_tokens(None, size, self.num_groups)).pin_memory(),
                                non_blocking=True)
        self._views(size)[4].fill_(1)
        self._set_valid(0)
        self.graphs[size].replay()

    def _set_valid(self, rows: int) -> None:
        if rows != self._valid_value:
            self.valid_tokens.fill_(rows)
            self._valid_value = rows
