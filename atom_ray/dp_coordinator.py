"""The DPCoordinator actor: the front of a data-parallel engine. It owns N DP ranks (each a Coordinator actor
running one engine instance of tensor_parallel_size ranks, with its own scheduler and KV cache) and routes
each new request to one of them; clients talk to it exactly as to a single Coordinator.

Routing: the rank with the least outstanding work (unfinished requests, then their prompt tokens), except
that a prompt whose first blocks this router sent to some rank before goes back to that rank (whose prefix
cache likely still holds them) unless that rank is busier than the least busy by more than AFFINITY_SLACK
requests. The memory of which prefixes went where is bounded (least recently used forgotten first).

Outputs: one long poll outstanding per DP rank brings back every output delta that rank produced since the
previous poll, and the deltas go to their clients' outboxes: Ray calls here are per request (add, abort)
and per poll, never per step per rank. When the model's experts span the DP ranks
(enable_expert_parallel), the ranks step in lockstep among themselves (engine/engine_loop.py), not through
this actor.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict

from engine.config import EngineConfig
from engine.core.scheduler import spec_rates
from engine.errors import EngineDeadError, InvalidRequestError
from engine.sampling_params import SamplingParams

from atom_ray.coordinator import ClientOutboxes, Coordinator
from atom_ray.placement import PlacementOptions, rank_options

logger = logging.getLogger(__name__)

AFFINITY_BLOCKS = 4  # prefixes of up to this many full KV blocks are remembered
AFFINITY_SLACK = 4  # outstanding requests by which an affine rank may exceed the least busy one
AFFINITY_MEMORY = 65536  # prefixes remembered


def merge_expert_loads(loads: list[dict]) -> dict:
    """Independent DP ranks' expert loads (each counts its own tokens) as one. Under expert parallelism every
    rank's report already covers the whole EP group, so one rank's is the whole picture."""
    per_expert = [sum(values) for values in zip(*(load["tokens_per_expert"] for load in loads))]
    total = sum(per_expert)
    return {"window_steps": min(load["window_steps"] for load in loads), "tokens": total,
            "tokens_per_expert": per_expert, "tokens_per_ep_rank": [total],
            "ep_rank_imbalance": 1.0,
            "expert_imbalance": max(per_expert) * len(per_expert) / total if total else 1.0}


def _rendezvous_address() -> str:
    from atom_ray.placement import rendezvous_address
    return rendezvous_address()


class DPCoordinator(ClientOutboxes):
    ROUTER_CLIENT = "dp-router"
    POLL_TIMEOUT_S = 1.0
    SHUTDOWN_TIMEOUT_S = 45.0

    def __init__(self, config: EngineConfig, group, options: PlacementOptions) -> None:
        logging.basicConfig(level=logging.INFO)
        super().__init__()
        self.config = config
        self.size = config.data_parallel_size
        self._group, self._options = group, options
        self.ranks: list = []
        self.rank_of: dict[str, int] = {}  # request id -> DP rank
        self.prompt_tokens: dict[str, int] = {}
        self.outstanding = [0] * self.size
        self.outstanding_tokens = [0] * self.size
        self.routed = [0] * self.size
        self.affinity_routed = 0
        self._prefixes: OrderedDict[bytes, int] = OrderedDict()
        self._rank_stats: list[dict] = [{} for _ in range(self.size)]
        self._error: BaseException | None = None
        self._pollers: list[asyncio.Task] = []
        self._info: dict | None = None
        self._tokenizer = None
        self._block_size = config.block_size
        self._vocab_size: int | None = None

    @property
    def error(self) -> BaseException | None:
        return self._error

    async def initialize(self) -> dict:
        """Start every DP rank (each starts its TP peers and loads the model) and begin polling them."""
        if self._info is not None:
            return self._info
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        tp = self.config.tensor_parallel_size
        init_method = None
        if self.config.enable_expert_parallel:
            # One torch.distributed world for every DP rank's MoE layers; its rank 0 (DP rank 0's TP rank 0)
            # listens on a free port of the node of the placement group's first bundle.
            probe = ray.remote(num_cpus=0)(_rendezvous_address).options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=0))
            init_method = await probe.remote()
        actor = ray.remote(Coordinator)
        self.ranks = [actor.options(**rank_options(self._group, dp * tp, self._options), max_concurrency=10_000)
                      .remote(self.config, self._group, self._options, dp, init_method) for dp in range(self.size)]
        infos = await asyncio.gather(*(rank.initialize.remote() for rank in self.ranks))
        info = dict(infos[0])
        self._tokenizer = info["tokenizer"]
        self._vocab_size = getattr(info["config"], "vocab_size", None)
        self._rank_stats = [i["stats"] for i in infos]
        self._pollers = [asyncio.create_task(self._poll_rank(dp)) for dp in range(self.size)]
        info["stats"] = self.stats()
        self._info = info
        return info

    # ---- called by clients ----------------------------------------------------------------------------
    async def add_request(self, client_id: str, request_id: str, prompt, params: SamplingParams) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine failed: {self._error!r}")
        self.owner[request_id] = client_id  # first: an abort may come while the prompt is tokenized
        # Text is tokenized off the event loop (a long prompt would hold every other call up).
        token_ids = await asyncio.to_thread(self._token_ids, prompt) if isinstance(prompt, (str, dict)) \
            else self._token_ids(prompt)
        if self.owner.get(request_id) != client_id:  # aborted meanwhile: never sent to a rank
            return
        dp = self._route(token_ids)
        self.rank_of[request_id] = dp
        self.prompt_tokens[request_id] = len(token_ids) if token_ids is not None else 0
        self.outstanding[dp] += 1
        self.outstanding_tokens[dp] += self.prompt_tokens[request_id]
        self.routed[dp] += 1
        try:
            await self.ranks[dp].add_request.remote(self.ROUTER_CLIENT, request_id, prompt, params)
        except BaseException as exc:
            self._forget(request_id)
            self.owner.pop(request_id, None)
            self.ranks[dp].abort.remote([request_id])
            cause = getattr(exc, "cause", None)
            raise cause if isinstance(cause, BaseException) else exc from None

    async def abort(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            if self.owner.pop(request_id, None) is not None and request_id in self.rank_of:
                by_rank.setdefault(self.rank_of[request_id], []).append(request_id)
                self._forget(request_id)
        for dp, ids in by_rank.items():
            self.ranks[dp].abort.remote(ids)

    async def rank_process_ids(self) -> list[tuple[str, int]]:
        """(node address, pid) of every rank: DP rank 0's TP ranks first, then DP rank 1's, ..."""
        per_rank = await asyncio.gather(*(rank.rank_process_ids.remote() for rank in self.ranks))
        return [pid for ranks in per_rank for pid in ranks]

    def stats(self) -> dict:
        """The sums over DP ranks of their engines' counters, and each rank's own under 'dp_ranks' (with the
        requests this router sent it)."""
        ranks = []
        for dp, stats in enumerate(self._rank_stats):
            ranks.append({**stats, "dp_rank": dp, "routed_requests": self.routed[dp],
                          "outstanding_requests": self.outstanding[dp]})
        total: dict = {}
        for stats in ranks:
            for key, value in stats.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "dp_rank":
                    total[key] = total.get(key, 0) + value
        if total.get("num_kv_blocks"):
            total["kv_cache_usage"] = 1.0 - total.get("num_free_kv_blocks", 0) / total["num_kv_blocks"]
        if total.get("num_state_slots"):
            total["state_slot_usage"] = 1.0 - total.get("num_free_state_slots", 0) / total["num_state_slots"]
        if "spec_verifies" in total:  # rates are not sums
            total.update(spec_rates(total))
        total["dp_ranks"] = ranks
        loads = [stats["expert_load"] for stats in self._rank_stats if stats.get("expert_load")]
        if loads:
            total["expert_load"] = loads[0] if self.config.enable_expert_parallel else merge_expert_loads(loads)
        total["affinity_routed_requests"] = self.affinity_routed
        total["error"] = repr(self._error) if self._error is not None else None
        return total

    async def shutdown(self) -> None:
        for task in self._pollers:
            task.cancel()
        # Together: lockstep ranks stop at the same agreement. A rank that hangs in its teardown is killed.
        try:
            results = await asyncio.wait_for(asyncio.gather(*(rank.shutdown.remote() for rank in self.ranks),
                                                            return_exceptions=True), self.SHUTDOWN_TIMEOUT_S)
        except asyncio.TimeoutError:
            results = [TimeoutError(f"no clean stop within {self.SHUTDOWN_TIMEOUT_S:.0f} s")] * self.size
        for dp, result in enumerate(results):
            if isinstance(result, BaseException):
                logger.warning("DP rank %d did not stop cleanly: %r", dp, result)
        import ray
        for rank in self.ranks:
            ray.kill(rank)

    # ---- routing ---------------------------------------------------------------------------------------
    def _token_ids(self, prompt) -> list[int] | None:
        """The prompt's token ids where they are cheap to know (ids given, or text with a tokenizer); the
        engine checks the prompt itself."""
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
        if isinstance(prompt, str):
            if self._tokenizer is None:
                return None
            try:
                return self._tokenizer.encode(prompt)
            except InvalidRequestError:
                return None  # the engine refuses it with the same message
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return None

    def _prefix_keys(self, token_ids: list[int]) -> list[bytes]:
        """Keys of the prompt's first 1..AFFINITY_BLOCKS full blocks, longest first."""
        size = self._block_size
        blocks = min(AFFINITY_BLOCKS, len(token_ids) // size)
        digest = hashlib.blake2b(digest_size=16)
        keys = []
        for block in range(blocks):
            digest.update(repr(token_ids[block * size:(block + 1) * size]).encode())
            keys.append(digest.copy().digest())
        return keys[::-1]

    def _route(self, token_ids: list[int] | None) -> int:
        least = min(range(self.size), key=lambda dp: (self.outstanding[dp], self.outstanding_tokens[dp], dp))
        keys = self._prefix_keys(token_ids) if token_ids else []
        chosen = least
        for key in keys:
            dp = self._prefixes.get(key)
            if dp is not None and self.outstanding[dp] - self.outstanding[least] <= AFFINITY_SLACK:
                chosen = dp
                if dp != least:
                    self.affinity_routed += 1
                break
        for key in keys:
            self._prefixes[key] = chosen
            self._prefixes.move_to_end(key)
        while len(self._prefixes) > AFFINITY_MEMORY:
            self._prefixes.popitem(last=False)
        return chosen

    def _forget(self, request_id: str) -> None:
        dp = self.rank_of.pop(request_id, None)
        if dp is not None:
            self.outstanding[dp] -= 1
            self.outstanding_tokens[dp] -= self.prompt_tokens.pop(request_id, 0)

    # ---- outputs ---------------------------------------------------------------------------------------
    async def _poll_rank(self, dp: int) -> None:
        rank = self.ranks[dp]
        while True:
            try:
                deltas, stats = await rank.poll.remote(self.ROUTER_CLIENT, self.POLL_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the rank's actor died: the whole engine is unusable (one EP group)
                self._fail(dp, exc)
                return
            self._rank_stats[dp] = stats
            if stats.get("error"):
                self._fail(dp, RuntimeError(stats["error"]))
            for delta in deltas:
                if delta.finished:
                    self._forget(delta.request_id)
                self._hand_to_owner(delta)
            if self._error is not None:
                return

    def _fail(self, dp: int, exc: BaseException) -> None:
        if self._error is None:
            logger.error("DP rank %d failed: %r", dp, exc)
            self._error = EngineDeadError(f"DP rank {dp} failed: {exc!r}")
        self._wake_all_clients()
