"""The current step's attention metadata, visible to every attention layer during one forward pass."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class ForwardContext:
    attn_metadata: object
    block_size: int


_context: ForwardContext | None = None


@contextmanager
def forward_context(attn_metadata, block_size: int):
    global _context
    previous, _context = _context, ForwardContext(attn_metadata, block_size)
    try:
        yield _context
    finally:
        _context = previous


def get_forward_context() -> ForwardContext:
    assert _context is not None, "attention layers run only inside forward_context()"
    return _context
