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
from engine.kernels.triton import pdl

# One program scans at most this many vocabulary entries; a second kernel picks each row's winner among the
# chunks'. The chunking depends only on the vocabulary size, so the winner among exact ties (the lowest id,
# as torch's argmax) never depends on the batch.
_MAX_BLOCK_V = 4096


@triton.jit
def _chunk_kernel(logits_ptr, temperature_ptr, min_p_ptr, row_max_ptr, seed_ptr, best_val_ptr, best_idx_ptr,
                  num_rows, vocab_size, stride_row, num_chunks, GREEDY_ONLY: tl.constexpr,
                  APPLY_MIN_P: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_V: tl.constexpr, USE_PDL: tl.constexpr):
    """Per (row, chunk): the chunk's largest raw logit and its id (the greedy winner) and, unless
    GREEDY_ONLY, the exponential race's winner. Winners are [2, rows, chunks] (greedy, race)."""
    if USE_PDL:
        pdl.enter()
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < num_rows
    rows = rows.to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]
    mask = row_mask[:, None] & (cols < vocab_size)
    raw = tl.load(logits_ptr + rows[:, None] * stride_row + cols, mask=mask, other=float("-inf"))
    out = rows * num_chunks + chunk
    greedy_val, greedy_idx = tl.max(raw, axis=1, return_indices=True, return_indices_tie_break_left=True)
    tl.store(best_val_ptr + out, greedy_val, mask=row_mask)
    tl.store(best_idx_ptr + out, (chunk * BLOCK_V + greedy_idx).to(tl.int64), mask=row_mask)
    if not GREEDY_ONLY:
        temperature = tl.load(temperature_ptr + rows, mask=row_mask, other=1.0)
        temperature = tl.where(temperature > 0, temperature, 1.0)[:, None]
        logits = raw / temperature
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
        race_val, race_idx = tl.max(score, axis=1, return_indices=True, return_indices_tie_break_left=True)
        out += num_rows * num_chunks
        tl.store(best_val_ptr + out, race_val, mask=row_mask)
        tl.store(best_idx_ptr + out, (chunk * BLOCK_V + race_idx).to(tl.int64), mask=row_mask)


@triton.jit
def _pick_kernel(best_val_ptr, best_idx_ptr, temperature_ptr, out_ptr, num_rows, num_chunks,
                 GREEDY_ONLY: tl.constexpr, CHUNKS_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    """A row's token: the best of its chunks' greedy winners (temperature 0) or race winners."""
    if USE_PDL:
        pdl.enter()
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS_PAD)
    base = row * num_chunks
    if not GREEDY_ONLY:
        base += tl.where(tl.load(temperature_ptr + row) > 0, num_rows * num_chunks, 0)
    values = tl.load(best_val_ptr + base + chunks, mask=chunks < num_chunks, other=float("-inf"))
    _, best = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(best_idx_ptr + base + best))


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """logits [B, V] fp32 -> token ids [B] int64; temperature-0 rows take the argmax. Two launches whatever
    the batch holds: the chunks' winners, then each row's pick among them."""
    greedy_only = t.all_greedy
    temperature = t.temperature
    if not greedy_only and (t.any_top_k or t.any_top_p):
        # Sort-based filtering from the reference (no host sync); the kernel then sees scaled logits. Greedy
        # rows keep temperature 0 (and so their argmax), whose scale is 1.
        scale = torch.where(temperature > 0, temperature, 1.0).unsqueeze(1)
        logits = apply_top_k_top_p_min_p(logits / scale, dataclasses.replace(t, any_min_p=False))
        temperature = torch.where(temperature > 0, 1.0, 0.0)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    block_v = min(_MAX_BLOCK_V, max(16, triton.next_power_of_2(vocab_size)))
    block_rows = min(_MAX_BLOCK_V // block_v, triton.next_power_of_2(num_rows))  # small vocabularies
    num_chunks = triton.cdiv(vocab_size, block_v)
    winners = 1 if greedy_only else 2
    best_val = torch.empty(winners, num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(winners, num_rows, num_chunks, dtype=torch.int64, device=logits.device)
    if greedy_only:
        # The kernels take these pointers but, compiled GREEDY_ONLY, never read them.
        temperature = min_p = row_max = seeds = logits
    else:
        min_p, seeds = t.min_p, t.seeds
        # Without min-p the kernel never reads row_max (APPLY_MIN_P is off): any tensor will do.
        row_max = logits.amax(dim=-1) if t.any_min_p else temperature
    _chunk_kernel[(triton.cdiv(num_rows, block_rows), num_chunks)](
        logits, temperature, min_p, row_max, seeds, best_val, best_idx, num_rows, vocab_size,
        logits.stride(0), num_chunks, GREEDY_ONLY=greedy_only, APPLY_MIN_P=not greedy_only and t.any_min_p,
        BLOCK_ROWS=block_rows, BLOCK_V=block_v, num_warps=8, **pdl.launch_options(logits))
    _pick_kernel[(num_rows,)](best_val, best_idx, temperature, out, num_rows, num_chunks, GREEDY_ONLY=greedy_only,
                              CHUNKS_PAD=triton.next_power_of_2(num_chunks), num_warps=1,
                              **pdl.launch_options(logits))
    return out
