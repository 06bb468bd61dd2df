"""The Triton GEMM and experts on int4_group weights (compressed-tensors' pack-quantized W4A16, engine/kernels/quant.py)
against the torch reference: float32 activations give the product with the dequantized weight to float32
rounding (the codes enter the dot as exact integers, each group's product takes its scales), half-precision
ones the reference's result to the output's rounding; tiles narrower and wider than a group, K tails past the
last tile, N no tile divides, bias, remote experts; groups the kernels cannot tile are refused at preparation.
On a CUDA GPU the kernels run compiled; elsewhere under TRITON_INTERPRET=1, at tiny sizes."""
from __future__ import annotations


import pytest
import torch

from triton_device import (DEVICE, ON_GPU, check_quantized_graph_replay,  # noqa: E402  (skips without Triton)
                           relative_error)

from engine.kernels import registry  # noqa: E402
from engine.kernels.quant import QuantScheme, dequantize_weight, quantize_weight  # noqa: E402
from engine.kernels.torch import moe as torch_moe  # noqa: E402
from engine.kernels.torch import quant as reference  # noqa: E402
from engine.kernels.triton import moe, moe_quant, quant  # noqa: E402

N = 72  # no tile divides it
# (K, group): K tiles wider than a group with a tail past the last one (160 = 5 groups of 32; tiles of 64 and
# 256), and tiles narrower than a group (float32's 64 inside groups of 128).
SHAPES = [(160, 32), (256, 128)]
EXACT = 1e-5           # float32 activations against x @ W^T of the dequantized weight
ROUNDING_LIMIT = 1e-2  # half-precision outputs: the same products, rounded (the interpreter truncates)


def int4_weight(n: int, k: int, group: int, experts: int | None = None, scale_dtype=torch.bfloat16):
    shape = (n, k) if experts is None else (experts, n, k)
    qw = quantize_weight(torch.randn(*shape, device=DEVICE) / k ** 0.5, QuantScheme("int4_group", "none", (1, group)))
    qw.scale = qw.scale.to(scale_dtype)  # as a layer holds them: the model's dtype
    registry.prepare_quantized(quant.gemm_quantized, qw)
    return qw


# ---- the GEMM --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k, group", SHAPES)
@pytest.mark.parametrize("rows", [1, 16, 40])
def test_float32_rows_are_the_product_with_the_dequantized_weight(k, group, rows):
    qw = int4_weight(N, k, group, scale_dtype=torch.float32)
    x = torch.randn(rows, k, device=DEVICE)
    assert relative_error(quant.gemm_quantized(x, qw), x @ dequantize_weight(qw).t()) < EXACT


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [3, 40])
def test_half_precision_rows_match_the_reference(dtype, rows):
    qw = int4_weight(N, 160, 32, scale_dtype=dtype)
    x = torch.randn(rows, 160, device=DEVICE).to(dtype)
    bias = torch.randn(N, device=DEVICE).to(dtype)
    assert relative_error(quant.gemm_quantized(x, qw, bias), reference.gemm_quantized(x, qw, bias)) < ROUNDING_LIMIT
    out = quant.gemm_quantized(x, qw, bias, out_dtype=torch.float32)
    assert relative_error(out, reference.gemm_quantized(x, qw, bias, out_dtype=torch.float32)) < EXACT


def test_a_wrong_scale_group_is_seen():
    """Negative control of the tests above: the second group's scales doubled."""
    qw = int4_weight(N, 160, 32, scale_dtype=torch.float32)
    x = torch.randn(3, 160, device=DEVICE)
    expected = x @ dequantize_weight(qw).t()
    qw.scale[:, 1] *= 2
    qw.prepared.clear()
    assert relative_error(quant.gemm_quantized(x, qw), expected) > 1e-2


@pytest.mark.parametrize("group, k, message", [(16, 160, "power of two of at least 32"),
                                               (64, 160, r"in_features \(160\) to be whole groups of 64")])
def test_groups_the_kernels_cannot_tile_are_refused_at_preparation(group, k, message):
    qw = quantize_weight(torch.randn(8, 192), QuantScheme("int4_group", "none", (1, group)))
    qw.weight = qw.weight[:, :k // 2]
    with pytest.raises(ValueError, match=message):
        registry.prepare_quantized(quant.gemm_quantized, qw)


def test_the_backend_serves_the_int4_ops():
    from engine.kernels import triton as backend
    assert backend.BACKEND.ops["gemm_int4_group"] is quant.gemm_quantized
    assert backend.BACKEND.ops["fused_experts_int4"] is moe_quant.fused_experts_quantized


# ---- the experts -----------------------------------------------------------------------------------------

HIDDEN, INTER, EXPERTS = 128, 96, 4  # INTER: three groups of 32, a tail past each 64-wide K tile
BATCH_TILES = moe.MoeTiles(block_m=32, gate_up_block_n=32, gate_up_block_k=64, down_block_n=64, down_block_k=64)


def experts(scale_dtype):
    return (int4_weight(2 * INTER, HIDDEN, 32, EXPERTS, scale_dtype),
            int4_weight(HIDDEN, INTER, 32, EXPERTS, scale_dtype))


def routing(num_tokens: int, top_k: int = 2):
    ids = torch.rand(num_tokens, EXPERTS, device=DEVICE).topk(top_k, dim=-1).indices.to(torch.int32)
    weights = torch.rand(num_tokens, top_k, device=DEVICE)
    return weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("tokens, tiles", [(3, None), (24, BATCH_TILES)])
def test_float32_experts_are_the_experts_of_the_dequantized_weights(tokens, tiles):
    (w13, w2), x = experts(torch.float32), torch.randn(tokens, HIDDEN, device=DEVICE)
    weights, ids = routing(tokens)
    expected = torch_moe.fused_experts(x, dequantize_weight(w13), dequantize_weight(w2), weights, ids)
    assert relative_error(moe_quant.fused_experts_quantized(x, w13, w2, weights, ids, tiles), expected) < EXACT


def test_bfloat16_experts_match_the_reference():
    (w13, w2), x = experts(torch.bfloat16), torch.randn(5, HIDDEN, device=DEVICE).bfloat16()
    weights, ids = routing(5)
    ids[1] = -1  # held by other ranks: contributes nothing
    ids[3, 0] = -1
    out = moe_quant.fused_experts_quantized(x, w13, w2, weights, ids)
    assert not out[1].any()
    # Three bf16 roundings (the intermediate, each expert's output, their sum), which the interpreter truncates:
    # each pulls toward zero (MXFP4's weight-only experts measure the same, 1.6 % of the largest output).
    limit = 2 * ROUNDING_LIMIT if ON_GPU else 4 * ROUNDING_LIMIT
    assert relative_error(out, reference.fused_experts_quantized(x, w13, w2, weights, ids)) < limit


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_decode_replays_in_a_cuda_graph_with_new_inputs():
    qw, x = int4_weight(N, 160, 32), torch.randn(1, 160, device=DEVICE).bfloat16()
    (w13, w2), h = experts(torch.bfloat16), torch.randn(2, HIDDEN, device=DEVICE).bfloat16()
    weights, ids = routing(2)
    check_quantized_graph_replay(qw, x, w13, w2, h, weights, ids, routing(2))
