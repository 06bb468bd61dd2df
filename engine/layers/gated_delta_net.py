"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5: in-projections to q, k (key heads), v
and the output gate z (value heads), b and a (one per value head); a causal depthwise convolution (SiLU) over
[q | k | v]; the gated delta rule with beta = sigmoid(b) and g = -exp(A_log) softplus(a + dt_bias), key heads
repeated to the value heads; the gated output norm w * norm(o) * silu(z); the out-projection.

Its caches are two state-pool tensors per running request (`cache_specs`): the convolution's last kernel - 1
inputs and the recurrent state [value heads, dk, dv] in float32. The runner zeroes a request's slot when it is
admitted (again after a preemption), so a first prefill chunk starts from zero and a later one continues.

Heads split across TP ranks in whole key-head groups (a key head with its value heads); the convolution's
channels, A_log and dt_bias follow their heads, the out-projection is row-parallel.

Quantized checkpoints: the in-projections load dequantized to the model's dtype (FP8 per tensor, per channel
or in blocks, MXFP4: engine/layers/dequantized_weight.py); the out-projection is a quantized linear layer.

Checkpoint layouts: Qwen3-Next fuses `in_proj_qkvz` and `in_proj_ba` interleaved per key-head group ([q k v z]
and [b a] of each group); Qwen3.5 has them apart and contiguous (`in_proj_qkv` [q | k | v], `in_proj_z`,
`in_proj_b`, `in_proj_a`), loaded through the shard ids "qkv", "z", "b", "a". Both end up in this layer's
contiguous per-rank layout: in_proj_qkvz [q | k | v | z], in_proj_ba [b | a]."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.forward_context import get_forward_context
from engine.kernels import ops
from engine.kv_cache_spec import StateSpec
from engine.layers.attention import KVCacheLayer
from engine.layers.dequantized_weight import DequantizingWeight, is_quantized
from engine.layers.layernorm import RMSNormGated
from engine.layers.linear import RowParallelLinear, shard_range
from engine.parallel import get_parallel_state


class GatedDeltaNet(KVCacheLayer):
    supports_fp8_kv_cache = False
    supports_cuda_graphs = False  # its ops loop over sequences on the host

    def __init__(self, config) -> None:
        super().__init__()
        # Speculative decoding: per state slot of a sequence verifying drafts in the latest step, the states
        # before it and its inputs, until `keep_verified` moves the states to after the tokens kept.
        self.spec_stash: dict[int, tuple] = {}
        state = get_parallel_state()
        self.nk, self.nv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        if self.nv % self.nk:
            raise ValueError(f"linear_num_value_heads {self.nv} is not a multiple of linear_num_key_heads {self.nk}")
        if self.nk % state.tp_size:
            raise ValueError(f"tensor_parallel_size {state.tp_size} does not divide the {self.nk} key heads of the "
                             "Gated DeltaNet layers")
        self.ratio = self.nv // self.nk  # value heads per key head
        self.k_start, self.nk_local = shard_range(self.nk, state.tp_size, state.tp_rank)
        self.v_start, self.nv_local = self.k_start * self.ratio, self.nk_local * self.ratio
        self.width = config.linear_conv_kernel_dim
        hidden = config.hidden_size
        key_local, value_local = self.nk_local * self.dk, self.nv_local * self.dv
        self.split = [key_local, key_local, value_local, value_local]  # q, k, v, z
        self.conv_channels = 2 * key_local + value_local
        # From a quantized checkpoint they load dequantized (its kernels compute in the model's dtype).
        self.in_proj_qkvz = DequantizingWeight(sum(self.split), hidden, self._load_qkvz)
        self.in_proj_ba = DequantizingWeight(2 * self.nv_local, hidden, self._load_ba)
        self.conv1d = _Weight(self.conv_channels, self.width)
        self.A_log = nn.Parameter(torch.empty(self.nv_local, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.nv_local, dtype=torch.float32), requires_grad=False)
        self.norm = RMSNormGated(self.dv, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(self.nv * self.dv, hidden, bias=False,
                                          input_shard=(self.v_start * self.dv, value_local))
        for param, loader in ((self.conv1d.weight, self._load_conv), (self.A_log, self._load_per_head),
                              (self.dt_bias, self._load_per_head)):
            param.weight_loader = loader
        for param in (self.in_proj_qkvz.weight, self.in_proj_ba.weight):
            param.check_loaded = self._check_projection_loaded

    # ---- caches -------------------------------------------------------------------------------------------
    def cache_specs(self):
        return {"conv": StateSpec((self.conv_channels, self.width - 1), kind="gdn_conv_state"),
                "ssm": StateSpec((self.nv_local, self.dk, self.dv), torch.float32, kind="gdn_recurrent_state")}

    # ---- loading: every layout to [q | k | v | z] and [b | a], this rank's heads ----------------------------
    def _heads(self, tensor: torch.Tensor, count: int, size: int, start: int, local: int) -> torch.Tensor:
        """Rows of heads [start, start + local) of a [count * size, ...] tensor."""
        return tensor.reshape(count, size, *tensor.shape[1:])[start:start + local].reshape(local * size,
                                                                                          *tensor.shape[1:])

    def _load_qkvz(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        nk, dk, dv, r = self.nk, self.dk, self.dv, self.ratio
        ks, kl = self.k_start, self.nk_local
        q_end, k_end, v_end = self.split[0], sum(self.split[:2]), sum(self.split[:3])
        if shard is None:  # Qwen3-Next: per key-head group [q (dk) | k (dk) | v (r dv) | z (r dv)]
            _check(loaded, (nk * (2 * dk + 2 * r * dv), param.shape[1]), "in_proj_qkvz")
            groups = loaded.reshape(nk, 2 * dk + 2 * r * dv, -1)[ks:ks + kl]
            q, k, v, z = groups.split([dk, dk, r * dv, r * dv], dim=1)
            param.data.copy_(torch.cat([part.reshape(-1, loaded.shape[1]) for part in (q, k, v, z)]))
        elif shard == "qkv":  # Qwen3.5: [q (nk dk) | k (nk dk) | v (nv dv)]
            _check(loaded, (2 * nk * dk + self.nv * dv, param.shape[1]), "in_proj_qkv")
            q, k, v = loaded.split([nk * dk, nk * dk, self.nv * dv])
            param.data[:q_end].copy_(self._heads(q, nk, dk, ks, kl))
            param.data[q_end:k_end].copy_(self._heads(k, nk, dk, ks, kl))
            param.data[k_end:v_end].copy_(self._heads(v, self.nv, dv, self.v_start, self.nv_local))
        elif shard == "z":
            _check(loaded, (self.nv * dv, param.shape[1]), "in_proj_z")
            param.data[v_end:].copy_(self._heads(loaded, self.nv, dv, self.v_start, self.nv_local))
        else:
            raise ValueError(f"unknown Gated DeltaNet projection shard {shard!r}")

    def _load_ba(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        nv_l = self.nv_local
        if shard is None:  # Qwen3-Next: per key-head group [b (r) | a (r)]
            _check(loaded, (2 * self.nv, param.shape[1]), "in_proj_ba")
            groups = loaded.reshape(self.nk, 2 * self.ratio, -1)[self.k_start:self.k_start + self.nk_local]
            b, a = groups.split([self.ratio, self.ratio], dim=1)
            param.data.copy_(torch.cat([b.reshape(nv_l, -1), a.reshape(nv_l, -1)]))
        elif shard in ("b", "a"):
            _check(loaded, (self.nv, param.shape[1]), f"in_proj_{shard}")
            rows = loaded[self.v_start:self.v_start + nv_l]
            param.data[:nv_l].copy_(rows) if shard == "b" else param.data[nv_l:].copy_(rows)
        else:
            raise ValueError(f"unknown Gated DeltaNet projection shard {shard!r}")

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """conv1d.weight [C, 1, K], channels [q | k | v] of every head."""
        nk, dk = self.nk, self.dk
        full = loaded.reshape(loaded.shape[0], -1)
        _check(full, (2 * nk * dk + self.nv * self.dv, self.width), "conv1d.weight")
        q, k, v = full.split([nk * dk, nk * dk, self.nv * self.dv])
        param.data.copy_(torch.cat([self._heads(q, nk, dk, self.k_start, self.nk_local),
                                    self._heads(k, nk, dk, self.k_start, self.nk_local),
                                    self._heads(v, self.nv, self.dv, self.v_start, self.nv_local)]))

    def _load_per_head(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _check(loaded, (self.nv,), "a per-head Gated DeltaNet parameter")
        param.data.copy_(loaded[self.v_start:self.v_start + self.nv_local].float())

    def _check_projection_loaded(self, param: nn.Parameter, shards: set) -> str | None:
        if None in shards:
            return None
        wanted = {"qkv", "z"} if param is self.in_proj_qkvz.weight else {"b", "a"}
        missing = sorted(wanted - shards)
        return f"shards {missing}" if missing else None

    # ---- forward ------------------------------------------------------------------------------------------
    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        metadata = get_forward_context().attn_metadata
        tokens = hidden_states.shape[0]
        if metadata is None:  # a lockstep dummy step: no sequence, but the out-projection's reduction runs
            return self.out_proj(hidden_states.new_zeros(tokens, self.nv_local * self.dv))
        caches = self.caches or {}
        q, k, v, z = ops.gemm(hidden_states, self.in_proj_qkvz.weight, None).split(self.split, dim=-1)
        b, a = ops.gemm(hidden_states, self.in_proj_ba.weight, None).split(self.nv_local, dim=-1)
        conv_input = torch.cat([q, k, v], dim=-1)
        verify = get_forward_context().verify_seqs if caches else ()
        snapshots = [self._snapshot(metadata, seq, caches) for seq in verify]  # before the ops advance them
        mixed = ops.causal_conv1d(conv_input, self.conv1d.weight, caches.get("conv"), metadata)
        q, k, v = mixed.split(self.split[:3], dim=-1)
        q = q.reshape(tokens, self.nk_local, self.dk).repeat_interleave(self.ratio, dim=1)
        k = k.reshape(tokens, self.nk_local, self.dk).repeat_interleave(self.ratio, dim=1)
        v = v.reshape(tokens, self.nv_local, self.dv)
        beta = torch.sigmoid(b)
        g = -self.A_log.exp() * F.softplus(a.float() + self.dt_bias)
        for slot, begin, end, conv_state, ssm_state in snapshots:
            self.spec_stash[slot] = (conv_state, ssm_state, conv_input[begin:end].clone(),
                                     *(t[begin:end].clone() for t in (q, k, v, g, beta)))
        o = ops.gated_delta_rule(q, k, v, g, beta, caches.get("ssm"), metadata)
        o = self.norm(o, z.reshape(tokens, self.nv_local, self.dv))
        return self.out_proj(o.reshape(tokens, -1))


    # ---- speculative decoding: moving a verify step's state back ------------------------------------------
    def _snapshot(self, metadata, seq: int, caches: dict):
        slot = metadata.state_slots_cpu[seq]
        begin, end = metadata.query_start_loc_cpu[seq], metadata.query_start_loc_cpu[seq + 1]
        return slot, begin, end, caches["conv"][slot].clone(), caches["ssm"][slot].clone()

    def keep_verified(self, slot: int, num_kept: int) -> None:
        """A verify step on state slot `slot` kept its first `num_kept` tokens: the states become those
        after them (recomputed from the state before the step and the step's inputs, kept for this)."""
        conv_state, ssm_state, conv_input, q, k, v, g, beta = self.spec_stash.pop(slot)
        if num_kept == conv_input.shape[0]:
            return  # every token kept: the step's own states are right
        from engine.kernels.torch.gdn import conv_state_after, state_after
        self.caches["conv"][slot] = conv_state_after(conv_state, conv_input[:num_kept])
        self.caches["ssm"][slot] = state_after(ssm_state, q[:num_kept], k[:num_kept], v[:num_kept], g[:num_kept],
                                               beta[:num_kept])


def _check(tensor: torch.Tensor, shape: tuple, what: str) -> None:
    if is_quantized(tensor):  # the in-projections arrive dequantized (DequantizingWeight); nothing else may be
        raise ValueError(f"{what} is quantized in this checkpoint ({tensor.dtype}); it loads in full precision only")
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{what}: shape {tuple(tensor.shape)}, expected {tuple(shape)}")


class _Weight(nn.Module):
    """A bare `weight` (named as the checkpoint's `<name>.weight`), loaded by the layer's own loaders."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols), requires_grad=False)
