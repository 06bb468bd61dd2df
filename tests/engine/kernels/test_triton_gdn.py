"""flash-linear-attention's Gated DeltaNet kernels (engine/kernels/triton/gdn.py) against the torch references
(engine/kernels/torch/gdn.py) on fresh random bf16 inputs with the states in a pool (recurrent states float32):
a varlen prefill of three requests from nonzero states in two chunks that carry the states (the second chunk a
mixed step with a decode), decode steps over slots out of order, and a pass without caches.

Needs a CUDA GPU and an importable `fla` (the `gdn` extra); skipped otherwise."""
from __future__ import annotations


import pytest
import torch

pytest.importorskip("triton")

from engine.kernels.triton import gdn  # noqa: E402

if (reason := gdn.unavailable_reason()) is not None:
    pytest.skip(f"FLA's kernels cannot run here: {reason}", allow_module_level=True)

from benchmarks.gdn_check import conv_inputs, delta_rule_inputs, relative_error, step_metadata  # noqa: E402
from engine.kernels.torch import gdn as reference  # noqa: E402

DEVICE = "cuda"
TOLERANCE = 2e-2  # largest error relative to the reference's largest magnitude, for bf16 inputs
HEADS, DK, DV = 8, 128, 128  # Qwen3-Next's head sizes, a quarter of its value heads
CHANNELS, WIDTH = 2 * 4 * DK + HEADS * DV, 4  # [q | k | v] of 4 key heads and 8 value heads
POOL = 12

# (new tokens, state slot) per sequence and step: three requests prefilled in two chunks, the middle one
# decoding in the second (decodes go first); then decodes alone over slots out of order.
PREFILL_IN_TWO_CHUNKS = [([130, 7, 64], [5, 2, 9]), ([1, 70, 3], [2, 5, 9])]
DECODE_STEPS = [([1] * 6, [7, 0, 11, 3, 9, 1])] * 3


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    error = relative_error(actual, expected)
    assert error < TOLERANCE, error


def check_delta_rule_steps(steps) -> None:
    """Each step through both implementations from the same pool: the outputs, and the whole pool after it
    (slots outside the step untouched)."""
    pool = torch.randn(POOL, HEADS, DK, DV, device=DEVICE)
    ours, theirs = pool.clone(), pool.clone()
    for lengths, slots in steps:
        metadata = step_metadata(lengths, slots, DEVICE)
        q, k, v, g, beta = delta_rule_inputs(sum(lengths), HEADS, DK, DV, DEVICE)
        assert_close(gdn.gated_delta_rule(q, k, v, g, beta, ours, metadata),
                     reference.gated_delta_rule(q, k, v, g, beta, theirs, metadata))
        assert_close(ours, theirs)


def check_conv_steps(steps) -> None:
    pool = torch.randn(POOL, CHANNELS, WIDTH - 1, device=DEVICE).to(torch.bfloat16)
    ours, theirs = pool.clone(), pool.clone()
    for lengths, slots in steps:
        metadata = step_metadata(lengths, slots, DEVICE)
        x, weight = conv_inputs(sum(lengths), CHANNELS, WIDTH, DEVICE)
        assert_close(gdn.causal_conv1d(x, weight, ours, metadata), reference.causal_conv1d(x, weight, theirs, metadata))
        assert_close(ours, theirs)


def test_the_triton_backend_runs_fla_here():
    from engine.kernels.triton import BACKEND
    assert BACKEND.ops["gated_delta_rule"] is gdn.gated_delta_rule
    assert BACKEND.ops["causal_conv1d"] is gdn.causal_conv1d


def test_delta_rule_varlen_prefill_in_two_chunks_carries_the_states():
    check_delta_rule_steps(PREFILL_IN_TWO_CHUNKS)


def test_delta_rule_decodes_read_and_write_their_slots_out_of_order():
    check_delta_rule_steps(DECODE_STEPS)


def test_conv_varlen_prefill_in_two_chunks_carries_the_states():
    check_conv_steps(PREFILL_IN_TWO_CHUNKS)


def test_conv_decodes_read_and_write_their_slots_out_of_order():
    check_conv_steps(DECODE_STEPS)


def test_a_pass_without_caches_starts_every_sequence_from_zero():
    metadata = step_metadata([1, 1, 50, 3], [-1] * 4, DEVICE)
    q, k, v, g, beta = delta_rule_inputs(metadata.num_tokens, HEADS, DK, DV, DEVICE)
    assert_close(gdn.gated_delta_rule(q, k, v, g, beta, None, metadata),
                 reference.gated_delta_rule(q, k, v, g, beta, None, metadata))
    x, weight = conv_inputs(metadata.num_tokens, CHANNELS, WIDTH, DEVICE)
    assert_close(gdn.causal_conv1d(x, weight, None, metadata), reference.causal_conv1d(x, weight, None, metadata))
