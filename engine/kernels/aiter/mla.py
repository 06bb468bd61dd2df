"""Multi-head latent attention on AITER (amd-aiter 0.1.7), as ATOM's MLA backend maps it (contracts:
engine/kernels/mla.py): `concat_and_cache_mla` writes the latent entries into the spec's cache
[num_blocks, block_size, L + R] as it is; decodes run the assembly MQA kernel `aiter.mla.mla_decode_fwd`
over a page-size-1 view of that cache ([slots, 1, 1, L + R], kv_indices = each sequence's entry slots, as
ATOM runs it); prefill chunks expand their context latents through kv_b_proj and run
`flash_attn_varlen_func` (causal, bottom-right aligned), a cached prefix gathered from the cache first.

`mla_sparse_attention` runs the same decode kernel with one "batch" per query row whose pages are its
selected slots. amd-aiter 0.1.7's mla_decode_fwd returns no log-sum-exp (its non-persistent mode leaves
final_lse unwritten; the persistent mode's mla_reduce_v1 writes it only for KV-split tiles), so the LSE is
computed beside it in torch from the same selected entries.

What 0.1.7's kernels cannot run (checked at start-up in engine/kernels/aiter/__init__.declines, or per
call where the start-up facts do not carry the shape): bf16 only; the assembly is built for DeepSeek's
entry (L 512 + R 64) and for 16 or 128 query heads: fewer heads are padded with zero queries to the next
of those; other shapes run the fallback backend's op (Triton where it runs, else the torch reference).
FP8 latent caches run there too (declined at start-up; a call with `kv_quant` falls back as well): 0.1.7's
mla_decode_fwd reads an FP8 cache beside bf16 queries only in its persistent mode (the a16w8 `_ps` kernel,
16 heads, with get_mla_metadata_v1's work lists), and otherwise only with FP8 queries and a query scale;
the non-persistent bf16 mode used here has no FP8-cache kernel (asm_mla.cu leaves it unset).
"""
from __future__ import annotations

import functools
import importlib
import logging

import torch

from engine.kernels.aiter.ops import kernel
from engine.kernels.attention import KVCacheQuant
from engine.kernels.mla import MLAWeights
from engine.kv_cache_spec import entry_slots

logger = logging.getLogger(__name__)

LATENT_DIM, ROPE_DIM = 512, 64  # the assembly kernels' entry (DeepSeek-V2/V3, Kimi-K2, V3.2)
HEAD_COUNTS = (16, 128)         # mla_decode_fwd's non-persistent kernels (get_meta_param asserts it)
DTYPES = (torch.bfloat16,)      # bf16 queries and KV (the fp8 kernels need FP8 queries with scales)
FP8_CACHE_REASON = ("amd-aiter 0.1.7's mla_decode_fwd reads FP8 latent caches only in its persistent mode or "
                    "with FP8 queries")


def kernel_heads(num_heads: int) -> int | None:
    """The head count the decode kernel runs `num_heads` query heads as (zero queries pad the rest), or
    None when no kernel takes that many."""
    return next((count for count in HEAD_COUNTS if num_heads <= count), None)


def unsupported(num_heads: int, entry_dim: int, v_dim: int, dtype: torch.dtype) -> str | None:
    """Why mla_decode_fwd cannot run this shape, or None."""
    if dtype not in DTYPES:
        return f"mla_decode_fwd's assembly kernels take bf16 queries and KV, not {dtype}"
    if (entry_dim, v_dim) != (LATENT_DIM + ROPE_DIM, LATENT_DIM):
        return (f"mla_decode_fwd's assembly kernels are built for {LATENT_DIM}+{ROPE_DIM}-dim entries with "
                f"{LATENT_DIM}-dim values, not {entry_dim} and {v_dim}")
    if kernel_heads(num_heads) is None:
        return f"mla_decode_fwd runs at most {HEAD_COUNTS[-1]} query heads, not {num_heads}"
    return None


@functools.lru_cache(maxsize=None)
def fallback(op: str, device_type: str, reason: str):
    """The fallback backend's `op` (as registry.resolve picks it) for a shape AITER cannot run, logged once
    per reason."""
    from engine.kernels import registry
    name = registry.fallback_backend_name("aiter", torch.device(device_type))
    logger.warning("aiter %s: %s; this shape runs on the %s backend", op, reason, name)
    return importlib.import_module(registry.BACKEND_MODULES[name]).BACKEND.ops[op]


@functools.lru_cache(maxsize=8)
def _unit_scale(device: torch.device) -> torch.Tensor:
    return torch.ones(1, dtype=torch.float32, device=device)


def decode_latent(query: torch.Tensor, kv_cache: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                  scale: float, v_dim: int) -> torch.Tensor:
    """mla_decode_fwd over a page-size-1 view of `kv_cache` ([..., D] entries): query row b ([B, H, D])
    attends to the entries kv_indices[kv_indptr[b]:kv_indptr[b+1]]; returns [B, H, v_dim] (rows with no
    entry are undefined). Heads are padded to the kernel's count and the padding dropped."""
    from aiter.mla import mla_decode_fwd
    num_rows, num_heads, dim = query.shape
    heads = kernel_heads(num_heads)
    if heads != num_heads:
        query = torch.cat((query, query.new_zeros(num_rows, heads - num_heads, dim)), dim=1)
    out = query.new_empty(num_rows, heads, v_dim)
    device = query.device
    qo_indptr = torch.arange(num_rows + 1, dtype=torch.int32, device=device)
    last_page_lens = torch.ones(num_rows, dtype=torch.int32, device=device)
    mla_decode_fwd(query.contiguous(), kv_cache.view(-1, 1, 1, dim), out, qo_indptr, kv_indptr, kv_indices,
                   last_page_lens, 1, sm_scale=scale)
    return out[:, :num_heads]


def sequence_slots(block_table: torch.Tensor, seq_lens: torch.Tensor, max_len: int,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [rows, max_len] int64, valid [rows, max_len]): the cache slot of each sequence's entry at
    each position (-1 past its length)."""
    positions = torch.arange(max_len, device=block_table.device)[None, :].expand(block_table.shape[0], -1)
    valid = positions < seq_lens[:, None]
    return entry_slots(block_table, torch.where(valid, positions, -1), block_size), valid


def ragged(counts: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_indptr [rows + 1], kv_indices) int32 of rows' valid slots (row-major order)."""
    kv_indptr = torch.zeros(counts.shape[0] + 1, dtype=torch.int32, device=slots.device)
    kv_indptr[1:] = counts.cumsum(0)
    return kv_indptr, slots[valid].to(torch.int32)


@kernel("aiter.concat_and_cache_mla + aiter.mla.mla_decode_fwd (decode, page 1) + "
        "aiter.flash_attn_varlen_func (prefill, expanded)")
def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                  kv_cache: torch.Tensor | None, metadata, weights: MLAWeights, scale: float,
                  block_size: int, kv_quant: KVCacheQuant | None = None) -> torch.Tensor:
    import aiter
    num_tokens, num_heads, _ = q_nope.shape
    entry_dim = latent.shape[-1] + k_pe.shape[-1]
    reason = FP8_CACHE_REASON if kv_quant is not None else unsupported(num_heads, entry_dim, latent.shape[-1],
                                                                         q_nope.dtype)
    if reason is not None:
        return fallback("mla_attention", q_nope.device.type, reason)(q_nope, q_pe, latent, k_pe, kv_cache, metadata,
                                                                      weights, scale, block_size, kv_quant=kv_quant)
    if kv_cache is not None:
        aiter.concat_and_cache_mla(latent, k_pe, kv_cache, metadata.slot_mapping, "auto", _unit_scale(latent.device))
    out = q_nope.new_empty(num_tokens, num_heads, weights.v_head_dim)
    num_decodes = metadata.num_decodes
    if num_decodes:
        q_latent = torch.einsum("bhn,hnl->bhl", q_nope[:num_decodes], weights.w_uk)
        query = torch.cat((q_latent, q_pe[:num_decodes]), dim=-1)
        seq_lens = metadata.seq_lens[:num_decodes]
        slots, valid = sequence_slots(metadata.block_table[:num_decodes], seq_lens,
                                      max(metadata.seq_lens_cpu[:num_decodes]), block_size)
        kv_indptr, kv_indices = ragged(seq_lens, slots, valid)
        out_latent = decode_latent(query, kv_cache, kv_indptr, kv_indices, scale, latent.shape[-1])
        out[:num_decodes] = torch.einsum("bhl,hvl->bhv", out_latent, weights.w_uv)
    if metadata.num_seqs > num_decodes:
        _prefill(q_nope, q_pe, latent, k_pe, kv_cache, metadata, weights, scale, block_size, out)
    return out


def _prefill(q_nope, q_pe, latent, k_pe, kv_cache, metadata, weights: MLAWeights, scale, block_size, out) -> None:
    """The prefill sequences (after the decodes) in one flash_attn_varlen_func call: each one's context
    latents (this step's own, or its whole context from the cache when part of it was cached before)
    expanded through kv_b_proj into per-head keys [k_nope | k_pe] and values."""
    import aiter
    first, starts, lens = metadata.num_decodes, metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    begin, end = starts[first], starts[metadata.num_seqs]
    latents, rope_keys, context_lens = [], [], []
    for seq in range(first, metadata.num_seqs):
        seq_begin, seq_end, seq_len = starts[seq], starts[seq + 1], lens[seq]
        if kv_cache is None or seq_len == seq_end - seq_begin:  # no cached prefix: this step's entries
            latents.append(latent[seq_begin:seq_end])
            rope_keys.append(k_pe[seq_begin:seq_end])
        else:
            block_ids = metadata.block_table[seq, :-(-seq_len // block_size)].long()
            entries = kv_cache[block_ids].flatten(0, 1)[:seq_len].to(q_nope.dtype)
            latents.append(entries[:, :latent.shape[-1]])
            rope_keys.append(entries[:, latent.shape[-1]:])
        context_lens.append(seq_len)
    context_latent, context_pe = torch.cat(latents), torch.cat(rope_keys)
    num_heads = q_nope.shape[1]
    kv = weights.kv_b(context_latent).view(context_latent.shape[0], num_heads, -1)
    k_nope, values = kv.split([weights.qk_nope_head_dim, weights.v_head_dim], dim=-1)
    keys = torch.cat((k_nope, context_pe[:, None, :].expand(-1, num_heads, -1)), dim=-1)
    query = torch.cat((q_nope[begin:end], q_pe[begin:end]), dim=-1)
    device = query.device
    query_lens = [starts[s + 1] - starts[s] for s in range(first, metadata.num_seqs)]
    cu_q = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(context_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    result = aiter.flash_attn_varlen_func(query, keys, values.contiguous(), cu_q, cu_k, max(query_lens),
                                          max(context_lens), softmax_scale=scale, causal=True)
    out[begin:end] = result[0] if isinstance(result, tuple) else result


@kernel("aiter.mla.mla_decode_fwd (page 1, each query's selected entries) + torch log-sum-exp")
def mla_sparse_attention(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, scale: float,
                         v_dim: int, kv_quant: KVCacheQuant | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads, dim = q.shape
    reason = FP8_CACHE_REASON if kv_quant is not None else unsupported(num_heads, dim, v_dim, q.dtype)
    if reason is None and kv_cache.dtype != q.dtype:
        reason = f"the cache is {kv_cache.dtype}, the queries {q.dtype}"
    if reason is not None:
        return fallback("mla_sparse_attention", q.device.type, reason)(q, kv_cache, slots, scale, v_dim,
                                                                        kv_quant=kv_quant)
    valid = slots >= 0
    counts = valid.sum(dim=1)
    lse = selected_lse(q, kv_cache, slots, valid, scale)
    if not bool(valid.any()):
        return q.new_zeros(num_tokens, num_heads, v_dim), lse
    kv_indptr, kv_indices = ragged(counts, slots.long(), valid)
    out = decode_latent(q, kv_cache, kv_indptr, kv_indices, scale, v_dim)
    return torch.where((counts > 0)[:, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device)), lse


def selected_lse(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """[T, H] float32: log-sum-exp of each query row's scaled scores over its selected entries (-inf for a
    row with none), in chunks of rows that keep the gathered entries within a fixed budget."""
    num_tokens, num_heads, dim = q.shape
    entries_all = kv_cache.view(-1, dim)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32, device=q.device)
    chunk = max(1, (1 << 24) // max(1, slots.shape[1] * dim))
    for begin in range(0, num_tokens, chunk):
        end = min(begin + chunk, num_tokens)
        entries = entries_all[slots[begin:end].long().clamp(min=0)].float()  # [t, K, D]
        scores = torch.einsum("thd,tkd->thk", q[begin:end].float(), entries) * scale
        lse[begin:end] = torch.logsumexp(scores.masked_fill(~valid[begin:end, None, :], float("-inf")), dim=-1)
    return lse
