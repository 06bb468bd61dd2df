"""pa_fwd_asm: paged decode attention of the asm kernels (csrc/py_itfs_cu/asm_pa.cu).

Q [T, H, D] bf16/fp16; K [nblk, Hk, D/x, bs, x]; V [nblk, Hk, bs/x, D, x] with x = 16 / K.element_size;
block_tables int32 [B, >= max_blocks] read as row b at b * block_tables_stride0; context_lens int32 [B].
The softmax scale is fixed at 1/sqrt(D) (there is no parameter). Quantised KV (fp8 of the arch, or
int8; a uint8 cache is taken for int8, not fp8 bytes) needs K_QScale/V_QScale fp32 [nblk, Hk, bs]:
value = stored * scale[block, head, slot].
Without qo_indptr (or with max_qlen == 1) row b of Q is sequence b's single query and rows past B are
not written. With qo_indptr [B+1] and max_qlen > 1, sequence b owns rows qo_indptr[b]..[b+1] with a
causal mask ending at its context length. Returns out_ if given, else a new [T, H, D] tensor of Q's
dtype (unwritten rows NaN here, garbage on the GPU).

Kernel selection follows hsa/<arch>/pa/pa_asm.csv: block size 16 (gfx942 also bs 1024 for bf16 Q,
fp8 KV, GQA 10), GQA 8 or 16 after rounding up to a multiple of 8, no multi-token kernels for
unquantised GQA 16. The kernels assume head size 128; 0.1.7 does not check it and would compute
garbage, the double raises instead.
"""
import math
from typing import Optional

import torch

from ..jit.utils.chip_info import get_gfx
from ..utility import dtypes
from .._double.layouts import key_cache_tokens, value_cache_tokens
from .._double.recording import recorded

__all__ = ["pa_fwd_asm"]


def _kernel_exists(q_type: str, kv_type: str, gqa: int, mtp: int, msk: int, hp: int, block_size: int) -> bool:
    """The rows of pa_asm.csv: (qType, kvType, Gqa, Mtp, Msk, Hp, blkSz)."""
    if block_size == 1024:
        return (get_gfx() == "gfx942" and (q_type, kv_type, gqa) == ("bf16", "fp8", 10)
                and (mtp, msk, hp) in ((0, 0, 0), (12, 1, 0), (13, 1, 0), (14, 1, 0)))
    if block_size != 16 or gqa not in (8, 16):
        return False
    if kv_type == q_type:  # unquantised
        return hp == 0 and ((mtp, msk) == (0, 0) or gqa == 8 and (mtp, msk) in ((1, 0), (1, 1)))
    if (mtp, msk) in ((0, 0), (1, 0), (1, 1)) and hp == 0:
        return True
    return kv_type == "fp8" and gqa == 8 and (mtp, msk) == (0, 0) and hp in (1, 2)


def _select_kernel(q_type, kv_type, gqa, mtp, msk, hp, block_size) -> None:
    """get_heuristic_kernel: try mtp then 1, GQA exact then rounded up to 8; hp 1 matches any hp."""
    for mtp_ in ((mtp, 1) if mtp > 0 else (0,)):
        for gqa_ in (gqa, (gqa + 7) // 8 * 8):
            for hp_ in ((0, 1, 2) if hp == 1 else (hp,)):
                if _kernel_exists(q_type, kv_type, gqa_, mtp_, msk, hp_, block_size):
                    return
    raise RuntimeError(
        f"get_heuristic_kernel: cannot get heuristic kernel! q_type:{q_type} kv_type:{kv_type} gqa:{gqa} "
        f"mtp:{mtp} msk:{msk} hp:{hp} block_size:{block_size}")


def _type_name(dtype: torch.dtype) -> str:
    names = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.uint8: "int8", torch.int8: "int8", dtypes.fp8: "fp8"}
    if dtype not in names:
        raise RuntimeError(f"pa_fwd: unsupport dtype: {dtype} (fp8 on {get_gfx()} is {dtypes.fp8})")
    return names[dtype]


@recorded()
def pa_fwd_asm(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables_stride0: int,
    max_qlen: int = 1,
    K_QScale: Optional[torch.Tensor] = None,
    V_QScale: Optional[torch.Tensor] = None,
    out_: Optional[torch.Tensor] = None,
    qo_indptr: Optional[torch.Tensor] = None,
    high_precision: Optional[int] = 1,  # [0, 1, 2] 2 is the highest precision, this is only for fp8 kvcache
    kernelName: Optional[str] = None,
) -> torch.Tensor:
    if Q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"pa_fwd: unsupport Q dtype: {Q.dtype}")
    q_type, kv_type = _type_name(Q.dtype), _type_name(K.dtype)
    tokens, heads, head_size = Q.shape
    nblk, kv_heads, d_outer, block_size, x = K.shape
    if x != 16 // K.element_size() or d_outer * x != head_size:
        raise RuntimeError(f"pa_fwd: K must be [nblk, Hk, D/x, bs, x] with x={16 // K.element_size()}, "
                           f"got {tuple(K.shape)}")
    value_shape = (nblk, kv_heads, block_size // x, head_size, x)
    if tuple(V.shape) != value_shape or V.dtype != K.dtype:
        raise RuntimeError(f"pa_fwd: V must be [nblk, Hk, bs/x, D, x] = {value_shape}, got {tuple(V.shape)} {V.dtype}")
    mtp, msk = (max_qlen + 10, 1) if qo_indptr is not None and max_qlen > 1 else (0, 0)
    hp = {1: 1, 2: 2}.get(high_precision, 0)
    _select_kernel(q_type, kv_type, heads // kv_heads, mtp, msk, hp, block_size)
    if head_size != 128:
        raise RuntimeError(f"pa_fwd_asm kernels are built for head size 128, got {head_size}")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise RuntimeError("pa_fwd: block_tables and context_lens must be int32")
    quantised = kv_type != q_type
    if quantised and (K_QScale is None or V_QScale is None):
        raise RuntimeError("pa_fwd: quantised KV needs K_QScale and V_QScale [nblk, Hk, bs] (the kernel reads them)")

    if quantised:
        for scale in (K_QScale, V_QScale):
            if tuple(scale.shape) != (nblk, kv_heads, block_size) or scale.dtype != torch.float32:
                raise RuntimeError(f"pa_fwd: K_QScale/V_QScale must be fp32 [nblk, Hk, bs], "
                                   f"got {tuple(scale.shape)} {scale.dtype}")
    if K.dtype == torch.uint8:  # the kernel table knows it as "int8": bytes are read as signed
        K, V = K.view(torch.int8), V.view(torch.int8)

    def context(blocks: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[H, length, D] float32 keys and values of one sequence (dequantised, GQA-expanded)."""
        keys = key_cache_tokens(K[blocks]).float()  # [blocks, Hk, bs, D]
        values = value_cache_tokens(V[blocks], asm_layout=True).float()
        if quantised:
            keys = keys * K_QScale[blocks].unsqueeze(-1)
            values = values * V_QScale[blocks].unsqueeze(-1)
        keys, values = (t.transpose(0, 1).reshape(kv_heads, -1, head_size)[:, :length] for t in (keys, values))
        return keys.repeat_interleave(heads // kv_heads, 0), values.repeat_interleave(heads // kv_heads, 0)

    output = out_ if out_ is not None else torch.full_like(Q, float("nan"))
    table = block_tables.reshape(-1)
    lens = context_lens.tolist()
    starts = qo_indptr.tolist() if mtp else list(range(len(lens) + 1))
    scale = 1.0 / math.sqrt(head_size)
    for b, length in enumerate(lens):
        rows = slice(starts[b], starts[b + 1])
        queries = Q[rows].float()  # [n, H, D]
        if length <= 0:
            output[rows] = 0
            continue
        first = b * block_tables_stride0
        k, v = context(table[first: first + -(-length // block_size)].long(), length)
        scores = torch.einsum("nhd,hkd->hnk", queries, k) * scale
        n = queries.shape[0]
        allowed = torch.arange(length).unsqueeze(0) <= (length - n + torch.arange(n)).unsqueeze(1)
        scores = scores.masked_fill(~allowed, float("-inf"))
        output[rows] = torch.einsum("hnk,hkd->nhd", scores.softmax(dim=-1), v).to(output.dtype)
    return output
