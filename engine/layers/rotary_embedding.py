"""Rotary position embedding with a precomputed cos/sin table indexed by position.

Scaling types: default, linear, llama3, proportional (Gemma 4: the first pairs of the whole head rotate,
the rest keep frequency 0; computed here) and yarn (inverse frequencies from transformers' own
implementation). Dynamic-NTK and longrope depend on the sequence length at run time and are refused.

A config may give its rope settings per layer type (transformers 5's nested `rope_parameters`, e.g. Gemma's
`{"sliding_attention": {...}, "full_attention": {...}}`): each layer then names its type, and a layer that
does not, or names a type the config lacks, is refused with both named (never a silent default theta).
"""
from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


def per_layer_type(params) -> bool:
    """Whether rope settings are given per layer type (a mapping of mappings)."""
    return bool(params) and all(isinstance(value, dict) for value in params.values())


def rope_parameters(hf_config, layer_type: str | None = None) -> dict:
    """The rope settings of a config (of `layer_type`'s layers where they differ by type), whichever
    transformers version wrote it."""
    params = getattr(hf_config, "rope_parameters", None)
    if per_layer_type(params):
        if layer_type is None:
            raise ValueError(f"this config gives rope_parameters per layer type ({', '.join(sorted(params))}), but "
                             "the layer being built did not name its type; the model's code must pass it")
        if layer_type not in params:
            raise ValueError(f"rope_parameters have no entry for layer type {layer_type!r} (the config has "
                             f"{', '.join(sorted(params))})")
        params = dict(params[layer_type])
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    elif params and "rope_theta" in params:
        params = dict(params)
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low_freq_factor, old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _proportional_inv_freq(params: dict, head_dim: int) -> torch.Tensor:
    """Gemma 4's full-attention layers: the whole head's frequencies (exponents over head_dim), of which the
    first partial_rotary_factor x head_dim / 2 rotate and the rest keep frequency 0 (an identity rotation),
    divided by `factor`. Rotated as a whole head, pairs (i, i + head_dim / 2) turn together."""
    angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim
    inv_freq = torch.cat((1.0 / (params["rope_theta"] ** exponents), torch.zeros(head_dim // 2 - angles)))
    return inv_freq / params.get("factor", 1.0)


def compute_inv_freq(hf_config, rotary_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim / 2] and the attention scaling applied to cos and sin (of
    `layer_type`'s layers where the config's rope settings differ by layer type)."""
    params = rope_parameters(hf_config, layer_type)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    base = params["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    if rope_type == "proportional":  # rotary_dim is the whole head: the unrotated pairs get frequency 0
        return _proportional_inv_freq(params, rotary_dim), 1.0
    if rope_type == "yarn":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        with torch.device("cpu"):  # all of it on the CPU, whatever device the model is built under
            inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](hf_config, torch.device("cpu"), layer_type=layer_type)
        return inv_freq.float(), float(scaling)
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, head_size: int, rotary_dim: int, max_position: int, is_neox_style: bool = True,
                 layer_type: str | None = None) -> None:
        """`layer_type`: the layer's type where the config gives rope settings per type (Gemma's
        "sliding_attention" / "full_attention")."""
        super().__init__()
        self.head_size, self.rotary_dim, self.is_neox_style = head_size, rotary_dim, is_neox_style
        inv_freq, scaling = compute_inv_freq(hf_config, rotary_dim, layer_type)
        positions = torch.arange(max_position, dtype=torch.float32)  # on the model's device (a device context)
        freqs = torch.outer(positions, inv_freq.to(positions.device))  # yarn's come from transformers on the CPU
        cache = torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def rope_args(self, positions: torch.Tensor) -> tuple:
        """What the attention layer takes to apply this rotation (its backend rotates queries and keys,
        fused with its KV-cache write where it can)."""
        return positions, self.cos_sin_cache, self.is_neox_style
