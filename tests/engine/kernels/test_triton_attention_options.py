"""The Triton attention kernels with options (sliding window, sinks, soft-capping, head sizes up to 512)
against the torch reference (itself held to a dense reference in tests/engine/test_attention_options.py):
prefill over cached prefixes, split-K decode (sinks counted once across splits), the fused decode step, with
every block a window gave back poisoned with NaN, so that one read of it shows in the output.

On a CUDA GPU the kernels run compiled; elsewhere under TRITON_INTERPRET=1 at tiny sizes."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from triton_device import DEVICE  # noqa: E402  (skips the module without Triton)
from attention_inputs import cos_sin_table  # noqa: E402
from windowed_attention import paged_batch  # noqa: E402

from engine.kernels.attention import AttentionOptions  # noqa: E402
from engine.kernels.torch.attention import TorchAttentionBackend  # noqa: E402
from engine.kernels.triton.attention import TritonAttentionBackend  # noqa: E402

MIXED = [(0, 1), (9, 1), (45, 1), (100, 1), (0, 40), (35, 30), (3, 5)]
DECODES = [(0, 1), (9, 1), (70, 1), (150, 1), (33, 1)]
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def sinks(num_heads: int) -> torch.Tensor:
    return (torch.randn(num_heads) * 2).to(DEVICE)


def run(seqs, options: AttentionOptions, num_heads=4, num_kv_heads=2, head_size=32, block_size=16,
        dtype=torch.float32, rope=False, reference_options: AttentionOptions | None = None, **plan):
    """(Triton's output, the torch reference's) on one batch; the blocks the window gave back are NaN."""
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 4
    common, dropped = paged_batch(seqs, block_size, num_blocks, options.window, device=DEVICE)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, device=DEVICE).to(dtype)
    if dropped:
        cache[:, dropped] = float("nan")
    query = torch.randn(common.num_tokens, num_heads, head_size, device=DEVICE).to(dtype)
    key = torch.randn(common.num_tokens, num_kv_heads, head_size, device=DEVICE).to(dtype)
    value = torch.randn(common.num_tokens, num_kv_heads, head_size, device=DEVICE).to(dtype)
    rope_args = None
    if rope:
        positions = torch.tensor([p for c, n in seqs for p in range(c, c + n)], device=DEVICE)
        rope_args = (positions, cos_sin_table(max(c + n for c, n in seqs), head_size), True)
    scale = head_size ** -0.5
    expected_cache = cache.clone()
    expected = TorchAttentionBackend.forward(query.clone(), key.clone(), value, expected_cache, common, scale,
                                             block_size, rope_args, options=reference_options or options)
    metadata = TritonAttentionBackend.build_metadata(common, block_size)
    if plan:
        metadata = dataclasses.replace(metadata, **plan, _decode_plans={})
    actual = TritonAttentionBackend.forward(query, key, value, cache, metadata, scale, block_size, rope_args,
                                            options=options)
    return actual, expected, metadata


def assert_close(actual, expected, dtype=torch.float32):
    assert torch.isfinite(actual).all(), "a kernel read a block outside the window (NaN-poisoned)"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])


OPTIONS = {
    "window16": lambda h: AttentionOptions(window=16),
    "window1": lambda h: AttentionOptions(window=1),
    "window20+sinks": lambda h: AttentionOptions(window=20, sinks=sinks(h)),
    "sinks": lambda h: AttentionOptions(sinks=sinks(h)),
    "softcap": lambda h: AttentionOptions(softcap=2.0),
    "all": lambda h: AttentionOptions(window=24, sinks=sinks(h), softcap=4.0),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_mixed_batch_with_options_matches_reference(name):
    options = OPTIONS[name](4)
    actual, expected, _ = run(MIXED, options)
    assert_close(actual, expected)


@pytest.mark.parametrize("name", ["window16", "window20+sinks", "all"])
def test_split_k_decode_counts_sinks_once_and_reads_only_the_window(name):
    options = OPTIONS[name](8)
    actual, expected, metadata = run(DECODES, options, num_heads=8, num_kv_heads=2, num_sms=64,
                                     min_split_tokens=16)
    assert_close(actual, expected)
    num_splits, _ = next(iter(metadata._decode_plans.values()))
    assert num_splits >= 2  # the sinks went through the reduction


@pytest.mark.parametrize("name", ["window16", "window20+sinks", "all"])
def test_fused_decode_step_with_options(name):
    options = OPTIONS[name](4)
    for plan in ({}, dict(num_sms=64, min_split_tokens=16)):  # one split, and split-K combined in the kernel
        actual, expected, _ = run(DECODES, options, rope=True, **plan)
        torch.testing.assert_close(actual, expected, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("head_size", [256, 512])
def test_wide_heads_with_window_and_sinks(head_size):
    options = AttentionOptions(window=16, sinks=sinks(4))
    actual, expected, _ = run([(0, 1), (40, 1), (20, 12)], options, num_heads=4, num_kv_heads=1,
                              head_size=head_size)
    assert_close(actual, expected)


def test_bf16_with_options():
    options = AttentionOptions(window=16, sinks=sinks(4), softcap=8.0)
    actual, expected, _ = run(MIXED, options, dtype=torch.bfloat16)
    assert_close(actual, expected, torch.bfloat16)


def test_negative_controls_fail():
    """What these comparisons catch: a window off by one, sinks ignored."""
    window = AttentionOptions(window=16)
    actual, expected, _ = run(MIXED, window, reference_options=AttentionOptions(window=17))
    assert not torch.allclose(actual, expected, rtol=1e-4, atol=1e-4)
    with_sinks = AttentionOptions(sinks=sinks(4))
    actual, expected, _ = run(DECODES, with_sinks, reference_options=AttentionOptions())
    assert not torch.allclose(actual, expected, rtol=1e-4, atol=1e-4)


def test_a_mixed_step_with_more_than_eight_decode_splits_takes_the_wide_reduction():
    """The split reduction compiles two tile sizes (up to 8 splits, and up to the most): a mixed step whose
    long decodes take more than 8 splits goes through the wide one, sinks included."""
    from engine.kernels.triton import decode_attention
    seqs = [(300, 1), (180, 1), (0, 20)]  # two decodes with long contexts, one prefill
    actual, expected, metadata = run(seqs, AttentionOptions(sinks=sinks(4)), num_sms=512, min_split_tokens=16)
    assert_close(actual, expected)
    num_splits, _ = next(iter(metadata._decode_plans.values()))
    assert num_splits > 8 and decode_attention.splits_pad(num_splits) == 64
