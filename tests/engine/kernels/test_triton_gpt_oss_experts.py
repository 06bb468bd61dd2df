"""gpt-oss's experts in the Triton MoE kernels (full precision and MXFP4): the biases added in the gate/up and
down epilogues, the clamp, and the activation (up + 1) * gate * sigmoid(alpha * gate), against the torch
reference; with a control that each feature changes the output.

On a CUDA GPU the kernels run compiled; elsewhere under TRITON_INTERPRET=1 at tiny sizes."""
from __future__ import annotations

import pytest
import torch

from triton_device import DEVICE  # noqa: E402  (skips the module without Triton)

from engine.kernels.quant import QuantScheme, dequantize_weight, quantize_weight  # noqa: E402
from engine.kernels.torch.moe import fused_experts as reference  # noqa: E402
from engine.kernels.triton.moe import fused_experts  # noqa: E402
from engine.kernels.triton.moe_quant import fused_experts_quantized  # noqa: E402

GPT_OSS = dict(swiglu_limit=0.7, oai_alpha=1.702)


def experts(dtype=torch.float32, seed=0, hidden=64, inter=32):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(7, hidden, generator=generator)
    w13 = torch.randn(4, 2 * inter, hidden, generator=generator) * 0.3
    w2 = torch.randn(4, hidden, inter, generator=generator) * 0.3
    b13 = torch.randn(4, 2 * inter, generator=generator) * 0.5
    b2 = torch.randn(4, hidden, generator=generator) * 0.5
    weights = torch.rand(7, 2, generator=generator)
    ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, -1], [0, 2], [1, 3], [2, 0]], dtype=torch.int32)
    return [t.to(dtype) if t.is_floating_point() and t is not weights else t for t in (x, w13, w2, b13, b2)] + \
        [weights, ids]


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=str)
def test_full_precision_experts_with_biases_and_oai_activation(dtype, tolerance):
    x, w13, w2, b13, b2, weights, ids = experts(dtype)
    expected = reference(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2, **GPT_OSS).float()
    x_d, w13_d, w2_d, b13_d, b2_d, weights_d, ids_d = on_device(x, w13, w2, b13, b2, weights, ids)
    out = fused_experts(x_d, w13_d, w2_d, weights_d, ids_d, w13_bias=b13_d, w2_bias=b2_d, **GPT_OSS).cpu().float()
    error = ((out - expected).abs().max() / expected.abs().max()).item()
    assert error < tolerance, error
    # Controls: each feature moves the reference well past the tolerance.
    for changed in (dict(w13_bias=None, w2_bias=None, **GPT_OSS), dict(w13_bias=b13, w2_bias=b2),
                    dict(w13_bias=b13, w2_bias=b2, oai_alpha=1.702)):
        other = reference(x, w13, w2, weights, ids, **changed).float()
        assert ((other - expected).abs().max() / expected.abs().max()).item() > 0.05


def test_mxfp4_experts_with_biases_and_oai_activation():
    """Weight-only MXFP4 (gpt-oss's published experts): the products of the dequantized weights, to bf16
    rounding of the activations (tl.dot_scaled multiplies bf16)."""
    scheme = QuantScheme("mxfp4", "none")
    x, w13, w2, b13, b2, weights, ids = experts()
    x = x.bfloat16().float()
    q13, q2 = quantize_weight(w13, scheme), quantize_weight(w2, scheme)
    expected = reference(x, dequantize_weight(q13), dequantize_weight(q2), weights, ids, w13_bias=b13, w2_bias=b2,
                         **GPT_OSS)
    for q in (q13, q2):
        q.weight, q.scale = q.weight.to(DEVICE), q.scale.to(DEVICE)
        fused_experts_quantized.prepare(q)
    x_d, b13_d, b2_d, weights_d, ids_d = on_device(x, b13, b2, weights, ids)
    out = fused_experts_quantized(x_d, q13, q2, weights_d, ids_d, w13_bias=b13_d, w2_bias=b2_d, **GPT_OSS).cpu()
    error = ((out - expected).abs().max() / expected.abs().max()).item()
    assert error < 1e-2, error


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=str)
def test_gelu_experts(dtype, tolerance):
    """Gemma 4's experts: gelu_tanh(gate) * up in the gate/up epilogue (full precision and MXFP4)."""
    x, w13, w2, _, _, weights, ids = experts(dtype)
    expected = reference(x, w13, w2, weights, ids, gelu=True).float()
    x_d, w13_d, w2_d, weights_d, ids_d = on_device(x, w13, w2, weights, ids)
    out = fused_experts(x_d, w13_d, w2_d, weights_d, ids_d, gelu=True).cpu().float()
    assert ((out - expected).abs().max() / expected.abs().max()).item() < tolerance
    silu = reference(x, w13, w2, weights, ids).float()
    assert ((silu - expected).abs().max() / expected.abs().max()).item() > 0.05
    if dtype == torch.float32:
        scheme = QuantScheme("mxfp4", "none")
        xb = x.bfloat16().float()
        q13, q2 = quantize_weight(w13, scheme), quantize_weight(w2, scheme)
        want = reference(xb, dequantize_weight(q13), dequantize_weight(q2), weights, ids, gelu=True)
        for q in (q13, q2):
            q.weight, q.scale = q.weight.to(DEVICE), q.scale.to(DEVICE)
            fused_experts_quantized.prepare(q)
        got = fused_experts_quantized(*on_device(xb), q13, q2, *on_device(weights, ids), gelu=True).cpu()
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-2
