"""AITER adapters for the dense ops, MoE routing and experts, and sampling. Each function imports `aiter`
when called (never at module import) and states the AITER kernel it runs in its `kernel` attribute, which
the start-up kernel table prints."""
from __future__ import annotations

import functools
import math

import torch

from engine.kernels.sampling import SamplingTensors
from engine.kernels.torch import ops as reference
from engine.kernels.torch.sampling import exponential_noise
from engine.kernels.torch.sampling import sample as reference_sample

# Ops whose AITER kernels take only bf16/fp16 (a float32 model runs them elsewhere).
HALF_PRECISION_ONLY = ("gemm", "gated_gemm", "rms_norm", "fused_add_rms_norm", "rotary_embedding",
                       "silu_and_mul", "gelu_tanh_and_mul", "fused_experts")


def kernel(name: str):
    """Tag an adapter with the AITER kernel(s) it runs, for the kernel table."""
    def tag(fn):
        fn.kernel = name
        return fn
    return tag


@functools.lru_cache(maxsize=1)
def gfx() -> str:
    """The GPU architecture AITER sees: "gfx942" (MI300X/MI325X), "gfx950" (MI350X/MI355X), ..."""
    from aiter.jit.utils.chip_info import get_gfx
    return get_gfx()


def rows(x: torch.Tensor) -> torch.Tensor:
    """[..., K] as a 2-D [M, K] view (a copy only if the last dimension is strided)."""
    return x.reshape(-1, x.shape[-1])


# ---- dense ----------------------------------------------------------------------------------------------

@kernel("aiter.tuned_gemm.tgemm.mm")
def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    from aiter.tuned_gemm import tgemm
    return tgemm.mm(rows(x), weight, bias).view(*x.shape[:-1], weight.shape[0])


@kernel("aiter.tuned_gemm.tgemm.mm + aiter.silu_and_mul")
def gated_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return silu_and_mul(gemm(x, weight, bias))


@kernel("aiter.rmsnorm2d_fwd")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype != weight.dtype:  # a float32 residual stream: the reference rounds as the contract says
        return reference.rms_norm(x, weight, eps)
    import aiter
    return aiter.rmsnorm2d_fwd(rows(x), weight, eps).view(x.shape)


@kernel("aiter.rmsnorm2d_fwd_with_add")
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    if residual.dtype != weight.dtype:
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    import aiter
    x2 = rows(x.to(weight.dtype))
    residual2 = rows(residual)
    out, residual_out = torch.empty_like(x2), torch.empty_like(residual2)
    aiter.rmsnorm2d_fwd_with_add(out, x2, residual2, residual_out, weight, eps)
    return out.view(x.shape), residual_out.view(residual.shape)


def _act_and_mul(x: torch.Tensor, name: str) -> torch.Tensor:
    """AITER's gated activations (one kernel, the activation of the first half times the second)."""
    import aiter
    x2 = rows(x)
    out = torch.empty(x2.shape[0], x2.shape[1] // 2, dtype=x.dtype, device=x.device)
    getattr(aiter, name)(out, x2)
    return out.view(*x.shape[:-1], x.shape[-1] // 2)


@kernel("aiter.silu_and_mul")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(x, "silu_and_mul")


@kernel("aiter.gelu_tanh_and_mul")
def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(x, "gelu_tanh_and_mul")


_ROPE_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _cos_sin(cos_sin_cache: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Our [max_position, rotary_dim] table (cos half, then sin half) as AITER's cos and sin
    [max_position, 1, 1, rotary_dim / 2] in `dtype`, made once per table (a model's tables live as long as
    the process)."""
    key = (cos_sin_cache.data_ptr(), tuple(cos_sin_cache.shape), dtype)
    if key not in _ROPE_TABLES:
        half = cos_sin_cache.shape[-1] // 2
        cos = cos_sin_cache[:, :half].to(dtype).contiguous()[:, None, None, :]
        sin = cos_sin_cache[:, half:].to(dtype).contiguous()[:, None, None, :]
        _ROPE_TABLES[key] = (cos, sin)
    return _ROPE_TABLES[key]


@kernel("aiter.rope_cached_positions_2c_fwd_inplace")
def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on contiguous [T, heads, D] queries and keys, viewed as AITER's sbhd [1, T, heads, D]; the
    rotated part is the first rotary_dim features (nope_first=False), as in HF's partial rotary."""
    import aiter
    query, key = query.contiguous(), key.contiguous()
    cos, sin = _cos_sin(cos_sin_cache, query.dtype)
    num_tokens = query.shape[0]
    aiter.rope_cached_positions_2c_fwd_inplace(
        query.view(1, num_tokens, *query.shape[1:]), key.view(1, num_tokens, *key.shape[1:]), cos, sin,
        positions.view(1, num_tokens), 0 if is_neox else 1, True, False)
    return query, key


# ---- sampling -------------------------------------------------------------------------------------------

@kernel("aiter.mixed_sample_outer_exponential (top-k/top-p/min-p batches: torch)")
def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Greedy and temperature rows in one kernel: argmax of softmax(logits / T) over exponential noise,
    the noise drawn from each row's seeded generator exactly as the reference draws it, so seeded requests
    get the reference's tokens. Batches with top-k, top-p or min-p take the reference."""
    if t.all_greedy:
        return logits.argmax(dim=-1)
    if t.any_top_k or t.any_top_p or t.any_min_p:
        return reference_sample(logits, t)
    import aiter
    out = torch.empty(logits.shape[0], dtype=torch.int32, device=logits.device)
    aiter.mixed_sample_outer_exponential(out, logits.float(), exponential_noise(logits.float(), t),
                                         t.temperature.float())
    return out.long()


# ---- mixture of experts ---------------------------------------------------------------------------------

@kernel("aiter.topk_softmax")
def moe_topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool):
    import aiter
    num_tokens = logits.shape[0]
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    token_expert = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    aiter.topk_softmax(weights, ids, token_expert, logits, renormalize)
    return weights, ids


@kernel("aiter.grouped_topk / aiter.biased_grouped_topk")
def moe_grouped_topk(logits: torch.Tensor, top_k: int, renormalize: bool, num_groups: int, topk_groups: int,
                     scoring: str, correction_bias: torch.Tensor | None, routed_scaling_factor: float):
    """DeepSeek-V3's sigmoid + bias (biased_grouped_topk) and grouped softmax/sigmoid without a bias
    (grouped_topk); softmax scores with a bias have no AITER kernel and take the reference."""
    if correction_bias is not None and scoring != "sigmoid":
        from engine.kernels.torch.moe import moe_grouped_topk as reference_grouped
        return reference_grouped(logits, top_k, renormalize, num_groups, topk_groups, scoring, correction_bias,
                                 routed_scaling_factor)
    import aiter
    num_tokens = logits.shape[0]
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if correction_bias is not None:
        aiter.biased_grouped_topk(logits, correction_bias.to(logits.dtype), weights, ids, num_groups, topk_groups,
                                  renormalize, routed_scaling_factor)
    else:
        aiter.grouped_topk(logits, weights, ids, num_groups, topk_groups, renormalize,
                           is_softmax=scoring == "softmax", routed_scaling_factor=routed_scaling_factor)
    return weights, ids


def shuffle_in_place(weight: torch.Tensor) -> None:
    """Rewrite [.., N, K] weights in the (16, 16)-tiled order of AITER's pre-shuffled GEMM and MoE kernels."""
    from aiter.ops.shuffle import shuffle_weight
    weight.copy_(shuffle_weight(weight, layout=(16, 16)))


def _prepare_experts(w13: torch.Tensor, w2: torch.Tensor) -> None:
    shuffle_in_place(w13)
    shuffle_in_place(w2)


_EXPERT_MASKS: dict[tuple, torch.Tensor] = {}


def masked_ids(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Our ids with -1 for "no expert here" (remote experts under expert parallelism) as fused_moe takes
    them: every -1 becomes one extra expert id, E, that `expert_mask` ([E + 1] int32, zero last) marks as
    not held, so its routes add nothing; the real experts keep their ids (mask prefix sums are identity)."""
    key = (num_experts, ids.device)
    if key not in _EXPERT_MASKS:
        mask = torch.ones(num_experts + 1, dtype=torch.int32, device=ids.device)
        mask[-1] = 0
        _EXPERT_MASKS[key] = mask
    return torch.where(ids < 0, num_experts, ids).to(torch.int32), _EXPERT_MASKS[key]


@kernel("aiter.fused_moe.fused_moe")
def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    """Expert weights were shuffled in place once after loading (`prepare_weights`). A clamped SwiGLU
    (`swiglu_limit`) is declined at start-up (the Triton op serves such models), never reaches here."""
    if swiglu_limit is not None:
        raise NotImplementedError("aiter's fused_moe has no clamped SwiGLU (swiglu_limit)")
    import aiter
    from aiter.fused_moe import fused_moe
    ids, mask = masked_ids(ids, w13.shape[0])
    return fused_moe(x, w13, w2, weights, ids, expert_mask=mask, activation=aiter.ActivationType.Silu,
                     quant_type=aiter.QuantType.No)


fused_experts.prepare_weights = _prepare_experts


def default_softmax_scale(head_size: int) -> float:
    return 1.0 / math.sqrt(head_size)
