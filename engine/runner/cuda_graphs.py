"""Decode CUDA graphs: the model's forward pass captured once per batch size over fixed-address input
buffers. A decode-only step of B sequences copies its inputs into the buffers, pads to the smallest
captured size >= B, and replays; larger or mixed batches run eagerly.

Attention metadata is captured at the longest possible context (max_model_len), so backends that size
launch grids from the context (split-K decode) bake in a grid that covers every later step; shorter
contexts exit early inside the kernels.
"""
from __future__ import annotations

import logging

import torch

from engine.forward_context import forward_context
from engine.kernels.attention import CommonAttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 513, 32))
    return sorted({s for s in sizes if s <= max_num_seqs} | {min(max_num_seqs, 512)})


class DecodeGraphs:
    def __init__(self, model, attn_backend, block_size: int, max_model_len: int, max_batch: int,
                 device: torch.device) -> None:
        self.model, self.attn_backend, self.block_size = model, attn_backend, block_size
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(self.max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((self.max_batch,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(self.max_batch, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(self.max_batch, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(self.max_batch + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _metadata(self, batch: int):
        common = CommonAttentionMetadata(
            num_seqs=batch, num_decodes=batch, num_tokens=batch,
            query_start_loc=self.query_start_loc[:batch + 1], seq_lens=self.seq_lens[:batch],
            block_table=self.block_table[:batch], slot_mapping=self.slot_mapping[:batch],
            max_query_len=1, max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[self.max_model_len] * batch,
            num_computed_tokens_cpu=[self.max_model_len - 1] * batch)
        return self.attn_backend.build_metadata(common, self.block_size)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for batch in reversed(self.sizes):  # largest first: later graphs reuse its memory
            metadata = self._metadata(batch)
            with forward_context(metadata, self.block_size):
                self.model(self.input_ids[:batch], self.positions[:batch])  # warm-up: compile and tune
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[batch] = self.model(self.input_ids[:batch], self.positions[:batch])
            self.graphs[batch] = graph
        torch.cuda.synchronize()
        logger.info("captured decode graphs for batch sizes %s", self.sizes)

    def padded_size(self, batch: int) -> int | None:
        for size in self.sizes:
            if size >= batch:
                return size
        return None

    def run(self, batch: int, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        """Hidden states [batch, hidden] of a decode-only step (inputs already on the device)."""
        size = self.padded_size(batch)
        self.input_ids[:batch].copy_(input_ids, non_blocking=True)
        self.positions[:batch].copy_(positions, non_blocking=True)
        self.slot_mapping[:batch].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:batch].copy_(seq_lens, non_blocking=True)
        self.block_table[:batch, :block_table.shape[1]].copy_(block_table, non_blocking=True)
        if size > batch:  # padding rows: write nothing to the cache, attend to one token
            self.slot_mapping[batch:size].fill_(-1)
            self.seq_lens[batch:size].fill_(1)
        self.graphs[size].replay()
        return self.outputs[size][:batch]
