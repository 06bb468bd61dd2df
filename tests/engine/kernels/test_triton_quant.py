"""The Triton GEMMs and experts on quantized weights against the torch reference (engine/kernels/torch/quant.py),
for every scheme: decode-sized batches on the weight-only skinny kernels, larger ones on the W8A8 / MXFP4 paths,
shapes that no tile divides, bias, float32 output, the activation quantizers bit for bit, and the prepare hook
as a layer calls it.

Weight-only products skip the activation quantization the reference emulates, so they are held to a few
percent of it, and exactly (float32) to the product with the dequantized weight. On a CUDA GPU the kernels run
compiled; elsewhere under TRITON_INTERPRET=1, at tiny sizes."""
from __future__ import annotations


import pytest
import torch

from triton_device import (DEVICE, ON_GPU, check_quantized_graph_replay,  # noqa: E402  (skips without Triton)
                           relative_error)

from engine.kernels import registry  # noqa: E402
from engine.kernels.quant import (QuantScheme, QuantizedWeight, dequantize_weight, fake_quantize_fp8,  # noqa: E402
                                  quantize_e2m1, quantize_weight)
from engine.kernels.torch import moe as torch_moe  # noqa: E402
from engine.kernels.torch import quant as reference  # noqa: E402
from engine.kernels.triton import activation_quant, moe, moe_quant, quant  # noqa: E402

SCHEMES = {
    "fp8_tensor": QuantScheme("fp8_tensor"),
    "fp8_tensor_static": QuantScheme("fp8_tensor", activation="static"),
    "fp8_channel": QuantScheme("fp8_channel"),
    "fp8_block": QuantScheme("fp8_block"),
    "mxfp4": QuantScheme("mxfp4", activation="none"),
    "mxfp4_a4": QuantScheme("mxfp4", activation="mxfp4"),
}
N, K = 72, 160  # no tile divides N; K is a multiple of 32 (MXFP4 groups), not of 128 (FP8 blocks)
WEIGHT_ONLY_LIMIT = 4e-2  # weight-only against the reference's quantized activations (one GEMM)
ROUNDING_LIMIT = 1e-2     # the same arithmetic, rounded to bf16 (the interpreter truncates)
# FP8 x FP8 products on a GPU's tensor cores (torch._scaled_mm and Triton's tl.dot alike): Hopper keeps about
# 14 bits of the running sum within each promotion interval. Measured on an H100 with the activations bit-equal
# to the reference's: 1.3e-4 to 3.2e-4 of the largest output, where float32 arithmetic gives 2e-7.
FP8_TENSOR_CORE_LIMIT = 1e-3


def weight(name: str, n: int = N, k: int = K, experts: int | None = None) -> QuantizedWeight:
    shape = (n, k) if experts is None else (experts, n, k)
    qw = quantize_weight(torch.randn(*shape, device=DEVICE) / k ** 0.5, SCHEMES[name])
    if SCHEMES[name].activation == "static":
        qw.input_scale = torch.tensor([0.02], device=DEVICE)  # randn activations stay within 448 * 0.02
    return qw


def activations(m: int, k: int = K, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(m, k, device=DEVICE).to(dtype)


def float32_activations(m: int, name: str, k: int = K) -> torch.Tensor:
    """Float32 activations; for MXFP4, whose dot multiplies bf16 ones, values that bf16 holds exactly."""
    x = activations(m, k, torch.float32)
    return x.bfloat16().float() if name.startswith("mxfp4") else x


def takes_w8a8() -> bool:
    return quant.fp8_tensor_cores(torch.device(DEVICE))


# ---- dense GEMMs -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("rows", [1, 16])
def test_decode_rows_match_reference(name, rows):
    qw, x = weight(name), activations(rows)
    bias = torch.randn(N, device=DEVICE).to(x.dtype)
    limit = ROUNDING_LIMIT if name == "mxfp4" else WEIGHT_ONLY_LIMIT
    assert relative_error(quant.gemm_quantized(x, qw, bias), reference.gemm_quantized(x, qw, bias)) < limit


@pytest.mark.parametrize("name", ["fp8_tensor", "fp8_channel", "fp8_block", "mxfp4"])
@pytest.mark.parametrize("rows", [1, 3])
def test_decode_rows_are_the_product_with_the_dequantized_weight(name, rows):
    """Weight-only: exactly x W^T for W the weight the quantized one stands for (one row: the CUDA-core GEMV)."""
    qw, x = weight(name), float32_activations(rows, name)
    expected = x @ dequantize_weight(qw).t()
    assert relative_error(quant.gemm_quantized(x, qw), expected) < 1e-5


@pytest.mark.parametrize("name", SCHEMES)
def test_prefill_rows_quantize_activations_as_the_reference(name):
    """Past 16 rows the FP8 schemes multiply FP8 activations (where the device has FP8 tensor cores) and
    MXFP4 w4a4 MXFP4 ones, quantized as the reference does: the same products, to float32 rounding (to the
    tensor cores' FP8 accumulation on a GPU)."""
    qw, x = weight(name), activations(40)
    bias = torch.randn(N, device=DEVICE)
    actual = quant.gemm_quantized(x, qw, bias, out_dtype=torch.float32)
    expected = reference.gemm_quantized(x, qw, bias, out_dtype=torch.float32)
    if name.startswith("mxfp4"):
        limit = 1e-5
    elif takes_w8a8():
        limit = FP8_TENSOR_CORE_LIMIT if ON_GPU else 1e-5
    else:
        limit = WEIGHT_ONLY_LIMIT
    assert relative_error(actual, expected) < limit


@pytest.mark.parametrize("name", ["fp8_block", "mxfp4"])
@pytest.mark.parametrize("rows", [2, 40])
def test_float16_activations_match_reference(name, rows):
    qw, x = weight(name), activations(rows, dtype=torch.float16)
    weight_only = name == "fp8_block" and (rows <= 16 or not takes_w8a8())
    limit = WEIGHT_ONLY_LIMIT if weight_only else ROUNDING_LIMIT
    out = quant.gemm_quantized(x, qw, out_dtype=torch.float32)
    assert relative_error(out, reference.gemm_quantized(x, qw, out_dtype=torch.float32)) < limit


@pytest.mark.skipif(not quant._sm90_cuda(torch.device(DEVICE)), reason="the integer e4m3 -> bf16 path is sm_90+ PTX")
@pytest.mark.parametrize("name", ["fp8_tensor", "fp8_block"])
@pytest.mark.parametrize("rows", [1, 3])
def test_fast_e4m3_conversion_gives_the_same_bits_as_torch_conversion(monkeypatch, name, rows):
    """Every e4m3 code (subnormals, both zeros, +-448; NaN aside) as a weight: the decode kernels with
    e4m3_to_bf16 return exactly what they return with Triton's own conversion."""
    qw = weight(name, n=64, k=256)
    codes = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    codes = codes[(codes & 0x7F) != 0x7F]
    qw.weight.view(torch.uint8).view(-1)[:] = codes.repeat(qw.weight.numel() // codes.numel() + 1)[:qw.weight.numel()]
    x = activations(rows, k=256)
    fast = quant.gemm_quantized(x, qw, out_dtype=torch.float32)
    monkeypatch.setattr(quant, "FAST_FP8_CONVERSION", False)
    assert torch.equal(fast, quant.gemm_quantized(x, qw, out_dtype=torch.float32))


def test_leading_dimensions_are_kept():
    qw, x = weight("fp8_block"), activations(6).view(2, 3, K)
    out = quant.gemm_quantized(x, qw)
    assert out.shape == (2, 3, N) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, quant.gemm_quantized(x.reshape(6, K), qw).view(2, 3, N))


@pytest.mark.parametrize("rows", [1, 6, 40])
def test_no_block_scale_is_read_past_the_scales_end(rows):
    """A decode K tile (up to 1,024 wide) on a short K (160: two scale blocks) reads no scale past the last:
    with NaN there, the output stays finite and the same (CI once met NaN in memory past the scales)."""
    qw, x = weight("fp8_block"), activations(rows)
    expected = quant.gemm_quantized(x, qw)
    padded = torch.full((qw.scale.numel() + 64,), float("nan"), device=DEVICE)
    padded[:qw.scale.numel()] = qw.scale.reshape(-1)
    qw.scale, qw.prepared = padded[:qw.scale.numel()].view(qw.scale.shape), {}
    out = quant.gemm_quantized(x, qw)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("name", ["fp8_block", "mxfp4"])
@pytest.mark.parametrize("rows", [1, 2])
def test_blocks_cut_by_the_matrix_edge(name, rows):
    """N and K past the last whole FP8 block (200 = 128 + 72 rows, 288 = 2 * 128 + 32 columns) and past the
    last whole skinny K tile."""
    qw, x = weight(name, n=200, k=288), float32_activations(rows, name, k=288)
    expected = x @ dequantize_weight(qw).t()
    assert relative_error(quant.gemm_quantized(x, qw), expected) < 1e-5


def test_an_empty_batch_gives_an_empty_output():
    out = quant.gemm_quantized(activations(0), weight("fp8_channel"), out_dtype=torch.float32)
    assert out.shape == (0, N) and out.dtype == torch.float32


@pytest.mark.parametrize("name", ["fp8_tensor", "fp8_tensor_static", "fp8_channel"])
def test_scaled_mm_path_matches_reference(monkeypatch, name):
    """Per-tensor and per-channel FP8 past 16 rows run torch._scaled_mm on CUDA; its operands (activations
    quantized by the Triton kernel, the scales' shapes) are the same on CPU, where torch has it too."""
    if not ON_GPU:
        monkeypatch.setattr(quant, "_scaled_mm_serves", lambda *args: True)
    elif not quant._scaled_mm_serves(activations(1), SCHEMES[name].method, 80, 160, torch.bfloat16):
        pytest.skip("this GPU has no FP8 _scaled_mm")
    qw, x = weight(name, n=80), activations(40)
    bias = torch.randn(80, device=DEVICE).to(x.dtype)
    assert relative_error(quant.gemm_quantized(x, qw, bias), reference.gemm_quantized(x, qw, bias)) < ROUNDING_LIMIT


# ---- activation quantizers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [None, K, 128, 32])
def test_fp8_activation_quantizer_matches_the_reference_bit_for_bit(group):
    x = activations(5) * torch.logspace(-3, 3, K, device=DEVICE).to(torch.bfloat16)  # subnormals to saturation
    q, scales = activation_quant.quantize_fp8(x, group)
    if group is None:
        dequantized = q.float() * scales
    else:
        dequantized = q.float() * scales.repeat_interleave(group, dim=1)[:, :K]
    torch.testing.assert_close(dequantized, fake_quantize_fp8(x, group), rtol=0, atol=0)


def test_fp8_static_scale_quantizer_saturates_as_the_reference():
    x, scale = activations(4) * 30, torch.tensor([0.05], device=DEVICE)
    q, scales = activation_quant.quantize_fp8(x, None, scale)
    torch.testing.assert_close(q.float() * scales, fake_quantize_fp8(x, None, static_scale=scale), rtol=0, atol=0)


def test_mxfp4_activation_quantizer_matches_the_reference_bit_for_bit():
    x = activations(4, k=256, dtype=torch.float32) * 4
    x[0, :32] = 0.0                                                   # an all-zero group
    x[1, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * torch.tensor([1.0] * 8 + [-1.0] * 8)
    x[1, 16:32] = 0.1                                                 # ties to the even code, both signs
    x[2, :32] = 1e-40                                                 # subnormal amax
    q, scales = activation_quant.quantize_mxfp4(x)
    expected_q, expected_scales = quantize_e2m1(x)
    assert torch.equal(scales, expected_scales)
    assert torch.equal(q, expected_q)


# ---- prepare ---------------------------------------------------------------------------------------------


def test_prepare_as_a_layer_calls_it_and_the_op_reads_the_prepared_layout():
    """A non-contiguous loaded weight (a column slice) is kept as a contiguous copy; the loaded tensors stay."""
    full = weight("fp8_channel", k=2 * K)
    sliced = QuantizedWeight(full.scheme, full.weight[:, :K], full.scale)
    registry.prepare_quantized(quant.gemm_quantized, sliced)
    prepared_weight, prepared_scale = sliced.prepared["triton"]
    assert prepared_weight.is_contiguous() and torch.equal(prepared_weight, full.weight[:, :K])
    assert not sliced.weight.is_contiguous()
    x = activations(2, dtype=torch.float32)
    expected = x @ dequantize_weight(QuantizedWeight(full.scheme, full.weight[:, :K].contiguous(), full.scale)).t()
    assert relative_error(quant.gemm_quantized(x, sliced), expected) < 1e-5


def test_prepare_refuses_mxfp4_rows_that_are_not_whole_groups():
    qw = QuantizedWeight(QuantScheme("mxfp4", activation="none"), torch.zeros(8, 24, dtype=torch.uint8, device=DEVICE),
                         torch.zeros(8, 1, dtype=torch.uint8, device=DEVICE))
    with pytest.raises(ValueError, match="in_features % 32"):
        registry.prepare_quantized(quant.gemm_quantized, qw)


def test_the_backend_serves_every_quantized_op():
    from engine.kernels import triton as backend
    for op in ("gemm_fp8_tensor", "gemm_fp8_channel", "gemm_fp8_block", "gemm_mxfp4"):
        assert backend.BACKEND.ops[op] is quant.gemm_quantized
    for op in ("fused_experts_fp8", "fused_experts_mxfp4"):
        assert backend.BACKEND.ops[op] is moe_quant.fused_experts_quantized


# ---- experts ---------------------------------------------------------------------------------------------

HIDDEN, INTER, EXPERTS = 128, 96, 4  # INTER: no multiple of 128 (FP8 blocks), of 64 (tiles)
BATCH_TILES = moe.MoeTiles(block_m=32, gate_up_block_n=32, gate_up_block_k=64, down_block_n=64, down_block_k=64)


def experts(name: str):
    w13 = weight(name, n=2 * INTER, k=HIDDEN, experts=EXPERTS)
    w2 = weight(name, n=HIDDEN, k=INTER, experts=EXPERTS)
    for registered in (w13, w2):
        registry.prepare_quantized(moe_quant.fused_experts_quantized, registered)
    return w13, w2


def routing(num_tokens: int, top_k: int = 2):
    scores = torch.rand(num_tokens, EXPERTS, device=DEVICE)
    ids = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    weights = torch.rand(num_tokens, top_k, device=DEVICE)
    return weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("name", ["fp8_tensor", "fp8_channel", "fp8_block", "mxfp4", "mxfp4_a4"])
def test_decode_experts_match_reference(name):
    x, (w13, w2) = activations(3, HIDDEN), experts(name)
    weights, ids = routing(3)
    actual = moe_quant.fused_experts_quantized(x, w13, w2, weights, ids)
    # Two quantized GEMMs with a SiLU between them: twice a single GEMM's allowance. w4a4 quantizes the
    # intermediate, whose last bf16 bit differs with the order of the sums: a value at an e2m1 midpoint can
    # round the other way, which moves it by a whole e2m1 step (weight-only's class of error).
    limit = 2 * (ROUNDING_LIMIT if name == "mxfp4" else WEIGHT_ONLY_LIMIT)
    assert relative_error(actual, reference.fused_experts_quantized(x, w13, w2, weights, ids)) < limit


@pytest.mark.parametrize("name", ["fp8_tensor", "fp8_channel", "fp8_block", "mxfp4"])
def test_decode_experts_are_the_experts_of_the_dequantized_weights(name):
    x, (w13, w2) = float32_activations(3, name, HIDDEN), experts(name)
    weights, ids = routing(3)
    expected = torch_moe.fused_experts(x, dequantize_weight(w13), dequantize_weight(w2), weights, ids)
    limit = ROUNDING_LIMIT if name == "mxfp4" else 1e-5  # MXFP4's dot rounds the float32 intermediate to bf16
    assert relative_error(moe_quant.fused_experts_quantized(x, w13, w2, weights, ids), expected) < limit


@pytest.mark.parametrize("name", ["fp8_tensor", "fp8_channel", "fp8_block", "mxfp4_a4"])
def test_batch_experts_quantize_activations_as_the_reference(name):
    """Row tiles of more than 16 pairs: FP8 x FP8 products on activations quantized per token (fp8_tensor:
    per token, finer than the reference's per tensor) or per token and block; MXFP4 w4a4 as the reference.
    Float32 activations, so that no rounding of the intermediate hides a difference."""
    x, (w13, w2) = activations(24, HIDDEN, dtype=torch.float32), experts(name)
    weights, ids = routing(24)
    actual = moe_quant.fused_experts_quantized(x, w13, w2, weights, ids, BATCH_TILES)
    exact = takes_w8a8() and name != "fp8_tensor" or name == "mxfp4_a4"
    limit = 1e-5 if exact else 2 * WEIGHT_ONLY_LIMIT
    assert relative_error(actual, reference.fused_experts_quantized(x, w13, w2, weights, ids)) < limit


def test_pairs_of_remote_experts_contribute_nothing():
    x, (w13, w2) = activations(5, HIDDEN), experts("fp8_block")
    weights, ids = routing(5)
    ids[1] = -1
    ids[3, 0] = -1
    out = moe_quant.fused_experts_quantized(x, w13, w2, weights, ids)
    assert not out[1].any()
    limit = 2 * WEIGHT_ONLY_LIMIT
    assert relative_error(out, reference.fused_experts_quantized(x, w13, w2, weights, ids)) < limit


def test_an_empty_batch_of_experts_gives_an_empty_output():
    w13, w2 = experts("mxfp4")
    out = moe_quant.fused_experts_quantized(activations(0, HIDDEN), w13, w2, torch.empty(0, 2, device=DEVICE),
                                            torch.empty(0, 2, dtype=torch.int32, device=DEVICE))
    assert out.shape == (0, HIDDEN) and out.dtype == torch.bfloat16


# ---- CUDA graphs -----------------------------------------------------------------------------------------


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("name", ["fp8_block", "mxfp4"])
def test_decode_replays_in_a_cuda_graph_with_new_inputs(name):
    qw, x = weight(name), activations(1)
    (w13, w2), h = experts(name), activations(2, HIDDEN)
    weights, ids = routing(2)
    check_quantized_graph_replay(qw, x, w13, w2, h, weights, ids, routing(2))
