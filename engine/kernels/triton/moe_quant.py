"""The routed experts' MLPs on quantized weights in Triton: `fused_experts` (moe.py) with each grouped GEMM's
weight tiles read as FP8 (per-tensor, per-row or block scales), packed e2m1 (MXFP4) or packed int4 codes in
groups (int4_group, through int4.py) and dequantized in the K loop (the scale formats: engine/kernels/quant.py;
the reference: engine/kernels/torch/quant.py).

Where each expert sees at most 16 pairs (decode, small batches: bound by reading the weights) the products
are weight-only, against unquantized activations (e4m3 -> bf16 through quant.e4m3_to_bf16 on Hopper: 8-9 %
faster at 16-128 tokens of Qwen3-30B-A3B on an H100). Past that, on GPUs with FP8 tensor cores, FP8 experts
run W8A8: the activations are quantized per token (fp8_tensor, fp8_channel) or per token and K-block
(fp8_block) by a Triton kernel before each GEMM, and the products are FP8 x FP8 tensor-core dots (on an H100
at 512 and 2048 tokens 13 % and 25 % faster than weight-only dequantization, the quantization pass
included). (The reference quantizes fp8_tensor activations per tensor, over each expert's tokens; per token
is finer.) MXFP4 w4a4
quantizes the activations to MXFP4 as the reference does; w4a16 (MXFP4, int4) leaves them. As in moe.py, nothing reads a
device value on the host and every shape follows from the inputs' shapes (CUDA-graph safe).
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from engine.kernels.quant import QuantizedWeight
from engine.kernels.triton import int4, moe, pdl, quant
from engine.kernels.triton.activation_quant import ACT_MXFP4, quantize_activations
from engine.kernels.triton.quant import (INT4, METHOD_CODES, MXFP4, accumulate, activation_scales,
                                         block_k_within, fp8_tensor_cores, operands, prepare, scale_output,
                                         weight_scales)

W8A8_EXPERTS = True  # past 16 pairs per expert, FP8 experts multiply FP8 activations (off: weight-only, slower)


@triton.jit
def _gate_up_kernel(x_ptr, x_scale_ptr, w13_ptr, w13_scale_ptr, act_ptr, sorted_pairs_ptr, block_expert_ptr,
                    num_pairs, hidden, inter, top_k, stride_x, stride_xs, stride_we, stride_wn, stride_se, stride_sn,
                    num_n_blocks, limit, b13_ptr, stride_be, alpha, METHOD: tl.constexpr, ACT: tl.constexpr,
                    BLOCK_SN: tl.constexpr, BLOCK_SK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr, FAST_FP8: tl.constexpr = False,
                    CLAMP: tl.constexpr = False, BIAS: tl.constexpr = False, OAI: tl.constexpr = False,
                    GELU: tl.constexpr = False):
    """moe._gate_up_kernel with quantized w13[e] (rows n and I + n: gate and up) and activations as ACT says;
    CLAMP: gate <= limit and -limit <= up <= limit after the scales, before the SiLU (as moe._gate_up_kernel)."""
    if USE_PDL:
        pdl.enter()
    block = tl.program_id(0) // num_n_blocks
    pid_n = tl.program_id(0) % num_n_blocks
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    pairs, valid = moe.block_rows(sorted_pairs_ptr, block, num_pairs, BLOCK_M)
    tokens = tl.where(valid, pairs // top_k, 0).to(tl.int64)
    features = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    feature_mask = features < inter
    PACKED_W: tl.constexpr = 2 if METHOD == MXFP4 else 1
    PACKED_A: tl.constexpr = 2 if ACT == ACT_MXFP4 else 1
    ka = tl.arange(0, BLOCK_K // PACKED_A)
    kw = tl.arange(0, BLOCK_K // PACKED_W)
    x_rows = x_ptr + tokens[:, None] * stride_x
    gate_rows = w13_ptr + expert.to(tl.int64) * stride_we + features.to(tl.int64)[None, :] * stride_wn
    up_rows = gate_rows + inter.to(tl.int64) * stride_wn
    s_base = w13_scale_ptr + expert.to(tl.int64) * stride_se
    a_index = tokens * stride_xs  # of each row's activation scales
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, hidden, BLOCK_K):
        if METHOD == INT4:
            gate_scales = s_base + features.to(tl.int64)[None, :] * stride_sn
            gate = int4.accumulate_int4(gate, x_rows, valid, gate_rows, gate_scales, feature_mask, k, hidden,
                                        BLOCK_SK, BLOCK_K, UPCAST)
            up = int4.accumulate_int4(up, x_rows, valid, up_rows, gate_scales + inter.to(tl.int64) * stride_sn,
                                      feature_mask, k, hidden, BLOCK_SK, BLOCK_K, UPCAST)
        else:
            a = tl.load(x_rows + k // PACKED_A + ka[None, :],
                        mask=valid[:, None] & (k // PACKED_A + ka < hidden // PACKED_A)[None, :], other=0.0)
            w_mask = (k // PACKED_W + kw < hidden // PACKED_W)[:, None] & feature_mask[None, :]
            a_scale = activation_scales(x_scale_ptr, a_index, valid, k, hidden, METHOD, ACT, BLOCK_SK, BLOCK_K)
            gate_scale = weight_scales(s_base, features, feature_mask, k, hidden, stride_sn, METHOD, BLOCK_SN,
                                       BLOCK_SK, BLOCK_K)
            up_scale = weight_scales(s_base, inter + features, feature_mask, k, hidden, stride_sn, METHOD, BLOCK_SN,
                                     BLOCK_SK, BLOCK_K)
            gate = accumulate(gate, a, a_scale,
                              tl.load(gate_rows + k // PACKED_W + kw[:, None], mask=w_mask, other=0.0), gate_scale,
                              METHOD, ACT, UPCAST, FAST_FP8)
            up = accumulate(up, a, a_scale, tl.load(up_rows + k // PACKED_W + kw[:, None], mask=w_mask, other=0.0),
                            up_scale, METHOD, ACT, UPCAST, FAST_FP8)
    gate = scale_output(gate, x_scale_ptr, a_index, s_base, features, feature_mask, METHOD, ACT)
    up = scale_output(up, x_scale_ptr, a_index, s_base, inter + features, feature_mask, METHOD, ACT)
    if BIAS:
        gate, up = moe.add_gate_up_bias(gate, up, b13_ptr, expert, stride_be, features, feature_mask, inter,
                                        act_ptr.dtype.element_ty)
    if CLAMP:
        gate, up = moe.clamp_swiglu(gate, up, limit)
    moe.store_gated(act_ptr, gate, up, pairs, valid, features, feature_mask, inter, alpha, OAI, GELU)


@triton.jit
def _down_kernel(act_ptr, act_scale_ptr, w2_ptr, w2_scale_ptr, expert_out_ptr, sorted_pairs_ptr, block_expert_ptr,
                 num_pairs, hidden, inter, stride_act, stride_as, stride_we, stride_wn, stride_se, stride_sn,
                 num_n_blocks, b2_ptr, stride_be, METHOD: tl.constexpr, ACT: tl.constexpr, BLOCK_SN: tl.constexpr,
                 BLOCK_SK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 UPCAST: tl.constexpr, USE_PDL: tl.constexpr, FAST_FP8: tl.constexpr = False,
                 BIAS: tl.constexpr = False):
    """moe._down_kernel with quantized w2[e] and activations as ACT says."""
    if USE_PDL:
        pdl.enter()
    block = tl.program_id(0) // num_n_blocks
    pid_n = tl.program_id(0) % num_n_blocks
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    pairs, valid = moe.block_rows(sorted_pairs_ptr, block, num_pairs, BLOCK_M)
    rows = tl.where(valid, pairs, 0).to(tl.int64)
    features = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    feature_mask = features < hidden
    PACKED_W: tl.constexpr = 2 if METHOD == MXFP4 else 1
    PACKED_A: tl.constexpr = 2 if ACT == ACT_MXFP4 else 1
    ka = tl.arange(0, BLOCK_K // PACKED_A)
    kw = tl.arange(0, BLOCK_K // PACKED_W)
    act_rows = act_ptr + rows[:, None] * stride_act
    w_rows = w2_ptr + expert.to(tl.int64) * stride_we + features.to(tl.int64)[None, :] * stride_wn
    s_base = w2_scale_ptr + expert.to(tl.int64) * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, inter, BLOCK_K):
        if METHOD == INT4:
            scales = s_base + features.to(tl.int64)[None, :] * stride_sn
            acc = int4.accumulate_int4(acc, act_rows, valid, w_rows, scales, feature_mask, k, inter, BLOCK_SK, BLOCK_K,
                                       UPCAST)
        else:
            a = tl.load(act_rows + k // PACKED_A + ka[None, :],
                        mask=valid[:, None] & (k // PACKED_A + ka < inter // PACKED_A)[None, :], other=0.0)
            w = tl.load(w_rows + k // PACKED_W + kw[:, None],
                        mask=(k // PACKED_W + kw < inter // PACKED_W)[:, None] & feature_mask[None, :], other=0.0)
            a_scale = activation_scales(act_scale_ptr, rows * stride_as, valid, k, inter, METHOD, ACT, BLOCK_SK,
                                        BLOCK_K)
            w_scale = weight_scales(s_base, features, feature_mask, k, inter, stride_sn, METHOD, BLOCK_SN, BLOCK_SK,
                                    BLOCK_K)
            acc = accumulate(acc, a, a_scale, w, w_scale, METHOD, ACT, UPCAST, FAST_FP8)
    acc = scale_output(acc, act_scale_ptr, rows * stride_as, s_base, features, feature_mask, METHOD, ACT)
    if BIAS:
        acc = moe.add_down_bias(acc, b2_ptr, expert, stride_be, features, feature_mask,
                                expert_out_ptr.dtype.element_ty)
    tl.store(expert_out_ptr + pairs.to(tl.int64)[:, None] * hidden + features[None, :],
             acc.to(expert_out_ptr.dtype.element_ty), mask=valid[:, None] & feature_mask[None, :])


def fused_experts_quantized(x: torch.Tensor, w13: QuantizedWeight, w2: QuantizedWeight, weights: torch.Tensor,
                            ids: torch.Tensor, tiles: moe.MoeTiles | None = None,
                            swiglu_limit: float | None = None, w13_bias: torch.Tensor | None = None,
                            w2_bias: torch.Tensor | None = None, oai_alpha: float | None = None,
                            gelu: bool = False) -> torch.Tensor:
    """`fused_experts` with quantized experts w13 [E, 2I, H] and w2 [E, H, I] (one scheme for both): the ops
    fused_experts_fp8, fused_experts_mxfp4 and fused_experts_int4. `swiglu_limit` (DeepSeek-V4): gate clamped to
    <= limit and up to [-limit, limit] before the SiLU."""
    num_tokens, hidden = x.shape
    assert w13.scheme == w2.scheme, (w13.scheme, w2.scheme)
    assert w13.out_features == 2 * w2.in_features and w13.in_features == w2.out_features == hidden, \
        (w13.weight.shape, w2.weight.shape)
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    chunk = max(1, moe.PAIR_OUTPUT_BUDGET_BYTES // (ids.shape[1] * hidden * x.element_size()))
    for start in range(0, num_tokens, chunk):
        stop = min(num_tokens, start + chunk)
        _chunk(x[start:stop], w13, w2, weights[start:stop], ids[start:stop], out[start:stop], tiles,
               moe.gated_epilogue(swiglu_limit, w13_bias, w2_bias, oai_alpha, x, gelu))
    return out


def _chunk(x: torch.Tensor, w13: QuantizedWeight, w2: QuantizedWeight, weights: torch.Tensor, ids: torch.Tensor,
           out: torch.Tensor, tiles: moe.MoeTiles | None, epilogue: tuple) -> None:
    gate_up_args, gate_up_flags, down_args, down_flags = epilogue
    num_tokens, hidden = x.shape
    scheme = w13.scheme
    w13_weight, w13_scale = operands(w13)
    w2_weight, w2_scale = operands(w2)
    num_experts, inter = w13_weight.shape[0], w2.in_features
    top_k = ids.shape[1]
    num_pairs = num_tokens * top_k
    if x.stride(1) != 1:
        x = x.contiguous()
    fp8_products = W8A8_EXPERTS and scheme.method.startswith("fp8") and fp8_tensor_cores(x.device)
    tiles = tiles or default_tiles(num_pairs, num_experts, x.element_size(), scheme, fp8_products)
    w8a8 = fp8_products and tiles.block_m > 16
    sorted_pairs, block_expert = moe.align_pairs(ids, num_experts, tiles.block_m)
    num_blocks = block_expert.numel()
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    expert_out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    fast_fp8 = quant.FAST_FP8_CONVERSION and scheme.method.startswith("fp8") and quant._sm90_cuda(x.device)
    launch = dict(METHOD=METHOD_CODES[scheme.method], BLOCK_SN=scheme.block[0], BLOCK_SK=scheme.block[1],
                  UPCAST=x.device.type == "cpu", FAST_FP8=fast_fp8, num_warps=tiles.num_warps,
                  num_stages=tiles.num_stages, **pdl.launch_options(x))
    a, a_scale, act_code = quantize_activations(x, w13, w8a8, tensor_per_token=True)
    n_blocks = triton.cdiv(inter, tiles.gate_up_block_n)
    _gate_up_kernel[(num_blocks * n_blocks,)](
        a, a if a_scale is None else a_scale, w13_weight, w13_scale, act, sorted_pairs, block_expert, num_pairs,
        hidden, inter, top_k, a.stride(0), _row_stride(a_scale), w13_weight.stride(0), w13_weight.stride(1),
        _row_stride(w13_scale), _scale_row_stride(w13_scale), n_blocks, *gate_up_args, ACT=act_code,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.gate_up_block_n, BLOCK_K=tiles.gate_up_block_k, **gate_up_flags,
        **launch)
    a, a_scale, act_code = quantize_activations(act, w2, w8a8, tensor_per_token=True)
    n_blocks = triton.cdiv(hidden, tiles.down_block_n)
    _down_kernel[(num_blocks * n_blocks,)](
        a, a if a_scale is None else a_scale, w2_weight, w2_scale, expert_out, sorted_pairs, block_expert,
        num_pairs, hidden, inter, a.stride(0), _row_stride(a_scale), w2_weight.stride(0), w2_weight.stride(1),
        _row_stride(w2_scale), _scale_row_stride(w2_scale), n_blocks, *down_args, ACT=act_code, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.down_block_n, BLOCK_K=tiles.down_block_k, **down_flags, **launch)
    moe.combine(expert_out, weights, ids, out)


def _row_stride(t: torch.Tensor | None) -> int:
    """Stride of the leading dimension (an expert's or a row's scales), 1 for one value per row."""
    return 0 if t is None else t.stride(0) if t.dim() > 1 else 1


def _scale_row_stride(scale: torch.Tensor) -> int:
    """Stride between an expert's scale rows (block and MXFP4 scales), 0 where there is no such dimension."""
    return scale.stride(1) if scale.dim() == 3 else 0


def default_tiles(num_pairs: int, num_experts: int, element_size: int, scheme,
                  fp8_products: bool = False) -> moe.MoeTiles:
    """moe.default_tiles (measured for bf16 weights), with the decode tile's K tiles doubled for the narrower
    weights (about the bf16 tile's bytes per pipeline stage), and every K tile within one FP8 scale block (the
    block scheme's decode tile takes two more stages instead). Where the larger tiles multiply FP8 activations
    (`fp8_products`), 128-wide K tiles: on an H100 (Qwen3-30B-A3B experts, fp8_block, `quant_gemm_bench`
    shapes, 2026-11-24) 283 us against 340 with bf16's 64 at 512 tokens, 542 against 680 at 2048 (bf16
    weights: 450 and 621)."""
    tiles = moe.default_tiles(num_pairs, num_experts, element_size)
    if tiles.block_m == 16 and element_size == 2:
        tiles = dataclasses.replace(tiles, gate_up_block_k=2 * tiles.gate_up_block_k,
                                    down_block_k=2 * tiles.down_block_k)
    elif tiles.block_m > 16 and fp8_products:
        tiles = dataclasses.replace(tiles, gate_up_block_k=128, down_block_k=128)
    if scheme.method == "fp8_block":
        stages = tiles.num_stages + 2 if tiles.block_m == 16 else tiles.num_stages
        tiles = dataclasses.replace(tiles, gate_up_block_k=block_k_within(scheme.block, tiles.gate_up_block_k),
                                    down_block_k=block_k_within(scheme.block, tiles.down_block_k), num_stages=stages)
    return tiles


fused_experts_quantized.prepare = prepare
