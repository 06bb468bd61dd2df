"""The Triton backend's FP8 KV cache against the torch reference, with per-tensor and per-token scales: every
kernel that writes the cache (plain write, rotary embedding fused into it, the fused decode step) stores the
reference's FP8 bytes and scales, every kernel that reads it (prefill, split-K decode, fused decode) attends
over exactly the dequantized cache, and the result stays close to attention over the unquantized keys/values.

On a CUDA GPU the kernels run compiled; elsewhere under TRITON_INTERPRET=1 at tiny sizes."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from triton_device import DEVICE  # noqa: E402  (skips the module without Triton)
from attention_inputs import cos_sin_table, make_batch, qkv_views, randn  # noqa: E402

from engine.kernels.attention import FP8_KV_MIN_SCALE, KVCacheQuant  # noqa: E402
from engine.kernels.torch.attention import TorchAttentionBackend, write_cache  # noqa: E402
from engine.kernels.triton import decode_attention, ops  # noqa: E402
from engine.kernels.triton.attention import TritonAttentionBackend  # noqa: E402

FP8 = TritonAttentionBackend.fp8_kv_dtype
TENSOR_SCALES = (0.03, 0.02)  # keys, values: the FP8 range then covers inputs up to 13.4 and 9
# Two kernels attending over the same cache: what the activation dtype's rounding leaves between them.
SAME_CACHE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
              torch.float16: dict(rtol=5e-3, atol=5e-3)}
# FP8 against unquantized attention: the largest error relative to the output's largest value. e4m3 keeps 3
# mantissa bits: up to 6.25% per element, all of it where a context is one token long; longer contexts average
# much of it out (measured: 3-6% here, against 0.5-1% between two kernels over one FP8 cache).
FP8_ERROR = 0.1


def magnitudes(*shape) -> torch.Tensor:
    """Per token and head, a factor in 1/4..2: per-token scales differ, per-tensor ones still cover all."""
    return 2.0 ** torch.randint(-2, 2, (*shape, 1), device=DEVICE).float()


def fp8_cache(values: torch.Tensor, granularity: str) -> tuple[torch.Tensor, KVCacheQuant]:
    """The FP8 cache the reference writes for `values` [2, blocks, page, Hk, D] in every slot, and its scales."""
    num_blocks, block_size, num_kv_heads = values.shape[1:4]
    if granularity == "tensor":
        k_scale, v_scale = (torch.tensor([s], device=DEVICE) for s in TENSOR_SCALES)
    else:
        shape = TritonAttentionBackend.kv_scale_shape(num_blocks, block_size, num_kv_heads)
        k_scale, v_scale = torch.zeros(shape, device=DEVICE), torch.zeros(shape, device=DEVICE)
    cache = torch.empty(values.shape, dtype=FP8, device=DEVICE)
    slots = torch.arange(num_blocks * block_size, device=DEVICE)
    for half, scales in enumerate((k_scale, v_scale)):
        write_cache(cache[half], values[half].flatten(0, 1), slots, scales)
    return cache, KVCacheQuant(granularity, k_scale, v_scale)


def copy_of(cache: torch.Tensor, quant: KVCacheQuant) -> tuple[torch.Tensor, KVCacheQuant]:
    return cache.clone(), dataclasses.replace(quant, k_scale=quant.k_scale.clone(), v_scale=quant.v_scale.clone())


def dequantized(cache: torch.Tensor, quant: KVCacheQuant, dtype: torch.dtype) -> torch.Tensor:
    scales = [quant.k_scale, quant.v_scale]
    if quant.per_token:
        scales = [s[..., None] for s in scales]
    return torch.stack([(cache[half].float() * scales[half]).to(dtype) for half in range(2)])


def assert_same_cache(actual: tuple[torch.Tensor, KVCacheQuant], expected: tuple[torch.Tensor, KVCacheQuant]):
    """The same FP8 bytes (and per-token scales) in every slot."""
    assert torch.equal(actual[0].view(torch.uint8), expected[0].view(torch.uint8))
    assert torch.equal(actual[1].k_scale, expected[1].k_scale) and torch.equal(actual[1].v_scale, expected[1].v_scale)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).abs().max() / expected.double().abs().max())


def check_fp8_attention(seqs, granularity, dtype=torch.bfloat16, rope=None, num_heads=8, num_kv_heads=2,
                        head_size=64, block_size=16, **plan_overrides):
    """seqs: (cached tokens, new tokens), decodes first; rope: (rotary_dim, is_neox) handed to the backend.
    Returns the step's metadata (its decode plans filled)."""
    num_blocks = sum(-(-(cached + new) // block_size) for cached, new in seqs) + 3
    common = make_batch(seqs, block_size, num_blocks)
    query, key, value = qkv_views(common.num_tokens, num_heads, num_kv_heads, head_size, dtype)
    key.mul_(magnitudes(*key.shape[:2]))
    value.mul_(magnitudes(*value.shape[:2]))
    key[0, 0] = 0.0  # a head vector of zeros: the smallest per-token scale
    shape = TritonAttentionBackend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    plain_cache = (randn(*shape) * magnitudes(*shape[:4])).to(dtype)  # the cached prefixes, unquantized
    cache, quant = fp8_cache(plain_cache, granularity)
    expected_cache, expected_quant = copy_of(cache, quant)
    scale = head_size ** -0.5
    rope_args = None
    if rope is not None:
        rotary_dim, is_neox = rope
        positions = torch.tensor([p for cached, new in seqs for p in range(cached, cached + new)], device=DEVICE)
        rope_args = (positions, cos_sin_table(max(c + n for c, n in seqs), rotary_dim), is_neox)
    metadata = TritonAttentionBackend.build_metadata(common, block_size)
    if plan_overrides:
        metadata = dataclasses.replace(metadata, **plan_overrides, _decode_plans={})
    actual = TritonAttentionBackend.forward(query.clone(), key.clone(), value, cache, metadata, scale, block_size,
                                            rope_args, kv_quant=quant)

    # The reference on the same rotated query and keys (the Triton rotary op, bit for bit the fused rotation).
    if rope is not None:
        query, key = ops.rotary_embedding(positions, query.clone(), key.clone(), rope_args[1], rope_args[2])
    expected = TorchAttentionBackend.forward(query, key, value, expected_cache, common, scale, block_size,
                                             kv_quant=expected_quant)
    assert_same_cache((cache, quant), (expected_cache, expected_quant))

    # Attention over exactly the cache written (dequantized), this step's keys and values included.
    slots = common.slot_mapping
    held = dequantized(cache, quant, dtype)
    held_key, held_value = (held[half].flatten(0, 1)[slots] for half in range(2))
    over_cache = TorchAttentionBackend.forward(query, held_key, held_value, held.clone(), common, scale, block_size)
    torch.testing.assert_close(actual.float(), over_cache.float(), **SAME_CACHE[dtype])
    # The reference reads the cache too, but for prompts without a cached prefix it attends over this step's
    # unquantized keys: those rows agree only to FP8's error.
    starts = common.query_start_loc_cpu
    read_back = torch.zeros(common.num_tokens, dtype=torch.bool, device=DEVICE)
    for seq, (cached, _) in enumerate(seqs):
        read_back[starts[seq]:starts[seq + 1]] = seq < common.num_decodes or cached > 0
    torch.testing.assert_close(actual[read_back].float(), expected[read_back].float(), **SAME_CACHE[dtype])
    assert relative_error(actual, expected) < FP8_ERROR

    # Unquantized: the same step over a cache of the activations' dtype.
    plain = TorchAttentionBackend.forward(query, key, value, plain_cache, common, scale, block_size)
    assert relative_error(actual, plain) < FP8_ERROR
    return metadata


GRANULARITIES = ["tensor", "token"]
DECODES = [(15, 1), (16, 1), (150, 1), (0, 1), (40, 1)]  # within, at and past a block's end; several tiles


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("splits", ["one", "many"])
def test_decode_step_matches_the_reference(granularity, splits):
    plan = dict(num_sms=1024, min_split_tokens=16) if splits == "many" else dict(num_sms=1)
    metadata = check_fp8_attention(DECODES, granularity, **plan)
    num_splits, _ = next(iter(metadata._decode_plans.values()))
    assert (num_splits > 1) if splits == "many" else (num_splits == 1)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
def test_decode_step_with_rope_matches_the_reference(monkeypatch, granularity, fused):
    """Rotation, cache write and attention in one kernel, or as the rotary cache write and split-K decode."""
    monkeypatch.setattr(decode_attention, "FUSED_DECODE", fused)
    check_fp8_attention(DECODES, granularity, rope=(64, True), num_sms=1024, min_split_tokens=16)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("rope", [None, (32, False)], ids=["plain", "rope"])
def test_prefill_only_step_matches_attention_over_its_cache(granularity, rope):
    """Fresh prompts read their own keys back from the FP8 cache."""
    check_fp8_attention([(0, 37), (0, 20)], granularity, rope=rope)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("rope", [None, (64, True)], ids=["plain", "rope"])
def test_mixed_step_matches_the_reference(granularity, rope):
    """Decodes, a fresh prompt, a prompt after a cached prefix and a middle chunk of a chunked prefill."""
    check_fp8_attention([(15, 1), (70, 1), (0, 33), (32, 17), (20, 9)], granularity, rope=rope)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_chunked_prefill_after_a_cached_prefix_matches_the_reference(granularity):
    """Chunks whose queries see the cached prefix unmasked and their own chunk causally, across blocks."""
    check_fp8_attention([(48, 20), (5, 40)], granularity, num_heads=4, num_kv_heads=1)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_fp32_and_fp16_activations_match_the_reference(granularity, dtype):
    """fp32 attends without rounding the widened keys; fp16 scales per-token values before the product."""
    check_fp8_attention([(15, 1), (40, 1), (9, 12)], granularity, dtype=dtype, rope=(64, False))


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("writer", ["plain", "rope", "fused-decode"])
def test_cache_write_clamps_to_the_fp8_range_and_skips_padding(monkeypatch, granularity, writer):
    """Keys past the per-tensor range store its largest value, a head vector of zeros stores zeros with the
    smallest per-token scale, and a padding token (slot -1) writes neither values nor scales: in the plain cache
    write, the one with the rotary embedding and the fused decode step alike."""
    monkeypatch.setattr(decode_attention, "FUSED_DECODE", True)
    block_size, num_kv_heads = 16, 2
    seqs = [(3, 1), (17, 1), (30, 1)] if writer == "fused-decode" else [(0, 6)]
    common = make_batch(seqs, block_size, 6)
    common.slot_mapping[1] = -1
    query, key, value = qkv_views(common.num_tokens, 4, num_kv_heads, 64, torch.bfloat16)
    key[0, 1, 5] = 40.0  # past 448 * the key scale
    key[2, 0] = 0.0
    positions = torch.tensor([p for cached, new in seqs for p in range(cached, cached + new)], device=DEVICE)
    rope_args = None if writer == "plain" else (positions, cos_sin_table(64, 64), True)
    shape = TritonAttentionBackend.kv_cache_shape(6, block_size, num_kv_heads, 64)
    cache, quant = fp8_cache(torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE), granularity)
    if quant.per_token:
        quant.k_scale.fill_(-1.0)  # marks the slots that the step leaves alone
        quant.v_scale.fill_(-1.0)
    expected_cache, expected_quant = copy_of(cache, quant)
    TritonAttentionBackend.forward(query.clone(), key.clone(), value, cache, common, 0.125, block_size, rope_args,
                                   kv_quant=quant)

    if rope_args is not None:
        query, key = ops.rotary_embedding(positions, query.clone(), key.clone(), rope_args[1], True)
    keep = common.slot_mapping >= 0  # (the reference would store a padding token in the last slot)
    write_cache(expected_cache[0], key[keep], common.slot_mapping[keep], expected_quant.k_scale)
    write_cache(expected_cache[1], value[keep], common.slot_mapping[keep], expected_quant.v_scale)
    assert_same_cache((cache, quant), (expected_cache, expected_quant))
    written = cache.view(torch.uint8).flatten(1, 2).ne(0).flatten(2).any(dim=-1).any(dim=0)
    assert int(written.sum()) == common.num_tokens - 1  # every token but the padding one
    rows = cache[0].flatten(0, 1)
    if granularity == "tensor" and writer == "plain":
        assert rows[common.slot_mapping[0], 1, 5].float() == 448.0
    if granularity == "token":
        k_scales = quant.k_scale.flatten(0, 1)
        assert k_scales[common.slot_mapping[2], 0] == torch.tensor(FP8_KV_MIN_SCALE, dtype=torch.float32)
        assert not rows[common.slot_mapping[2], 0].float().any()
        for scales in (quant.k_scale, quant.v_scale):
            assert int(scales.flatten(0, 1).ne(-1).all(dim=-1).sum()) == common.num_tokens - 1


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_profiling_pass_without_a_cache_ignores_the_quantization(granularity):
    common = make_batch([(0, 30), (0, 9)], 16, 8)
    query, key, value = qkv_views(common.num_tokens, 8, 2, 64, torch.bfloat16)
    _, quant = fp8_cache(torch.zeros(2, 8, 16, 2, 64, device=DEVICE), granularity)
    expected = TritonAttentionBackend.forward(query, key, value, None, common, 0.125, 16)
    actual = TritonAttentionBackend.forward(query, key, value, None, common, 0.125, 16, kv_quant=quant)
    assert torch.equal(actual, expected)
