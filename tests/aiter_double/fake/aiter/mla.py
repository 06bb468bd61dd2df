"""aiter.mla.mla_decode_fwd: absorbed MLA decode, MQA over latent entries (0.1.7's aiter/mla.py: the assembly
stage 1 `mla_decode_stage1_asm_fwd`, csrc/py_itfs_cu/asm_mla.cu, then a Triton merge of the KV splits).

q [total_s, H, D] (contiguous; the heads are the MQA group of the one KV head); kv_buffer [num_page,
page_size, 1, D], page_size a power of two; o [total_s, H, Lv] written in place: the values are the
first Lv dims of each entry. Batch b owns query rows qo_indptr[b]:qo_indptr[b+1] and pages
kv_indices[kv_indptr[b]:kv_indptr[b+1]], of which the last holds kv_last_page_lens[b] entries (all int32).
sm_scale defaults to D**-0.5. Row i of batch b attends to all of its batch's entries (one query row per
batch: max_seqlen_q 1, the decode the double emulates).

Limits of the real code, raised here too: logit_cap must be 0; the non-persistent path asserts H in
{16, 128} (get_meta_param); the kernel checks one KV head, q.shape[2] == kv_buffer.shape[3] and a
contiguous q, and has bf16 kernels for bf16 q and KV only (fp8 needs scales: not emulated). The assembly
is built for DeepSeek's entry (D 576 = 512 latent + 64 rope, Lv 512; the C++ does not check it, other
sizes would read the wrong bytes), so the double refuses other sizes.

Returns (logits, final_lse) like the real function in non-persistent bf16 mode: logits are the fp32
per-split outputs [total_s, num_kv_splits, H, Lv] (the double computes one split) and final_lse is the
real code's `torch.empty` that nothing writes (the double fills it with NaN): 0.1.7 returns no
log-sum-exp. A batch with no entry gets 0/0 = NaN from the split merge. The persistent mode
(work_meta_data and the reduce maps) is not emulated.
"""
import torch

from ._double.recording import recorded

__all__ = ["mla_decode_fwd"]

_ENTRY_DIM, _LATENT_DIM = 576, 512  # what the assembly kernels are built for
_HEAD_COUNTS = (16, 128)           # get_meta_param: assert nhead in {16: ..., 128: ...}


def _int32(name: str, tensor: torch.Tensor) -> list[int]:
    if tensor.dtype != torch.int32:
        raise RuntimeError(f"{name} must be int32 (the kernel reads 32-bit indices), got {tensor.dtype}")
    return tensor.tolist()


@recorded()
def mla_decode_fwd(
    q,
    kv_buffer,
    o,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_last_page_lens,
    max_seqlen_q,
    sm_scale=None,  # 1.0 / (qk_head_dim**0.5)
    logit_cap=0.0,
    num_kv_splits=None,  # for experts only!!!
    num_kv_splits_indptr=None,  # for experts only!!!
    work_meta_data=None,
    work_indptr=None,
    work_info_set=None,
    reduce_indptr=None,
    reduce_final_map=None,
    reduce_partial_map=None,
    q_scale=None,
    kv_scale=None,
):
    assert logit_cap <= 0, f"{logit_cap=} is not support yet"
    if work_meta_data is not None:
        raise NotImplementedError("the aiter double does not emulate mla_decode_fwd's persistent mode")
    num_page, page_size, nhead_kv, qk_head_dim = kv_buffer.shape
    total_s, nhead, v_head_dim = o.shape
    if sm_scale is None:
        sm_scale = 1.0 / (qk_head_dim ** 0.5)
    assert nhead in _HEAD_COUNTS, f"{nhead=} not supported"
    if not q.is_contiguous():
        raise RuntimeError("mla_decode_stage1_asm_fwd:only support Q.is_contiguous() for now")
    if nhead_kv != 1:
        raise RuntimeError("mla_decode_stage1_asm_fwd:only support num_kv_heads==1 for now")
    if q.shape[2] != qk_head_dim:
        raise RuntimeError("mla_decode_stage1_asm_fwd:only support head_size == KV.size(3) for now")
    if q.dtype != torch.bfloat16 or kv_buffer.dtype != torch.bfloat16:
        raise RuntimeError(f"mla_decode_stage1_asm_fwd: unsupport current Q_type: {q.dtype} with KV {kv_buffer.dtype} "
                           "(the double: bf16 q and KV)")
    if (qk_head_dim, v_head_dim) != (_ENTRY_DIM, _LATENT_DIM):
        raise RuntimeError(f"the assembly MLA kernels are built for D {_ENTRY_DIM}, Lv {_LATENT_DIM}; got "
                           f"D {qk_head_dim}, Lv {v_head_dim}")
    if page_size & (page_size - 1):
        raise RuntimeError(f"page_size {page_size} is not a power of two (the kernel takes log2(page_size))")
    if max_seqlen_q != 1:
        raise NotImplementedError("the aiter double emulates mla_decode_fwd for max_seqlen_q == 1 only")
    starts_q, starts_kv = _int32("qo_indptr", qo_indptr), _int32("kv_indptr", kv_indptr)
    pages, last_lens = _int32("kv_indices", kv_indices), _int32("kv_last_page_lens", kv_last_page_lens)
    entries_all = kv_buffer[:, :, 0]  # [num_page, page_size, D]
    logits = torch.empty(total_s, 1, nhead, v_head_dim, dtype=torch.float32)
    for b in range(len(starts_q) - 1):
        rows = slice(starts_q[b], starts_q[b + 1])
        if starts_q[b + 1] - starts_q[b] > max_seqlen_q:
            raise RuntimeError(f"batch {b} has more than max_seqlen_q={max_seqlen_q} query rows")
        own = pages[starts_kv[b]:starts_kv[b + 1]]
        length = max(0, (len(own) - 1) * page_size + last_lens[b]) if own else 0
        entries = entries_all[torch.tensor(own, dtype=torch.long)].reshape(-1, qk_head_dim)[:length].float()
        queries = q[rows].float()  # [rows, H, D]
        if length == 0:
            logits[rows, 0] = float("nan")
            continue
        scores = torch.einsum("rhd,sd->rhs", queries, entries) * sm_scale
        probs = torch.softmax(scores, dim=-1)
        logits[rows, 0] = torch.einsum("rhs,sv->rhv", probs, entries[:, :v_head_dim])
    o.copy_(logits[:, 0].to(o.dtype))
    final_lse = torch.full((total_s, nhead), float("nan"), dtype=torch.float32)
    return logits, final_lse
