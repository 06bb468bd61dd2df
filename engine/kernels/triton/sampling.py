"""Sampling on the GPU without a host sync: temperature, top-k, top-p, min-p (the torch reference's order
and semantics), then an exponential race whose noise is Philox keyed by each row's seed.

The race argmax(p / E), E ~ Exp(1), is computed as argmax(logit - log E); E = -log U with U from
`tl.rand(row_seed, vocab_index)`, so a row's token depends only on its seed and logits, never on the other
rows of the batch. The noise is not the torch backend's generator: seeded outputs differ between the two
backends (each is reproducible on its own)."""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from engine.kernels.sampling import SamplingTensors
from engine.kernels.torch.sampling import apply_top_k_top_p_min_p

# One program scans at most this many vocabulary entries; the per-chunk winners are reduced in torch. The
# chunking depends only on the vocabulary size, so the winner among exact ties never depends on the batch.
_MAX_BLOCK_V = 4096


@triton.jit
def _race_kernel(logits_ptr, temperature_ptr, min_p_ptr, row_max_ptr, seed_ptr, best_val_ptr, best_idx_ptr,
                 num_rows, vocab_size, stride_row, num_chunks, APPLY_MIN_P: tl.constexpr,
                 BLOCK_ROWS: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < num_rows
    rows = rows.to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]
    mask = row_mask[:, None] & (cols < vocab_size)
    temperature = tl.load(temperature_ptr + rows, mask=row_mask, other=1.0)
    temperature = tl.where(temperature > 0, temperature, 1.0)[:, None]
    logits = tl.load(logits_ptr + rows[:, None] * stride_row + cols, mask=mask, other=float("-inf")) / temperature
    if APPLY_MIN_P:
        # p < min_p * p_max  <=>  exp(logit - max_logit) < min_p: the softmax normaliser cancels.
        row_max = tl.load(row_max_ptr + rows, mask=row_mask, other=0.0)[:, None] / temperature
        min_p = tl.load(min_p_ptr + rows, mask=row_mask, other=0.0)[:, None]
        logits = tl.where(tl.exp(logits - row_max) < min_p, float("-inf"), logits)
    seed = tl.load(seed_ptr + rows, mask=row_mask, other=0)[:, None]
    uniform = tl.rand(seed, cols + tl.zeros([BLOCK_ROWS, BLOCK_V], tl.int32))
    # U in [0, 1): U = 0 gives E = inf, a score of -inf (never chosen), which is the right limit.
    exponential = -tl.log(uniform)
    score = tl.where(logits > float("-inf"), logits - tl.log(exponential), float("-inf"))
    best = tl.argmax(score, axis=1)
    out = rows * num_chunks + chunk
    tl.store(best_val_ptr + out, tl.max(score, axis=1), mask=row_mask)
    tl.store(best_idx_ptr + out, (chunk * BLOCK_V + best).to(tl.int64), mask=row_mask)


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """logits [B, V] fp32 -> token ids [B] int64; temperature-0 rows take the argmax."""
    greedy = logits.argmax(dim=-1)
    if t.all_greedy:
        return greedy
    temperature = t.temperature
    if t.any_top_k or t.any_top_p:
        # Sort-based filtering from the reference (no host sync); the kernel then sees scaled logits.
        scale = torch.where(temperature > 0, temperature, 1.0).unsqueeze(1)
        logits = apply_top_k_top_p_min_p(logits / scale, dataclasses.replace(t, any_min_p=False))
        temperature = torch.ones_like(temperature)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    block_v = min(_MAX_BLOCK_V, max(16, triton.next_power_of_2(vocab_size)))
    block_rows = min(_MAX_BLOCK_V // block_v, triton.next_power_of_2(num_rows))  # small vocabularies
    num_chunks = triton.cdiv(vocab_size, block_v)
    row_max = logits.amax(dim=-1) if t.any_min_p else temperature  # the latter is an unused placeholder
    best_val = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(num_rows, num_chunks, dtype=torch.int64, device=logits.device)
    _race_kernel[(triton.cdiv(num_rows, block_rows), num_chunks)](
        logits, temperature, t.min_p, row_max, t.seeds, best_val, best_idx, num_rows, vocab_size,
        logits.stride(0), num_chunks, APPLY_MIN_P=t.any_min_p, BLOCK_ROWS=block_rows, BLOCK_V=block_v,
        num_warps=8)
    sampled = best_idx.gather(1, best_val.argmax(dim=1, keepdim=True)).squeeze(1)
    return torch.where(t.temperature > 0, sampled, greedy)
