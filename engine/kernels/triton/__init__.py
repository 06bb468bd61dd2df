"""The portable Triton backend: norms, rotary embedding, SiLU-and-mul, sampling, paged attention and the
mixture-of-experts router and expert GEMMs as Triton kernels for any CUDA or ROCm GPU.

`gemm` runs a Triton skinny GEMM for decode-sized batches (up to 16 rows, bf16/fp16), where it measured
faster than cuBLAS, and the vendor BLAS (cuBLAS / hipBLASLt through torch) for everything larger; at those
sizes `gated_gemm` applies the MLP's SiLU-and-mul in the GEMM's epilogue. Quantized weights (FP8, MXFP4) have
their own GEMMs and experts (quant.py, moe_quant.py), weight-only skinny kernels for decode included."""
from __future__ import annotations

import torch

from engine.kernels.registry import KernelBackend
from engine.kernels.triton import gdn, gemv, mla, mla_sparse, moe, moe_quant, moe_routing, ops, quant
from engine.kernels.triton.attention import TritonAttentionBackend
from engine.kernels.triton.sampling import sample

# Gated DeltaNet: flash-linear-attention's Triton kernels where `fla` imports (the optional `gdn` extra), else
# the torch references (a recurrence per token); chosen once, here, and logged (see gdn.py).
_GDN_OPS = gdn.select_ops()

BACKEND = KernelBackend(
    name="triton",
    ops={
        "gemm": gemv.gemm,
        "gemm_float32": gemv.gemm_float32,
        "rms_norm": ops.rms_norm,
        "fused_add_rms_norm": ops.fused_add_rms_norm,
        "rms_norm_variant": ops.rms_norm_variant,
        "fused_add_rms_norm_variant": ops.fused_add_rms_norm_variant,
        "rms_norm_gated": ops.rms_norm_gated,
        "rotary_embedding": ops.rotary_embedding,
        "silu_and_mul": ops.silu_and_mul,
        "causal_conv1d": _GDN_OPS["causal_conv1d"],
        "gated_delta_rule": _GDN_OPS["gated_delta_rule"],
        "gelu_tanh_and_mul": ops.gelu_tanh_and_mul,
        "gated_gemm": gemv.gated_gemm,
        "sample": sample,
        "moe_topk_softmax": moe.moe_topk_softmax,
        "moe_grouped_topk": moe.moe_grouped_topk,  # the torch reference (see moe.py)
        "fused_experts": moe.fused_experts,
        "moe_route_mask": moe_routing.moe_route_mask,
        "moe_local_slots": moe_routing.moe_local_slots,
        "gemm_fp8_tensor": quant.gemm_quantized,
        "gemm_fp8_channel": quant.gemm_quantized,
        "gemm_fp8_block": quant.gemm_quantized,
        "gemm_mxfp4": quant.gemm_quantized,
        "gemm_int4_group": quant.gemm_quantized,
        "fused_experts_fp8": moe_quant.fused_experts_quantized,
        "fused_experts_mxfp4": moe_quant.fused_experts_quantized,
        "fused_experts_int4": moe_quant.fused_experts_quantized,
        "mla_attention": mla.mla_attention,
        "mla_sparse_attention": mla_sparse.mla_sparse_attention,
    },
    attention=TritonAttentionBackend,
)


def available(device: torch.device) -> str | None:
    """None when the backend can run on `device`, else why not."""
    if device.type != "cuda":
        return f"Triton kernels need a CUDA or ROCm GPU, not {device.type}"
    if not torch.cuda.is_available():
        return "no CUDA or ROCm GPU is visible to torch"
    return None
