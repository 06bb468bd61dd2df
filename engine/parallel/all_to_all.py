"""Expert-parallel token exchange: each rank's tokens reach the ranks that hold their experts, the experts
run there, and the results come back to the token's rank, summed.

Every buffer's shape depends only on the step's padded token count (the largest DP rank's tokens in this
step, agreed once per step and rounded up to a CUDA-graph bucket; see engine/forward_context.py), never on
how many tokens chose which expert: no split sizes travel, nothing reaches the host inside the forward
pass, and an EP decode step is captured in a CUDA graph like a one-GPU step. Each rank sends a chunk of
`rows` tokens (its share of the padded count); padding rows and slots for no expert carry id -1, weight 0.

`ExpertAllToAll` is the interface a MoE layer calls; `make_all_to_all` picks the implementation:
- `GatherScatterExchange` (vLLM's allgather-reducescatter): every rank all-gathers the group's hidden
  states with their top-k ids and weights, runs its own experts on the pairs that chose them, and a
  reduce-scatter sums the partial outputs back to each token's rank. The form for decode-sized steps.
- `PaddedAllToAll`: each token goes once to each rank holding one of its experts (with its k slots, those
  for other ranks' experts marked -1), through an all-to-all with a fixed capacity of `rows` per
  destination (a token goes at most once to a rank, so nothing can overflow), and comes back the same way.
  The capacity is what a worst-case routing needs: its bytes equal the all-gather's, its expert work too.
- `StepExchange`: one of the two per step, chosen from the (static) chunk size, logged once per form.
- `MoriAllToAll` (engine/parallel/mori_all_to_all.py): AMD's MORI dispatch/combine kernels on the GPUs of
  one ROCm node; chosen with the `aiter` kernel backend where MORI is installed and the layout fits it.
  Its kernels keep device-side counts of their own, so a MORI step runs eagerly (`capturable` False).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine import kernels
from engine.config import EXPERT_EXCHANGES
from engine.kernels import ops
from engine.kernels.torch import moe as torch_moe

logger = logging.getLogger(__name__)

# "auto": steps of up to this many tokens per rank take the all-gather form; larger ones PREFILL_FORM. At EP=2
# with top-8 routing 99.6 % of tokens reach both ranks, so the padded all-to-all moves the all-gather's bytes
# with more work around it; which is faster at prefill sizes (and at EP=8, where ~66 % do) is not measured
# yet (benchmarks/ep_exchange_bench.py), so "auto" keeps the all-gather form throughout.
DECODE_ROWS = 512
PREFILL_FORM = "allgather"


@dataclass
class Dispatched:
    """What one rank received: rows of hidden states, each with a token's k slots as local expert indices
    (-1: another rank's expert, padding or nothing) and their routing weights; `handle` is what `combine`
    needs to send the results back."""
    hidden: torch.Tensor        # [R, H]
    local_ids: torch.Tensor     # [R, k] int32, index into this rank's experts, -1 = none
    weights: torch.Tensor       # [R, k] float32, 0 where local_ids is -1
    handle: tuple


@dataclass(frozen=True)
class ExchangeLayout:
    """What an exchange may size its buffers by: the MoE layer's shape and the most tokens one rank sends in
    a step (0: unknown)."""
    num_experts: int
    hidden_size: int
    top_k: int
    max_tokens_per_rank: int
    dtype: torch.dtype          # of the hidden states sent


@dataclass(frozen=True)
class ExpertPlacement:
    """Which EP rank holds which experts: `ranges[r]` = (first expert, count) of rank r; this is `rank`."""
    ranges: tuple[tuple[int, int], ...]
    rank: int

    @property
    def ranks(self) -> int:
        return len(self.ranges)

    @property
    def local(self) -> tuple[int, int]:
        return self.ranges[self.rank]

    def owners(self, device) -> torch.Tensor:
        """int64 [E]: the rank holding each expert."""
        return torch.cat([torch.full((count,), rank, dtype=torch.int64)
                          for rank, (_, count) in enumerate(self.ranges)]).to(device)


class ExpertAllToAll:
    capturable = True  # whether a step through it can be captured in a CUDA graph

    def dispatch(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 counts: torch.Tensor | None = None) -> Dispatched:
        """`hidden` [rows, H] with the global expert ids [rows, k] (-1: none) and weights chosen for them.
        `counts` [E + 1] int64: += the pairs that every rank of the group routed to each expert (the
        expert-load counters; index E collects id -1)."""
        raise NotImplementedError

    def combine(self, expert_out: torch.Tensor, handle: tuple) -> torch.Tensor:
        """[rows, H]: each of this rank's tokens summed over the ranks its experts ran on."""
        raise NotImplementedError

    def combine_tp_group(self, expert_out: torch.Tensor, handle: tuple, tp_size: int, tp_rank: int):
        """[tp_size * rows, H]: the tokens of this rank's whole TP group (the ranks tp_size * d .. of the EP
        group, which hold one DP rank's tokens a chunk each), summed, where one collective gives them; else
        None (the caller combines its own chunk and all-gathers it over the TP group)."""
        return None


def count_over_group(counts: torch.Tensor, ids: torch.Tensor, all_reduce) -> None:
    """counts += the group's pairs per expert, from this rank's `ids` and a sum over the group."""
    mine = torch.zeros_like(counts)
    torch_moe.add_counts(mine, ids)
    counts += all_reduce(mine)


# torch 2.13 renamed the single-tensor forms (the old names warn); the GPU hosts' torch 2.11 has the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Collectives:
    """The group's collectives, through host memory where the ranks share a GPU or run on CPU (gloo)."""

    def __init__(self, group, host_collectives: bool) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.host = host_collectives

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.contiguous().cpu() if self.host else tensor.contiguous()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        local = self._to_host(tensor)
        out = local.new_empty((self.world * local.shape[0], *local.shape[1:]))
        _all_gather_single(out, local, group=self.group)
        return out.to(tensor.device)

    def reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        local = self._to_host(tensor)
        out = local.new_empty((local.shape[0] // self.world, *local.shape[1:]))
        _reduce_scatter_single(out, local, group=self.group)
        return out.to(tensor.device)

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """Equal splits: the i-th of `world` equal parts of the first dimension goes to rank i."""
        local = self._to_host(tensor)
        out = torch.empty_like(local)
        dist.all_to_all_single(out, local, group=self.group)
        return out.to(tensor.device)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        local = self._to_host(tensor)
        dist.all_reduce(local, group=self.group)
        return local.to(tensor.device)


def _pack_routing(ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """float32 [rows, 2k]: ids (exact in float32 below 2**24) then weights, so that both travel together."""
    return torch.cat((ids.float(), weights.float()), dim=1)


class GatherScatterExchange(ExpertAllToAll):
    """All-gather the group's tokens and routing; reduce-scatter the partial expert outputs.

    Where the group has the one-shot symmetric-memory all-reduce (engine/parallel/symmetric_all_reduce.py:
    CUDA GPUs that map each other's memory) and a decode step's buffers fit it, both collectives are
    one-shot all-reduces, a few microseconds each against NCCL's tens at these sizes: the gather sums
    float32 buffers in which each rank filled only its own rows (x + 0 is exact), the scatter sums the
    partial outputs and keeps this rank's rows. Otherwise NCCL's all-gather and reduce-scatter."""

    def __init__(self, group, placement: ExpertPlacement, host_collectives: bool, small_all_reduce=None) -> None:
        self.net = _Collectives(group, host_collectives)
        self.rank = placement.rank
        self.expert_start, self.num_local_experts = placement.local
        self.small = small_all_reduce

    def _one_shot_rows(self, hidden: torch.Tensor, top_k: int) -> int:
        """The most tokens per rank whose collectives fit the one-shot all-reduce (0: none do)."""
        if self.small is None:
            return 0
        per_row = self.net.world * max((hidden.shape[1] + 2 * top_k) * 4, hidden.shape[1] * hidden.element_size())
        return self.small.max_bytes // per_row

    def _one_shot(self, rows: int, hidden: torch.Tensor, top_k: int) -> bool:
        """Whether both of a step's collectives fit the one-shot all-reduce (the same answer on every rank)."""
        return rows <= self._one_shot_rows(hidden, top_k)

    def dispatch(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 counts: torch.Tensor | None = None) -> Dispatched:
        rows, width = hidden.shape
        routing = _pack_routing(ids, weights)
        one_shot, limit = self._one_shot(rows, hidden, ids.shape[1]), self._one_shot_rows(hidden, ids.shape[1])
        _log_once("expert exchange: all-gather form " + (
            f"over one-shot symmetric-memory all-reduces for steps of up to {limit} tokens per EP rank" if one_shot
            else f"over NCCL for steps of more than {limit} tokens per EP rank" if limit else "over NCCL"))
        if one_shot:
            mine = hidden.new_zeros((self.net.world * rows, width + routing.shape[1]), dtype=torch.float32)
            own = mine[self.rank * rows:(self.rank + 1) * rows]
            own[:, :width] = hidden
            own[:, width:] = routing
            gathered = self.small(mine)
            all_hidden, all_routing, handle = gathered[:, :width].to(hidden.dtype), gathered[:, width:], (True, rows)
        else:
            all_hidden, all_routing, handle = self.net.all_gather(hidden), self.net.all_gather(routing), (False, rows)
        local_ids, local_weights = ops.moe_local_slots(all_routing, self.expert_start, self.num_local_experts,
                                                       counts)
        return Dispatched(all_hidden, local_ids, local_weights, handle)

    def combine(self, expert_out: torch.Tensor, handle: tuple) -> torch.Tensor:
        one_shot, rows = handle
        if one_shot:
            return self.small(expert_out.contiguous())[self.rank * rows:(self.rank + 1) * rows]
        return self.net.reduce_scatter(expert_out)

    def combine_tp_group(self, expert_out: torch.Tensor, handle: tuple, tp_size: int, tp_rank: int):
        # The one-shot all-reduce leaves every row's sum on every rank: the TP group's rows need no gather.
        one_shot, rows = handle
        if not one_shot:
            return None
        first = (self.rank - tp_rank) * rows
        return self.small(expert_out.contiguous())[first:first + tp_size * rows]


class PaddedAllToAll(ExpertAllToAll):
    """Send buffer [ranks, rows]: destination r's part holds, from its front, the tokens with an expert on r."""

    def __init__(self, group, placement: ExpertPlacement, host_collectives: bool, device) -> None:
        self.net = _Collectives(group, host_collectives)
        self.ranks = placement.ranks
        self.owner = placement.owners(device)
        self.expert_start, self.num_local_experts = placement.local

    def dispatch(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 counts: torch.Tensor | None = None) -> Dispatched:
        if counts is not None:
            count_over_group(counts, ids, self.net.all_reduce)
        rows, top_k = ids.shape
        destination = torch.where(ids >= 0, self.owner[ids.long().clamp(min=0)], -1)  # [rows, k]
        ranks = torch.arange(self.ranks, device=ids.device)
        for_rank = destination[:, None, :] == ranks[None, :, None]  # [rows, ranks, k]
        sent = for_rank.any(dim=2)  # [rows, ranks]: the token goes to rank r
        # Its row in the send buffer: destination r's part, in token order from the part's front; a token
        # that does not go to r is placed on the spare last row, which is not sent.
        place = torch.where(sent, torch.cumsum(sent.long(), dim=0) - 1 + ranks * rows, self.ranks * rows)
        send = hidden.new_zeros((self.ranks * rows + 1, hidden.shape[1]))
        routing = torch.zeros((self.ranks * rows + 1, 2 * top_k), dtype=torch.float32, device=ids.device)
        routing[:, :top_k] = -1.0
        for rank in range(self.ranks):  # each destination's copy keeps the slots of its own experts only
            mine = for_rank[:, rank]
            send.index_copy_(0, place[:, rank], hidden)
            routing.index_copy_(0, place[:, rank], _pack_routing(torch.where(mine, ids, -1),
                                                                 torch.where(mine, weights.float(), 0.0)))
        received = self.net.all_to_all(send[:-1])
        local_ids, local_weights = ops.moe_local_slots(self.net.all_to_all(routing[:-1]), self.expert_start,
                                                       self.num_local_experts)
        return Dispatched(received, local_ids, local_weights, (sent, place))

    def combine(self, expert_out: torch.Tensor, handle: tuple) -> torch.Tensor:
        sent, place = handle
        back = self.net.all_to_all(expert_out)
        back = torch.cat((back, back.new_zeros((1, back.shape[1]))))  # the spare row
        parts = back[place.reshape(-1)].view(*place.shape, -1).float()  # [rows, ranks, H]
        return torch.where(sent[:, :, None], parts, 0.0).sum(dim=1).to(expert_out.dtype)


class StepExchange(ExpertAllToAll):
    """The all-gather form up to `decode_rows` tokens per rank, `large` above: every rank sees the same
    (padded) chunk size, so every rank takes the same form for the same layer call."""

    def __init__(self, small: ExpertAllToAll, large: ExpertAllToAll, decode_rows: int, names: tuple[str, str]):
        self.small, self.large, self.decode_rows, self.names = small, large, decode_rows, names

    def _form(self, rows: int) -> ExpertAllToAll:
        small = rows <= self.decode_rows
        _log_once(f"expert exchange: {self.names[0 if small else 1]} form for steps of "
                  f"{'up to' if small else 'more than'} {self.decode_rows} tokens per EP rank")
        return self.small if small else self.large

    def dispatch(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 counts: torch.Tensor | None = None) -> Dispatched:
        form = self._form(hidden.shape[0])
        sent = form.dispatch(hidden, weights, ids, counts)
        sent.handle = (form, sent.handle)
        return sent

    def combine(self, expert_out: torch.Tensor, handle: tuple) -> torch.Tensor:
        form, inner = handle
        return form.combine(expert_out, inner)

    def combine_tp_group(self, expert_out: torch.Tensor, handle: tuple, tp_size: int, tp_rank: int):
        form, inner = handle
        return form.combine_tp_group(expert_out, inner, tp_size, tp_rank)


def make_all_to_all(group, placement: ExpertPlacement, host_collectives: bool, form: str = "auto",
                    layout: ExchangeLayout | None = None, device=None, small_all_reduce=None) -> ExpertAllToAll:
    """The EP exchange for a MoE layer. `form` "auto" takes MORI when the `aiter` kernel backend is active,
    `import mori` works and `layout` fits MORI's kernels (engine/parallel/mori_all_to_all.py says what
    fits), otherwise the all-gather form for decode-sized steps and PREFILL_FORM above; "mori" takes MORI
    wherever it fits (else as "auto"); "allgather" and "all_to_all" take that form for every step. Why
    MORI was not taken is logged once per reason."""
    if form not in EXPERT_EXCHANGES:
        raise ValueError(f"expert exchange {form!r} is unknown; use one of {EXPERT_EXCHANGES}")
    if form == "mori" or form == "auto" and kernels.active_backend().name == "aiter":
        from engine.parallel import mori_all_to_all
        problem = mori_all_to_all.unsuitable(group, layout, host_collectives)
        if problem is None:
            return mori_all_to_all.MoriAllToAll(group, layout)
        _log_once(f"expert exchange: MORI not used, torch.distributed instead: {problem}")
    gather = GatherScatterExchange(group, placement, host_collectives, small_all_reduce)
    if form == "allgather":
        return gather
    padded = PaddedAllToAll(group, placement, host_collectives, device)
    if form == "all_to_all":
        return padded
    if PREFILL_FORM == "allgather":
        return gather
    return StepExchange(gather, padded, DECODE_ROWS, ("all-gather", "padded all-to-all"))


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)
