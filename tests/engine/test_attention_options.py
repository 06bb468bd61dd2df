"""Attention options on the torch reference backend (the Triton kernels' own tests are in
tests/engine/kernels/test_triton_attention_options.py): sliding windows that read only the blocks inside the
window, learned sinks, logit soft-capping, head sizes up to 512, against an independent dense reference,
with negative controls (a window off by one, sinks dropped, no cap) that the comparison catches."""
from __future__ import annotations

import pytest
import torch

from engine.kernels.attention import AttentionOptions, CommonAttentionMetadata
from engine.kernels.torch.attention import TorchAttentionBackend
from engine.kv_cache_spec import FULL_GROUP, CacheGroupMetadata
from windowed_attention import dense_reference, paged_batch

# (cached, new): decodes first (across block ends, shorter and longer than the window), then a chunked
# prefill whose window starts in its cached prefix, a prefill longer than the window, and a short one.
SEQS = [(0, 1), (7, 1), (40, 1), (77, 1), (30, 25), (0, 45), (3, 4)]


def run_case(options: AttentionOptions, reference_options: AttentionOptions, num_heads=4, num_kv_heads=2,
             head_size=32, block_size=8, dtype=torch.float32, seed=0, poison_window: int | None = -1):
    """The backend's outputs and the reference's, per sequence; blocks a window gave back are NaN."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in SEQS) + 4
    poison_window = options.window if poison_window == -1 else poison_window
    metadata, dropped = paged_batch(SEQS, block_size, num_blocks, poison_window, generator=generator)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=generator).to(dtype)
    if dropped:
        cache[:, dropped] = float("nan")
    tokens = metadata.num_tokens
    query = torch.randn(tokens, num_heads, head_size, generator=generator).to(dtype)
    key = torch.randn(tokens, num_kv_heads, head_size, generator=generator).to(dtype)
    value = torch.randn(tokens, num_kv_heads, head_size, generator=generator).to(dtype)
    scale = head_size ** -0.5
    out = TorchAttentionBackend.forward(query, key, value, cache, metadata, scale, block_size, options=options)
    results = []
    for seq, (cached, new) in enumerate(SEQS):
        begin = metadata.query_start_loc_cpu[seq]
        blocks = metadata.block_table[seq, :-(-(cached + new) // block_size)].long()
        keys = cache[0][blocks].flatten(0, 1)[:cached + new]  # this step's keys were written in place
        values = cache[1][blocks].flatten(0, 1)[:cached + new]
        expected = dense_reference(query[begin:begin + new], keys.nan_to_num(), values.nan_to_num(),
                                   torch.arange(cached, cached + new), scale, reference_options)
        results.append((out[begin:begin + new].double(), expected))
    return results


def close(results, tolerance=1e-5) -> bool:
    return all(torch.allclose(got, expected, rtol=tolerance, atol=tolerance) for got, expected in results)


def sinks(num_heads=4, seed=1) -> torch.Tensor:
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("options", [
    AttentionOptions(window=16),
    AttentionOptions(window=1),
    AttentionOptions(window=9, sinks=sinks()),
    AttentionOptions(sinks=sinks()),
    AttentionOptions(softcap=3.0),
    AttentionOptions(window=12, sinks=sinks(), softcap=5.0),
], ids=["window16", "window1", "window9+sinks", "sinks", "softcap", "all"])
def test_options_match_the_dense_reference(options):
    assert close(run_case(options, options))


def test_negative_controls_fail_the_comparison():
    """The comparison is not blind: a kernel that got each option wrong would fail it."""
    window = AttentionOptions(window=16)
    assert not close(run_case(window, AttentionOptions(window=17)))  # window off by one
    assert not close(run_case(window, AttentionOptions()))  # window ignored
    with_sinks = AttentionOptions(sinks=sinks())
    assert not close(run_case(with_sinks, AttentionOptions()))  # sinks dropped
    assert not close(run_case(with_sinks, AttentionOptions(sinks=sinks() * 0.5)))
    capped = AttentionOptions(softcap=3.0)
    assert not close(run_case(capped, AttentionOptions()))


def test_a_window_reads_no_block_it_gave_back():
    """Blocks before each sequence's window are NaN in run_case: one read would make an output NaN."""
    results = run_case(AttentionOptions(window=10), AttentionOptions(window=10))
    assert all(torch.isfinite(got).all() for got, _ in results) and close(results)
    # Control: attention over the whole context of the same poisoned cache does read them.
    whole = run_case(AttentionOptions(sinks=sinks()), AttentionOptions(sinks=sinks()), poison_window=10)
    assert not all(torch.isfinite(got).all() for got, _ in whole)


@pytest.mark.parametrize("head_size", [256, 512])
def test_head_sizes_up_to_512(head_size):
    options = AttentionOptions(window=16, sinks=sinks(8))
    assert close(run_case(options, options, num_heads=8, num_kv_heads=1, head_size=head_size), 1e-4)


def test_bf16_with_options_stays_close():
    options = AttentionOptions(window=16, sinks=sinks(), softcap=10.0)
    assert close(run_case(options, options, dtype=torch.bfloat16), 3e-2)


def test_a_layer_reads_its_own_groups_table_and_slots():
    full_table = torch.zeros(1, 4, dtype=torch.int32)
    window_table = torch.ones(1, 4, dtype=torch.int32)
    metadata = CommonAttentionMetadata(
        num_seqs=1, num_decodes=1, num_tokens=1, query_start_loc=torch.tensor([0, 1]),
        seq_lens=torch.tensor([5]), block_table=full_table, slot_mapping=torch.tensor([4]),
        max_query_len=1, max_seq_len=5, query_start_loc_cpu=[0, 1], seq_lens_cpu=[5],
        num_computed_tokens_cpu=[4])
    metadata.groups = {FULL_GROUP: CacheGroupMetadata(1, None, 8, full_table, metadata.slot_mapping, None),
                       (1, 16): CacheGroupMetadata(1, 16, 8, window_table, torch.tensor([12]), None)}
    view = metadata.for_group((1, 16))
    assert view.block_table is window_table and view.slot_mapping.tolist() == [12]
    assert metadata.for_group((1, 16)) is view  # built once a step, shared by the group's layers
    assert metadata.for_group(FULL_GROUP) is metadata
    with pytest.raises(KeyError, match=r"no paged cache group \(1, 32\)"):
        metadata.for_group((1, 32))


def test_options_refuse_nonsense():
    with pytest.raises(ValueError, match="window"):
        AttentionOptions(window=0)
    with pytest.raises(ValueError, match="positive cap"):
        AttentionOptions(softcap=0.0)
