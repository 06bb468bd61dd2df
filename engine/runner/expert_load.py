"""Expert load over a window of steps: how many tokens each expert and each EP rank received, so that an
imbalanced deployment can be seen (in the engine's stats, the Prometheus metrics and the benchmarks).

Each MoE layer adds its routing to a device counter inside the forward pass (no host sync, so the counting
is captured in CUDA graphs too). Every `window` steps the runner copies the counters to the host in the
background; the report is the difference between the last two copies that reached the host. Counts are of
(token, expert) pairs, summed over the layers; under expert parallelism each layer counts the whole EP
group's routing (the `counts` of engine.parallel.all_to_all.ExpertAllToAll.dispatch), so any rank's report
covers every rank.
"""
from __future__ import annotations

import torch


def expert_load_tracker(model, window: int) -> "ExpertLoadTracker | None":
    """A tracker over the model's MoE layers, or None (no experts, or `window` 0: no counting)."""
    from engine.layers.fused_moe import FusedMoE
    from engine.layers.linear import shard_range
    from engine.parallel import get_parallel_state
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    if not layers or not window:
        return None
    ep_size, num_experts = get_parallel_state().ep_size, layers[0].num_experts
    return ExpertLoadTracker(layers, window, [shard_range(num_experts, ep_size, rank) for rank in range(ep_size)])


class ExpertLoadTracker:
    def __init__(self, layers: list, window: int, rank_ranges: list[tuple[int, int]]) -> None:
        """`layers`: the model's FusedMoE layers; `rank_ranges`: (first expert, count) of each EP rank (one
        range over every expert without expert parallelism)."""
        self.layers, self.window, self.rank_ranges = layers, window, rank_ranges
        self.num_experts = layers[0].num_experts
        for layer in layers:
            layer.count_expert_load(True)
        self.steps = 0
        self._pending: tuple | None = None  # (host copy, event, step) on its way
        self._report: dict | None = None
        self.reset()

    def reset(self) -> None:
        """Start counting afresh, forgetting what warm-up passes counted (in place: captured graphs hold the
        counters' addresses)."""
        for layer in self.layers:
            layer.load_counts.zero_()
        self._pending = None
        # (counts [L, E], step) of the last copy that reached the host
        self._previous = (torch.zeros(len(self.layers), self.num_experts, dtype=torch.int64), self.steps)

    def step(self) -> None:
        """After each forward pass of a step: every `window` steps, copy the counters to the host."""
        self.steps += 1
        self._collect()
        if self.steps % self.window or self._pending is not None:
            return
        counts = torch.stack([layer.load_counts[:self.num_experts] for layer in self.layers])
        if counts.is_cuda:
            host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            host.copy_(counts, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = counts, None
        self._pending = (host, event, self.steps)
        self._collect()

    def _collect(self) -> None:
        if self._pending is None:
            return
        host, event, step = self._pending
        if event is not None and not event.query():
            return
        self._pending = None
        self._report = self._summarise(host - self._previous[0], step - self._previous[1])
        self._previous = (host.clone(), step)

    def _summarise(self, counts: torch.Tensor, steps: int) -> dict:
        per_expert = counts.sum(dim=0)
        per_rank = torch.stack([per_expert[start:start + count].sum() for start, count in self.rank_ranges])
        total = int(per_expert.sum())
        return {
            "window_steps": steps,
            "tokens": total,
            "tokens_per_expert": per_expert.tolist(),
            "tokens_per_ep_rank": per_rank.tolist(),
            # The busiest rank (expert) over the average one: 1.0 is perfectly balanced.
            "ep_rank_imbalance": float(per_rank.max()) * len(per_rank) / total if total else 1.0,
            "expert_imbalance": float(per_expert.max()) * len(per_expert) / total if total else 1.0,
        }

    def report(self) -> dict | None:
        """The latest complete window, or None before the first one ends."""
        self._collect()
        return self._report
