"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight) as DeepSeek defines it.

Queries: `q_proj`, or the low-rank `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` (q_lora_rank); each head
splits into a position-free part (qk_nope_head_dim) and a rotated part (qk_rope_head_dim). Keys and values:
`kv_a_proj_with_mqa` gives one latent (kv_lora_rank, normalised by `kv_a_layernorm`) and one rope key shared
by all heads; the cache keeps just these two per token, on every TP rank. `kv_b_proj` expands a latent into
each head's k_nope and v; `o_proj` mixes the heads' outputs. Heads split across TP ranks (the q and kv_b
projections by output heads, o_proj by input heads); the latent projections are replicated.

RoPE: GPT-J style (interleaved pairs) unless the config sets `rope_interleave=False` (neox). transformers
rotates the same pairs but writes the result de-interleaved (evens, then odds): a permutation applied to
queries and keys alike, which leaves every q.k unchanged. Yarn rope scaling also scales the softmax by
mscale(factor, mscale_all_dim)^2.

FP8 cache (`kv_cache_dtype="fp8"`): the latent entries are stored as FP8 with one per-tensor scale per layer
(engine/kernels/mla.py), the checkpoint's `self_attn.k_scale` where it has one (as vLLM scales MLA caches),
else 1.0; per-token scales are not offered.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from engine.forward_context import get_forward_context
from engine.kernels import ops
from engine.kernels.mla import MLAWeights, mla_attention
from engine.kernels.quant import dequantize_weight
from engine.kv_cache_spec import CacheSpec, PagedSpec
from engine.layers.attention import KVCacheLayer
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, shard_range
from engine.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from engine.parallel import get_parallel_state

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default epsilon, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(hf_config, qk_head_dim: int) -> float:
    """qk_head_dim^-1/2, times mscale(factor, mscale_all_dim)^2 under a rope scaling that names
    mscale_all_dim (DeepSeek's yarn; transformers' `yarn_apply_mscale`)."""
    scale = qk_head_dim ** -0.5
    params = rope_parameters(hf_config)
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if params["rope_type"] != "default" and mscale_all_dim:
        scale *= yarn_mscale(params["factor"], mscale_all_dim) ** 2
    return scale


class LatentCacheScale(nn.Module):
    """The per-tensor FP8 scale of one layer's latent cache: `k_scale` float32 [1], 1.0 unless the checkpoint
    has one. Checkpoints name it `self_attn.k_scale`, which the loader places at `self_attn.attn.k_scale`
    (engine.loader.quant_plan.checkpoint_param_name): MLAAttention holds this module as `attn`. A checkpoint's
    `v_scale` finds no parameter and is skipped: the entry is key and value at once, one scale serves both."""

    def __init__(self) -> None:
        super().__init__()
        self.k_scale = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)
        self.k_scale.weight_loader = self._load
        self.k_scale.check_loaded = lambda param, shards: None  # optional
        self.from_checkpoint = False

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.numel() != 1:
            raise ValueError(f"a per-tensor KV-cache scale must be one number, got shape {tuple(loaded.shape)}")
        param.data.copy_(loaded.float().reshape(1))
        self.from_checkpoint = True


class MLAAttention(KVCacheLayer):
    supports_fp8_kv_cache = True
    fp8_kv_scale_granularities = ("tensor",)  # one scale per layer (KVCacheQuant("tensor", scale, scale))
    # Capturable where the step goes through mla_attention alone and the active op reads no host-side lengths
    # (the Triton one; the torch reference loops on them). A subclass with its own forward is not, unless it
    # declares so itself.
    supports_cuda_graphs = property(lambda self: type(self).forward is MLAAttention.forward
                                    and getattr(ops.mla_attention, "cuda_graph_safe", False))

    def __init__(self, config) -> None:
        super().__init__()
        state = get_parallel_state()
        total_heads = config.num_attention_heads
        head_start, self.num_heads = shard_range(total_heads, state.tp_size, state.tp_rank)
        self.qk_nope_head_dim, self.qk_rope_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))

        def heads(per_head: int) -> tuple[int, int]:  # this rank's slice of a head-major dimension
            return head_start * per_head, self.num_heads * per_head

        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, total_heads * self.qk_head_dim,
                                               output_shard=heads(self.qk_head_dim))
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_heads * self.qk_head_dim,
                                                 output_shard=heads(self.qk_head_dim))
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        kv_b_per_head = self.qk_nope_head_dim + self.v_head_dim
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, total_heads * kv_b_per_head,
                                              output_shard=heads(kv_b_per_head))
        self.o_proj = RowParallelLinear(total_heads * self.v_head_dim, hidden, bias=bias,
                                        input_shard=heads(self.v_head_dim))
        is_neox = getattr(config, "rope_interleave", True) is False
        self.rotary_emb = RotaryEmbedding(config, self.qk_rope_head_dim, self.qk_rope_head_dim,
                                          config.max_position_embeddings, is_neox_style=is_neox)
        self.scale = mla_softmax_scale(config, self.qk_head_dim)
        self.attn = LatentCacheScale()
        self._weights: MLAWeights | None = None

    def cache_specs(self) -> dict[str, CacheSpec]:
        """One latent entry per token (kv_lora_rank + qk_rope_head_dim), the same on every TP rank."""
        return {"kv": PagedSpec((self.kv_lora_rank + self.qk_rope_head_dim,), kind="mla")}

    def kv_scale_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        raise NotImplementedError("an FP8 latent cache has one per-tensor scale, no per-token scales")

    # The FP8 cache's per-tensor scales as the runner binds them (KVCacheQuant("tensor", k_scale, v_scale)):
    # one tensor for both.
    @property
    def k_scale(self) -> nn.Parameter:
        return self.attn.k_scale

    @property
    def v_scale(self) -> nn.Parameter:
        return self.attn.k_scale

    @property
    def checkpoint_kv_scales(self) -> bool:
        return self.attn.from_checkpoint

    def mla_weights(self) -> MLAWeights:
        """kv_b_proj as MLA attention reads it, made at the first forward pass (after loading): W_UK and
        W_UV are views of a full-precision weight, or of its dequantized copy (in the activations' dtype)."""
        if self._weights is None:
            kv_b = self.kv_b_proj
            dense = kv_b.weight
            if kv_b.qweight is not None:
                dense = dequantize_weight(kv_b.qweight).to(self.kv_a_layernorm.weight.dtype)
            per_head = dense.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
            w_uk, w_uv = per_head.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
            self._weights = MLAWeights(kv_b, w_uk, w_uv)
        return self._weights

    def project(self, positions: torch.Tensor, hidden_states: torch.Tensor):
        """The step's queries and cache entries: q_nope [T, H, N], q_pe [T, H, R] (rotated), the normalised
        latent [T, L], k_pe [T, 1, R] (rotated), and the q-LoRA residual [T, q_lora_rank] (None without
        q-LoRA; DSA's indexer reads it)."""
        q_resid = None
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
            q = self.q_b_proj(q_resid)
        q_nope, q_pe = q.view(-1, self.num_heads, self.qk_head_dim).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.qk_rope_head_dim],
                                                                    dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        # Rotated copies (a backend's rotation may work in place; q_pe and k_pe are views of the projections).
        q_pe, k_pe = ops.rotary_embedding(positions, q_pe.contiguous(), k_pe.contiguous()[:, None],
                                          self.rotary_emb.cos_sin_cache, self.rotary_emb.is_neox_style)
        return q_nope, q_pe, latent, k_pe, q_resid

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q_nope, q_pe, latent, k_pe, _ = self.project(positions, hidden_states)
        context = get_forward_context()
        if context.attn_metadata is None:  # a lockstep dummy step: nothing to attend to, nothing to cache
            out = q_nope.new_zeros(q_nope.shape[0], self.num_heads * self.v_head_dim)
        else:
            out = mla_attention(q_nope, q_pe, latent, k_pe[:, 0], self.kv_cache, context.attn_metadata,
                                self.mla_weights(), self.scale, context.block_size, self.kv_quant)
        return self.o_proj(out.reshape(-1, self.num_heads * self.v_head_dim))
