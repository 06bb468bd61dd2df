"""Reference quantized GEMMs and MoE experts: dequantize to float32, quantize the activations as the scheme
says, matmul, round once (engine/kernels/quant.py states the formats). Slow, exact, runs anywhere: the oracle
for the Triton and AITER versions and what CPU runs."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.quant import QuantizedWeight, dequantize_weight, expert_slice, fake_quantize_activations


def gemm_quantized(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """(x [..., K], weight [N, K] quantized, bias [N] | None) -> [..., N] in `out_dtype` (default x's)."""
    lead = x.shape[:-1]
    y = fake_quantize_activations(x.reshape(-1, x.shape[-1]), qw) @ dequantize_weight(qw).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype).reshape(*lead, -1)


def fused_experts_quantized(x: torch.Tensor, w13: QuantizedWeight, w2: QuantizedWeight, weights: torch.Tensor,
                            ids: torch.Tensor) -> torch.Tensor:
    """`fused_experts` (engine/kernels/torch/moe.py) with quantized expert weights: each expert's GEMMs as
    `gemm_quantized` (its activations quantized as its scheme says), the intermediate rounded to x's dtype."""
    num_tokens, hidden = x.shape
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out.to(x.dtype)
    flat_ids = ids.reshape(-1).long()
    token_of_pair = torch.arange(num_tokens, device=x.device).repeat_interleave(ids.shape[1])
    flat_weights = weights.reshape(-1).float()
    intermediate = w2.in_features
    for expert in torch.unique(flat_ids).tolist():
        if expert < 0:
            continue
        pairs = (flat_ids == expert).nonzero(as_tuple=True)[0]
        tokens = token_of_pair[pairs]
        gate_up = gemm_quantized(x[tokens], expert_slice(w13, expert))
        hidden_act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        y = gemm_quantized(hidden_act, expert_slice(w2, expert), out_dtype=torch.float32)
        out.index_add_(0, tokens, y * flat_weights[pairs, None])
    return out.to(x.dtype)
