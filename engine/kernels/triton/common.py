"""Triton device functions that several kernel files share: the matrix product every kernel uses, the
rotary-embedding arithmetic of the rotary kernel and of the kernels it is fused into, and the paged KV cache of
the prefill and decode attention kernels: its addressing, its (FP8) writes and the (FP8) reads of its tiles.

An FP8 cache (KVCacheQuant) is float8_e4m3fn (Triton's float8e4nv). Kernels take its kind as the constexpr
KV_QUANT: "none" (the cache holds the activations' dtype), "tensor" or "token" (the granularity of its scales)."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.kernels.attention import FP8_KV_MIN_SCALE, KVCacheQuant, fp8_max

FP8_KV_DTYPE = torch.float8_e4m3fn
_FP8_MAX = tl.constexpr(fp8_max(FP8_KV_DTYPE))
_MIN_SCALE = tl.constexpr(FP8_KV_MIN_SCALE)
LOG2E = tl.constexpr(1.4426950408889634)  # the kernels' softmax runs in base 2: exp(x) = exp2(x * LOG2E)


def interpreting() -> bool:
    """Whether kernels run under Triton's interpreter (which triton.jit settles as a kernel module is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Triton's interpreter narrows fp32 to fp8 by rounding ties up and flushing subnormals to zero (3.x); it narrows
# values already on the fp8 grid exactly, so under it the FP8 cache writes round on the grid first.
_INTERPRETED = tl.constexpr(interpreting())


@triton.jit
def dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:  # only under the interpreter, whose dot multiplies half-precision bit patterns as integers
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif a.dtype == tl.float32:  # full precision, not TF32: fp32 runs are the accuracy reference
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def rope_coefficients(table_ptr, position, stride_table, dims, dtype, HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """Per feature d of a head: out[d] = x[d] * cos[d] + x[partner[d]] * sin[d] (sin carries the sign);
    features past the rotary dimensions keep cos 1, sin 0. The table is rounded to the activation dtype
    first, as the torch reference does."""
    if IS_NEOX:
        freq = tl.where(dims < HALF, dims, dims - HALF)
        partner = tl.where(dims < HALF, dims + HALF, dims - HALF)
        sign = tl.where(dims < HALF, -1.0, 1.0)
    else:
        freq = dims // 2
        partner = dims + 1 - 2 * (dims % 2)
        sign = tl.where(dims % 2 == 0, -1.0, 1.0)
    rotating = dims < 2 * HALF
    row = table_ptr + position * stride_table
    cos = tl.load(row + freq, mask=rotating, other=1.0).to(dtype).to(tl.float32)
    sin = tl.load(row + HALF + freq, mask=rotating, other=0.0).to(dtype).to(tl.float32) * sign
    return cos, sin, partner, rotating


@triton.jit
def rotated(ptr, dims, partner, rotating, mask, cos, sin):
    """The rotated features (fp32) of the head rows at `ptr`, where `mask`. The explicit fma keeps the
    compiler from contracting the sum either way round: every kernel that rotates gets the same bits."""
    x = tl.load(ptr + dims, mask=mask, other=0.0)
    x_partner = tl.load(ptr + partner, mask=mask & rotating, other=0.0)
    return tl.fma(x.to(tl.float32), cos, x_partner.to(tl.float32) * sin)


def kv_quant_args(kv_quant: KVCacheQuant | None, cache: torch.Tensor) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(KV_QUANT, key scales, value scales) for a launch on one layer's cache [blocks, page, heads, dim]; without
    quantization the cache stands in for the scale pointers, which are then never read."""
    if kv_quant is None:
        return "none", cache, cache
    assert cache.dtype == FP8_KV_DTYPE, f"an FP8 KV cache on the Triton backend is {FP8_KV_DTYPE}, not {cache.dtype}"
    rows = cache.numel() // cache.shape[-1] if kv_quant.per_token else 1
    for scales in (kv_quant.k_scale, kv_quant.v_scale):
        assert scales.dtype == torch.float32 and scales.is_contiguous() and scales.numel() == rows, \
            (kv_quant.granularity, scales.shape, scales.dtype)
    return kv_quant.granularity, kv_quant.k_scale, kv_quant.v_scale


@triton.jit
def gelu_tanh(g):
    """GELU, tanh form, of float32 g: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh through exp."""
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    return 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))


@triton.jit
def soft_capped(s, cap):
    """cap * tanh(s / cap) (logit soft-capping; scores and cap both in the log2 domain), with tanh written
    through exp2, which every Triton version has: tanh(x) = 1 - 2 / (exp(2x) + 1)."""
    return cap - 2 * cap / (tl.math.exp2(s / cap * (2 * LOG2E)) + 1)


@triton.jit
def with_sinks(acc, m, l, sinks_ptr, heads, valid):
    """An online softmax's unnormalised output [R, D], running max and running sum [R] with each row's
    attention sink (a natural-log logit per head, at `heads` [R]; rows not `valid` are padding) joined to
    the sum: the final output is then acc / l."""
    sink = tl.load(sinks_ptr + heads, mask=valid, other=0.0).to(tl.float32) * LOG2E
    m_new = tl.maximum(m, sink)
    alpha = tl.math.exp2(m - m_new)
    return acc * alpha[:, None], l * alpha + tl.math.exp2(sink - m_new)


@triton.jit
def paged_rows(block_table_ptr, seq, stride_bt, tokens, valid, num_kv_heads, kv_head, PAGE_SIZE: tl.constexpr):
    """Row (int64) of each token's head vector in a [blocks, page, heads, dim] cache: times the head size its
    element offset, and as it is the offset of its per-token scale in [blocks, page, heads]."""
    pages = tl.load(block_table_ptr + seq * stride_bt + tokens // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    slots = pages * PAGE_SIZE + tokens % PAGE_SIZE
    return slots * num_kv_heads + kv_head


@triton.jit
def key_scores(q, k, k_scale_ptr, rows, valid, scale_log2, KV_QUANT: tl.constexpr, UPCAST: tl.constexpr):
    """Scaled logits q k^T of a tile of keys [BLOCK_N, D]: FP8 keys widen exactly to q's dtype for the dot and
    their per-token scales multiply their columns (a per-tensor key scale is already in `scale_log2`)."""
    s = dot(q, tl.trans(k.to(q.dtype)), UPCAST)
    if KV_QUANT == "token":
        s = s * (tl.load(k_scale_ptr + rows, mask=valid, other=0.0) * scale_log2)[None, :]
    else:
        s = s * scale_log2
    return s


@triton.jit
def weighted_values(p, v, v_scale_ptr, rows, valid, dtype, KV_QUANT: tl.constexpr, UPCAST: tl.constexpr):
    """p v of softmax weights [M, BLOCK_N] and a tile of values [BLOCK_N, D], multiplied in `dtype`. Per-token
    FP8 scales multiply the weights, a tile far smaller than the values; in fp16 they multiply the values
    instead, as small weights times small scales would sink into fp16's subnormals. (A per-tensor value scale
    multiplies the finished sum.)"""
    if KV_QUANT == "token":
        v_scale = tl.load(v_scale_ptr + rows, mask=valid, other=0.0)
        if dtype == tl.float16:
            out = dot(p.to(dtype), (v.to(tl.float32) * v_scale[:, None]).to(dtype), UPCAST)
        else:
            out = dot((p * v_scale[None, :]).to(dtype), v.to(dtype), UPCAST)
    else:
        out = dot(p.to(dtype), v.to(dtype), UPCAST)
    return out


@triton.jit
def store_kv_rows(cache_ptr, scale_ptr, rows, dims, x, row_mask, HEAD_SIZE: tl.constexpr, KV_QUANT: tl.constexpr):
    """Store head vectors x [R, D_PAD] at cache rows [R, 1] (slot * num_kv_heads + head) where row_mask: in the
    cache's dtype, or as engine.kernels.attention.quantize_to_fp8 does, with the per-tensor scale or with
    per-row scales (per_token_fp8_scale) computed here and stored at the same rows of the scales."""
    mask = row_mask & (dims < HEAD_SIZE)
    offsets = rows * HEAD_SIZE + dims
    if KV_QUANT == "none":
        tl.store(cache_ptr + offsets, x.to(cache_ptr.dtype.element_ty), mask=mask)
    else:
        x = x.to(tl.float32)
        if KV_QUANT == "token":
            amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1, keep_dims=True)
            scale = tl.maximum(tl.math.div_rn(amax, _FP8_MAX), _MIN_SCALE)
            tl.store(scale_ptr + rows, scale, mask=row_mask)
        else:
            scale = tl.load(scale_ptr)
        # Correctly rounded division, as torch divides: the same FP8 bytes as the reference.
        x = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -_FP8_MAX), _FP8_MAX)
        if _INTERPRETED:
            x = _round_to_e4m3(x)
        tl.store(cache_ptr + offsets, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_to_e4m3(x):
    """fp32 x (within the e4m3 range) rounded to the nearest e4m3 value, ties to even, still in fp32: adding
    2^(e + 20) to |x| < 2^(e + 1) leaves its bits at e4m3's spacing 2^(e - 3) (for subnormals 2^-9, e = -6)."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    magic = ((exponent + 20 + 127) << 23).to(tl.float32, bitcast=True)
    rounded = (tl.abs(x) + magic) - magic
    return tl.where(bits < 0, -rounded, rounded)
