"""The AITER backend for ROCm GPUs (MI300X gfx942, MI355X gfx950): each op mapped onto the AITER kernel
that ATOM uses for it (../../docs/ROCM.md has the table and the AITER version targeted).

`aiter` is imported only inside the functions here (and never by any other backend), so the project
imports and runs without it. What AITER cannot serve for a model (attention with a head size other than 128,
sliding windows, KV blocks other than 16, per-tensor FP8 KV scales, MXFP4 on gfx942, weight-only MXFP4, MLA
outside bf16 or over an FP8 latent cache, ...) is declined here at start-up and runs on the Triton backend
(the torch reference where Triton cannot run); the kernel table logged at start-up shows what runs.
"""
from __future__ import annotations

import torch

from engine.kernels.aiter import attention, mla, ops, quant
from engine.kernels.registry import KernelBackend, ModelFacts

PA_ASM_HEAD_SIZE = 128  # pa_fwd_asm: AITER_CHECK(head_size == 128)
PA_ASM_BLOCK_SIZE = 16  # the non-persistent assembly kernels exist for 16-token KV blocks only
PA_ASM_MAX_GQA = 16     # query heads per KV head the kernels are built for (8 and 16; smaller round up)


def declines(op: str, facts: ModelFacts) -> str | None:
    """Why AITER cannot serve `op` for this model, or None (see the module docstring)."""
    if op == "attention":
        if any(size != PA_ASM_HEAD_SIZE for size in facts.head_sizes):
            return f"pa_fwd_asm needs head size {PA_ASM_HEAD_SIZE}, the model has {sorted(set(facts.head_sizes))}"
        if facts.block_size != PA_ASM_BLOCK_SIZE:
            return f"pa_fwd_asm needs block_size {PA_ASM_BLOCK_SIZE}, not {facts.block_size}"
        if facts.sliding_window:
            return "pa_fwd_asm has no sliding window"
        if facts.attention_extras:
            return f"pa_fwd_asm has no {' or '.join(facts.attention_extras)}"
        if any(ratio > PA_ASM_MAX_GQA for ratio in facts.gqa_ratios):
            return f"pa_fwd_asm serves at most {PA_ASM_MAX_GQA} query heads per KV head"
        if facts.dtype not in (torch.bfloat16, torch.float16):
            return f"pa_fwd_asm takes bf16/fp16 queries, not {facts.dtype}"
        if facts.fp8_kv_cache and facts.kv_cache_scales == "tensor":
            return "pa_fwd_asm reads FP8 caches with per-token scales (kv_cache_scales='token' or 'auto')"
        return None
    if op in ("mla_attention", "mla_sparse_attention") and facts.dtype not in mla.DTYPES:
        return f"mla_decode_fwd's assembly kernels take bf16, the model runs in {facts.dtype}"
    if op in ("mla_attention", "mla_sparse_attention") and facts.fp8_kv_cache and facts.mla_entry is not None:
        return mla.FP8_CACHE_REASON
    if op in ("fused_experts", "fused_experts_fp8", "fused_experts_mxfp4") and facts.clamped_experts:
        return "aiter's fused_moe has no clamped SwiGLU (swiglu_limit)"
    if op in ("fused_experts", "fused_experts_fp8", "fused_experts_mxfp4") and facts.expert_epilogue:
        return f"aiter's fused_moe is not mapped for {facts.expert_epilogue}"
    if op == "mla_attention" and facts.mla_heads is not None and facts.mla_entry is not None:
        return mla.unsupported(facts.mla_heads, sum(facts.mla_entry), facts.mla_entry[0], facts.dtype)
    if op in ("gemm_mxfp4", "fused_experts_mxfp4") and ops.gfx() == "gfx942":
        return "AITER's MXFP4 kernels need gfx950 (MI355X); this GPU is gfx942"
    scheme = {"gemm_mxfp4": facts.linear_quant, "fused_experts_mxfp4": facts.experts_quant}.get(op)
    if scheme is not None and scheme.method == "mxfp4" and scheme.activation == "none":
        return "weight-only MXFP4 (w4a16): no AITER a16w4 kernel is mapped"
    if op in ops.HALF_PRECISION_ONLY and facts.dtype not in (torch.bfloat16, torch.float16):
        return f"AITER's kernel takes bf16/fp16, the model runs in {facts.dtype}"
    return None


BACKEND = KernelBackend(
    name="aiter",
    ops={
        "gemm": ops.gemm,
        "rms_norm": ops.rms_norm,
        "fused_add_rms_norm": ops.fused_add_rms_norm,
        "rotary_embedding": ops.rotary_embedding,
        "silu_and_mul": ops.silu_and_mul,
        "gelu_tanh_and_mul": ops.gelu_tanh_and_mul,
        "gated_gemm": ops.gated_gemm,
        "sample": ops.sample,
        "moe_topk_softmax": ops.moe_topk_softmax,
        "moe_grouped_topk": ops.moe_grouped_topk,
        "fused_experts": ops.fused_experts,
        "gemm_fp8_tensor": quant.gemm_fp8_tensor,
        "gemm_fp8_channel": quant.gemm_fp8_channel,
        "gemm_fp8_block": quant.gemm_fp8_block,
        "gemm_mxfp4": quant.gemm_mxfp4,
        "fused_experts_fp8": quant.fused_experts_fp8,
        "fused_experts_mxfp4": quant.fused_experts_mxfp4,
        "mla_attention": mla.mla_attention,
        "mla_sparse_attention": mla.mla_sparse_attention,
    },
    attention=attention.AiterAttentionBackend,
    declines=declines,
)


def available(device: torch.device) -> str | None:
    """None when AITER can run on `device`, else why not."""
    if device.type != "cuda" or not torch.version.hip:
        return "AITER runs on ROCm GPUs only"
    try:
        import aiter  # noqa: F401
    except Exception as exc:  # ImportError, or its JIT failing to find hipcc
        return f"aiter does not import ({type(exc).__name__}: {exc}); pip install 'atom-ray[rocm]' on a ROCm host"
    return None
