"""DeepSeek-V4's compressors: every `ratio` tokens of a sequence become one compressed cache entry, and the
CSA layers' lightning indexer picks each query's top-k entries (transformers' `DeepseekV4HCACompressor`,
`DeepseekV4CSACompressor`, `DeepseekV4Indexer`).

Entry w pools the tokens of window w = [w * ratio, (w + 1) * ratio) by a softmax over tokens, per feature, of
`gate_proj(x) + position_bias[token's place in the window]`, weighting `kv_proj(x)`; then `kv_norm`, then RoPE
("compress" type) at the window's *first* position w * ratio. The overlapping form (CSA and its indexer) projects
2 * head_dim features per token: the last head_dim (Cb) pool into the token's own window's entry, the first
head_dim (Ca) into the next window's, so entry w pools 2 * ratio tokens ([w - 1 | w]); entry 0 has no previous
window (weight 0). An entry is made at the step that brings its window's last token.

Running state (a per-request StateSpec, carried across chunked-prefill and decode steps): the raw projections
(kv and gate before the bias) of the sequence's last `ring` tokens (ratio, or 2 * ratio when overlapping),
token position p at row p % ring: all a later step needs to finish the current window (and to overlap it)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.kv_cache_spec import StateSpec
from engine.layers.deepseek_v4_rope import DeepseekV4RMSNorm, TrailingRope, rotate_trailing
from engine.layers.dsa import top_index_scores
from engine.layers.linear import ReplicatedLinear


@dataclass
class StepLayout:
    """Where each of a step's tokens sits: its position, its sequence (row of the step's metadata), and per
    sequence the first position of the step (= tokens already computed), the context length after the step,
    and its row in the state pool (None: the profiling pass, which keeps no state)."""
    positions: torch.Tensor   # [T] int64
    token_seq: torch.Tensor   # [T] int64
    seq_start: torch.Tensor   # [num_seqs] int64
    seq_end: torch.Tensor     # [num_seqs] int64
    state_slots: torch.Tensor | None

    @classmethod
    def from_metadata(cls, metadata, positions: torch.Tensor, stateful: bool) -> "StepLayout":
        starts = metadata.query_start_loc.long()
        query_lens = starts[1:] - starts[:-1]
        token_seq = torch.repeat_interleave(torch.arange(metadata.num_seqs, device=positions.device), query_lens,
                                            output_size=positions.shape[0])
        seq_end = metadata.seq_lens.long()
        slots = metadata.state_slots.long() if stateful and metadata.state_slots is not None else None
        if stateful and slots is None:
            raise RuntimeError("DeepSeek-V4 compressors keep per-request state, but the step has no state slots")
        return cls(positions.long(), token_seq, seq_end - query_lens, seq_end, slots)


class WindowPooling(nn.Module):
    """The pooling shared by the compressors and the indexer's key compressor (parameter names as in
    transformers' checkpoints: kv_proj, gate_proj, position_bias, kv_norm)."""
    state_kind = "compressor_state"

    def __init__(self, hf_config, ratio: int, head_dim: int, overlap: bool, rope: TrailingRope) -> None:
        super().__init__()
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, overlap
        features = 2 * head_dim if overlap else head_dim
        self.ring = 2 * ratio if overlap else ratio
        self.kv_proj = ReplicatedLinear(hf_config.hidden_size, features)
        self.gate_proj = ReplicatedLinear(hf_config.hidden_size, features)
        self.position_bias = nn.Parameter(torch.zeros(ratio, features, dtype=torch.float32), requires_grad=False)
        self.kv_norm = DeepseekV4RMSNorm(head_dim, hf_config.rms_norm_eps)
        self.rope = rope

    def state_spec(self) -> StateSpec:
        """The raw kv and gate projections of the last `ring` tokens: [ring, 2, features]."""
        return StateSpec((self.ring, 2, self.position_bias.shape[1]), kind=self.state_kind)

    def pool(self, x: torch.Tensor, layout: StepLayout, state: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries whose windows this step completes: (entries [N, head_dim], rotated; the index [N] of
        the step token that completes each, at position (w + 1) * ratio - 1 for entry w). Then records this
        step's projections in `state` ([num_slots, ring, 2, features]; None: nothing recorded, the step being
        the profiling pass where every sequence starts at position 0)."""
        projected = torch.stack((self.kv_proj(x), self.gate_proj(x)), dim=1)  # [T, 2, F]
        positions, ratio, ring = layout.positions, self.ratio, self.ring
        done = ((positions + 1) % ratio == 0).nonzero(as_tuple=True)[0]
        entries = x.new_zeros(0, self.head_dim)
        if done.numel():
            entries = self._pool_windows(projected, done, layout, state)
        if state is not None:
            self._record(projected, layout, state)
        return entries, done

    def _pool_windows(self, projected, done, layout: StepLayout, state) -> torch.Tensor:
        ratio, ring, head_dim = self.ratio, self.ring, self.head_dim
        last = layout.positions[done]                        # each window's last position
        first = last - ratio + 1                              # each window's first position: RoPE's
        needed = (first - (ring - ratio))[:, None] + torch.arange(ring, device=done.device)  # [N, ring]
        seq = layout.token_seq[done]
        in_step = needed >= layout.seq_start[seq][:, None]
        rows = projected[(done[:, None] - (last[:, None] - needed)).clamp(min=0)]  # [N, ring, 2, F]
        if state is not None:
            flat_state = state.view(-1, *state.shape[2:])
            kept = flat_state[layout.state_slots[seq][:, None] * ring + needed.remainder(ring)]
            rows = torch.where(in_step[..., None, None], rows, kept.to(rows.dtype))
        kv, gate = rows[:, :, 0], rows[:, :, 1].float() + self.position_bias.repeat(ring // ratio, 1)
        if self.overlap:  # previous window's first half (Ca), this window's second half (Cb)
            kv = torch.cat((kv[:, :ratio, :head_dim], kv[:, ratio:, head_dim:]), dim=1)
            gate = torch.cat((gate[:, :ratio, :head_dim], gate[:, ratio:, head_dim:]), dim=1)
        exists = (needed >= 0)[..., None]  # window 0 has no previous window
        kv = kv.masked_fill(~exists, 0.0)
        gate = gate.masked_fill(~exists, float("-inf"))
        pooled = (kv * gate.softmax(dim=1).to(kv.dtype)).sum(dim=1)
        cos, sin = self.rope.cos_sin(first, pooled.dtype)
        return rotate_trailing(self.kv_norm(pooled), cos, sin)

    def _record(self, projected, layout: StepLayout, state: torch.Tensor) -> None:
        """Keep the projections of each sequence's last `ring` positions (those a later window may need)."""
        keep = layout.positions >= layout.seq_end[layout.token_seq] - self.ring
        rows = layout.state_slots[layout.token_seq[keep]] * self.ring + layout.positions[keep].remainder(self.ring)
        state.view(-1, *state.shape[2:])[rows] = projected[keep].to(state.dtype)


class IndexerScorer(nn.Module):
    """Per-query head weights of the indexer score (transformers' `scorer.weights_proj`)."""

    def __init__(self, hf_config) -> None:
        super().__init__()
        self.weights_proj = ReplicatedLinear(hf_config.hidden_size, hf_config.index_n_heads)


class Indexer(WindowPooling):
    """Lightning indexer: its own overlapping compressor at index_head_dim makes one key per window; a query t
    scores entry s by sum_h w[t, h] * relu(q[t, h] . k[s]) * index_head_dim^-1/2 (w = weights_proj(x) *
    index_n_heads^-1/2; q from the attention's q_a output through q_b_proj, rotated at t's position), in
    float32, and keeps its `index_topk` best entries among those whose windows ended by t."""
    state_kind = "indexer_state"

    def __init__(self, hf_config, ratio: int, rope: TrailingRope) -> None:
        super().__init__(hf_config, ratio, hf_config.index_head_dim, overlap=True, rope=rope)
        self.num_heads, self.top_k = hf_config.index_n_heads, hf_config.index_topk
        self.q_b_proj = ReplicatedLinear(hf_config.q_lora_rank, self.num_heads * self.head_dim)
        self.scorer = IndexerScorer(hf_config)

    def select(self, x: torch.Tensor, q_residual: torch.Tensor, layout: StepLayout, keys: torch.Tensor,
               key_slots) -> torch.Tensor:
        """Each query's chosen entries [T, min(index_topk, most entries)] (entry indices, -1: none).
        `keys` viewed [-1, head_dim] holds the indexer keys; `key_slots(rows, entries)` maps entry indices
        [R, K] of step tokens `rows` to slots in it."""
        positions = layout.positions
        visible = (positions + 1) // self.ratio                       # entries whose windows have ended
        num_entries = int(visible.max().item()) if positions.numel() else 0
        num_tokens = positions.shape[0]
        if num_entries == 0:
            return torch.full((num_tokens, 0), -1, dtype=torch.long, device=positions.device)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        q = self.q_b_proj(q_residual).view(num_tokens, self.num_heads, self.head_dim)
        q = rotate_trailing(q, cos[:, None], sin[:, None]).float()
        head_weights = self.scorer.weights_proj(x).float() * self.num_heads ** -0.5  # [T, H]
        top_k = min(self.top_k, num_entries)
        chosen = torch.empty(num_tokens, top_k, dtype=torch.long, device=positions.device)
        entries = torch.arange(num_entries, device=positions.device)
        flat_keys = keys.reshape(-1, self.head_dim)
        chunk = max(1, (1 << 24) // (num_entries * self.head_dim))  # bounds the gathered keys' memory
        for begin in range(0, num_tokens, chunk):
            rows = torch.arange(begin, min(begin + chunk, num_tokens), device=positions.device)
            future = entries[None, :] >= visible[rows, None]
            slots = key_slots(rows, entries[None, :].masked_fill(future, -1))
            gathered = flat_keys[slots.clamp(min=0)].float()             # [R, E, head_dim]
            # Ties to the lower entry (a stable sort): the same choice on every TP rank.
            picked = top_index_scores(q[rows], head_weights[rows], gathered, ~future, top_k, self.head_dim ** -0.5)
            chosen[rows] = picked.masked_fill(picked >= visible[rows, None], -1)
        return chosen
