"""Reference implementations in plain PyTorch: correct on any device, and the oracle for other backends."""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def gemm_float32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T accumulated and returned in float32, unrounded: a row-parallel rank's share (so that
    the sum over ranks is rounded once, as one device's GEMM rounds its sum) or logits (whose half-precision
    rounding ties many top candidates). On GPUs the BLAS writes the float32 accumulator itself; elsewhere
    the inputs are converted to float32 first (exact, but a float32 copy of the weight per call)."""
    if x.dtype == torch.float32:
        return F.linear(x, weight)
    if x.is_cuda:
        if _mm_takes_out_dtype():
            rows = x.reshape(-1, x.shape[-1])
            return torch.mm(rows, weight.t(), out_dtype=torch.float32).view(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight).float()  # rounded: no float32-output BLAS in this torch (logged once)
    return F.linear(x.float(), weight.float())


_mm_out_dtype: list[bool] = []


def _mm_takes_out_dtype() -> bool:
    """Whether this torch's CUDA/ROCm BLAS path takes mm(..., out_dtype=float32) for half inputs."""
    if not _mm_out_dtype:
        try:
            a = torch.ones(2, 8, dtype=torch.bfloat16, device="cuda")
            _mm_out_dtype.append(torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            _mm_out_dtype.append(False)
        if not _mm_out_dtype[0]:
            logger.warning(
                "torch.mm(out_dtype=float32) is unavailable: large float32-output GEMMs round to the input dtype")
    return _mm_out_dtype[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in float32, the normalised value rounded to the activations' dtype (the weight's) before
    # the weight (transformers' order), in one fused op. Only a float32 residual stream makes x's dtype
    # differ from it.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(weight.dtype)


# RMSNorm variants beside Llama's (rms_norm): how the weight meets the normalised value, always from float32
# statistics, the result rounded once to x's dtype.
NORM_STYLES = ("llama", "offset", "float32", "none")


def rms_norm_variant(x: torch.Tensor, weight: torch.Tensor | None, eps: float, style: str) -> torch.Tensor:
    """style "offset": norm(x) * (1 + w) in float32 (Gemma 1-3, Qwen3-Next / Qwen3.5, weights stored as offsets
    from one); "float32": norm(x) * w in float32 (Gemma 4, gpt-oss); "none": norm(x), no weight (Gemma 4's
    v_norm); "llama": rms_norm's order (normalised value rounded first, then times w)."""
    if style == "llama":
        return rms_norm(x, weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    if style == "offset":
        normed = normed * (1.0 + weight.float())
    elif style == "float32":
        normed = normed * weight.float()
    elif style != "none":
        raise ValueError(f"RMSNorm style {style!r} is unknown; one of {NORM_STYLES}")
    return normed.to(x.dtype)


def fused_add_rms_norm_variant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                               style: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm_variant(x + residual), x + residual): x, an activation or a float32 all-reduced sum, is rounded
    to the residual's dtype and added there. Style "llama" is fused_add_rms_norm."""
    if style == "llama":
        return fused_add_rms_norm(x, residual, weight, eps)
    residual = x.to(residual.dtype) + residual
    return rms_norm_variant(residual, weight, eps, style), residual


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated Delta Net's output norm (Qwen3-Next / Qwen3.5): w * norm(x), rounded to x's dtype first, times
    silu(gate) in float32, rounded once more."""
    normed = weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return (normed * F.silu(gate.float())).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # x, an activation or a float32 all-reduced sum, is rounded to the activations' dtype (the weight's) as
    # one device's GEMM rounds its output, then added in the residual's dtype (float32 or the same).
    residual = x.to(weight.dtype).to(residual.dtype) + residual
    return rms_norm(residual, weight, eps), residual


def gated_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return silu_and_mul(gemm(x, weight, bias))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


_cos_sin_memo: tuple = ()


def _cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype):
    """cos and sin for this step's positions, gathered once per step rather than once per layer. Keyed by
    identity (the memo keeps the tensors alive, so an id cannot be reused): callers pass a fresh positions
    tensor each step, never one refilled in place (the runner builds it from the step's host inputs; the
    graph-captured triton path has its own RoPE). Version counters cannot be checked instead: tensors made
    under inference_mode do not track them."""
    global _cos_sin_memo
    key = (positions, cos_sin_cache, dtype)
    if len(_cos_sin_memo) == 2 and all(a is b for a, b in zip(_cos_sin_memo[0], key)):
        return _cos_sin_memo[1]
    cos_sin = cos_sin_cache[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
    _cos_sin_memo = (key, cos_sin)
    return cos_sin


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, H, D], key [T, Hk, D]; cos_sin_cache [max_pos, rotary_dim] (cos half, then sin half).
    Only the first rotary_dim features of each head rotate."""
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = _cos_sin(positions, cos_sin_cache, query.dtype)
    out = []
    for x in (query, key):
        if rotary_dim == x.shape[-1]:
            out.append(_rotate(x, cos, sin, is_neox))
        else:
            rotated = _rotate(x[..., :rotary_dim], cos, sin, is_neox)
            out.append(torch.cat((rotated, x[..., rotary_dim:]), dim=-1))
    return out[0], out[1]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return F.gelu(x[..., :half], approximate="tanh") * x[..., half:]
