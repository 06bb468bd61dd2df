"""The current step's attention metadata, and how MoE layers pad the step, visible to every layer during
one forward pass."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class MoEStep:
    """How a step's MoE layers treat its rows.

    `padded_tokens`: the token count that expert-parallel exchanges size their buffers by, the same on every
    rank of the EP group in this step (the largest DP rank's tokens, rounded up to a CUDA-graph bucket), so
    that no collective's shape depends on routing or on one rank's batch.
    `valid_tokens`: how many leading rows of the layer's input are real tokens; the rest are padding (a
    CUDA graph's unused rows, an idle DP rank's dummy row) that must reach no expert. A device tensor [1]
    where it changes between replays of one graph, an int where the step runs eagerly, None where every
    row is real."""
    padded_tokens: int
    valid_tokens: torch.Tensor | int | None = None


@dataclass
class ForwardContext:
    attn_metadata: object
    block_size: int
    moe: MoEStep | None = None
    # Speculative decoding: the sequences (indices in the metadata) that verify drafts in this pass. Layers
    # with per-request state keep what they need to move it back to after the drafts the step keeps.
    verify_seqs: tuple[int, ...] = ()
    # While prompt-step graphs are captured: where attention layers end one graph and start the next
    # (engine/runner/prompt_graphs.py); None otherwise.
    pieces: object | None = None


_context: ForwardContext | None = None


@contextmanager
def forward_context(attn_metadata, block_size: int, moe: MoEStep | None = None, verify_seqs: tuple[int, ...] = ()):
    global _context
    previous, _context = _context, ForwardContext(attn_metadata, block_size, moe, verify_seqs)
    try:
        yield _context
    finally:
        _context = previous


def get_forward_context() -> ForwardContext:
    assert _context is not None, "attention layers run only inside forward_context()"
    return _context


def current_moe_step() -> MoEStep | None:
    """The step's MoEStep, or None outside a forward pass of the engine (a layer called on its own)."""
    return _context.moe if _context is not None else None
