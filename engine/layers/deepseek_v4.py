"""DeepSeek-V4 attention (transformers' `DeepseekV4Attention`): one shared key=value head, a sliding window,
and, in CSA and HCA layers, compressed entries of the older context.

Per token: q = q_b_proj(q_a_norm(q_a_proj(x))) per head, normalised without a weight; kv = kv_norm(kv_proj(x)),
one head of head_dim used as key and value. Both rotate (GPT-J pairs) on their trailing rope dims at the token's
position, with the "main" RoPE in sliding-only layers and the "compress" one (yarn) in CSA/HCA layers.
A query attends, with per-head sinks and scale head_dim^-1/2, to two scopes computed apart and merged by their
log-sum-exps:
- the window: the last `sliding_window` tokens, itself included (a PagedSpec with that window);
- the compressed scope (CSA: ratio 4 with the indexer's top-k; HCA: ratio 128, every entry): entries whose
  windows ended at or before the query (entry w is visible to position t when w < (t + 1) // ratio).
The output's rope dims rotate back by the query's position (values carried their keys' rotation), then the
grouped low-rank projection: o_a_proj maps each of o_groups groups of heads to o_lora_rank, o_b_proj mixes.

Caches: "window" (one entry per token, head_dim, the last sliding_window tokens read), "compressed" (one
entry per ratio tokens), "indexer" (CSA: the indexer's key per entry, same group), and the compressors' running
state ("compressor_state", "indexer_state": StateSpecs). A decode step reads the window, the chosen (CSA) or
all (HCA) compressed entries, and the CSA indexer's keys: never the whole context. Attention is replicated
on every TP rank (transformers' TP plan does the same: a single KV head)."""
from __future__ import annotations

import torch
from torch import nn

from engine.forward_context import get_forward_context
from engine.kernels import ops
from engine.kernels.mla import mla_sparse_attention
from engine.kernels.quant import QuantizedWeight
from engine.kernels.registry import prepare_quantized
from engine.kv_cache_spec import CacheSpec, PagedSpec, entry_slots
from engine.layers.attention import KVCacheLayer
from engine.layers.deepseek_v4_compressor import Indexer, StepLayout, WindowPooling
from engine.layers.deepseek_v4_rope import DeepseekV4RMSNorm, TrailingRope, rotate_trailing, unit_rms_norm
from engine.layers.linear import LinearBase, ReplicatedLinear

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


def merge_scopes_with_sinks(outs: list[torch.Tensor], lses: list[torch.Tensor], sinks: torch.Tensor
                            ) -> torch.Tensor:
    """Attention over the union of key sets computed apart (outs [T, H, D], lses [T, H] float32 with -inf for
    an empty scope), with a per-head sink logit in the softmax's denominator:
    out = sum_s exp(lse_s - lse) out_s * 1 / (1 + exp(sink - lse)), lse = logsumexp_s lse_s; 0 where lse = -inf."""
    lse = torch.stack(lses).logsumexp(dim=0)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    out = sum(torch.exp(part - safe)[..., None] * o.float() for o, part in zip(outs, lses))
    out = out * torch.sigmoid(safe - sinks.float())[..., None]
    return torch.where(finite[..., None], out, torch.zeros_like(out)).to(outs[0].dtype)


class GroupedLinear(LinearBase):
    """Block-diagonal projection: input [T, groups, in_per_group] -> [T, groups * out_per_group], group g by
    rows [g * out_per_group, (g + 1) * out_per_group) of `weight` [groups * out_per_group, in_per_group],
    replicated on every rank. Quantized (FP8 128x128 blocks in DeepSeek-V4-Flash), each group runs the scheme's
    GEMM over its rows of the weight and their scales, so a group must cover whole blocks of scale rows."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__(in_per_group, out_features, bias=False, tp_dim=None)
        self.groups = groups
        self.group_weights: list[QuantizedWeight] = []

    def finish_loading(self) -> None:
        """Split the loaded quantized weight into one QuantizedWeight per group (views) and prepare each."""
        scheme, self.group_weights = self.quant_scheme, []
        if scheme is None:
            return
        rows = self.output_size // self.groups
        per_scale_row = scheme.block[0] if scheme.method == "fp8_block" else 1
        if rows % per_scale_row:
            raise ValueError(f"grouped projection: groups of {rows} rows do not cover whole {per_scale_row}-row "
                             f"blocks of {scheme.describe()} scales")
        input_scale = None if self.input_scale is None else self.input_scale.data.max().reshape(1)
        op = getattr(ops, scheme.gemm_op)
        for g in range(self.groups):
            scale = self.weight_scale.data
            if scheme.method != "fp8_tensor":  # one scale for all groups otherwise
                scale = scale[g * rows // per_scale_row:(g + 1) * rows // per_scale_row]
            group = QuantizedWeight(scheme, self.weight.data[g * rows:(g + 1) * rows], scale, input_scale)
            prepare_quantized(op, group)
            self.group_weights.append(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_scheme is None:
            weight = self.weight.view(self.groups, -1, self.weight.shape[1])
            return torch.einsum("tgi,goi->tgo", x, weight).flatten(1)
        op = getattr(ops, self.quant_scheme.gemm_op)
        return torch.cat([op(x[:, g].contiguous(), group) for g, group in enumerate(self.group_weights)], dim=-1)


class DeepseekV4Attention(KVCacheLayer):
    supports_fp8_kv_cache = False
    supports_cuda_graphs = False  # the compressors choose their work on the host

    def __init__(self, hf_config, layer_index: int) -> None:
        super().__init__()
        config = hf_config
        self.layer_type = config.layer_types[layer_index]
        if self.layer_type not in LAYER_TYPES:
            raise ValueError(f"DeepSeek-V4 layer type {self.layer_type!r} is not supported ({LAYER_TYPES})")
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.rope_dim = int(config.head_dim * config.partial_rotary_factor)
        self.window = config.sliding_window
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        if self.num_heads * self.head_dim % config.o_groups:
            raise ValueError(f"{self.num_heads} heads of {self.head_dim} do not split into o_groups={config.o_groups}")
        self.q_a_proj = ReplicatedLinear(config.hidden_size, config.q_lora_rank)
        self.q_a_norm = DeepseekV4RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = ReplicatedLinear(config.q_lora_rank, self.num_heads * self.head_dim)
        self.kv_proj = ReplicatedLinear(config.hidden_size, self.head_dim)
        self.kv_norm = DeepseekV4RMSNorm(self.head_dim, config.rms_norm_eps)
        self.o_a_proj = GroupedLinear(self.num_heads * self.head_dim // config.o_groups,
                                      config.o_groups * config.o_lora_rank, config.o_groups)
        self.o_b_proj = ReplicatedLinear(config.o_groups * config.o_lora_rank, config.hidden_size)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False)
        sliding_only = self.layer_type == "sliding_attention"
        self.rope = TrailingRope(config, "main" if sliding_only else "compress", self.rope_dim)
        self.compressor = None
        if not sliding_only:
            self.ratio = int(config.compress_rates[self.layer_type])
            if self.layer_type == "compressed_sparse_attention":
                self.compressor = WindowPooling(config, self.ratio, self.head_dim, overlap=True, rope=self.rope)
                self.compressor.indexer = Indexer(config, self.ratio, self.rope)
            else:
                self.compressor = WindowPooling(config, self.ratio, self.head_dim, overlap=False, rope=self.rope)

    @property
    def indexer(self) -> Indexer | None:
        return getattr(self.compressor, "indexer", None)

    def cache_specs(self) -> dict[str, CacheSpec]:
        specs: dict[str, CacheSpec] = {
            "window": PagedSpec((self.head_dim,), window=self.window, kind="sliding_window")}
        if self.compressor is not None:
            specs["compressed"] = PagedSpec((self.head_dim,), ratio=self.ratio, kind="compressed")
            specs["compressor_state"] = self.compressor.state_spec()
        if self.indexer is not None:
            specs["indexer"] = PagedSpec((self.indexer.head_dim,), ratio=self.ratio, kind="indexer")
            specs["indexer_state"] = self.indexer.state_spec()
        return specs

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        metadata = get_forward_context().attn_metadata
        num_tokens = hidden_states.shape[0]
        if metadata is None:  # a lockstep dummy step: nothing to attend to, nothing to cache
            return hidden_states.new_zeros(num_tokens, self.o_b_proj.output_size)
        q_residual = self.q_a_norm(self.q_a_proj(hidden_states))
        q = unit_rms_norm(self.q_b_proj(q_residual).view(num_tokens, self.num_heads, self.head_dim), self.eps)
        cos, sin = self.rope.cos_sin(positions, hidden_states.dtype)
        q = rotate_trailing(q, cos[:, None], sin[:, None])
        kv = rotate_trailing(self.kv_norm(self.kv_proj(hidden_states)), cos, sin)
        layout = StepLayout.from_metadata(metadata, positions, stateful=self.compressor is not None
                                          and self.caches is not None)
        all_tokens = torch.arange(num_tokens, device=positions.device)

        window = self._scope_store("window", (1, self.window), kv, all_tokens, layout.positions, metadata, layout)
        offsets = torch.arange(self.window, device=positions.device) - (self.window - 1)
        window_slots = window.slots(all_tokens, layout.positions[:, None] + offsets)
        scopes = [mla_sparse_attention(q, window.cache, window_slots, self.scale, self.head_dim)]
        if self.compressor is not None:
            compressed = self._compressed_slots(hidden_states, q_residual, layout, metadata)
            if compressed is not None:
                scopes.append(mla_sparse_attention(q, *compressed, self.scale, self.head_dim))
        out = merge_scopes_with_sinks([o for o, _ in scopes], [lse for _, lse in scopes], self.sinks)
        out = rotate_trailing(out, cos[:, None], -sin[:, None])  # undo the values' rotation at the query
        grouped = out.reshape(num_tokens, self.o_a_proj.groups, -1)
        return self.o_b_proj(self.o_a_proj(grouped))

    def _compressed_slots(self, hidden_states, q_residual, layout: StepLayout, metadata):
        """Make this step's compressed entries (and indexer keys), store them, and return (cache, slots
        [T, K]) of each query's compressed scope, or None while no query sees an entry yet."""
        group = (self.ratio, None)
        state = None if self.caches is None else self.caches["compressor_state"]
        entries, done = self.compressor.pool(hidden_states, layout, state)
        compressed = self._scope_store("compressed", group, entries, done, layout.positions[done] // self.ratio,
                                       metadata, layout)
        all_tokens = torch.arange(hidden_states.shape[0], device=hidden_states.device)
        visible = (layout.positions + 1) // self.ratio
        if self.indexer is None:  # HCA: every entry that is complete
            num_entries = int(visible.max().item())
            if num_entries == 0:
                return None
            chosen = torch.arange(num_entries, device=visible.device).expand(visible.shape[0], -1)
            chosen = chosen.masked_fill(chosen >= visible[:, None], -1)
        else:
            state = None if self.caches is None else self.caches["indexer_state"]
            keys, key_done = self.indexer.pool(hidden_states, layout, state)
            index = self._scope_store("indexer", group, keys, key_done, layout.positions[key_done] // self.ratio,
                                      metadata, layout)
            chosen = self.indexer.select(hidden_states, q_residual, layout, index.cache, index.slots)
            if chosen.shape[1] == 0:
                return None
        return compressed.cache, compressed.slots(all_tokens, chosen)

    def _scope_store(self, name: str, group: tuple, rows: torch.Tensor, tokens: torch.Tensor,
                     entry_index: torch.Tensor, metadata, layout: StepLayout) -> "_Scope":
        """Store `rows` (the entries made by step tokens `tokens`, entry numbers `entry_index`) in cache `name`
        and return how to address that cache. The profiling pass has no caches: the scope is then the step's
        own rows, addressed through a block table of one-entry blocks (every sequence starts at 0 there)."""
        if self.caches is not None:
            cache, group_metadata = self.caches[name], metadata.groups[group]
            if tokens.numel():
                cache.view(-1, cache.shape[-1])[group_metadata.slot_mapping[tokens]] = rows.to(cache.dtype)
            return _Scope(cache, group_metadata.block_table, group_metadata.block_size, layout.token_seq)
        width = int(entry_index.max().item()) + 1 if entry_index.numel() else 1
        table = torch.full((metadata.num_seqs, width), -1, dtype=torch.long, device=rows.device)
        table[layout.token_seq[tokens], entry_index] = torch.arange(tokens.numel(), device=rows.device)
        return _Scope(rows[:, None], table, 1, layout.token_seq)


class _Scope:
    """A cache and its block tables: `slots(tokens, entries [R, K])` gives the cache slots of entries (-1
    none) of the sequences of step tokens `tokens`."""

    def __init__(self, cache: torch.Tensor, block_table: torch.Tensor, block_size: int, token_seq: torch.Tensor):
        self.cache, self.block_table, self.block_size, self.token_seq = cache, block_table, block_size, token_seq

    def slots(self, tokens: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        entries = entries.expand(tokens.shape[0], -1)
        return entry_slots(self.block_table[self.token_seq[tokens]], entries, self.block_size)
