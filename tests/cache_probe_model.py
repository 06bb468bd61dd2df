"""A parameter-free test model that exercises every kind of cache a layer can declare: a sliding window, a
compressed cache (one entry per RATIO tokens) and per-request state. Each token writes its position and id
into the window, adds its id to its compressed entry, and adds to its request's running state; it then
reads its whole window and every completed compressed entry back through the group block tables, checks
that each entry is the one it expects (a block given to another request, a lost state or an unzeroed slot
shows up in `errors`), and emits the token `expected_next_token` computes from the token history alone.

Registered in tests as the architecture "CacheProbeForCausalLM" (see tests/engine/test_cache_specs.py)."""
from __future__ import annotations

import torch
from torch import nn

from engine.forward_context import get_forward_context
from engine.kv_cache_spec import PagedSpec, StateSpec
from engine.layers.attention import KVCacheLayer

WINDOW = 6
RATIO = 4
FIRST_TOKEN = 3  # emitted tokens are FIRST_TOKEN + value % (vocab - FIRST_TOKEN)


def step_value(ids: list[int], position: int) -> int:
    """What the probe computes at `position` of a sequence whose tokens are `ids`."""
    running = sum(ids[:position + 1])
    window = sum(ids[max(0, position - WINDOW + 1):position + 1])
    compressed = sum(ids[:(position + 1) // RATIO * RATIO])
    return running + 3 * window + 7 * compressed


def expected_next_token(ids: list[int], vocab_size: int) -> int:
    return FIRST_TOKEN + step_value(ids, len(ids) - 1) % (vocab_size - FIRST_TOKEN)


def expected_generation(prompt: list[int], num_tokens: int, vocab_size: int) -> list[int]:
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(expected_next_token(ids, vocab_size))
    return ids[len(prompt):]


class CacheProbeLayer(KVCacheLayer):
    supports_fp8_kv_cache = False
    supports_cuda_graphs = False
    errors: list[str] = []  # every inconsistency seen, across instances (the test clears it)

    def cache_specs(self):
        return {"window": PagedSpec((2,), torch.float64, window=WINDOW, kind="sliding_window"),
                "compressed": PagedSpec((2,), torch.float64, ratio=RATIO, kind="compressed"),
                "state": StateSpec((2,), torch.float64)}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        metadata = get_forward_context().attn_metadata
        values = torch.zeros(input_ids.shape[0], dtype=torch.float64)
        if metadata is None or self.caches is None:  # a dummy step, or the profiling pass
            return values
        window_group, compressed_group = metadata.groups[(1, WINDOW)], metadata.groups[(RATIO, None)]
        window = self.caches["window"].view(-1, 2)
        compressed = self.caches["compressed"].view(-1, 2)
        block_size = window_group.block_size
        ids, pos = input_ids.tolist(), positions.tolist()
        starts = metadata.query_start_loc_cpu
        for seq in range(metadata.num_seqs):
            state = self.caches["state"][metadata.state_slots_cpu[seq]]
            table, ctable = window_group.block_table_cpu[seq], compressed_group.block_table_cpu[seq]
            for t in range(starts[seq], starts[seq + 1]):
                p, token = pos[t], ids[t]
                if int(state[1]) != p:
                    self.errors.append(f"state holds {int(state[1])} tokens at position {p}")
                state[0] += token
                state[1] += 1
                window[int(window_group.slot_mapping[t])] = torch.tensor([p, token], dtype=torch.float64)
                slot = int(compressed_group.slot_mapping[t])
                if p % RATIO == 0:
                    compressed[slot] = torch.tensor([p // RATIO, 0.0], dtype=torch.float64)
                compressed[slot, 1] += token
                window_sum = 0.0
                for q in range(max(0, p - WINDOW + 1), p + 1):
                    entry = window[int(table[q // block_size]) * block_size + q % block_size]
                    if int(entry[0]) != q:
                        self.errors.append(f"window entry of position {q} holds position {int(entry[0])}")
                    window_sum += float(entry[1])
                compressed_sum = 0.0
                for e in range((p + 1) // RATIO):
                    entry = compressed[int(ctable[e // block_size]) * block_size + e % block_size]
                    if int(entry[0]) != e:
                        self.errors.append(f"compressed entry {e} holds entry {int(entry[0])}")
                    compressed_sum += float(entry[1])
                values[t] = float(state[0]) + 3 * window_sum + 7 * compressed_sum
        return values


class CacheProbeForCausalLM(nn.Module):
    def __init__(self, config, residual_dtype=None) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.layers = nn.ModuleList([CacheProbeLayer()])

    @staticmethod
    def remap_checkpoint_name(name: str) -> None:
        return None  # no parameters: whatever the folder's checkpoint holds is skipped

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.layers[0](input_ids, positions)

    def compute_logits(self, values: torch.Tensor) -> torch.Tensor:
        tokens = FIRST_TOKEN + values.long() % (self.vocab_size - FIRST_TOKEN)
        logits = torch.zeros(values.shape[0], self.vocab_size, dtype=torch.float32, device=values.device)
        logits[torch.arange(values.shape[0]), tokens] = 1.0
        return logits
