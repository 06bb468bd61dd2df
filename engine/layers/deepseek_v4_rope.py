"""DeepSeek-V4's rotary embedding and norms, as transformers defines them.

RoPE: GPT-J style (pairs of neighbouring features) on the *trailing* `rope_dim` features of a head, with one
table per rope type of `config.rope_parameters` ("main": sliding-only layers, plain RoPE; "compress": CSA and
HCA layers, their compressors and indexer, with yarn whose attention factor V4 fixes at 1). cos and sin are
computed from the positions at each call (the real configs allow a million positions: no table) and rounded to
the activations' dtype before the rotation, which runs in float32. The inverse rotation (V4's attention output)
is the same with -sin.

Norms: `DeepseekV4RMSNorm` keeps its weight in float32 and multiplies before rounding once; the weightless
norm (queries per head, the hyper-connections' input) rounds the reciprocal root first."""
from __future__ import annotations

import torch
from torch import nn


def rope_inv_freq(hf_config, label: str, rope_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rope_dim / 2] and the cos/sin scaling of rope type `label` ("main" or "compress")."""
    params = hf_config.rope_parameters[label]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)), 1.0
    if rope_type != "yarn":
        raise ValueError(f"DeepSeek-V4 rope type {rope_type!r} (rope_parameters[{label!r}]) is not supported "
                         f"(default, yarn)")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](hf_config, torch.device("cpu"), layer_type=label)
    if inv_freq.numel() != rope_dim // 2:
        raise ValueError(f"yarn gave {inv_freq.numel()} frequencies for a rope dimension of {rope_dim}")
    return inv_freq.float(), float(scaling)


class TrailingRope(nn.Module):
    """Interleaved-pair rotation of the last `rope_dim` features at given positions."""

    def __init__(self, hf_config, label: str, rope_dim: int) -> None:
        super().__init__()
        self.label, self.rope_dim = label, rope_dim
        inv_freq, self.scaling = rope_inv_freq(hf_config, label, rope_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [*positions.shape, rope_dim / 2], rounded to `dtype` (as transformers rounds them)."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        return (freqs.cos() * self.scaling).to(dtype), (freqs.sin() * self.scaling).to(dtype)


def rotate_trailing(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] with its last 2 * cos.shape[-1] features rotated in neighbouring pairs (cos and sin broadcast
    against x's leading dimensions), in float32, rounded to x's dtype; pass -sin for the inverse rotation."""
    rope_dim = 2 * cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    cos, sin = cos.float(), sin.float()
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((nope, rotated.to(x.dtype)), dim=-1)


class DeepseekV4RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, in float32 with a float32 weight, rounded once."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype)


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The weightless norm: x * rsqrt(mean(x^2) + eps), the reciprocal rounded to x's dtype first."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
