"""flash_attn_varlen_func: variable-length prefill attention (CK fmha / asm v3 in the real aiter).

q [Tq, H, Dq], k [Tk, Hk, Dq], v [Tk, Hk, Dv] fp16/bf16 (D <= 256), H % Hk == 0 (query head h uses
KV head h // (H/Hk)); cu_seqlens_q/k int32 [B+1]. softmax_scale defaults to Dq**-0.5; with
logits_soft_cap > 0 the scaled scores become cap * tanh(s / cap). Masks are aligned bottom-right:
query i of a sequence (lengths sq, sk) sees key j when i + sk - sq - left <= j <= i + sk - sq + right,
causal meaning right = 0, -1 meaning unbounded (and sizes >= max_seqlen_k count as -1). A fully
masked row yields zeros (lse -inf). Returns out [Tq, H, Dv] (written into `out` if given), plus
softmax_lse fp32 [H, Tq] (natural log) when return_lse, plus an empty tensor when return_attn_probs.
The double does not emulate dropout, bias, alibi, paged KV (block_table) or padded cu_seqlens.
"""
from typing import Optional

import torch

from .._double.recording import recorded

__all__ = ["flash_attn_varlen_func"]


def _unsupported(**options) -> None:
    used = [name for name, active in options.items() if active]
    if used:
        raise NotImplementedError(f"the aiter double does not emulate flash_attn_varlen_func({', '.join(used)})")


@recorded()
def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    min_seqlen_q=0,
    dropout_p=0.0,
    softmax_scale=None,
    logits_soft_cap=0.0,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    bias=None,
    alibi_slopes=None,
    deterministic=False,
    return_lse=False,
    return_attn_probs=False,
    how_v3_bf16_cvt=1,
    block_table=None,
    out=None,
    cu_seqlens_q_padded: Optional[torch.Tensor] = None,
    cu_seqlens_k_padded: Optional[torch.Tensor] = None,
):
    _unsupported(dropout_p=dropout_p > 0, bias=bias is not None, alibi_slopes=alibi_slopes is not None,
                 block_table=block_table is not None,
                 cu_seqlens_padded=cu_seqlens_q_padded is not None or cu_seqlens_k_padded is not None)
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError(f"FlashAttention only support fp16, bf16 and fp8 data type; got {q.dtype}, {k.dtype}, "
                           f"{v.dtype} (the double: fp16/bf16)")
    heads, kv_heads = q.shape[1], k.shape[1]
    if max(q.shape[-1], v.shape[-1]) > 256 or heads % kv_heads:
        raise RuntimeError(f"CK fmha: head size <= 256 and H % Hk == 0 required; q {tuple(q.shape)} k {tuple(k.shape)}")
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32:
        raise RuntimeError("cu_seqlens_q/cu_seqlens_k must be int32")
    scale = q.shape[-1] ** (-0.5) if softmax_scale is None else softmax_scale
    left, right = window_size[0], window_size[1]
    left = -1 if left >= max_seqlen_k else left
    right = -1 if right >= max_seqlen_k else right
    if causal:
        right = 0

    total_q = q.shape[0]
    result = torch.empty(total_q, heads, v.shape[-1], dtype=q.dtype) if out is None else out
    lse = torch.full((heads, total_q), float("-inf"), dtype=torch.float32)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    group = heads // kv_heads
    for b in range(len(starts_q) - 1):
        rows_q, rows_k = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
        sq, sk = starts_q[b + 1] - starts_q[b], starts_k[b + 1] - starts_k[b]
        queries = q[rows_q].float().transpose(0, 1)  # [H, sq, D]
        keys = k[rows_k].float().transpose(0, 1).repeat_interleave(group, dim=0)
        values = v[rows_k].float().transpose(0, 1).repeat_interleave(group, dim=0)
        scores = queries @ keys.transpose(1, 2) * scale
        if logits_soft_cap > 0:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        diagonal = torch.arange(sq).unsqueeze(1) + sk - sq
        j = torch.arange(sk).unsqueeze(0)
        allowed = torch.ones(sq, sk, dtype=torch.bool)
        if right >= 0:
            allowed &= j <= diagonal + right
        if left >= 0:
            allowed &= j >= diagonal - left
        scores = scores.masked_fill(~allowed, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [H, sq]
        probs = torch.exp(scores - row_lse.unsqueeze(-1)).nan_to_num(0.0)
        result[rows_q] = (probs @ values).transpose(0, 1).to(result.dtype)
        lse[:, rows_q] = row_lse
    returned = [result]
    if return_lse:
        returned.append(lse)
    if return_attn_probs:
        returned.append(torch.empty(0))
    return returned[0] if len(returned) == 1 else tuple(returned)
