"""fused_moe: the routed-expert MLP of the real aiter.fused_moe, computed expert by expert.

hidden_states [T, H]; w1 [E, 2I, H] (gate rows first, then up) and w2 [E, H, I], preshuffled by
shuffle_weight(w, (16, 16)) - except fp4x2 weights, which the real wrapper treats as preshuffled only
when the tensor carries shuffle_weight's `is_shuffled = True` attribute (it picks the CK "a4w4" or
"a4w4_bns" kernels by it). topk_weight fp32 [T, k], topk_ids int32 [T, k] hold GLOBAL expert ids.
expert_mask (expert parallelism): int32 [global_E] with 1 for the experts this rank holds; w1/w2 hold
only those, in global order (local index = cumsum(mask) - 1); routes to other experts add nothing, a
token without local routes gives 0. num_local_tokens int32 [1]: rows past it are not computed (0).

Per quant_type (activations are quantised dynamically with get_hip_quant unless they already have
the weight dtype, then a1_scale is required):
- No: bf16/fp16 weights.
- per_Tensor: fp8 weights, w1_scale and w2_scale with one fp32 per expert ([E, 1, 1] or [E]).
- per_Token: fp8 weights, w1_scale [E, 2I, 1], w2_scale [E, H, 1] fp32; activations per token.
- per_1x128 (per_128x128 is remapped to it): w1_scale [E, 2I/128, H/128], w2_scale [E, H/128, I/128].
- per_1x32 (gfx950): fp4x2 weights [E, 2I, H/2], [E, H, I/2]; e8m0 scales for the 2-D views
  [E*2I, H/32] and [E*H, I/32], each passed through e8m0_shuffle; activations MXFP4.
Stage 1 output (silu(gate) * up, or gelu) is rounded to `dtype` (per_1x128 keeps float32) before
stage 2 quantises it like the input. Routed weights are applied after stage 2 (doweight_stage1=False)
or to stage 1's output; accumulation in float32, one rounding to dtype (default hidden_states.dtype,
which must then be fp16/bf16).
"""
import functools
from typing import Optional

import torch

from .jit.utils.chip_info import get_gfx
from .ops.enum import ActivationType, QuantType
from .ops.quant import get_hip_quant
from .utility import dtypes
from ._double import numerics
from ._double.layouts import blockscale_weight, unshuffle_e8m0, unshuffle_weight
from ._double.recording import recorded

quant_remap = {QuantType.per_128x128: QuantType.per_1x128}


@functools.lru_cache(maxsize=1024)
def get_inter_dim(w1_shape, w2_shape):
    E, _, model_dim = w1_shape
    E, model_dim, inter_dim = w2_shape

    int4_war = model_dim // w1_shape[-1]
    inter_dim *= int4_war
    return E, model_dim, inter_dim


@recorded()
def fused_moe(
    hidden_states,
    w1,  # [expert(local_expert:EP), inter_dim*2, dim] N,K
    w2,  # [expert(local_expert:EP), dim, inter_dim]
    topk_weight,
    topk_ids,
    expert_mask: Optional[torch.tensor] = None,  # EP
    activation=ActivationType.Silu,
    quant_type=QuantType.No,
    doweight_stage1=False,
    # following for quant
    w1_scale: Optional[torch.tensor] = None,  # [expert(local_expert:EP), inter_dim, 1]
    w2_scale: Optional[torch.tensor] = None,  # [expert(local_expert:EP), model_dim, 1]
    a1_scale: Optional[torch.tensor] = None,  # [expert(local_expert:EP), 1, model_dim]
    a2_scale: Optional[torch.tensor] = None,  # [expert(local_expert:EP), 1, inter_dim]
    # following for tuning
    block_size_M=None,
    num_local_tokens: Optional[torch.tensor] = None,
    moe_sorting_dispatch_policy=0,
    dtype=None,
    # following for cktile support
    hidden_pad=0,
    intermediate_pad=0,
    bias1=None,
    bias2=None,
):
    activation = ActivationType(activation.value)  # the real wrapper reads .value: enums only
    quant_type = quant_remap.get(QuantType(quant_type.value), QuantType(quant_type.value))
    _unsupported(hidden_pad=hidden_pad != 0, intermediate_pad=intermediate_pad != 0, bias1=bias1 is not None,
                 bias2=bias2 is not None, a2_scale=a2_scale is not None)
    tokens, topk = topk_ids.shape
    E, model_dim, inter_dim = get_inter_dim(w1.shape, w2.shape)
    assert w1.shape[1] in [inter_dim, inter_dim * 2], f"Invalid MoE weight: {w1.shape=} {w2.shape=}"
    if w1.shape[1] != 2 * inter_dim:
        raise NotImplementedError("the aiter double emulates gate+up (g1u1) weights only")
    dtype = hidden_states.dtype if dtype is None else dtype
    assert dtype in [dtypes.fp16, dtypes.bf16], f"Fused_moe unsupported out dtype: {dtype}"
    if topk_ids.dtype != torch.int32 or topk_weight.dtype != torch.float32:
        raise RuntimeError(f"topk_ids must be int32 and topk_weight fp32, got {topk_ids.dtype}, {topk_weight.dtype}")

    if quant_type == QuantType.per_Tensor and num_local_tokens is not None:
        raise AssertionError("num_rows is not supported for per_tensor_quant_hip")
    local_ids = _local_expert_ids(topk_ids, expert_mask, E)
    valid = tokens if num_local_tokens is None else min(tokens, int(num_local_tokens.reshape(-1)[0]))
    token_idx, slot = torch.nonzero(local_ids[:valid] >= 0, as_tuple=True)
    experts = local_ids[token_idx, slot]
    routed = topk_weight[token_idx, slot].float().unsqueeze(1)
    out = torch.zeros(tokens, model_dim, dtype=torch.float32)
    if token_idx.numel() == 0:
        return out.to(dtype)
    gate_up = _expert_weights(w1, w1_scale, quant_type, E)
    down = _expert_weights(w2, w2_scale, quant_type, E)
    act = {ActivationType.Silu: torch.nn.functional.silu, ActivationType.Gelu: torch.nn.functional.gelu}.get(activation)
    if act is None:
        raise NotImplementedError(f"the aiter double emulates Silu and Gelu, not {activation}")

    a1 = _activation_input(hidden_states[:valid], a1_scale, quant_type, w1.dtype)[token_idx]
    h = _per_expert_matmul(a1, gate_up, experts)
    h = act(h[:, :inter_dim]) * h[:, inter_dim:]
    if doweight_stage1:
        h = h * routed
    a2 = _quantised(h if quant_type == QuantType.per_1x128 else h.to(dtype), quant_type, w2.dtype)
    y = _per_expert_matmul(a2, down, experts)
    if not doweight_stage1:
        y = y * routed
    out.index_add_(0, token_idx, y)
    return out.to(dtype)


def _per_expert_matmul(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Row r of x times weights[experts[r]]^T, float32."""
    out = torch.empty(x.shape[0], weights.shape[1], dtype=torch.float32)
    for expert in experts.unique().tolist():
        rows = experts == expert
        out[rows] = x[rows] @ weights[expert].t()
    return out


def _unsupported(**options) -> None:
    used = [name for name, active in options.items() if active]
    if used:
        raise NotImplementedError(f"the aiter double does not emulate fused_moe({', '.join(used)})")


def _local_expert_ids(topk_ids: torch.Tensor, expert_mask: Optional[torch.Tensor], num_local: int) -> torch.Tensor:
    """Global ids -> local expert index, -1 for experts this rank does not hold."""
    ids = topk_ids.long()
    if expert_mask is None:
        return ids
    if expert_mask.dtype != torch.int32 or expert_mask.dim() != 1:
        raise RuntimeError(f"expert_mask must be int32 [global_E] (moe_sorting reads int32), got {expert_mask.dtype}")
    if int(expert_mask.sum()) != num_local:
        raise RuntimeError(f"expert_mask marks {int(expert_mask.sum())} local experts but w1 holds {num_local}")
    local = torch.cumsum(expert_mask, 0) - 1
    local[expert_mask == 0] = -1
    return local[ids]


def _expert_weights(w: torch.Tensor, scale: Optional[torch.Tensor], quant_type: QuantType, E: int) -> torch.Tensor:
    """[E, N, K] stored weights -> float32 logical weights."""
    if quant_type == QuantType.per_1x32:
        if get_gfx() == "gfx942":
            raise RuntimeError("MXFP4 fused_moe needs gfx950 (no fp4 kernels on gfx942)")
        if w.dtype != dtypes.fp4x2:
            raise RuntimeError(f"per_1x32 fused_moe needs fp4x2 weights, got {w.dtype}")
        if scale is None or scale.dim() != 2 or scale.element_size() != 1:
            raise RuntimeError("per_1x32 fused_moe scales are e8m0 2-D: e8m0_shuffle of [E*N, K/32]")
        raw = unshuffle_weight(w, (16, 16)) if getattr(w, "is_shuffled", False) else w
        n, k = w.shape[1], w.shape[2] * 2
        codes = unshuffle_e8m0(scale)
        return numerics.mxfp4_dequantize(raw.view(torch.uint8).reshape(E * n, k // 2), codes).view(E, n, k)
    logical = unshuffle_weight(w, (16, 16)).float()
    if quant_type == QuantType.No:
        if w.dtype not in (dtypes.bf16, dtypes.fp16):
            raise RuntimeError(f"QuantType.No fused_moe needs bf16/fp16 weights, got {w.dtype}")
        return logical
    if w.dtype != dtypes.fp8:
        raise RuntimeError(f"{quant_type.name} fused_moe needs {dtypes.fp8} weights on {get_gfx()}, got {w.dtype}")
    n, k = w.shape[1], w.shape[2]
    if quant_type == QuantType.per_Tensor:
        _expect(scale, E, "one scale per expert [E, 1, 1]")
        return logical * scale.float().reshape(E, 1, 1)
    if quant_type == QuantType.per_Token:
        _expect(scale, E * n, f"[E, {n}, 1]")
        return logical * scale.float().reshape(E, n, 1)
    if quant_type == QuantType.per_1x128:
        _expect(scale, E * (n // 128) * (k // 128), f"[E, {n // 128}, {k // 128}]")
        blocks = scale.float().reshape(E, n // 128, k // 128)
        return torch.stack([blockscale_weight(logical[e], blocks[e]) for e in range(E)])
    raise NotImplementedError(f"fused_moe quant_type {quant_type}")


def _expect(scale: Optional[torch.Tensor], numel: int, shape: str) -> None:
    if scale is None or scale.numel() != numel or scale.dtype != torch.float32:
        got = None if scale is None else f"{tuple(scale.shape)} {scale.dtype}"
        raise RuntimeError(f"fused_moe scale must be fp32 {shape}, got {got}")


def _activation_input(x: torch.Tensor, a1_scale, quant_type: QuantType, weight_dtype: torch.dtype) -> torch.Tensor:
    """Stage-1 input as the kernels see it: quantised then dequantised, float32 [T, H]."""
    if quant_type == QuantType.No:
        return x.float()
    if x.dtype == weight_dtype:  # already quantised by the caller
        if a1_scale is None:
            raise AssertionError("a1_scale must be provided for quantized input for fused_moe")
        if quant_type not in (QuantType.per_Tensor, QuantType.per_Token):
            raise NotImplementedError("the aiter double takes pre-quantised input for per_Tensor/per_Token only")
        return x.float() * a1_scale.float().reshape(-1, 1)
    return _quantised(x, quant_type, weight_dtype, a1_scale)


def _quantised(x: torch.Tensor, quant_type: QuantType, weight_dtype: torch.dtype, scale=None) -> torch.Tensor:
    """Quantise x [R, C] the way fused_moe's get_hip_quant call does, and dequantise to float32."""
    if quant_type == QuantType.No:
        return x.float()
    if quant_type == QuantType.per_1x32:
        packed, codes = get_hip_quant(quant_type)(x, scale=scale, quant_dtype=dtypes.fp4x2)
        return numerics.mxfp4_dequantize(packed, codes)
    if quant_type == QuantType.per_1x128:
        q, s = numerics.quantize_rows(x.float().reshape(x.shape[0], -1, 128), weight_dtype, 1e-10)
        return (q.float() * s).reshape(x.shape)
    q, s = get_hip_quant(quant_type)(x, scale=scale, quant_dtype=weight_dtype)
    return q.float() * s.float().reshape(-1, 1) if quant_type == QuantType.per_Token else q.float() * s.float()
