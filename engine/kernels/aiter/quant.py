"""AITER adapters for quantized weights (ATOM's LinearBase and FusedMoE dispatch by quant type):

| op                  | AITER kernel                                   | weights prepared once                 |
|---------------------|------------------------------------------------|---------------------------------------|
| gemm_fp8_tensor     | get_hip_quant(per_Tensor) + tgemm.mm(scales)   | FP8 in the GPU's format               |
| gemm_fp8_channel    | get_hip_quant(per_Token) + gemm_a8w8_bpreshuffle | + shuffle_weight (16, 16)           |
| gemm_fp8_block      | get_hip_quant(per_1x128) + gemm_a8w8_blockscale_bpreshuffle | + shuffle_weight (16, 16) |
| gemm_mxfp4          | get_hip_quant(per_1x32) + gemm_a4w4 (gfx950)   | shuffle_weight, e8m0_shuffle(scales)  |
| fused_experts_fp8   | fused_moe.fused_moe(quant_type=per_Tensor / per_Token / per_1x128) | shuffled, per expert |
| fused_experts_mxfp4 | fused_moe.fused_moe(quant_type=per_1x32) (gfx950) | shuffled, e8m0_shuffle             |

"The GPU's format": MI300X (gfx942) computes in float8_e4m3fnuz, whose bit patterns mean half of what
they mean in e4m3fn, so checkpoint weights are reinterpreted and their scales (and static input scales)
doubled (ATOM's normalize_e4m3fn_to_e4m3fnuz); MI355X takes e4m3fn as it is.

A layer the AITER kernels cannot take (weight-only MXFP4, which has no AITER GEMM here; sizes the
pre-shuffled kernels cannot tile) is decided at preparation, logged once per op and reason, and runs on the
fallback backend's op (Triton, or the torch reference where Triton cannot run).
"""
from __future__ import annotations

import functools
import logging

import torch

from engine.kernels.aiter.ops import kernel, masked_ids, rows
from engine.kernels.quant import FP8_DTYPE, QuantizedWeight

logger = logging.getLogger(__name__)

SHUFFLE_TILE = (16, 32)  # shuffle_weight(layout=(16, 16)) needs N % 16 == 0 and K (bytes per row / 1) % 32 == 0


def aiter_fp8_dtype() -> torch.dtype:
    from aiter.utility import dtypes
    return dtypes.fp8


def to_device_fp8(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3fn weights and their scale in the GPU's FP8 format (see the module docstring)."""
    target = aiter_fp8_dtype()
    if weight.dtype == target:
        return weight, scale
    assert weight.dtype == FP8_DTYPE and target == torch.float8_e4m3fnuz, (weight.dtype, target)
    bits = weight.view(torch.int8).clone()
    bits[bits == -128] = 0  # e4m3fn's -0 is fnuz's NaN
    return bits.view(torch.float8_e4m3fnuz), scale * 2.0


def _shufflable(weight: torch.Tensor) -> bool:
    n, k_bytes = weight.shape[-2], weight.shape[-1] * weight.element_size()
    return n % SHUFFLE_TILE[0] == 0 and k_bytes % SHUFFLE_TILE[1] == 0


def _shuffled(weight: torch.Tensor) -> torch.Tensor:
    from aiter.ops.shuffle import shuffle_weight
    return shuffle_weight(weight, layout=(16, 16))


@functools.lru_cache(maxsize=None)
def _log_fallback(op: str, reason: str) -> None:
    logger.info("kernel backend aiter: %s layers with %s run on the fallback backend", op, reason)


def fallback_op(op: str):
    """The fallback backend's version of `op` (the same choice `registry.resolve` makes)."""
    from engine.kernels.registry import _load, fallback_backend_name
    return _load(fallback_backend_name("aiter", torch.device("cuda"))).BACKEND.ops[op]


def _decline(qw: QuantizedWeight, op: str, reason: str) -> None:
    _log_fallback(op, reason)
    qw.prepared["aiter"] = None
    prepare = getattr(fallback_op(op), "prepare", None)
    if prepare is not None:
        prepare(qw)


def _run_fallback(op: str, *args):
    return fallback_op(op)(*args)


def _finish(y: torch.Tensor, x: torch.Tensor, bias, out_dtype, n: int) -> torch.Tensor:
    if bias is not None:
        y = y + bias
    return y.to(out_dtype or x.dtype).view(*x.shape[:-1], n)


# ---- dense GEMMs ----------------------------------------------------------------------------------------

def _prepare_fp8(qw: QuantizedWeight, op: str, shuffle: bool) -> None:
    weight, scale = to_device_fp8(qw.weight, qw.scale.float())
    if shuffle:
        if not _shufflable(weight):
            _decline(qw, op, f"sizes the (16, 16) pre-shuffled kernels cannot tile ({tuple(weight.shape)})")
            return
        weight = _shuffled(weight)
    input_scale = None
    if qw.input_scale is not None:
        input_scale = qw.input_scale * (2.0 if weight.dtype == torch.float8_e4m3fnuz else 1.0)
    qw.prepared["aiter"] = {"weight": weight, "scale": scale, "input_scale": input_scale}


@kernel("aiter.get_hip_quant(per_Tensor) + aiter.tuned_gemm.tgemm.mm")
def gemm_fp8_tensor(x, qw: QuantizedWeight, bias=None, out_dtype=None):
    p = qw.prepared.get("aiter")
    if p is None:
        return _run_fallback("gemm_fp8_tensor", x, qw, bias, out_dtype)
    import aiter
    from aiter.tuned_gemm import tgemm
    quantize = aiter.get_hip_quant(aiter.QuantType.per_Tensor)
    xq, x_scale = quantize(rows(x), scale=p["input_scale"], quant_dtype=p["weight"].dtype)
    y = tgemm.mm(xq, p["weight"], None, otype=x.dtype, scale_a=x_scale, scale_b=p["scale"])
    return _finish(y, x, bias, out_dtype, qw.out_features)


gemm_fp8_tensor.prepare = lambda qw: _prepare_fp8(qw, "gemm_fp8_tensor", shuffle=False)


@kernel("aiter.get_hip_quant(per_Token) + aiter.gemm_a8w8_bpreshuffle")
def gemm_fp8_channel(x, qw: QuantizedWeight, bias=None, out_dtype=None):
    p = qw.prepared.get("aiter")
    if p is None:
        return _run_fallback("gemm_fp8_channel", x, qw, bias, out_dtype)
    import aiter
    quantize = aiter.get_hip_quant(aiter.QuantType.per_Token)
    xq, x_scale = quantize(rows(x), quant_dtype=p["weight"].dtype)
    y = aiter.gemm_a8w8_bpreshuffle(xq, p["weight"], x_scale, p["scale"].view(-1, 1), None, x.dtype)
    return _finish(y, x, bias, out_dtype, qw.out_features)


gemm_fp8_channel.prepare = lambda qw: _prepare_fp8(qw, "gemm_fp8_channel", shuffle=True)


def _prepare_block(qw: QuantizedWeight) -> None:
    if qw.scheme.block != (128, 128) or qw.in_features % 128:
        _decline(qw, "gemm_fp8_block", "blocks other than 128x128 or K not a multiple of 128")
        return
    _prepare_fp8(qw, "gemm_fp8_block", shuffle=True)


@kernel("aiter.get_hip_quant(per_1x128) + aiter.gemm_a8w8_blockscale_bpreshuffle")
def gemm_fp8_block(x, qw: QuantizedWeight, bias=None, out_dtype=None):
    p = qw.prepared.get("aiter")
    if p is None:
        return _run_fallback("gemm_fp8_block", x, qw, bias, out_dtype)
    import aiter
    quantize = aiter.get_hip_quant(aiter.QuantType.per_1x128)
    xq, x_scale = quantize(rows(x), quant_dtype=p["weight"].dtype, transpose_scale=True)
    y = aiter.gemm_a8w8_blockscale_bpreshuffle(xq, p["weight"], x_scale, p["scale"], x.dtype)
    return _finish(y, x, bias, out_dtype, qw.out_features)


gemm_fp8_block.prepare = _prepare_block


def _e8m0_shuffled(scale: torch.Tensor) -> torch.Tensor:
    """uint8 e8m0 scales [.., N, K/32] as the MXFP4 kernels read them: 2-D, padded, shuffled, typed e8m0."""
    from aiter.utility import dtypes
    from aiter.utility.fp4_utils import e8m0_shuffle
    return e8m0_shuffle(scale.reshape(-1, scale.shape[-1])).view(dtypes.fp8_e8m0)


def _as_fp4x2(weight: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 bytes typed as AITER's fp4x2 (uint8 would select other kernels)."""
    from aiter.utility import dtypes
    return weight.view(dtypes.fp4x2)


def _prepare_mxfp4(qw: QuantizedWeight) -> None:
    if qw.scheme.activation != "mxfp4":
        _decline(qw, "gemm_mxfp4", "weight-only MXFP4 (no AITER a16w4 GEMM is mapped)")
        return
    if not _shufflable(qw.weight):
        _decline(qw, "gemm_mxfp4", f"sizes the pre-shuffled kernel cannot tile ({tuple(qw.weight.shape)})")
        return
    qw.prepared["aiter"] = {"weight": _shuffled(_as_fp4x2(qw.weight)), "scale": _e8m0_shuffled(qw.scale)}


@kernel("aiter.get_hip_quant(per_1x32) + aiter.gemm_a4w4")
def gemm_mxfp4(x, qw: QuantizedWeight, bias=None, out_dtype=None):
    p = qw.prepared.get("aiter")
    if p is None:
        return _run_fallback("gemm_mxfp4", x, qw, bias, out_dtype)
    import aiter
    from aiter.utility import dtypes
    x2 = rows(x)
    m = x2.shape[0]
    quantize = aiter.get_hip_quant(aiter.QuantType.per_1x32)
    xq, x_scale = quantize(x2, quant_dtype=dtypes.fp4x2, shuffle=True)
    out = torch.empty((m + 31) // 32 * 32, qw.out_features, dtype=x.dtype, device=x.device)
    aiter.gemm_a4w4(xq, p["weight"], x_scale, p["scale"], out)
    return _finish(out[:m], x, bias, out_dtype, qw.out_features)


gemm_mxfp4.prepare = _prepare_mxfp4


# ---- experts --------------------------------------------------------------------------------------------

def _expert_quant_type(method: str):
    import aiter
    return {"fp8_tensor": aiter.QuantType.per_Tensor, "fp8_channel": aiter.QuantType.per_Token,
            "fp8_block": aiter.QuantType.per_1x128, "mxfp4": aiter.QuantType.per_1x32}[method]


def _prepare_experts(qw: QuantizedWeight, op: str) -> None:
    method = qw.scheme.method
    if method == "mxfp4":
        if qw.scheme.activation != "mxfp4":
            _decline(qw, op, "weight-only MXFP4 experts (no AITER a16w4 MoE is mapped)")
            return
        weight, scale = _as_fp4x2(qw.weight), _e8m0_shuffled(qw.scale)  # scales stay 2-D [E * N, K / 32]
    else:
        if method == "fp8_block" and qw.scheme.block != (128, 128):
            _decline(qw, op, "blocks other than 128x128")
            return
        weight, scale = to_device_fp8(qw.weight, qw.scale.float())
        if method == "fp8_tensor":
            scale = scale.view(-1, 1)  # [E, 1]
        elif method == "fp8_channel":
            scale = scale.unsqueeze(-1)  # [E, N, 1]
    if not _shufflable(weight):
        _decline(qw, op, f"expert sizes the pre-shuffled kernels cannot tile ({tuple(weight.shape)})")
        return
    qw.prepared["aiter"] = {"weight": _shuffled(weight), "scale": scale}


def _fused_experts(op: str, x, w13: QuantizedWeight, w2: QuantizedWeight, weights, ids):
    p13, p2 = w13.prepared.get("aiter"), w2.prepared.get("aiter")
    if p13 is None or p2 is None:
        return _run_fallback(op, x, w13, w2, weights, ids)
    import aiter
    from aiter.fused_moe import fused_moe
    ids, mask = masked_ids(ids, w13.weight.shape[0])
    return fused_moe(x, p13["weight"], p2["weight"], weights, ids, expert_mask=mask,
                     activation=aiter.ActivationType.Silu, quant_type=_expert_quant_type(w13.scheme.method),
                     w1_scale=p13["scale"], w2_scale=p2["scale"])


@kernel("aiter.fused_moe.fused_moe (per_Tensor / per_Token / per_1x128)")
def fused_experts_fp8(x, w13: QuantizedWeight, w2: QuantizedWeight, weights, ids):
    return _fused_experts("fused_experts_fp8", x, w13, w2, weights, ids)


fused_experts_fp8.prepare = lambda qw: _prepare_experts(qw, "fused_experts_fp8")


@kernel("aiter.fused_moe.fused_moe (per_1x32)")
def fused_experts_mxfp4(x, w13: QuantizedWeight, w2: QuantizedWeight, weights, ids):
    return _fused_experts("fused_experts_mxfp4", x, w13, w2, weights, ids)


fused_experts_mxfp4.prepare = lambda qw: _prepare_experts(qw, "fused_experts_mxfp4")
