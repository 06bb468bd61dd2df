"""Reference quantized GEMMs and MoE experts: dequantize to float32, quantize the activations as the scheme
says, matmul, round once (engine/kernels/quant.py states the formats). Slow, exact, runs anywhere: the oracle
for the Triton and AITER versions and what CPU runs."""
from __future__ import annotations

import torch

from engine.kernels.quant import QuantizedWeight, dequantize_weight, expert_slice, fake_quantize_activations
from engine.kernels.torch.moe import each_expert, with_bias


def gemm_quantized(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """(x [..., K], weight [N, K] quantized, bias [N] | None) -> [..., N] in `out_dtype` (default x's)."""
    lead = x.shape[:-1]
    y = fake_quantize_activations(x.reshape(-1, x.shape[-1]), qw) @ dequantize_weight(qw).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype).reshape(*lead, -1)


def fused_experts_quantized(x: torch.Tensor, w13: QuantizedWeight, w2: QuantizedWeight, weights: torch.Tensor,
                            ids: torch.Tensor, swiglu_limit: float | None = None,
                            w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                            oai_alpha: float | None = None, gelu: bool = False) -> torch.Tensor:
    """`fused_experts` (engine/kernels/torch/moe.py) with quantized expert weights: each expert's GEMMs as
    `gemm_quantized` (its activations quantized as its scheme says), the intermediate rounded to x's dtype.
    `swiglu_limit` (DeepSeek-V4): gate clamped to <= limit and up to [-limit, limit] before the SiLU, on the
    gate/up GEMM's rounded output, as the full-precision op does; biases and `oai_alpha` (gpt-oss) as there."""
    return each_expert(x, weights, ids, w2.in_features,
                       with_bias(lambda rows, e: gemm_quantized(rows, expert_slice(w13, e)), w13_bias),
                       with_bias(lambda rows, e: gemm_quantized(rows, expert_slice(w2, e), out_dtype=torch.float32),
                                 w2_bias),
                       swiglu_limit, oai_alpha, gelu)
