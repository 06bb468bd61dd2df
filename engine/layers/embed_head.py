"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary
(padded so that every rank's slice has the same size)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import ops
from engine.parallel import get_parallel_state, tensor_parallel_all_gather, tensor_parallel_all_reduce


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        state = get_parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        self.num_embeddings = num_embeddings
        self.num_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_per_partition
        self.vocab_end = min(self.vocab_start + self.num_per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.num_per_partition, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.num_embeddings or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"checkpoint embedding has shape {tuple(loaded.shape)}, expected "
                             f"({self.num_embeddings}, {param.shape[1]})")
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(loaded[self.vocab_start:self.vocab_end])
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return tensor_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the selected hidden states: each rank computes its vocabulary slice, then the slices
    are gathered and the padding is cut off."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False) -> None:
        super().__init__(num_embeddings, embedding_dim)
        assert not bias, "LM-head bias is not supported"

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # On GPUs the logits stay float32 out of the GEMM: rounded to bf16, a logit of ~20 moves in steps of
        # 0.125, so top candidates often tie exactly and the tie goes whichever way the last bit fell.
        if hidden_states.is_cuda:
            logits = ops.gemm_float32(hidden_states, self.weight)
        else:
            logits = ops.gemm(hidden_states, self.weight, None)
        if self.tp_size > 1:
            logits = tensor_parallel_all_gather(logits, dim=-1)
        return logits[..., :self.num_embeddings]
