"""The Triton MLA kernels (engine/kernels/triton/mla.py, mla_sparse.py) against the torch reference: the
latent-cache write, the absorbed decode (ragged contexts, shuffled block tables, split and unsplit, metadata sized for a CUDA
graph), the expanded prefill with and without a cached prefix, mixed batches, the profiling pass, sparse
attention with its log-sum-exp, and all of them over an FP8 latent cache with a per-tensor scale.

On a CUDA GPU the kernels run compiled (tiny and DeepSeek-V2-Lite shapes); elsewhere under TRITON_INTERPRET=1
at tiny shapes: MLA as tests/tiny_models.py's deepseek configs have it (L=32, R=8, N=16, V=24, 6 heads)."""
from __future__ import annotations


import pytest
import torch

from triton_device import DEVICE, ON_GPU  # noqa: E402  (skips the module without Triton)

from engine.kernels.attention import CommonAttentionMetadata, KVCacheQuant, quantize_to_fp8  # noqa: E402
from engine.kernels.mla import MLAWeights  # noqa: E402
from engine.kernels.torch import mla as reference  # noqa: E402
from engine.kernels.triton import mla, mla_sparse  # noqa: E402

# (heads, kv_lora_rank L, rope R, qk_nope N, v_head_dim V)
TINY = (6, 32, 8, 16, 24)
LITE = (16, 512, 64, 128, 128)  # DeepSeek-V2-Lite's attention
SHAPES = [TINY, LITE] if ON_GPU else [TINY]
DTYPES = [torch.float32, torch.bfloat16]
BLOCK_SIZE = 4


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """The largest error relative to the output's scale (bf16: a few units in the last place)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual.shape, expected.shape)
    limit = 2e-5 if dtype == torch.float32 else 3e-2
    error = float((actual.double() - expected.double()).abs().max() / expected.double().abs().max())
    assert error < limit, error


def make_weights(shape, dtype) -> MLAWeights:
    heads, rank, _, nope, v = shape
    kv_b = (torch.randn(heads * (nope + v), rank) * rank ** -0.5).to(DEVICE, dtype)
    per_head = kv_b.view(heads, nope + v, rank)
    return MLAWeights(lambda x: x @ kv_b.T, per_head[:, :nope], per_head[:, nope:])  # strided, as the layer's


def make_batch(shape, dtype, query_lens, seq_lens, num_decodes, extra_blocks=3):
    """Inputs of one step and its metadata: each sequence's blocks shuffled over a cache filled with noise
    (its cached prefix and everything it must not read), slots of its last query_len positions."""
    heads, rank, rope, nope, _ = shape
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    order = torch.randperm(num_blocks)
    width = max(blocks_per_seq) + 1
    block_table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for seq, count in enumerate(blocks_per_seq):
        block_table[seq, :count] = order[used:used + count]
        used += count
    slots = []
    for seq, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        for pos in range(s_len - q_len, s_len):
            slots.append(int(block_table[seq, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    num_tokens = starts[-1]
    metadata = CommonAttentionMetadata(
        num_seqs=len(seq_lens), num_decodes=num_decodes, num_tokens=num_tokens,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), block_table=block_table.to(DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc_cpu=starts, seq_lens_cpu=list(seq_lens),
        num_computed_tokens_cpu=[s - q for s, q in zip(seq_lens, query_lens)])
    cache = torch.randn(num_blocks, BLOCK_SIZE, rank + rope).to(DEVICE, dtype)
    q_nope = torch.randn(num_tokens, heads, nope).to(DEVICE, dtype)
    q_pe = torch.randn(num_tokens, heads, rope).to(DEVICE, dtype)
    latent = torch.randn(num_tokens, rank).to(DEVICE, dtype)
    k_pe = torch.randn(num_tokens, 1, rope).to(DEVICE, dtype)[:, 0]  # a view, as the layer passes it
    return (q_nope, q_pe, latent, k_pe), cache, metadata


def run_both(shape, dtype, query_lens, seq_lens, num_decodes, scale=0.3):
    """(Triton output, reference output), after checking that both wrote the same cache."""
    inputs, cache, metadata = make_batch(shape, dtype, query_lens, seq_lens, num_decodes)
    weights = make_weights(shape, dtype)
    cache_ref = cache.clone()
    out = mla.mla_attention(*inputs, cache, metadata, weights, scale, BLOCK_SIZE)
    expected = reference.mla_attention(*inputs, cache_ref, metadata, weights, scale, BLOCK_SIZE)
    assert torch.equal(cache, cache_ref)
    return out, expected


# ---- decode -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("split", [False, True], ids=["one_split", "splits"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_decode_matches_reference_over_ragged_shuffled_contexts(shape, dtype, split, monkeypatch):
    if split:  # splits of one tile each, so that every length here spreads over several
        monkeypatch.setattr(mla, "MIN_SPLIT_TOKENS", 16)
    seq_lens = [1, 7, 20, 33] if not ON_GPU else [1, 7, 200, 1033, 64, 5]
    out, expected = run_both(shape, dtype, [1] * len(seq_lens), seq_lens, len(seq_lens))
    assert_close_to_scale(out, expected, dtype)


def test_decode_merges_many_splits_in_chunks(monkeypatch):
    """More splits than the reduction loads at once (on a pretended large GPU), beside a one-split sequence."""
    monkeypatch.setattr(mla, "MIN_SPLIT_TOKENS", 16)
    monkeypatch.setattr(mla, "REDUCE_CHUNK", 4)
    monkeypatch.setattr(mla.workspace, "num_sms", lambda device: 64)
    assert mla.decode_splits(2, 1, 200, 16, torch.device(DEVICE))[0] == 13
    out, expected = run_both(TINY, torch.float32, [1, 1], [200, 3], 2)
    assert_close_to_scale(out, expected, torch.float32)


def test_decode_splits_spread_each_sequence_over_the_grid(monkeypatch):
    monkeypatch.setattr(mla, "MIN_SPLIT_TOKENS", 16)
    splits, min_tiles = mla.decode_splits(1, 1, 1000, 16, torch.device(DEVICE))
    assert splits > 1 and min_tiles == 1
    assert mla.decode_splits(1, 1, 10, 16, torch.device(DEVICE)) == (1, 1)


def test_decode_reads_only_device_lengths():
    """Metadata as a CUDA graph captures it: host lengths at the longest context, rows wider than needed,
    a padding row (length 1, block 0, slot -1) behind the real ones: the real rows still match."""
    shape, dtype = TINY, torch.float32
    seq_lens = [9, 30, 2]
    inputs, cache, metadata = make_batch(shape, dtype, [1, 1, 1], seq_lens, 3)
    weights = make_weights(shape, dtype)
    expected = reference.mla_attention(*inputs, cache.clone(), metadata, weights, 0.3, BLOCK_SIZE)
    max_model_len = 64
    table = torch.zeros(4, max_model_len // BLOCK_SIZE, dtype=torch.int32, device=DEVICE)
    table[:3, :metadata.block_table.shape[1]] = metadata.block_table
    padded = [torch.cat((x, torch.zeros_like(x[:1]))) for x in inputs]
    graph_metadata = CommonAttentionMetadata(
        num_seqs=4, num_decodes=4, num_tokens=4, query_start_loc=torch.arange(5, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens + [1], dtype=torch.int32, device=DEVICE), block_table=table,
        slot_mapping=torch.cat((metadata.slot_mapping, metadata.slot_mapping.new_full((1,), -1))),
        max_query_len=1, max_seq_len=max_model_len, query_start_loc_cpu=list(range(5)),
        seq_lens_cpu=[max_model_len] * 4, num_computed_tokens_cpu=[max_model_len - 1] * 4)
    before = cache.clone()
    out = mla.mla_attention(*padded, cache, graph_metadata, weights, 0.3, BLOCK_SIZE)
    assert_close_to_scale(out[:3], expected, dtype)
    changed = (cache != before).flatten(2).any(-1).nonzero().tolist()
    written = [[int(s) // BLOCK_SIZE, int(s) % BLOCK_SIZE] for s in metadata.slot_mapping]
    assert sorted(changed) == sorted(written)  # the padding row stored nothing


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_decode_replays_in_a_cuda_graph_with_new_lengths():
    shape, dtype = LITE, torch.bfloat16
    inputs, cache, metadata = make_batch(shape, dtype, [1, 1], [300, 40], 2, extra_blocks=40)
    weights = make_weights(shape, dtype)
    graph_metadata = CommonAttentionMetadata(**{**metadata.__dict__, "seq_lens_cpu": [512, 512]})
    mla.mla_attention(*inputs, cache, graph_metadata, weights, 0.3, BLOCK_SIZE)  # warm-up: compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla.mla_attention(*inputs, cache, graph_metadata, weights, 0.3, BLOCK_SIZE)
    metadata.seq_lens.copy_(torch.tensor([97, 140], dtype=torch.int32))  # new lengths, same buffers
    graph.replay()
    torch.cuda.synchronize()
    metadata = CommonAttentionMetadata(**{**metadata.__dict__, "seq_lens_cpu": [97, 140]})
    expected = reference.mla_attention(*inputs, cache.clone(), metadata, weights, 0.3, BLOCK_SIZE)
    assert_close_to_scale(out, expected, dtype)


# ---- prefill and mixed batches --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("query_lens, seq_lens", [([5, 11], [5, 11]), ([3, 6], [10, 6]), ([4], [13])],
                         ids=["fresh", "one_cached_prefix", "cached_prefix"])
def test_prefill_matches_reference(shape, dtype, query_lens, seq_lens):
    if ON_GPU:  # long enough for several query and key tiles
        query_lens, seq_lens = [q * 13 for q in query_lens], [s * 13 for s in seq_lens]
    out, expected = run_both(shape, dtype, query_lens, seq_lens, 0)
    assert_close_to_scale(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_decode_and_prefill_batch(dtype):
    out, expected = run_both(TINY, dtype, [1, 1, 6, 3], [17, 2, 6, 9], 2)
    assert_close_to_scale(out, expected, dtype)


def test_profiling_pass_attends_within_the_step():
    (q_nope, q_pe, latent, k_pe), _, metadata = make_batch(TINY, torch.float32, [5, 3], [5, 3], 0)
    weights = make_weights(TINY, torch.float32)
    out = mla.mla_attention(q_nope, q_pe, latent, k_pe, None, metadata, weights, 0.3, BLOCK_SIZE)
    expected = reference.mla_attention(q_nope, q_pe, latent, k_pe, None, metadata, weights, 0.3, BLOCK_SIZE)
    assert_close_to_scale(out, expected, torch.float32)


# ---- sparse -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("v_dim", [32, 40], ids=["latent_values", "whole_entry_values"])
def test_sparse_matches_reference_with_padding_and_an_empty_row(dtype, v_dim):
    heads, dim, top_k = 6, 40, 21
    cache = torch.randn(12, BLOCK_SIZE, dim).to(DEVICE, dtype)
    q = torch.randn(5, heads, dim).to(DEVICE, dtype)
    slots = torch.stack([torch.randperm(12 * BLOCK_SIZE)[:top_k] for _ in range(5)])
    slots[1, 9:] = -1  # trailing padding
    slots[2, ::3] = -1  # scattered padding
    slots[3] = -1  # nothing to attend to
    slots = slots.to(DEVICE)
    out, lse = mla_sparse.mla_sparse_attention(q, cache, slots, 0.2, v_dim)
    expected, expected_lse = reference.mla_sparse_attention(q, cache, slots, 0.2, v_dim)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(out[3], torch.zeros_like(out[3])) and bool((lse[3] == float("-inf")).all())
    rows = [0, 1, 2, 4]
    assert_close_to_scale(out[rows], expected[rows], dtype)
    torch.testing.assert_close(lse[rows], expected_lse[rows], rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 2e-2)


def test_sparse_rejects_mismatched_shapes():
    cache = torch.zeros(2, BLOCK_SIZE, 40, device=DEVICE)
    with pytest.raises(ValueError, match="features"):
        mla_sparse.mla_sparse_attention(torch.zeros(3, 2, 32, device=DEVICE), cache, torch.zeros(3, 4, dtype=torch.int64,
                                                                                            device=DEVICE), 1.0, 32)
    with pytest.raises(ValueError, match="slots"):
        mla_sparse.mla_sparse_attention(torch.zeros(3, 2, 40, device=DEVICE), cache, torch.zeros(2, 4, dtype=torch.int64,
                                                                                            device=DEVICE), 1.0, 32)


# ---- FP8 latent cache ---------------------------------------------------------------------------------

FP8 = torch.float8_e4m3fn  # the Triton backend's FP8 KV dtype


def fp8_quant(scale: float) -> KVCacheQuant:
    """A per-tensor FP8 latent-cache scale (the one tensor for keys and values, as the runner binds it)."""
    tensor = torch.tensor([scale], dtype=torch.float32, device=DEVICE)
    return KVCacheQuant("tensor", tensor, tensor)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_cache_mixed_batch_writes_the_reference_bytes_and_matches_it(dtype, monkeypatch):
    """Split decodes, a prefill over a cached prefix and a fresh one over an FP8 cache (scale 0.05, so that
    the scale shows): the write stores the reference's FP8 bytes, and the outputs match the reference's."""
    monkeypatch.setattr(mla, "MIN_SPLIT_TOKENS", 16)
    inputs, cache, metadata = make_batch(TINY, dtype, [1, 1, 6, 3], [37, 2, 6, 9], 2)
    weights = make_weights(TINY, dtype)
    quant = fp8_quant(0.05)
    cache = quantize_to_fp8(cache, quant.k_scale, FP8)
    cache_ref = cache.clone()
    out = mla.mla_attention(*inputs, cache, metadata, weights, 0.3, BLOCK_SIZE, kv_quant=quant)
    expected = reference.mla_attention(*inputs, cache_ref, metadata, weights, 0.3, BLOCK_SIZE, kv_quant=quant)
    assert cache.dtype == FP8 and torch.equal(cache.view(torch.uint8), cache_ref.view(torch.uint8))
    assert_close_to_scale(out, expected, dtype)
    unscaled = reference.mla_attention(*inputs, cache_ref.clone(), metadata, weights, 0.3, BLOCK_SIZE,
                                       kv_quant=fp8_quant(1.0))
    assert (out[:2] - unscaled[:2]).abs().max() > 0.1 * unscaled[:2].abs().max()  # decodes read the scale


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_cache_sparse_matches_reference(dtype):
    heads, dim, v_dim, top_k = 6, 40, 32, 21
    quant = fp8_quant(0.05)
    cache = quantize_to_fp8(torch.randn(12, BLOCK_SIZE, dim).to(DEVICE), quant.k_scale, FP8)
    q = torch.randn(4, heads, dim).to(DEVICE, dtype)
    slots = torch.stack([torch.randperm(12 * BLOCK_SIZE)[:top_k] for _ in range(4)])
    slots[1, 9:] = -1
    slots[2] = -1
    slots = slots.to(DEVICE)
    out, lse = mla_sparse.mla_sparse_attention(q, cache, slots, 0.2, v_dim, kv_quant=quant)
    expected, expected_lse = reference.mla_sparse_attention(q, cache, slots, 0.2, v_dim, kv_quant=quant)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and bool((lse[2] == float("-inf")).all())
    rows = [0, 1, 3]
    assert_close_to_scale(out[rows], expected[rows], dtype)
    torch.testing.assert_close(lse[rows], expected_lse[rows], rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 2e-2)


# ---- the layer's capture flag -------------------------------------------------------------------------

def test_mla_layer_is_capturable_with_the_triton_op_only(monkeypatch):
    """MLAAttention's decode is capturable through the Triton op, not the reference; a subclass with a forward
    of its own (DeepSeek-V3.2's sparse layer, looping on host lengths) is not, unless it says so."""
    from engine.kernels import ops
    from engine.layers.mla import MLAAttention

    class OwnForward(MLAAttention):
        def forward(self, positions, hidden_states):
            raise NotImplementedError

    class DeclaredCapturable(OwnForward):
        supports_cuda_graphs = True
    layer, own, declared = (cls.__new__(cls) for cls in (MLAAttention, OwnForward, DeclaredCapturable))
    monkeypatch.setattr(ops, "mla_attention", mla.mla_attention, raising=False)
    assert layer.supports_cuda_graphs and not own.supports_cuda_graphs and declared.supports_cuda_graphs
    monkeypatch.setattr(ops, "mla_attention", reference.mla_attention, raising=False)
    assert not layer.supports_cuda_graphs
