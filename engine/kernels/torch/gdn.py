"""Gated DeltaNet (Qwen3-Next, Qwen3.5) reference ops over a ragged batch whose sequences each keep their
running state in a state-pool slot (zeroed by the runner when a request is admitted, so a first chunk starts
from zero and a later chunk of a chunked prefill continues where the previous one stopped).

- `causal_conv1d`: the depthwise causal convolution over each sequence's tokens, its left context the
  sequence's last kernel - 1 inputs (the conv state, updated in place), then SiLU.
- `gated_delta_rule`: per token t and value head, with the key and query l2-normalised and the query scaled
  by dk^-1/2 (all in float32): S <- exp(g_t) S; S <- S + k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t.
  S [dk, dv] is the head's recurrent state (float32, in place).

Sequences come as the attention metadata lays them out (`query_start_loc_cpu`, `state_slots` and their host
copy `state_slots_cpu`); decodes
(one token each) run batched, longer ones one sequence at a time, token by token: the reference is the
recurrence itself (exact in float32), which the chunked GPU kernels are checked against."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None, metadata) -> torch.Tensor:
    """x [T, C] (the step's inputs, sequences back to back), weight [C, K], conv_state [slots, C, K - 1] or
    None (a pass without caches: every sequence starts from zeros). Returns silu(conv) [T, C] in x's dtype;
    each sequence's last K - 1 inputs become its conv state."""
    num_channels, width = weight.shape
    out = torch.empty_like(x)
    starts = metadata.query_start_loc_cpu
    slots = metadata.state_slots_cpu if conv_state is not None else None
    for seq in range(metadata.num_seqs):
        begin, end = starts[seq], starts[seq + 1]
        if end == begin:
            continue
        tokens = x[begin:end].to(weight.dtype).t()  # [C, L]
        if slots is None:
            history = tokens.new_zeros(num_channels, width - 1)
        else:
            history = conv_state[slots[seq]].to(weight.dtype)
        window = torch.cat([history, tokens], dim=1)  # [C, K - 1 + L]
        if slots is not None:
            conv_state[slots[seq]] = window[:, -(width - 1):].to(conv_state.dtype)
        conv = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1), groups=num_channels)[0]  # [C, L]
        out[begin:end] = F.silu(conv).t().to(x.dtype)
    return out


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor | None, metadata) -> torch.Tensor:
    """q, k [T, Hv, dk] (key heads already repeated to the value heads), v [T, Hv, dv], g and beta [T, Hv]
    (g = log of the decay), state [slots, Hv, dk, dv] float32 or None (no caches: zero states, not kept).
    Returns o [T, Hv, dv] in v's dtype."""
    out_dtype = v.dtype
    q = _l2norm(q.float()) * q.shape[-1] ** -0.5
    k, v = _l2norm(k.float()), v.float()
    decay, beta = g.float().exp(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    starts = metadata.query_start_loc_cpu
    num_heads, dk, dv = k.shape[1], k.shape[2], v.shape[2]
    slots = metadata.state_slots_cpu if state is not None else None
    num_decodes = metadata.num_decodes
    if num_decodes and slots is not None:  # one token each: all at once
        index = metadata.state_slots[:num_decodes]
        current = state.index_select(0, index)
        out[:num_decodes] = _recurrent_step(current, q[:num_decodes], k[:num_decodes], v[:num_decodes],
                                            decay[:num_decodes], beta[:num_decodes])
        state.index_copy_(0, index, current)
    for seq in range(num_decodes if slots is not None else 0, metadata.num_seqs):
        begin, end = starts[seq], starts[seq + 1]
        current = (state[slots[seq]].clone() if slots is not None
                   else torch.zeros(num_heads, dk, dv, dtype=torch.float32, device=v.device))[None]
        for t in range(begin, end):
            out[t] = _recurrent_step(current, q[t:t + 1], k[t:t + 1], v[t:t + 1], decay[t:t + 1],
                                     beta[t:t + 1])[0]
        if slots is not None:
            state[slots[seq]] = current[0]
    return out.to(out_dtype)


def _recurrent_step(state, q, k, v, decay, beta):
    """One token of B sequences, in place on state [B, H, dk, dv]; q, k [B, H, dk], v [B, H, dv], decay and
    beta [B, H]. Returns o [B, H, dv]."""
    state.mul_(decay[..., None, None])
    remembered = (state * k[..., None]).sum(dim=-2)  # S^T k: [B, H, dv]
    delta = (v - remembered) * beta[..., None]
    state.add_(k[..., None] * delta[..., None, :])
    return (state * q[..., None]).sum(dim=-2)


def conv_state_after(history: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The conv state [C, K - 1] after inputs x [L, C] from `history` (a speculative step's kept tokens)."""
    window = torch.cat([history, x.t().to(history.dtype)], dim=1)
    return window[:, -history.shape[1]:]


def state_after(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor) -> torch.Tensor:
    """The recurrent state [Hv, dk, dv] after the tokens (rows of q, k, v, g, beta as `gated_delta_rule` takes
    them) from `state`, which is not changed: the same float32 recurrence."""
    q = _l2norm(q.float()) * q.shape[-1] ** -0.5
    k, v = _l2norm(k.float()), v.float()
    decay, beta = g.float().exp(), beta.float()
    current = state.clone()[None]
    for t in range(q.shape[0]):
        _recurrent_step(current, q[t:t + 1], k[t:t + 1], v[t:t + 1], decay[t:t + 1], beta[t:t + 1])
    return current[0]
