"""Gated DeltaNet ops on GPUs through flash-linear-attention's maintained Triton kernels (PyPI `fla-core`, the
optional `gdn` extra), adapted to the contracts of engine/kernels/torch/gdn.py: a ragged step, decodes first,
each sequence's states in a state-pool slot.

- Decodes (one token each) run FLA's recurrent decode kernel on the pool itself, in place, by slot: its KDA
  kernel (per-channel decay) with the head's scalar decay broadcast over the key channels, which is exactly the
  gated delta rule; FLA's own GDN recurrent kernel takes only contiguous states, so it would cost a gather and
  a scatter of every decode's state ([value heads, dk, dv] float32) each layer. The convolution's decode
  kernel reads and writes a contiguous cache, so its (small) states are gathered and scattered.
- Longer sequences run FLA's chunked kernels as one varlen batch (cu_seqlens), their states gathered from the
  pool as initial states and the final states scattered back; no host sync (the split comes from the host
  copies of the metadata).

FLA's convolution cache holds the last `width` inputs, ours the last `width - 1` (the oldest of FLA's is only
ever shifted out): the adapters add and drop that column. fla is imported lazily: `unavailable_reason` says why
it cannot serve (no GPU, not installed), and `select_ops` picks these adapters or the torch references."""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F

from engine.kernels.torch import gdn as torch_gdn

logger = logging.getLogger(__name__)

CHUNK = 64  # FLA's chunk length for chunk_gated_delta_rule and causal_conv1d (their default)


@functools.cache
def _fla() -> SimpleNamespace:
    """The FLA entry points the adapters call (imported on first use; an ImportError is not cached)."""
    import fla
    from fla.modules.causal_conv1d import causal_conv1d, causal_conv1d_update
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    from fla.ops.utils.index import prepare_chunk_indices
    return SimpleNamespace(version=fla.__version__, causal_conv1d=causal_conv1d,
                           causal_conv1d_update=causal_conv1d_update, chunk_gated_delta_rule=chunk_gated_delta_rule,
                           fused_recurrent_kda_fwd=fused_recurrent_kda_fwd, prepare_chunk_indices=prepare_chunk_indices)


def unavailable_reason() -> str | None:
    """None when FLA's kernels can serve the Gated DeltaNet ops in this process, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA or ROCm GPU is visible to torch"
    try:
        _fla()
    except Exception as exc:  # an optional dependency that fails to import in any way leaves the references
        return (f"flash-linear-attention is not importable ({type(exc).__name__}: {exc}); "
                "`pip install 'atom-ray[gdn]'` installs it")
    return None


def select_ops() -> dict[str, Callable]:
    """The `causal_conv1d` and `gated_delta_rule` the Triton backend runs: FLA's kernels where they can run, else
    the torch references; one log line says which and why."""
    reason = unavailable_reason()
    if reason is None:
        logger.info("Gated DeltaNet ops: flash-linear-attention %s Triton kernels", _fla().version)
        return {"causal_conv1d": causal_conv1d, "gated_delta_rule": gated_delta_rule}
    logger.info("Gated DeltaNet ops: the torch references (a loop over sequences and tokens), because %s", reason)
    return {"causal_conv1d": torch_gdn.causal_conv1d, "gated_delta_rule": torch_gdn.gated_delta_rule}


@dataclass
class _Split:
    """A step's sequences as the FLA kernels take them: `num_decodes` leading one-token sequences run by slot,
    the rest (tokens [num_decodes, num_tokens)) as one varlen batch."""
    num_decodes: int
    decode_slots: torch.Tensor | None  # [num_decodes] int64
    num_tokens: int
    varlen_slots: torch.Tensor | None  # [n] int64, None without states
    cu_seqlens: torch.Tensor | None  # [n + 1] int32 from 0; None without varlen sequences
    cu_seqlens_cpu: torch.Tensor | None
    chunk_indices: torch.Tensor | None


_last_split: tuple[tuple, _Split] | None = None


def _split(metadata, stateful: bool) -> _Split:
    """Built once per step: every Gated DeltaNet layer of the step reads the same metadata object, and FLA's own
    caches of what it derives from cu_seqlens hit only for the same tensor objects."""
    global _last_split
    key = (metadata, metadata.query_start_loc, metadata.state_slots, stateful)
    if _last_split is not None and all(a is b for a, b in zip(_last_split[0], key)):
        return _last_split[1]
    starts = metadata.query_start_loc
    host = metadata.query_start_loc_cpu
    # Without states every sequence starts from zero, a decode as a one-token varlen sequence.
    num_decodes = metadata.num_decodes if stateful else 0
    slots = metadata.state_slots
    assert not stateful or slots is not None, "Gated DeltaNet states without the step's state slots"
    cu_seqlens = cu_seqlens_cpu = chunk_indices = None
    if metadata.num_seqs > num_decodes:
        first = host[num_decodes]
        cu_seqlens_cpu = torch.tensor(host[num_decodes:metadata.num_seqs + 1], dtype=torch.int32) - first
        cu_seqlens = starts[num_decodes:metadata.num_seqs + 1] - first
        # (sequence, chunk) pairs, made on the host and copied without waiting (FLA's own copy would block).
        chunk_indices = _to_device(_fla().prepare_chunk_indices(cu_seqlens_cpu, CHUNK), starts.device)
    split = _Split(num_decodes, slots[:num_decodes] if num_decodes else None, host[metadata.num_seqs],
                   slots[num_decodes:metadata.num_seqs] if stateful else None, cu_seqlens, cu_seqlens_cpu,
                   chunk_indices)
    _last_split = (key, split)
    return split


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None, metadata) -> torch.Tensor:
    """The `causal_conv1d` contract (engine/kernels/torch/gdn.py) on FLA's causal_conv1d_update (decodes) and
    varlen causal_conv1d (the rest), SiLU fused."""
    fla = _fla()
    split = _split(metadata, conv_state is not None)
    out = torch.empty_like(x)
    decodes = split.num_decodes
    if decodes:
        cache = F.pad(conv_state.index_select(0, split.decode_slots), (1, 0))  # [d, C, width], column 0 unread
        y, _ = fla.causal_conv1d_update(x[:decodes], cache, weight=weight, activation="silu")
        out[:decodes] = y
        conv_state.index_copy_(0, split.decode_slots, cache[..., 1:].to(conv_state.dtype))
    if split.cu_seqlens is not None:
        rows = slice(decodes, split.num_tokens)
        initial = (F.pad(conv_state.index_select(0, split.varlen_slots), (1, 0)) if conv_state is not None
                   else None)
        y, final = fla.causal_conv1d(x[rows][None], weight, initial_state=initial,
                                     output_final_state=conv_state is not None, activation="silu",
                                     cu_seqlens=split.cu_seqlens, cu_seqlens_cpu=split.cu_seqlens_cpu,
                                     chunk_indices=split.chunk_indices)
        out[rows] = y[0]
        if conv_state is not None:
            conv_state.index_copy_(0, split.varlen_slots, final[..., 1:].to(conv_state.dtype))
    return out


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor | None, metadata) -> torch.Tensor:
    """The `gated_delta_rule` contract (engine/kernels/torch/gdn.py) on FLA's recurrent decode kernel (in place
    on the pool) and chunk_gated_delta_rule (the rest), the l2 norms of q and k in the kernels."""
    fla = _fla()
    split = _split(metadata, state is not None)
    num_heads, dk, dv = k.shape[1], k.shape[2], v.shape[2]
    scale = dk ** -0.5
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    decodes = split.num_decodes
    if decodes:
        # The kernel addresses a slot's state as [heads, dk, dv] contiguous at slot * stride(0).
        assert state.dtype == torch.float32 and state[0].is_contiguous(), (state.dtype, state.stride())
        step_q, step_k, step_v, step_beta = (t[:decodes, None].contiguous() for t in (q, k, v, beta))  # T = 1
        decay = g[:decodes, None, :, None].float().expand(decodes, 1, num_heads, dk).contiguous()
        fla.fused_recurrent_kda_fwd(q=step_q, k=step_k, v=step_v, g=decay, beta=step_beta, initial_state=state,
                                    scale=scale, inplace_final_state=True, ssm_state_indices=split.decode_slots,
                                    use_qk_l2norm_in_kernel=True, out=out[:decodes, None])
    if split.cu_seqlens is not None:
        rows = slice(decodes, split.num_tokens)
        initial = state.index_select(0, split.varlen_slots) if state is not None else None
        o, final = fla.chunk_gated_delta_rule(
            q[rows][None], k[rows][None], v[rows][None], g[rows][None].float(), beta[rows][None], scale=scale,
            initial_state=initial, output_final_state=state is not None, use_qk_l2norm_in_kernel=True,
            cu_seqlens=split.cu_seqlens, cu_seqlens_cpu=split.cu_seqlens_cpu, chunk_indices=split.chunk_indices)
        out[rows] = o[0]
        if state is not None:
            state.index_copy_(0, split.varlen_slots, final)
    return out


causal_conv1d.kernel = "fla causal_conv1d_update / causal_conv1d (varlen)"
gated_delta_rule.kernel = "fla fused_recurrent_kda_fwd (in place) / chunk_gated_delta_rule (varlen)"
