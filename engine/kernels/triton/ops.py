"""Triton kernels for the element-wise and row-wise operations: RMSNorm (every style of NORM_STYLES, fused with
the residual add or not, and Gated DeltaNet's gated norm, all one kernel), rotary embedding and SiLU-and-mul.
Numerics follow the torch reference in engine/kernels/torch/ops.py."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.torch.ops import NORM_STYLES
from engine.kernels.triton import pdl
from engine.kernels.triton.common import gelu_tanh, rope_coefficients, rotated

# Rows up to this many features are normalised from registers in one pass (no spills on sm_90 even in
# fp32); longer ones take two passes over chunks.
_MAX_SINGLE_PASS = 16384
_CHUNK = 4096


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 256))


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [outer, inner, N] with a unit last stride, without copying where the strides allow it
    (e.g. a [T, H, D] head view of a fused QKV output)."""
    n = x.shape[-1]
    if x.dim() == 3 and x.stride(-1) == 1:
        return x
    if x.stride(-1) == 1:
        try:
            return x.view(-1, 1, n)
        except RuntimeError:
            pass
    return x.contiguous().view(-1, 1, n)


def _rows_like(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A second input of x's shape (residual, gate) as [outer, inner, N] with x's outer and inner, so that one
    row index addresses both (a view where the strides allow it)."""
    t = t.reshape(rows.shape)
    return t if t.stride(-1) == 1 else t.contiguous()


@triton.jit
def _row_offsets(rows, inner, stride_outer, stride_inner):
    rows = rows.to(tl.int64)
    return (rows // inner) * stride_outer + (rows % inner) * stride_inner


@triton.jit
def _added(x, residual, w_ptr, res_ptr, STYLE: tl.constexpr):
    """x + residual, rounded to the residual's dtype. x (possibly a float32 all-reduced sum) is rounded first:
    to the activations' dtype (the weight's) in Llama's style, to the residual's in the others, as the torch
    references do."""
    if STYLE == "llama":
        x = x.to(w_ptr.dtype.element_ty)
    else:
        x = x.to(res_ptr.dtype.element_ty)
    return (x.to(tl.float32) + residual.to(tl.float32)).to(res_ptr.dtype.element_ty)


@triton.jit
def _weighted(x32, rstd, w_ptr, gate_ptr, gate_rows, cols, col_mask, mask, out_dtype,
              STYLE: tl.constexpr, ROUND_PRODUCT: tl.constexpr):
    """Rows x32 (float32) times their rstd, times the weight as STYLE says (a NORM_STYLES entry, or "gated":
    rms_norm_gated's w * norm(x) * silu(gate)), in float32, for one rounding to the output's dtype."""
    if STYLE != "none":
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    normed = x32 * rstd[:, None]
    if STYLE == "none":
        y = normed
    elif STYLE == "offset":
        y = normed * (1.0 + w)
    elif STYLE == "float32":
        y = normed * w
    else:  # "llama" and "gated": the normalised value is rounded to the output's dtype before the weight
        y = normed.to(out_dtype).to(tl.float32) * w
        if STYLE == "gated":
            if ROUND_PRODUCT:  # w * norm(x) in their common dtype: x's, unless the weight's is wider
                y = y.to(out_dtype).to(tl.float32)
            gate = tl.load(gate_ptr + gate_rows + cols, mask=mask, other=0.0).to(tl.float32)
            y = y * (gate / (1.0 + tl.exp(-gate)))
    return y


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, gate_ptr, w_ptr, out_ptr, res_out_ptr, num_rows, n, inner,
                     sx0, sx1, sr0, sr1, sg0, sg1, eps,
                     STYLE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ROUND_PRODUCT: tl.constexpr,
                     BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_PASS: tl.constexpr,
                     USE_PDL: tl.constexpr):
    if USE_PDL:
        pdl.enter()
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < num_rows
    x_rows = _row_offsets(rows, inner, sx0, sx1)[:, None]
    r_rows = _row_offsets(rows, inner, sr0, sr1)[:, None]
    if STYLE == "gated":
        g_rows = _row_offsets(rows, inner, sg0, sg1)[:, None]
    else:
        g_rows = x_rows  # never read
    out_rows = rows.to(tl.int64)[:, None] * n  # outputs are contiguous
    cols = tl.arange(0, BLOCK_N)[None, :]
    out_dtype = out_ptr.dtype.element_ty
    if SINGLE_PASS:
        mask = row_mask[:, None] & (cols < n)
        x = tl.load(x_ptr + x_rows + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = _added(x, tl.load(res_ptr + r_rows + cols, mask=mask, other=0.0), w_ptr, res_ptr, STYLE)
            tl.store(res_out_ptr + out_rows + cols, x, mask=mask)
        x32 = x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x32 * x32, axis=1) / n + eps)
        y = _weighted(x32, rstd, w_ptr, gate_ptr, g_rows, cols, cols < n, mask, out_dtype, STYLE, ROUND_PRODUCT)
        tl.store(out_ptr + out_rows + cols, y.to(out_dtype), mask=mask)
    else:
        total = tl.zeros([BLOCK_ROWS, BLOCK_N], dtype=tl.float32)
        for start in range(0, n, BLOCK_N):
            mask = row_mask[:, None] & (start + cols < n)
            x = tl.load(x_ptr + x_rows + start + cols, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                x = _added(x, tl.load(res_ptr + r_rows + start + cols, mask=mask, other=0.0), w_ptr, res_ptr,
                           STYLE)
                tl.store(res_out_ptr + out_rows + start + cols, x, mask=mask)
            x32 = x.to(tl.float32)
            total += x32 * x32
        rstd = tl.math.rsqrt(tl.sum(total, axis=1) / n + eps)
        if HAS_RESIDUAL:
            tl.debug_barrier()  # the sums stored above are re-read below, possibly by other threads
        for start in range(0, n, BLOCK_N):
            mask = row_mask[:, None] & (start + cols < n)
            if HAS_RESIDUAL:  # re-read the rounded sum this program just wrote
                x = tl.load(res_out_ptr + out_rows + start + cols, mask=mask, other=0.0)
            else:
                x = tl.load(x_ptr + x_rows + start + cols, mask=mask, other=0.0)
            y = _weighted(x.to(tl.float32), rstd, w_ptr, gate_ptr, g_rows, start + cols, start + cols < n, mask,
                          out_dtype, STYLE, ROUND_PRODUCT)
            tl.store(out_ptr + out_rows + start + cols, y.to(out_dtype), mask=mask)


def _launch_rms_norm(x, residual, weight, eps, style="llama", gate=None):
    """One launch of _rms_norm_kernel: (norm, sum) with a residual, (norm, norm) without."""
    n = x.shape[-1]
    rows_x = _as_rows(x)
    rows_r = _rows_like(residual, rows_x) if residual is not None else rows_x
    rows_g = _rows_like(gate, rows_x) if gate is not None else rows_x
    num_rows = rows_x.shape[0] * rows_x.shape[1]
    dtype = residual.dtype if residual is not None else x.dtype  # a float32 x with a residual takes its dtype
    # Llama's normalised output is in the activations' dtype (the weight's), also from a float32 residual
    # stream; the other styles' in x's (the sum's).
    out = torch.empty(x.shape, dtype=weight.dtype if style == "llama" else dtype, device=x.device)
    res_out = torch.empty(x.shape, dtype=dtype, device=x.device) if residual is not None else out
    if num_rows == 0:
        return out, res_out
    single = triton.next_power_of_2(n) <= _MAX_SINGLE_PASS
    block_n = triton.next_power_of_2(n) if single else _CHUNK
    # Short rows (per-head q/k norms) are batched several to a program.
    block_rows = max(1, min(16, 2048 // block_n, triton.next_power_of_2(num_rows)))
    round_product = gate is not None and torch.promote_types(weight.dtype, x.dtype) == x.dtype
    _rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
        rows_x, rows_r, rows_g, weight.contiguous() if weight is not None else rows_x, out, res_out, num_rows, n,
        rows_x.shape[1], rows_x.stride(0), rows_x.stride(1), rows_r.stride(0), rows_r.stride(1),
        rows_g.stride(0), rows_g.stride(1), eps,
        STYLE=style, HAS_RESIDUAL=residual is not None, ROUND_PRODUCT=round_product, BLOCK_ROWS=block_rows,
        BLOCK_N=block_n, SINGLE_PASS=single, num_warps=_num_warps(block_rows * block_n), **pdl.launch_options(out))
    return out, res_out


def _style_weight(style: str, weight: torch.Tensor | None) -> torch.Tensor | None:
    """The weight the style reads (none for "none", which ignores one given, as the reference does)."""
    if style not in NORM_STYLES:
        raise ValueError(f"RMSNorm style {style!r} is unknown; one of {NORM_STYLES}")
    assert weight is not None or style == "none", f"RMSNorm style {style!r} needs a weight"
    return None if style == "none" else weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch_rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One kernel: reads x and residual once, writes norm(x + residual) and x + residual (fresh tensors,
    so callers that keep the inputs are safe). x, possibly a float32 row-parallel sum, is rounded to the
    activations' dtype (the weight's) first and added in the residual's dtype, as the torch reference does."""
    assert x.shape == residual.shape and (x.dtype == residual.dtype or torch.float32 in (x.dtype, residual.dtype)), (
        x.shape, residual.shape, x.dtype, residual.dtype)
    return _launch_rms_norm(x, residual, weight, eps)


def rms_norm_variant(x: torch.Tensor, weight: torch.Tensor | None, eps: float, style: str) -> torch.Tensor:
    """The torch reference's styles in one kernel: statistics and the weight in float32, one rounding to x's
    dtype ("llama" is rms_norm). Any row layout the reference takes: [T, H, D] head views keep their strides."""
    return _launch_rms_norm(x, None, _style_weight(style, weight), eps, style)[0]


def fused_add_rms_norm_variant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                               style: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm_variant(x + residual), x + residual) in one kernel, x rounded to the residual's dtype before the
    add (the torch reference's order); "llama" is fused_add_rms_norm."""
    assert x.shape == residual.shape, (x.shape, residual.shape)
    return _launch_rms_norm(x, residual, _style_weight(style, weight), eps, style)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w * norm(x) * silu(gate) over each row of the last dimension (one value head of Gated DeltaNet's output,
    the weight shared by all heads), in one kernel; gate may be a strided view (a split of the in-projection)."""
    assert x.shape == gate.shape and weight.shape == x.shape[-1:], (x.shape, gate.shape, weight.shape)
    return _launch_rms_norm(x, None, weight, eps, "gated", gate)[0]


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, table_ptr, num_heads, num_kv_heads,
                   sq_t, sq_h, sk_t, sk_h, stride_table,
                   HALF: tl.constexpr, ROT_PAD: tl.constexpr, IS_NEOX: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_HK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        pdl.enter()
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(pos_ptr + token).to(tl.int64)
    dims = tl.arange(0, ROT_PAD)[None, :]  # the rotary features only; the rest of each head stays as it is
    cos, sin, partner, rotating = rope_coefficients(table_ptr, position, stride_table, dims,
                                                    q_ptr.dtype.element_ty, HALF, IS_NEOX)
    heads = tl.arange(0, BLOCK_H)[:, None]
    q_mask = (heads < num_heads) & rotating
    q_rows = q_ptr + token * sq_t + heads * sq_h
    q = rotated(q_rows, dims, partner, rotating, q_mask, cos, sin)
    kv_heads = tl.arange(0, BLOCK_HK)[:, None]
    k_mask = (kv_heads < num_kv_heads) & rotating
    k_rows = k_ptr + token * sk_t + kv_heads * sk_h
    k = rotated(k_rows, dims, partner, rotating, k_mask, cos, sin)
    tl.store(q_rows + dims, q.to(q_ptr.dtype.element_ty), mask=q_mask)  # in place: after every load
    tl.store(k_rows + dims, k.to(k_ptr.dtype.element_ty), mask=k_mask)


def _head_view(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        raise ValueError("rotary_embedding needs the head dimension to be contiguous")
    return x


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on query [T, H, D] and key [T, Hk, D] (strided head views allowed); only the first
    rotary_dim = cos_sin_cache.shape[-1] features of each head rotate."""
    query, key = _head_view(query), _head_view(key)
    num_tokens = query.shape[0]
    rotary_dim = cos_sin_cache.shape[-1]
    assert rotary_dim % 2 == 0 and rotary_dim <= query.shape[-1], (rotary_dim, query.shape)
    if num_tokens == 0:
        return query, key
    cache = cos_sin_cache.contiguous()
    half = rotary_dim // 2
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    block_h = triton.next_power_of_2(num_heads)
    _rotary_kernel[(num_tokens,)](
        positions.contiguous(), query, key, cache, num_heads, num_kv_heads,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cache.stride(0),
        HALF=half, ROT_PAD=triton.next_power_of_2(rotary_dim), IS_NEOX=is_neox,
        BLOCK_H=block_h, BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        num_warps=_num_warps(block_h * triton.next_power_of_2(half)), **pdl.launch_options(query))
    return query, key


@triton.jit
def _gated_activation_kernel(x_ptr, out_ptr, half, stride_x, BLOCK: tl.constexpr, GELU: tl.constexpr,
                             USE_PDL: tl.constexpr):
    """act(gate) * up with act silu, or (GELU) gelu_tanh. The activation is rounded to the activation dtype before the product, as
    F.silu(x) * y (F.gelu(x, approximate="tanh") * y) is in torch."""
    if USE_PDL:
        pdl.enter()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < half
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + half + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if GELU:
        act = gelu_tanh(g).to(gate.dtype)
    else:
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * half + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def _gated_activation(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    half = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*x.shape[:-1], half, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0 or half == 0:
        return out
    block = min(1024, triton.next_power_of_2(half))
    _gated_activation_kernel[(rows.shape[0], triton.cdiv(half, block))](
        rows, out, half, rows.stride(0), BLOCK=block, GELU=gelu, num_warps=_num_warps(block),
        **pdl.launch_options(out))
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _gated_activation(x, gelu=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _gated_activation(x, gelu=True)
