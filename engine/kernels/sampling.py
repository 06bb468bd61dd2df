"""The per-step sampling inputs that every backend's `sample` kernel takes."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingTensors:
    """When `all_greedy`, the tensors are None: argmax needs nothing else."""
    temperature: torch.Tensor  # [B] float32; 0 means greedy
    top_k: torch.Tensor  # [B] int64; 0 means no top-k
    top_p: torch.Tensor  # [B] float32; 1 means no top-p
    min_p: torch.Tensor  # [B] float32; 0 means no min-p
    seeds: torch.Tensor  # [B] int64; per-row seed of this step (request seed mixed with the output index)
    seeds_cpu: list[int]
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool


def step_seed(request_seed: int, output_index: int) -> int:
    """A 63-bit seed that depends only on the request's seed and which output token is being drawn, so
    that a seeded request gets the same tokens whatever else is in the batch, and after preemption."""
    value = (request_seed * 0x9E3779B97F4A7C15 + output_index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB)
    value &= (1 << 64) - 1
    value ^= value >> 31
    return value & ((1 << 63) - 1)


# 1 << b for the 8 bits of a byte: unpacks a token bitmask a byte at a time.
_BYTE_BITS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf into `logits[i, t]` wherever bit t of `bitmask[i]` is clear (bit t % 32 of int32 word
    t // 32: llguidance's and xgrammar's layout); a row of -1 words leaves its row as it was, to the bit. Other
    rows' tokens beyond the mask's 32 * width are masked too. One implementation for every backend: two
    element-wise ops over the rows. `bitmask` [rows, W] int32 on the logits' device."""
    num_rows, vocab_size = logits.shape
    bits = _BYTE_BITS.get(logits.device)
    if bits is None:
        bits = _BYTE_BITS[logits.device] = (1 << torch.arange(8, dtype=torch.int32)).to(torch.uint8).to(logits.device)
    # Little-endian words: byte k of word j holds tokens 32 j + 8 k .. 32 j + 8 k + 7, bit b token 32 j + 8 k + b.
    forbidden = ((bitmask.contiguous().view(torch.uint8).unsqueeze(-1) & bits) == 0).view(num_rows, -1)
    width = min(vocab_size, forbidden.shape[1])
    logits[:, :width].masked_fill_(forbidden[:, :width], float("-inf"))
    if width < vocab_size:
        logits[:, width:].masked_fill_((bitmask != -1).any(dim=1, keepdim=True), float("-inf"))
