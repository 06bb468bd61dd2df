"""Reference multi-head latent attention (engine/kernels/mla.py states the contract): prefill expands the
cached latents through kv_b_proj, one sequence at a time, as transformers does; decode is batched in the
absorbed form (q_nope @ W_UK into latent space, MQA over the latent entries, then @ W_UV), which rounds
differently from the expanded form (equal in exact arithmetic). An FP8 cache (`kv_quant`, per-tensor) is
written through `stored_entries` and every cached entry read through `read_entries` (engine/kernels/mla.py):
the rest of the computation is the one a cache of dequantized entries goes through."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.attention import KVCacheQuant
from engine.kernels.mla import MLAWeights, read_entries, stored_entries
from engine.kernels.torch.attention import gather_blocks


def write_latent_cache(kv_cache: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor,
                       kv_quant: KVCacheQuant | None = None) -> None:
    kv_cache.view(-1, kv_cache.shape[-1])[slots] = stored_entries(torch.cat((latent, k_pe), dim=-1), kv_cache,
                                                                  kv_quant)


def mla_attention(q_nope, q_pe, latent, k_pe, kv_cache, metadata, weights: MLAWeights, scale: float,
                  block_size: int, kv_quant: KVCacheQuant | None = None) -> torch.Tensor:
    if kv_cache is not None:
        write_latent_cache(kv_cache, latent, k_pe, metadata.slot_mapping, kv_quant)
    num_tokens, num_heads, _ = q_nope.shape
    out = q_nope.new_empty(num_tokens, num_heads, weights.v_head_dim)
    num_decodes = metadata.num_decodes
    if num_decodes:
        out[:num_decodes] = decode_absorbed(q_nope[:num_decodes], q_pe[:num_decodes], kv_cache, metadata,
                                            weights, scale, block_size, kv_quant)
    starts, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    kv_lora_rank = latent.shape[-1]
    for seq in range(num_decodes, metadata.num_seqs):
        begin, end = starts[seq], starts[seq + 1]
        seq_len = lens[seq]
        if seq_len == end - begin:  # nothing cached before this chunk: the new entries are the context
            context_latent, context_pe = latent[begin:end], k_pe[begin:end]
        else:
            block_ids = metadata.block_table[seq, :-(-seq_len // block_size)]
            entries = read_entries(gather_blocks(kv_cache, block_ids).flatten(0, 1)[:seq_len], kv_quant,
                                   q_nope.dtype)
            context_latent, context_pe = entries.split([kv_lora_rank, entries.shape[-1] - kv_lora_rank], dim=-1)
        out[begin:end] = prefill_expanded(q_nope[begin:end], q_pe[begin:end], context_latent, context_pe,
                                          weights, scale)
    return out


def prefill_expanded(q_nope, q_pe, context_latent, context_pe, weights: MLAWeights, scale: float) -> torch.Tensor:
    """One sequence's queries [Q, H, *] against its whole context [S, *] (S >= Q, the queries being the last
    Q positions): per-head keys [k_nope | k_pe] and values from kv_b_proj, causal attention."""
    num_queries, num_heads, _ = q_nope.shape
    context_len = context_latent.shape[0]
    kv = weights.kv_b(context_latent).view(context_len, num_heads, -1)
    k_nope, values = kv.split([weights.qk_nope_head_dim, weights.v_head_dim], dim=-1)
    keys = torch.cat((k_nope, context_pe[:, None, :].expand(-1, num_heads, -1)), dim=-1)
    query = torch.cat((q_nope, q_pe), dim=-1)
    mask = None
    if context_len != num_queries:
        positions = torch.arange(context_len - num_queries, context_len, device=query.device)
        mask = torch.arange(context_len, device=query.device)[None, :] <= positions[:, None]
    return F.scaled_dot_product_attention(
        query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask,
        is_causal=mask is None, scale=scale).transpose(0, 1)


def decode_absorbed(q_nope, q_pe, kv_cache, metadata, weights: MLAWeights, scale: float,
                    block_size: int, kv_quant: KVCacheQuant | None = None) -> torch.Tensor:
    """One query token per sequence, batched (contexts padded to the longest and masked): every head's query
    moved into latent space attends to the shared entries as one KV head (MQA; keys are the whole entry,
    values its latent part), and the latent output goes back through W_UV."""
    num_seqs, num_heads, _ = q_nope.shape
    kv_lora_rank = weights.w_uk.shape[-1]
    q_latent = torch.einsum("bhn,hnl->bhl", q_nope, weights.w_uk)
    query = torch.cat((q_latent, q_pe), dim=-1)[:, None]  # [B, 1, H, L + R]: the heads as query rows
    seq_lens_cpu = metadata.seq_lens_cpu[:num_seqs]
    max_len = max(seq_lens_cpu)
    block_ids = metadata.block_table[:num_seqs, :-(-max_len // block_size)]
    entries = read_entries(gather_blocks(kv_cache, block_ids).flatten(1, 2)[:, :max_len], kv_quant,
                           q_nope.dtype)[:, None]
    mask = None
    if min(seq_lens_cpu) != max_len:
        positions = torch.arange(max_len, device=query.device)
        mask = (positions[None, :] < metadata.seq_lens[:num_seqs, None]).view(num_seqs, 1, 1, max_len)
    out_latent = F.scaled_dot_product_attention(query, entries, entries[..., :kv_lora_rank], attn_mask=mask,
                                                scale=scale)[:, 0]  # [B, H, L]
    return torch.einsum("bhl,hvl->bhv", out_latent, weights.w_uv)


def mla_sparse_attention(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, scale: float,
                         v_dim: int, kv_quant: KVCacheQuant | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row attends, as one KV head shared by its H heads, to the cache entries at its `slots`
    (keys: the whole entry; values: its first `v_dim` dims). Returns the output and the log-sum-exp of the
    scaled scores; a row with no valid slot gives zeros and -inf. Rows go in chunks so that the gathered
    entries stay within a fixed memory budget."""
    num_tokens, num_heads, dim = q.shape
    entries_all = kv_cache.reshape(-1, kv_cache.shape[-1])
    out = q.new_zeros(num_tokens, num_heads, v_dim)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32, device=q.device)
    top_k = slots.shape[1]
    chunk = max(1, (1 << 24) // max(1, top_k * dim))
    for begin in range(0, num_tokens, chunk):
        end = min(begin + chunk, num_tokens)
        rows = slots[begin:end].long()
        valid = rows >= 0
        entries = entries_all[rows.clamp(min=0)]  # [t, K, D]
        entries = (entries if kv_quant is None else read_entries(entries, kv_quant, q.dtype)).float()
        scores = torch.einsum("thd,tkd->thk", q[begin:end].float(), entries) * scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [t, H]
        probs = torch.exp(scores - row_lse[..., None].clamp(min=torch.finfo(torch.float32).min))
        probs = torch.nan_to_num(probs.masked_fill(~valid[:, None, :], 0.0))
        out[begin:end] = torch.einsum("thk,tkv->thv", probs, entries[..., :v_dim]).to(q.dtype)
        lse[begin:end] = row_lse
    return out, lse
