"""DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5): multi-head latent attention (engine/layers/mla.py)
in which each query attends only to the `index_topk` earlier tokens that a lightning indexer selects.

The indexer, as transformers defines it (`DeepseekV32Indexer`): index queries `wq_b(q_resid)` ([H_I, D_I]
per token, from the q-LoRA residual `q_a_layernorm(q_a_proj(x))`), one index key `k_norm(wk(x))` (D_I, a
LayerNorm with bias), RoPE on the leading `qk_rope_head_dim` dims of both (neox halves for V3.2, GPT-J
pairs for GLM-5; the main attention rotates its trailing rope dims in pairs), per-head weights
`weights_proj(x) * H_I^-1/2` in float32, and for query s and key t <= s

    score(s, t) = sum_h w_h(s) * ReLU(q_h(s) . k(t) * D_I^-1/2)

computed in float32. Each query keeps the `index_topk` causal keys of highest score (all of them when the
context is no longer than `index_topk`: then DSA is dense MLA, up to the rounding of the absorbed form this
layer always attends in). transformers writes GLM-5's rotated pairs de-interleaved, a permutation of
queries and keys alike that changes no score.

DeepSeek's own indexer rotates queries and keys by a Hadamard matrix and scores them in FP8; transformers
skips both (the rotation is orthogonal, so it changes no score in exact arithmetic; FP8 is a speed choice), and
so does this layer: index keys are cached in the model's dtype, one entry per token (the "index_k" cache,
riding the latent cache's block table), also when the latent cache ("kv") is FP8 (`kv_cache_dtype="fp8"`:
written quantized with the layer's per-tensor scale, read dequantized by the sparse attention).

Selection is deterministic: ties go to the lower position (a stable sort), and the scores come from inputs
that every TP rank holds whole (replicated projections of the all-reduced hidden state), so all ranks pick
the same keys without exchanging them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.forward_context import get_forward_context
from engine.kernels import ops
from engine.kernels.mla import mla_sparse_attention, stored_entries
from engine.kv_cache_spec import FULL_GROUP, CacheSpec, PagedSpec, entry_slots
from engine.layers.linear import ReplicatedLinear
from engine.layers.mla import MLAAttention

# float32 elements of one chunk's per-head index scores ([queries, index heads, context]): the queries of a
# prefill are scored in chunks of max(1, INDEX_SCORES_BUDGET // (heads * context)), so one chunk holds at most
# max(INDEX_SCORES_BUDGET, heads * context) per-head scores (64 MiB at the default) plus chunk x context logits.
INDEX_SCORES_BUDGET = 1 << 24
INDEX_KEY_NORM_EPS = 1e-6  # transformers' nn.LayerNorm(index_head_dim, eps=1e-6)


@dataclass(frozen=True)
class DSAOptions:
    """How one family's DSA layer differs: `index_rope_interleaved` (GLM-5: GPT-J pairs in the indexer's
    rope dims; DeepSeek-V3.2: neox halves); `reuses_topk` (a GLM-5 "shared" layer: no indexer of its own,
    it attends to the keys the last full layer before it selected, for the same step)."""
    index_rope_interleaved: bool = False
    reuses_topk: bool = False


class TopkRelay:
    """One model's carrier of the current step's selection (cache slots [T, K]) from the layer that computed
    it to the `reuses_topk` layers after it; layers run in order, so a full layer always writes first."""
    slots: torch.Tensor | None = None


class LayerNorm(nn.Module):
    """LayerNorm with a bias (the indexer's `k_norm`), in the input's dtype as torch computes it."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class Float32Linear(nn.Module):
    """x @ W^T with W kept in float32 whatever the model's dtype (transformers keeps the indexer's
    `weights_proj` in float32: `_keep_in_fp32_modules`), replicated on every TP rank."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class LightningIndexer(nn.Module):
    """The indexer's projections (checkpoint names `indexer.wq_b`, `indexer.wk`, `indexer.k_norm`,
    `indexer.weights_proj`), replicated on every TP rank, and its top-k selection."""

    def __init__(self, config, rope_interleaved: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_interleaved = rope_interleaved  # the rotated dims: the width of the table `project` gets
        self.scale = self.head_dim ** -0.5
        self.wq_b = ReplicatedLinear(config.q_lora_rank, self.num_heads * self.head_dim)
        self.wk = ReplicatedLinear(config.hidden_size, self.head_dim)
        self.k_norm = LayerNorm(self.head_dim, INDEX_KEY_NORM_EPS)
        self.weights_proj = Float32Linear(config.hidden_size, self.num_heads)

    def project(self, positions: torch.Tensor, hidden_states: torch.Tensor, q_resid: torch.Tensor,
                cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Index queries [T, H_I, D_I] and keys [T, D_I] (rotated, the activations' dtype) and the per-head
        weights [T, H_I] (float32, H_I^-1/2 included)."""
        queries = self.wq_b(q_resid).view(-1, self.num_heads, self.head_dim)
        keys = self.k_norm(self.wk(hidden_states))
        queries, keys = ops.rotary_embedding(positions, queries, keys[:, None].contiguous(), cos_sin_cache,
                                             not self.rope_interleaved)
        weights = self.weights_proj(hidden_states) * self.num_heads ** -0.5
        return queries, keys[:, 0], weights

    def select(self, queries: torch.Tensor, weights: torch.Tensor, query_positions: torch.Tensor,
               key_store: torch.Tensor, context_slots: torch.Tensor, top_k: int) -> torch.Tensor:
        """The selected keys' slots [R, min(top_k, S)] (-1: none) of R query rows (queries [R, H_I, D_I],
        weights [R, H_I], positions [R]) over a context of S positions whose index keys sit at `context_slots`
        [1 or R, S] of `key_store` [slots, D_I] (one context shared by all rows, or one per row padded to S;
        positions after a row's query are never selected, so padding needs no mask of its own). Rows go in
        chunks of C = max(1, INDEX_SCORES_BUDGET // (H_I * S)): C x H_I x S per-head scores, C x S logits,
        and the context's S x D_I keys (C x S x D_I where each row has its own context) in float32."""
        num_rows, num_heads, _ = queries.shape
        context_len = context_slots.shape[1]
        key_positions = torch.arange(context_len, device=queries.device)
        num_selected = min(top_k, context_len)
        scoring = num_selected < context_len  # else every causal key is selected: nothing to score
        shared_context = context_slots.shape[0] == 1
        if scoring and shared_context:
            shared_keys = key_store[context_slots[0].clamp(min=0)][None]
        out = torch.empty(num_rows, num_selected, dtype=torch.int64, device=queries.device)
        chunk = max(1, INDEX_SCORES_BUDGET // (num_heads * context_len))
        for begin in range(0, num_rows, chunk):
            end = min(begin + chunk, num_rows)
            rows_slots = context_slots if shared_context else context_slots[begin:end]
            causal = key_positions[None, :] <= query_positions[begin:end, None]
            if scoring:
                keys = shared_keys if shared_context else key_store[rows_slots.clamp(min=0)]
                chosen = top_index_scores(queries[begin:end], weights[begin:end], keys, causal, num_selected,
                                          self.scale)
            else:
                chosen = key_positions.expand(end - begin, -1)
            valid = torch.gather(causal, 1, chosen)
            slots = torch.gather(rows_slots.expand(end - begin, -1), 1, chosen)
            out[begin:end] = torch.where(valid, slots, -1)
        return out


def top_index_scores(queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                     top_k: int, scale: float) -> torch.Tensor:
    """The lightning indexer's choice: for query rows (queries [R, H, D], head weights [R, H]) over keys
    [1 or R, S, D] (shared or per row), the key indices [R, top_k] of the highest
    sum_h w_h * ReLU(q_h . k * scale) among each row's `visible` [R, S] keys, in float32, ties to the lower
    index (a stable sort: the same choice on every rank that holds the same inputs). Rows with fewer than
    top_k visible keys fill up with invisible ones: callers mask those by `visible`."""
    scores = torch.relu(torch.matmul(queries.float(), keys.float().transpose(-1, -2)) * scale)  # [R, H, S]
    logits = torch.matmul(weights.float()[:, None, :], scores)[:, 0].masked_fill(~visible, float("-inf"))
    return torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]


class SparseMLAAttention(MLAAttention):
    """MLA (q-LoRA required: the indexer reads its residual) whose queries, prefill and decode alike, attend
    in latent space (the absorbed form: q_nope @ W_UK beside q_pe, over whole latent entries as keys and their
    latent part as values, then @ W_UV) to the keys their layer's indexer selected, or, for a `reuses_topk`
    layer, the last full layer's. Caches: "kv" (the latent entries, as MLAAttention) and, where there is an
    indexer, "index_k" (one index key per token), both in the full group so they share one block table."""

    supports_cuda_graphs = False  # its selection loops on host-side lengths

    def __init__(self, config, options: DSAOptions, relay: TopkRelay) -> None:
        super().__init__(config)
        if self.q_lora_rank is None:
            raise ValueError("DSA's lightning indexer reads the q-LoRA residual: the config needs q_lora_rank")
        if config.index_topk < 1:
            raise ValueError(f"index_topk must be >= 1, got {config.index_topk}")
        if not self.qk_rope_head_dim <= config.index_head_dim:
            raise ValueError(f"index_head_dim ({config.index_head_dim}) must hold the rotated "
                             f"qk_rope_head_dim ({self.qk_rope_head_dim}) dims")
        self.index_topk = config.index_topk
        self.relay = relay
        self.indexer = None if options.reuses_topk else LightningIndexer(config, options.index_rope_interleaved)

    def cache_specs(self) -> dict[str, CacheSpec]:
        specs = super().cache_specs()
        if self.indexer is not None:
            specs["index_k"] = PagedSpec((self.indexer.head_dim,), kind="indexer")
        return specs

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q_nope, q_pe, latent, k_pe, q_resid = self.project(positions, hidden_states)
        cos_sin_cache = self.rotary_emb.cos_sin_cache
        context = get_forward_context()
        metadata = context.attn_metadata
        if metadata is None:  # a lockstep dummy step: nothing to attend to, nothing to cache
            return self.o_proj(q_nope.new_zeros(q_nope.shape[0], self.num_heads * self.v_head_dim))
        entries = torch.cat((latent, k_pe[:, 0]), dim=-1)
        index_q = index_k = index_w = None
        if self.indexer is not None:
            index_q, index_k, index_w = self.indexer.project(positions, hidden_states, q_resid, cos_sin_cache)
        scope = _StepScope(self, metadata, context.block_size, entries, index_k)
        if self.indexer is None:
            assert self.relay.slots is not None, "a layer that reuses top-k runs after a full indexer layer"
            slots = self.relay.slots
        else:
            slots = scope.select(self.indexer, index_q, index_w, positions, self.index_topk)
            self.relay.slots = slots
        weights = self.mla_weights()
        query = torch.cat((torch.einsum("thn,hnl->thl", q_nope, weights.w_uk), q_pe), dim=-1)
        out_latent, _ = mla_sparse_attention(query, scope.latent_store, slots, self.scale, self.kv_lora_rank,
                                             scope.kv_quant)
        out = torch.einsum("thl,hvl->thv", out_latent, weights.w_uv)
        return self.o_proj(out.reshape(-1, self.num_heads * self.v_head_dim))


class _StepScope:
    """Where one step's context lives for a DSA layer: the bound caches, after this step's entries are
    written at their slots (the full group's block table maps positions to slots; an FP8 latent cache
    quantized, `kv_quant`); or, in the profiling pass (no caches: every sequence a prefill from position 0),
    the step's own entries, position p of the sequence starting at token b being row b + p."""

    def __init__(self, layer: SparseMLAAttention, metadata, block_size: int, entries: torch.Tensor,
                 index_keys: torch.Tensor | None) -> None:
        self.metadata = metadata
        self.kv_quant = None
        if layer.caches is None:
            assert not any(metadata.num_computed_tokens_cpu), "without caches every sequence starts at 0"
            self.latent_store, self.key_store, self.block_table = entries, index_keys, None
            return
        self.kv_quant = layer.kv_quant
        group = metadata.groups.get(FULL_GROUP)
        self.block_table, slot_mapping, self.block_size = (
            (group.block_table, group.slot_mapping, group.block_size) if group is not None
            else (metadata.block_table, metadata.slot_mapping, block_size))
        self.latent_store = layer.caches["kv"]
        self.latent_store.view(-1, entries.shape[-1])[slot_mapping] = stored_entries(entries, self.latent_store,
                                                                                     self.kv_quant)
        if index_keys is not None:
            assert "index_k" in layer.caches, "the runner binds every cache of cache_specs()"
            cache = layer.caches["index_k"]
            self.key_store = cache.view(-1, cache.shape[-1])
            self.key_store[slot_mapping] = index_keys.to(cache.dtype)

    def context_slots(self, first_seq: int, num_seqs: int, context_len: int) -> torch.Tensor:
        """[num_seqs, context_len] slots of positions 0..context_len-1 of consecutive sequences."""
        device = self.latent_store.device
        positions = torch.arange(context_len, device=device)
        if self.block_table is None:
            starts = self.metadata.query_start_loc_cpu[first_seq:first_seq + num_seqs]
            return torch.tensor(starts, device=device)[:, None] + positions
        table = self.block_table[first_seq:first_seq + num_seqs]
        return entry_slots(table, positions.expand(num_seqs, -1), self.block_size)

    def select(self, indexer: LightningIndexer, queries: torch.Tensor, weights: torch.Tensor,
               positions: torch.Tensor, top_k: int) -> torch.Tensor:
        """Every token's selected slots [T, min(top_k, longest context)], -1 padded: the decodes together
        (contexts padded to the longest), then each prefill chunk over its own context."""
        metadata = self.metadata
        num_decodes, starts, lens = metadata.num_decodes, metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        width = min(top_k, max(lens))
        slots = torch.full((queries.shape[0], width), -1, dtype=torch.int64, device=queries.device)
        key_store = self.key_store.reshape(-1, self.key_store.shape[-1])
        if num_decodes:
            context = self.context_slots(0, num_decodes, max(lens[:num_decodes]))
            chosen = indexer.select(queries[:num_decodes], weights[:num_decodes], positions[:num_decodes],
                                    key_store, context, top_k)
            slots[:num_decodes, :chosen.shape[1]] = chosen
        for seq in range(num_decodes, metadata.num_seqs):
            begin, end = starts[seq], starts[seq + 1]
            chosen = indexer.select(queries[begin:end], weights[begin:end], positions[begin:end], key_store,
                                    self.context_slots(seq, 1, lens[seq]), top_k)
            slots[begin:end, :chosen.shape[1]] = chosen
        return slots
