"""The Triton backend against the torch reference on fresh random inputs: norms, rotary embedding,
SiLU-and-mul, paged attention (decode, the fused decode step, prefill, mixed, cached prefixes, profiling) and
sampling.

On a CUDA GPU the kernels run compiled at real sizes; elsewhere under TRITON_INTERPRET=1 at tiny sizes."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from triton_device import DEVICE, ON_GPU  # noqa: E402  (skips the module without Triton)
from attention_inputs import cos_sin_table, make_batch, qkv_views, randn  # noqa: E402

from engine.kernels.attention import CommonAttentionMetadata  # noqa: E402
from engine.kernels.registry import OPS  # noqa: E402
from engine.kernels.sampling import SamplingTensors  # noqa: E402
from engine.kernels.torch import ops as reference  # noqa: E402
from engine.kernels.torch.attention import TorchAttentionBackend  # noqa: E402
from engine.kernels.torch.sampling import apply_top_k_top_p_min_p  # noqa: E402
from engine.kernels.torch.sampling import sample as reference_sample  # noqa: E402
from engine.kernels import triton as triton_backend  # noqa: E402
from engine.kernels.triton import attention as triton_attention  # noqa: E402
from engine.kernels.triton import decode_attention, gemv, ops, workspace  # noqa: E402
from engine.kernels.triton.attention import TritonAttentionBackend  # noqa: E402
from engine.kernels.triton.sampling import sample  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
             torch.float16: dict(rtol=5e-3, atol=5e-3)}


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """For long sums (GEMM outputs): the largest error relative to the output's scale, not per element."""
    limit = 1e-5 if dtype == torch.float32 else 3e-2
    error = float((actual.double() - expected.double()).abs().max() / expected.double().abs().max())
    assert error < limit, error


# ---- norms, activation, rotary ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 1000, 4096] if ON_GPU else [64, 300])
def test_rms_norm_matches_reference(dtype, hidden):
    x, weight = randn(37, hidden, dtype=dtype), randn(hidden, dtype=dtype)
    assert_matches(ops.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm_returns_norm_of_sum_and_sum(dtype):
    hidden = 4096 if ON_GPU else 256
    x, residual, weight = randn(19, hidden, dtype=dtype), randn(19, hidden, dtype=dtype), randn(hidden, dtype=dtype)
    normed, summed = ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    expected_normed, expected_sum = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert_matches(summed, expected_sum, dtype)
    assert_matches(normed, expected_normed, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("hidden", [256, 40000])
def test_fused_add_rms_norm_rounds_a_float32_sum_to_the_residuals_dtype(dtype, hidden):
    """A row-parallel layer's all-reduced float32 sum goes in as x: rounded once to the residual's dtype,
    exactly as the torch reference (and as an x already in that dtype) would be."""
    x32, residual, weight = randn(5, hidden), randn(5, hidden, dtype=dtype), randn(hidden, dtype=dtype)
    normed, summed = ops.fused_add_rms_norm(x32, residual, weight, 1e-5)
    expected_normed, expected_sum = reference.fused_add_rms_norm(x32, residual, weight, 1e-5)
    assert summed.dtype == normed.dtype == dtype
    assert_close_to_scale(summed, expected_sum, dtype)
    assert_close_to_scale(normed, expected_normed, dtype)
    if ON_GPU:  # bit for bit (Triton's interpreter truncates float32 -> bf16 instead of rounding to nearest)
        torch.testing.assert_close(summed, expected_sum, rtol=0, atol=0)
        rounded_first = ops.fused_add_rms_norm(x32.to(dtype), residual, weight, 1e-5)
        torch.testing.assert_close(summed, rounded_first[1], rtol=0, atol=0)
        torch.testing.assert_close(normed, rounded_first[0], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("hidden", [256, 40000])
@pytest.mark.parametrize("x_dtype", ["float32", "model"])
def test_fused_add_rms_norm_keeps_a_float32_residual_stream(dtype, hidden, x_dtype):
    """A float32 residual stream (residual_dtype="float32"): x, a float32 all-reduced sum or an activation,
    is rounded to the activations' dtype as one GPU's GEMM output is, then added in float32; the stream
    stays float32 and the normalised output is in the activations' dtype."""
    x = randn(5, hidden, dtype=torch.float32 if x_dtype == "float32" else dtype)
    residual, weight = randn(5, hidden), randn(hidden, dtype=dtype)
    normed, summed = ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    expected_normed, expected_sum = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert summed.dtype == torch.float32 and normed.dtype == dtype
    assert_close_to_scale(normed, expected_normed, dtype)
    if ON_GPU or x_dtype == "model":  # bit for bit (the interpreter truncates float32 -> bf16, not rounds)
        torch.testing.assert_close(summed, x.to(dtype).float() + residual, rtol=0, atol=0)
        torch.testing.assert_close(expected_sum, summed, rtol=0, atol=0)
    else:
        assert_close_to_scale(summed, expected_sum, dtype)
    if ON_GPU and hidden <= 4096:  # bit for bit where a row is one pass (longer rows sum their squares in
        # chunks, in another order than torch)
        torch.testing.assert_close(normed, expected_normed, rtol=0, atol=0)
    alone = ops.rms_norm(summed, weight, 1e-5)  # the first layer's norm of a float32 stream, unfused
    assert alone.dtype == dtype
    assert_close_to_scale(alone, reference.rms_norm(summed, weight, 1e-5), dtype)


def test_rms_norm_of_rows_longer_than_one_pass():
    x, residual, weight = randn(3, 40000), randn(3, 40000), randn(40000)
    assert_matches(ops.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), torch.float32)
    for actual, expected in zip(ops.fused_add_rms_norm(x, residual, weight, 1e-6),
                                reference.fused_add_rms_norm(x, residual, weight, 1e-6)):
        assert_matches(actual, expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_of_strided_head_view(dtype):
    """q/k norms see [T, H, D] views into a fused QKV output."""
    qkv = randn(11, (4 + 2 + 2) * 64, dtype=dtype)
    q = qkv[:, :4 * 64].reshape(-1, 4, 64)
    weight = randn(64, dtype=dtype)
    assert not q.is_contiguous()
    assert_matches(ops.rms_norm(q, weight, 1e-6), reference.rms_norm(q, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_matches_reference(dtype):
    x = randn(2, 13, 2 * (2816 if ON_GPU else 96), dtype=dtype)
    assert_matches(ops.silu_and_mul(x), reference.silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_tanh_and_mul_matches_reference(dtype):
    x = randn(2, 13, 2 * (2816 if ON_GPU else 96), dtype=dtype) * 3
    expected = reference.gelu_tanh_and_mul(x)
    assert_matches(ops.gelu_tanh_and_mul(x), expected, dtype)
    assert not torch.allclose(expected.float(), reference.silu_and_mul(x).float(), atol=0.05)  # not SiLU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head_size,rotary_dim", [(64, 64), (128, 64), (96, 48)])
def test_rotary_embedding_matches_reference_on_qkv_views(dtype, is_neox, head_size, rotary_dim):
    num_tokens, num_heads, num_kv_heads = (300, 32, 8) if ON_GPU else (9, 4, 2)
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    qkv = randn(num_tokens, q_size + 2 * kv_size, dtype=dtype)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.reshape(-1, num_heads, head_size), k.reshape(-1, num_kv_heads, head_size)
    positions = torch.randint(0, 4096, (num_tokens,), device=DEVICE)
    table = cos_sin_table(4096, rotary_dim)
    expected_q, expected_k = reference.rotary_embedding(positions, q.clone(), k.clone(), table, is_neox)
    actual_q, actual_k = ops.rotary_embedding(positions, q, k, table, is_neox)
    assert_matches(actual_q, expected_q, dtype)
    assert_matches(actual_k, expected_k, dtype)


# ---- skinny GEMM ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("rows,n,k,bias", [(1, 70, 300, True), (5, 64, 512, False), (16, 33, 257, True)])
def test_skinny_gemm_matches_linear(dtype, rows, n, k, bias):
    """Outputs and reduction lengths that are not multiples of the tiles, with and without bias."""
    if ON_GPU:
        n, k = n * 64, k * 16
    x, weight = randn(rows, k, dtype=dtype), randn(n, k, dtype=dtype)
    b = randn(n, dtype=dtype) if bias else None
    expected = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
    for config in (dict(block_n=32, block_k=128), dict(block_n=16, block_k=64), {}):
        actual = gemv.skinny_gemm(x, weight, b, **config)
        assert actual.shape == (rows, n) and actual.dtype == dtype
        if dtype == torch.float32:  # long fp32 sums in another order: error relative to the output's scale
            assert float((actual.double() - expected).abs().max() / expected.abs().max()) < 1e-5
        else:
            assert_matches(actual, expected.to(dtype), dtype)


@pytest.mark.parametrize("split", [2, 3, 8])
@pytest.mark.parametrize("gated,bias", [(False, True), (True, False)])
def test_split_k_skinny_gemm_matches_linear(split, gated, bias):
    """Split-K: each output tile's reduction shared by `split` programs (more than the K tiles: fewer
    splits, none empty), the last to arrive summing the partials; the arrival counters are left at zero,
    and a second call gives the same bits."""
    rows, n, k = 3, 48, 200
    if ON_GPU:
        n, k = n * 64, k * 16
    dtype = torch.bfloat16
    x, weight = randn(rows, k, dtype=dtype), randn(n, k, dtype=dtype)
    b = randn(n, dtype=dtype) if bias else None
    op = reference.gated_gemm if gated else torch.nn.functional.linear
    expected = op(x.double(), weight.double(), None if b is None else b.double())
    config = dict(block_n=16, block_k=32 if not ON_GPU else 256)
    actual = gemv.skinny_gemm(x, weight, b, **config, split=split, gated=gated)
    assert actual.shape == expected.shape and actual.dtype == dtype
    assert_close_to_scale(actual, expected, dtype)
    assert torch.equal(gemv.skinny_gemm(x, weight, b, **config, split=split, gated=gated), actual)
    assert not workspace._counters[x.device].any()


def test_skinny_gemm_keeps_leading_dims_and_reads_strided_rows():
    x = randn(2, 3, 96)[:, :, :64]  # rows with a stride of 96
    weight = randn(40, 64)
    assert_matches(gemv.skinny_gemm(x, weight, block_n=16, block_k=32), torch.nn.functional.linear(x, weight),
                   torch.float32)


def test_skinny_gemm_tiles_shrink_until_they_fit(monkeypatch):
    """A tile whose buffers do not fit the GPU's shared memory fails at launch; the next candidate is
    tried and the one that launched is kept for the shape."""
    from triton.runtime.errors import OutOfResources
    tried = []
    real = gemv.skinny_gemm

    def fake(x, weight, bias=None, **tiles):
        if not tiles:
            return real(x, weight, bias)
        tried.append(tiles)
        if tiles["block_k"] > 128:
            raise OutOfResources(300_000, 232_448, "shared memory")
        return real(x, weight, bias, **tiles)

    monkeypatch.setattr(gemv, "skinny_gemm", fake)
    monkeypatch.setattr(gemv, "_fitted", {})
    # bf16 with long rows: the preferred K tile is 512
    x, weight = randn(2, 8192, dtype=torch.bfloat16), randn(40, 8192, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x.double(), weight.double())
    actual = gemv.skinny_gemm(x, weight)
    assert float((actual.double() - expected).abs().max() / expected.abs().max()) < 2e-2
    assert [t["block_k"] for t in tried] == [512, 512, 256, 256, 128]
    assert len(gemv._fitted) == 1 and next(iter(gemv._fitted.values()))["block_k"] == 128
    tried.clear()
    gemv.skinny_gemm(x, weight)
    assert [t["block_k"] for t in tried] == [128], "the fitted tiles are reused"


def test_candidate_tiles_start_from_the_measured_best():
    first = next(gemv._candidate_tiles(4096, 14336, 2, 132))
    assert first == dict(block_n=32, block_k=512, num_stages=4, num_warps=4, split=1)
    assert next(gemv._candidate_tiles(4096, 4096, 2, 132)) == first, "thin projections too"
    assert all(t["block_k"] >= 64 and t["num_stages"] >= 2 for t in gemv._candidate_tiles(4096, 4096, 4, 132))


def test_programmatic_dependent_launch_is_off_without_sm90(monkeypatch):
    from engine.kernels.triton import pdl
    assert pdl.launch_options(torch.zeros(1)) == {"USE_PDL": False}  # host tensors never
    if ON_GPU:
        pdl._supported.cache_clear()
        monkeypatch.setenv("ATOM_RAY_TRITON_PDL", "0")
        assert pdl.launch_options(torch.zeros(1, device="cuda")) == {"USE_PDL": False}
        pdl._supported.cache_clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("rows,n,k,bias", [(1, 70, 300, True), (5, 64, 512, False), (16, 36, 257, True)])
def test_gated_skinny_gemm_matches_gemm_then_silu_and_mul(dtype, rows, n, k, bias):
    """SiLU-and-mul in the epilogue of a merged [gate; up] projection: the GEMM's then the activation's
    result, for output widths that are not multiples of the tile."""
    if ON_GPU:
        n, k = n * 64, k * 16
    x, weight = randn(rows, k, dtype=dtype), randn(2 * n, k, dtype=dtype)
    b = randn(2 * n, dtype=dtype) if bias else None
    expected = reference.gated_gemm(x.double(), weight.double(), None if b is None else b.double())
    for config in (dict(block_n=32, block_k=128, num_stages=2), dict(block_n=16, block_k=64, num_stages=2), {}):
        actual = gemv.skinny_gemm(x, weight, b, **config, gated=True)
        assert actual.shape == (rows, n) and actual.dtype == dtype
        assert_close_to_scale(actual, expected, dtype)


def test_gated_gemm_op_matches_reference_on_both_paths():
    """The skinny kernel for decode-sized half-precision batches on a GPU, the BLAS and the separate
    activation for everything else."""
    dtype = torch.bfloat16
    k, n = (4096, 1536) if ON_GPU else (96, 40)
    weight = randn(2 * n, k, dtype=dtype)
    for rows in (3, 40):
        x = randn(rows, k, dtype=dtype)
        actual, expected = gemv.gated_gemm(x, weight), reference.gated_gemm(x, weight)
        assert actual.shape == expected.shape == (rows, n)
        assert_close_to_scale(actual, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gemm_float32_returns_the_unrounded_float32_product(dtype):
    """A row-parallel rank's share: float32, closer to the exact product than the rounded GEMM output, on
    the skinny kernel's path (decode-sized rows on a GPU) and the BLAS path."""
    k, n = (4096, 1024) if ON_GPU else (96, 40)
    weight = randn(n, k, dtype=dtype)
    for rows in (3, 40):
        x = randn(rows, k, dtype=dtype)
        exact = torch.nn.functional.linear(x.double(), weight.double())
        actual = gemv.gemm_float32(x, weight)
        assert actual.shape == (rows, n) and actual.dtype == torch.float32
        assert float((actual.double() - exact).abs().max() / exact.abs().max()) < 1e-5
        if ON_GPU:  # half-precision rounding is far coarser than the float32 sum's error
            rounded = gemv.gemm(x, weight).double()
            assert (actual.double() - exact).abs().max() < (rounded - exact).abs().max()
    if not ON_GPU:  # on CPU the reference computes in float32 from exactly converted inputs
        assert torch.equal(reference.gemm_float32(x, weight), torch.nn.functional.linear(x.float(), weight.float()))
    skinny = gemv.skinny_gemm(x[:3], weight, out_dtype=torch.float32)
    assert skinny.dtype == torch.float32
    assert float((skinny.double() - exact[:3]).abs().max() / exact.abs().max()) < 1e-5


def test_gemm_op_takes_the_blas_for_large_batches_and_fp32():
    x, weight = randn(40, 32), randn(24, 32)
    assert_matches(gemv.gemm(x, weight), torch.nn.functional.linear(x, weight), torch.float32)
    assert_matches(gemv.gemm(x[:3], weight), torch.nn.functional.linear(x[:3], weight), torch.float32)


# ---- attention ----------------------------------------------------------------------------------------

def check_attention(seqs, num_heads, num_kv_heads, head_size, block_size, dtype, rope=None, **plan_overrides):
    """rope: (rotary_dim, is_neox) to hand the layer's rotation to the backend (fused with the cache write)."""
    num_blocks = sum(-(-(cached + new) // block_size) for cached, new in seqs) + 3
    common = make_batch(seqs, block_size, num_blocks)
    query, key, value = qkv_views(common.num_tokens, num_heads, num_kv_heads, head_size, dtype)
    shape = TritonAttentionBackend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    assert shape == TorchAttentionBackend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    cache = randn(*shape, dtype=dtype)  # stands in for the cached prefixes' keys and values
    expected_cache = cache.clone()
    scale = head_size ** -0.5
    rope_args = None
    if rope is not None:
        rotary_dim, is_neox = rope
        positions = torch.tensor([p for (cached, new) in seqs for p in range(cached, cached + new)], device=DEVICE)
        rope_args = (positions, cos_sin_table(max(c + n for c, n in seqs), rotary_dim), is_neox)
    expected = TorchAttentionBackend.forward(query.clone(), key.clone(), value, expected_cache, common, scale,
                                             block_size, rope_args)
    metadata = TritonAttentionBackend.build_metadata(common, block_size)
    if plan_overrides:
        metadata = dataclasses.replace(metadata, **plan_overrides, _decode_plans={})
    actual = TritonAttentionBackend.forward(query, key, value, cache, metadata, scale, block_size, rope_args)
    if rope is None:
        assert torch.equal(cache, expected_cache), "the cache write must store exactly this step's keys/values"
        assert_matches(actual, expected, dtype)
    else:
        # The kernel rotates in fp32, torch in the activation dtype: half-precision keys may differ by an
        # ulp, which the softmax can double in the output.
        assert_matches(cache, expected_cache, dtype)
        loose = {k: 2 * v for k, v in TOLERANCE[dtype].items()} if dtype != torch.float32 else TOLERANCE[dtype]
        torch.testing.assert_close(actual.float(), expected.float(), **loose)
    return metadata


def mixed_seqs(block_size: int) -> list[tuple[int, int]]:
    """Decodes (contexts on, just past and far past block boundaries), then a fresh prompt, a prompt with a
    cached prefix, and a middle chunk of a chunked prefill."""
    if ON_GPU:
        return ([(block_size - 1, 1), (block_size, 1), (4095, 1), (777, 1)] + [(int(n), 1) for n in
                torch.randint(1, 3000, (28,))] + [(0, 1000), (3 * block_size, 517), (1500, 2048)])
    return [(block_size - 1, 1), (2 * block_size, 1), (127, 1), (150, 1), (0, 70), (2 * block_size, 33),
            (40, 100), (37, 19)]


@pytest.mark.parametrize("head_size,num_heads,num_kv_heads,block_size", [
    (64, 4, 4, 16), (128, 8, 2, 32), (256, 8, 1, 16), (128, 8, 1, 16), (64, 8, 2, 32),
], ids=["d64-gqa1-bs16", "d128-gqa4-bs32", "d256-gqa8-bs16", "d128-gqa8-bs16", "d64-gqa4-bs32"])
def test_attention_mixed_batch_matches_reference_fp32(head_size, num_heads, num_kv_heads, block_size):
    if ON_GPU:
        num_heads, num_kv_heads = num_heads * 4, num_kv_heads * 4
    check_attention(mixed_seqs(block_size), num_heads, num_kv_heads, head_size, block_size, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_attention_mixed_batch_matches_reference_half(dtype, head_size):
    heads = (32, 8) if ON_GPU else (4, 1)
    block_size = 32 if head_size == 128 else 16
    check_attention(mixed_seqs(block_size), *heads, head_size, block_size, dtype)


@pytest.mark.parametrize("head_size", [48, 96])
def test_attention_head_size_not_a_power_of_two(head_size):
    check_attention(mixed_seqs(16), 4, 2, head_size, 16, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_split_k_matches_reference(dtype):
    """Long contexts split over many partitions, reduced afterwards; short ones leave splits unused."""
    seqs = [(2000, 1), (5, 1), (1024, 1)] if ON_GPU else [(300, 1), (5, 1), (128, 1)]
    metadata = check_attention(seqs, 8, 2, 64, 16, dtype, num_sms=64, min_split_tokens=16)
    num_splits, _ = next(iter(metadata._decode_plans.values()))
    assert num_splits >= 4


@pytest.mark.parametrize("dtype,is_neox,head_size,rotary_dim", [
    (torch.float32, True, 64, 64), (torch.bfloat16, False, 128, 64), (torch.float32, False, 96, 48),
    (torch.bfloat16, True, 128, 128),
], ids=["fp32-neox-d64", "bf16-gptj-d128-partial", "fp32-gptj-d96-partial", "bf16-neox-d128"])
def test_attention_with_rope_fused_into_the_cache_write(dtype, is_neox, head_size, rotary_dim):
    """The layer hands its rotation to the backend: queries and cached keys rotated as the separate rotary
    op would, for decodes, fresh prompts and chunks after a cached prefix."""
    heads = (32, 8) if ON_GPU else (4, 2)
    check_attention(mixed_seqs(16), *heads, head_size, 16, dtype, rope=(rotary_dim, is_neox))


def test_fused_rope_cache_write_equals_the_separate_kernels():
    """Bit for bit what ops.rotary_embedding followed by the plain cache write stores (bf16)."""
    seqs = [(16, 1), (40, 1), (0, 9)]
    common = make_batch(seqs, 16, 8)
    common.slot_mapping[5] = -1  # a padding token: its query still rotates, nothing reaches the cache
    metadata = TritonAttentionBackend.build_metadata(common, 16)
    query, key, value = qkv_views(common.num_tokens, 4, 2, 128, torch.bfloat16)
    positions = torch.tensor([16, 40] + list(range(9)), device=DEVICE)
    table = cos_sin_table(64, 128)
    fused_cache = torch.zeros(TritonAttentionBackend.kv_cache_shape(8, 16, 2, 128), device=DEVICE,
                              dtype=torch.bfloat16)
    separate_cache = fused_cache.clone()
    q_sep, k_sep = ops.rotary_embedding(positions, query.clone(), key.clone(), table, True)
    separate = TritonAttentionBackend.forward(q_sep, k_sep, value, separate_cache, metadata, 0.1, 16)
    fused = TritonAttentionBackend.forward(query, key, value, fused_cache, metadata, 0.1, 16, (positions, table, True))
    assert torch.equal(query, q_sep), "queries rotate in place"
    assert torch.equal(fused_cache, separate_cache)
    assert torch.equal(fused, separate)
    assert int((fused_cache[0].flatten(0, 1).abs().sum(dim=(1, 2)) > 0).sum()) == len(positions) - 1


def decode_step(seqs, num_heads, num_kv_heads, head_size, block_size, dtype, rope, num_padding=0):
    """A decode-only step: its batch (cached tokens per sequence), strided q/k/v views with `num_padding` more
    rows, a cache of random prefixes and the rotation `rope` = (rotary_dim, is_neox) as the layer hands it."""
    num_blocks = sum(-(-(cached + 1) // block_size) for cached in seqs) + 3
    common = make_batch([(cached, 1) for cached in seqs], block_size, num_blocks)
    query, key, value = qkv_views(len(seqs) + num_padding, num_heads, num_kv_heads, head_size, dtype)
    cache = randn(*TritonAttentionBackend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size), dtype=dtype)
    rotary_dim, is_neox = rope
    positions = torch.tensor(seqs + [0] * num_padding, device=DEVICE)
    return common, query, key, value, cache, (positions, cos_sin_table(max(seqs) + 1, rotary_dim), is_neox)


def triton_decode(monkeypatch, fused, metadata, query, key, value, cache, rope_args, block_size):
    """(output, cache after the step) through the fused kernel or the rotary cache write, split-K decode and
    reduction kernels, on copies of the inputs."""
    monkeypatch.setattr(decode_attention, "FUSED_DECODE", fused)
    cache = cache.clone()
    out = TritonAttentionBackend.forward(query.clone(), key.clone(), value, cache, metadata, 0.1, block_size,
                                         rope_args)
    return out, cache


@pytest.mark.parametrize("head_size,num_heads,num_kv_heads,block_size,dtype,rope,splits", [
    (64, 4, 4, 16, torch.float32, (64, True), "multi"),
    (128, 8, 2, 32, torch.bfloat16, (128, False), "multi"),
    (128, 8, 1, 16, torch.float32, (64, True), "multi"),  # more splits than the reduction takes at once
    (256, 8, 1, 16, torch.bfloat16, (256, True), "multi"),
    (96, 6, 2, 16, torch.float32, (48, False), "multi"),  # head size and group not powers of two
    (64, 8, 2, 32, torch.bfloat16, (64, True), "single"),
    (128, 8, 1, 16, torch.float32, (128, False), "single"),
], ids=["d64-gqa1-bs16-fp32-neox", "d128-gqa4-bs32-bf16-gptj", "d128-gqa8-bs16-fp32-neox-partial",
        "d256-gqa8-bs16-bf16-neox", "d96-gqa3-bs16-fp32-gptj-partial", "d64-gqa4-bs32-bf16-neox-one-split",
        "d128-gqa8-bs16-fp32-gptj-one-split"])
def test_fused_decode_matches_reference_and_the_separate_kernels(
        monkeypatch, head_size, num_heads, num_kv_heads, block_size, dtype, rope, splits):
    """A decode-only step in one kernel: the torch reference's output and cache, the cache bit for bit as the
    three separate kernels write it, and their output (bit for bit where nothing is split)."""
    if ON_GPU:
        num_heads, num_kv_heads = num_heads * 4, num_kv_heads * 4
    seqs = [block_size - 1, block_size, 150, 0, 3 * block_size + 5]
    common, query, key, value, cache, rope_args = decode_step(seqs, num_heads, num_kv_heads, head_size,
                                                              block_size, dtype, rope)
    expected_cache = cache.clone()
    expected = TorchAttentionBackend.forward(query.clone(), key.clone(), value, expected_cache, common, 0.1,
                                             block_size, rope_args)
    plan = dict(num_sms=1024, min_split_tokens=16) if splits == "multi" else dict(num_sms=1)
    metadata = dataclasses.replace(TritonAttentionBackend.build_metadata(common, block_size), **plan)
    fused, fused_cache = triton_decode(monkeypatch, True, metadata, query, key, value, cache, rope_args, block_size)
    num_splits, _ = next(iter(metadata._decode_plans.values()))
    assert (num_splits > 2) if splits == "multi" else (num_splits == 1)
    separate, separate_cache = triton_decode(monkeypatch, False, dataclasses.replace(metadata, _decode_plans={}),
                                             query, key, value, cache, rope_args, block_size)
    assert torch.equal(fused_cache, separate_cache)
    assert_matches(fused_cache, expected_cache, dtype)
    loose = {k: 2 * v for k, v in TOLERANCE[dtype].items()} if dtype != torch.float32 else TOLERANCE[dtype]
    torch.testing.assert_close(fused.float(), expected.float(), **loose)
    if splits == "single":
        assert torch.equal(fused, separate)
    else:  # the same partials, combined in another order
        assert_matches(fused, separate, dtype)


def as_graph_step(common: CommonAttentionMetadata, num_padding: int, max_model_len: int) -> CommonAttentionMetadata:
    """The batch as a captured decode graph sees it: padding rows after the real ones (no cache slot, one
    token of context), and host-side lengths at max_model_len, which plan the splits."""
    num_rows = common.num_seqs + num_padding
    table = torch.zeros(num_rows, common.block_table.shape[1], dtype=torch.int32, device=DEVICE)
    table[:common.num_seqs] = common.block_table
    return CommonAttentionMetadata(
        num_seqs=num_rows, num_decodes=num_rows, num_tokens=num_rows,
        query_start_loc=torch.arange(num_rows + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.cat((common.seq_lens, torch.ones(num_padding, dtype=torch.int32, device=DEVICE))),
        block_table=table, slot_mapping=torch.cat((common.slot_mapping, torch.full((num_padding,), -1, device=DEVICE))),
        max_query_len=1, max_seq_len=max_model_len, query_start_loc_cpu=list(range(num_rows + 1)),
        seq_lens_cpu=[max_model_len] * num_rows, num_computed_tokens_cpu=[max_model_len - 1] * num_rows)


def test_fused_decode_of_a_graph_step_with_padding_rows(monkeypatch):
    """Splits planned for the longest context: most exit at once, a short context is one split that writes
    its output directly, a long one is combined by its last split. Padding rows write nothing, and a second
    launch finds the arrival counters back at zero."""
    seqs, block_size = [40, 17, 200], 16
    common, query, key, value, cache, (positions, table, is_neox) = decode_step(
        seqs, 8, 2, 64, block_size, torch.float32, (64, True), num_padding=2)
    metadata = dataclasses.replace(TritonAttentionBackend.build_metadata(as_graph_step(common, 2, 512), block_size),
                                   num_sms=64, min_split_tokens=16)
    rope_args = (positions, table, is_neox)
    fused, fused_cache = triton_decode(monkeypatch, True, metadata, query, key, value, cache, rope_args, block_size)
    assert next(iter(metadata._decode_plans.values()))[0] >= 8
    assert not workspace._counters[query.device].any()
    again, _ = triton_decode(monkeypatch, True, metadata, query, key, value, cache, rope_args, block_size)
    assert torch.equal(again, fused)
    separate, separate_cache = triton_decode(monkeypatch, False, dataclasses.replace(metadata, _decode_plans={}),
                                             query, key, value, cache, rope_args, block_size)
    assert torch.equal(fused_cache, separate_cache)
    assert_matches(fused, separate, torch.float32)
    written = torch.zeros(cache[0].flatten(0, 1).shape[0], dtype=torch.bool, device=DEVICE)
    written[common.slot_mapping] = True
    assert torch.equal(fused_cache.flatten(1, 2)[:, ~written], cache.flatten(1, 2)[:, ~written]), \
        "padding rows write nothing"
    expected_cache = cache.clone()
    expected = TorchAttentionBackend.forward(query[:3].clone(), key[:3].clone(), value[:3], expected_cache, common,
                                             0.1, block_size, (positions[:3], table, is_neox))
    assert_matches(fused_cache, expected_cache, torch.float32)
    assert_matches(fused[:3], expected, torch.float32)


def test_each_context_spreads_over_the_splits_of_a_plan_for_a_longer_one(monkeypatch):
    """A plan made for the longest possible context (a CUDA graph's) gives a short context as many one-tile
    splits as it has tiles, as an eager plan for that context would, rather than the plan's longer splits;
    the separate split-K kernels and the fused one agree with the reference either way."""
    seqs, block_size = [40, 200, 17], 16
    common, query, key, value, cache, rope_args = decode_step(seqs, 8, 2, 64, block_size, torch.float32, (64, True))
    graph_plan = dataclasses.replace(TritonAttentionBackend.build_metadata(as_graph_step(common, 0, 4096), block_size),
                                     num_sms=64, min_split_tokens=16)
    tile = triton_attention._tile_sizes(64, 4)[1]
    tiles = [-(-(n + 1) // tile) for n in seqs]  # the context after this step's token, in decode tiles
    written = []
    real_partials = decode_attention._partials

    def partials(*args):
        acc, ml = real_partials(*args)
        ml.fill_(float("nan"))
        written.append(ml)
        return acc, ml
    monkeypatch.setattr(decode_attention, "_partials", partials)
    separate, _ = triton_decode(monkeypatch, False, graph_plan, query, key, value, cache, rope_args, block_size)
    num_splits = next(iter(graph_plan._decode_plans.values()))[0]
    assert max(tiles) < num_splits < 4096 // tile, "the plan's splits are several tiles long"
    splits_used = (~written[0][..., 0].isnan()).sum(dim=-1)  # [sequence, head]
    assert splits_used.tolist() == [[t] * 8 for t in tiles]
    fused, _ = triton_decode(monkeypatch, True, dataclasses.replace(graph_plan, _decode_plans={}), query, key, value,
                             cache, rope_args, block_size)
    expected_cache = cache.clone()
    expected = TorchAttentionBackend.forward(query.clone(), key.clone(), value, expected_cache, common, 0.1,
                                             block_size, rope_args)
    assert_matches(separate, expected, torch.float32)
    assert_matches(fused, expected, torch.float32)


def test_decode_only_and_prefill_only_batches():
    check_attention([(40, 1), (17, 1)], 4, 1, 64, 16, torch.float32)
    check_attention([(0, 45), (16, 16)], 4, 1, 64, 16, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_profiling_pass_without_cache_is_causal_prefill(dtype):
    seqs = [(0, 700), (0, 1300)] if ON_GPU else [(0, 70), (0, 9)]
    common = make_batch(seqs, 16, 256)
    query, key, value = qkv_views(common.num_tokens, 8, 2, 64, dtype)
    expected = TorchAttentionBackend.forward(query, key, value, None, common, 0.125, 16)
    metadata = TritonAttentionBackend.build_metadata(common, 16)
    assert_matches(TritonAttentionBackend.forward(query, key, value, None, metadata, 0.125, 16), expected, dtype)


def test_padding_tokens_with_negative_slots_are_not_written():
    common = make_batch([(0, 5)], 16, 4)
    common.slot_mapping[3] = -1
    query, key, value = qkv_views(5, 4, 2, 64, torch.float32)
    cache = torch.zeros(TritonAttentionBackend.kv_cache_shape(4, 16, 2, 64), device=DEVICE)
    TritonAttentionBackend.forward(query, key, value, cache, TritonAttentionBackend.build_metadata(common, 16),
                                   0.125, 16)
    assert int((cache[0].flatten(0, 1).abs().sum(dim=(1, 2)) > 0).sum()) == 4


# ---- sampling -----------------------------------------------------------------------------------------

def sampling_tensors(temperature, top_k=None, top_p=None, min_p=None, seeds=None) -> SamplingTensors:
    rows = len(temperature)
    top_k = top_k or [0] * rows
    top_p = top_p or [1.0] * rows
    min_p = min_p or [0.0] * rows
    seeds = seeds if seeds is not None else list(range(rows))
    sampling = [t > 0 for t in temperature]

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=DEVICE)

    return SamplingTensors(
        temperature=tensor(temperature, torch.float32), top_k=tensor(top_k, torch.int64),
        top_p=tensor(top_p, torch.float32), min_p=tensor(min_p, torch.float32), seeds=tensor(seeds, torch.int64),
        seeds_cpu=seeds, all_greedy=not any(sampling),
        any_top_k=any(k > 0 and s for k, s in zip(top_k, sampling)),
        any_top_p=any(p < 1 and s for p, s in zip(top_p, sampling)),
        any_min_p=any(m > 0 and s for m, s in zip(min_p, sampling)))


VOCAB = 128256 if ON_GPU else 3000


def test_greedy_rows_take_the_argmax():
    logits = randn(6, VOCAB)
    t = sampling_tensors([0.0, 0.8, 0.0, 1.0, 0.0, 1.3], top_k=[5, 0, 0, 3, 0, 0])
    sampled = sample(logits, t)
    greedy = torch.tensor([True, False, True, False, True, False], device=DEVICE)
    assert sampled.dtype == torch.int64 and sampled.shape == (6,)
    assert torch.equal(sampled[greedy], logits.argmax(dim=-1)[greedy])
    all_greedy = sampling_tensors([0.0] * 6)
    assert torch.equal(sample(logits, all_greedy), reference_sample(logits, all_greedy))


def test_same_seed_and_logits_give_the_same_token():
    logits = randn(8, VOCAB)
    t = sampling_tensors([1.0] * 8, seeds=[11, 12, 13, 14, 15, 16, 17, (1 << 63) - 1])
    assert torch.equal(sample(logits, t), sample(logits, t))
    other = sampling_tensors([1.0] * 8, seeds=[21, 22, 23, 24, 25, 26, 27, 28])
    assert not torch.equal(sample(logits, t), sample(logits, other))


def test_a_rows_token_does_not_depend_on_the_rest_of_the_batch():
    row = randn(1, VOCAB)
    alone = sample(row, sampling_tensors([0.9], top_p=[0.95], seeds=[1234]))
    companions = randn(5, VOCAB)
    batch = torch.cat((companions[:3], row, companions[3:]))
    t = sampling_tensors([1.0, 0.0, 0.5, 0.9, 1.2], top_k=[0, 0, 4, 0, 0], top_p=[1.0, 1.0, 1.0, 0.95, 0.8],
                         min_p=[0.1, 0.0, 0.0, 0.0, 0.0], seeds=[1, 2, 3, 1234, 5])
    assert int(sample(batch[:5], t)[3]) == int(alone)


@pytest.mark.parametrize("filters", [
    dict(top_k=[1, 2, 5, 50]), dict(top_p=[0.1, 0.5, 0.9, 0.99]), dict(min_p=[0.05, 0.2, 0.5, 0.9]),
    dict(top_k=[10, 10, 40, 40], top_p=[0.5, 0.9, 0.5, 0.9], min_p=[0.1, 0.0, 0.3, 0.05]),
], ids=["top_k", "top_p", "min_p", "all"])
def test_filtered_tokens_are_never_sampled(filters):
    num_draws = 64
    logits = (randn(4, 500) * 3).repeat_interleave(num_draws, dim=0)
    expanded = {name: [v for v in values for _ in range(num_draws)] for name, values in filters.items()}
    t = sampling_tensors([0.7] * (4 * num_draws), seeds=list(range(4 * num_draws)), **expanded)
    allowed = apply_top_k_top_p_min_p(logits / 0.7, t) > float("-inf")
    sampled = sample(logits, t)
    assert bool(allowed.gather(1, sampled.unsqueeze(1)).all())
    assert len(set(sampled.tolist())) > 4  # it does sample


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.5, 0), (1.0, 2)])
def test_sampling_frequencies_follow_the_distribution(temperature, top_k):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    num_draws = 20000 if ON_GPU else 4000
    logits = probs.log().to(DEVICE).expand(num_draws, 4).contiguous()
    t = sampling_tensors([temperature] * num_draws, top_k=[top_k] * num_draws,
                         seeds=[(i * 7919 + 17) << 20 for i in range(num_draws)])
    expected = (probs ** (1 / temperature))
    if top_k:
        expected[top_k:] = 0
    expected = expected / expected.sum()
    frequencies = torch.bincount(sample(logits, t).cpu(), minlength=4).float() / num_draws
    tolerance = 5 * (expected * (1 - expected) / num_draws).sqrt() + 1e-3
    assert bool(((frequencies - expected).abs() <= tolerance).all()), (frequencies, expected)


# ---- the backend as the registry sees it ---------------------------------------------------------------

def test_backend_offers_every_op_and_refuses_cpu():
    assert set(triton_backend.BACKEND.ops) == set(OPS)
    assert triton_backend.BACKEND.attention is TritonAttentionBackend
    assert triton_backend.available(torch.device("cpu")) is not None
    if ON_GPU:
        assert triton_backend.available(torch.device("cuda")) is None
