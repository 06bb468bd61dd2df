"""The torch reference backend: every operation, on any device."""
from __future__ import annotations

from engine.kernels.registry import KernelBackend
from engine.kernels.torch import gdn, mla, moe, ops, quant
from engine.kernels.torch.attention import TorchAttentionBackend
from engine.kernels.torch.sampling import sample

BACKEND = KernelBackend(
    name="torch",
    ops={
        "gemm": ops.gemm,
        "gemm_float32": ops.gemm_float32,
        "rms_norm": ops.rms_norm,
        "fused_add_rms_norm": ops.fused_add_rms_norm,
        "rms_norm_variant": ops.rms_norm_variant,
        "fused_add_rms_norm_variant": ops.fused_add_rms_norm_variant,
        "rms_norm_gated": ops.rms_norm_gated,
        "rotary_embedding": ops.rotary_embedding,
        "silu_and_mul": ops.silu_and_mul,
        "causal_conv1d": gdn.causal_conv1d,
        "gated_delta_rule": gdn.gated_delta_rule,
        "gelu_tanh_and_mul": ops.gelu_tanh_and_mul,
        "gated_gemm": ops.gated_gemm,
        "sample": sample,
        "moe_topk_softmax": moe.moe_topk_softmax,
        "moe_grouped_topk": moe.moe_grouped_topk,
        "fused_experts": moe.fused_experts,
        "moe_route_mask": moe.moe_route_mask,
        "moe_local_slots": moe.moe_local_slots,
        "gemm_fp8_tensor": quant.gemm_quantized,
        "gemm_fp8_channel": quant.gemm_quantized,
        "gemm_fp8_block": quant.gemm_quantized,
        "gemm_mxfp4": quant.gemm_quantized,
        "gemm_int4_group": quant.gemm_quantized,
        "fused_experts_fp8": quant.fused_experts_quantized,
        "fused_experts_mxfp4": quant.fused_experts_quantized,
        "fused_experts_int4": quant.fused_experts_quantized,
        "mla_attention": mla.mla_attention,
        "mla_sparse_attention": mla.mla_sparse_attention,
    },
    attention=TorchAttentionBackend,
)


def available(device) -> str | None:
    return None
