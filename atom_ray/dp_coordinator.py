"""The DPCoordinator actor: the front of a data-parallel engine. It owns N DP ranks (each a Coordinator actor
running one engine instance of tensor_parallel_size ranks, with its own scheduler and KV cache) and routes
each new request to one of them (atom_ray/dp_router.py); clients talk to it exactly as to a single
Coordinator.

Outputs: one long poll outstanding per DP rank brings back every output delta that rank produced since the
previous poll, and the deltas go to their clients' outboxes: Ray calls here are per request (add, abort)
and per poll, never per step per rank. When the model's experts span the DP ranks
(enable_expert_parallel), the ranks step in lockstep among themselves (engine/engine_loop.py), not through
this actor.

Failover: a DP rank fails when its poll raises (its actor died), reports its engine dead (a step raised,
the step watchdog fired) or does not answer within step_timeout_s past the poll's own wait (its process
hangs). The rank is fenced (no more routing; its actor killed, which takes its TP peers with it) and each of
its requests continues on a serving rank from what its client already has (atom_ray/request_journal.py,
engine/resume.py): the client sees a pause, not an error. Then the failed rank alone is started again and
rejoins the routing. Under expert parallelism the ranks form one EP group that cannot step without any of
its members, so the whole group is fenced, started again, and every live request resumes on it.
"""
from __future__ import annotations

import asyncio
import logging
import time

from engine.config import EngineConfig
from engine.core.scheduler import spec_rates
from engine.errors import EngineDeadError, InvalidRequestError
from engine.resume import ResumeState
from engine.sampling_params import SamplingParams

from atom_ray.coordinator import ClientOutboxes, Coordinator, OutputDelta
from atom_ray.dp_router import DPRouter
from atom_ray.placement import PlacementOptions, rank_options
from atom_ray.request_journal import RequestRecord

logger = logging.getLogger(__name__)


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


def _unwrap(exc: BaseException) -> BaseException:
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


class DPCoordinator(ClientOutboxes):
    ROUTER_CLIENT = "dp-router"
    POLL_TIMEOUT_S = 1.0
    SHUTDOWN_TIMEOUT_S = 45.0
    RESTART_ATTEMPTS = 3  # failed starts of a rank in a row before the whole engine is declared dead
    RESTART_BACKOFF_S = 2.0
    # A failed rank starts again once the requests it held have their next token on the survivors (or after
    # this long): its model load and profiling would otherwise take the CPU those re-prefills need.
    RESTART_DEFER_S = 10.0

    def __init__(self, config: EngineConfig, group, options: PlacementOptions) -> None:
        logging.basicConfig(level=logging.INFO)
        super().__init__()
        self.config = config
        self.size = config.data_parallel_size
        self._group, self._options = group, options
        self.ranks: list = [None] * self.size
        self.serving = [False] * self.size  # routable: started, and not fenced since
        self._generation = [0] * self.size  # bumped when a rank is fenced: its old incarnation's news is stale
        self._fenced = [asyncio.Event() for _ in range(self.size)]
        self._any_serving = asyncio.Event()
        self.router = DPRouter(self.size, config.block_size)
        self.journal: dict[str, RequestRecord] = {}
        self._rank_stats: list[dict] = [{} for _ in range(self.size)]
        self._error: BaseException | None = None
        self._pollers: list[asyncio.Task | None] = [None] * self.size
        self._tasks: set[asyncio.Task] = set()  # resumes and restarts under way
        self._info: dict | None = None
        self._tokenizer = None
        self.resumed_requests = self.failed_resumes = self.rank_restarts = 0
        self.resume_latency_s_sum = self.resume_latency_s_max = 0.0

    @property
    def error(self) -> BaseException | None:
        return self._error

    async def initialize(self) -> dict:
        """Start every DP rank (each starts its TP peers and loads the model) and begin polling them."""
        if self._info is None:
            infos = await self._start_ranks(list(range(self.size)))
            info = dict(infos[0])
            self._tokenizer = info["tokenizer"]
            info["stats"] = self.stats()
            self._info = info
        return self._info

    # ---- called by clients ----------------------------------------------------------------------------
    async def add_request(self, client_id: str, request_id: str, prompt, params: SamplingParams,
                          resume: ResumeState | None = None) -> None:
        """`resume`: the request continues one whose engine failed (a Serve replica's, deployments/)."""
        if self._error is not None:
            raise EngineDeadError(f"the engine failed: {self._error!r}")
        self.owner[request_id] = client_id  # first: an abort may come while the prompt is tokenized
        # Text is tokenized off the event loop (a long prompt would hold every other call up).
        token_ids = await asyncio.to_thread(self._token_ids, prompt) if isinstance(prompt, (str, dict)) \
            else self._token_ids(prompt)
        if self.owner.get(request_id) != client_id:  # aborted meanwhile: never sent to a rank
            return
        self.journal[request_id] = RequestRecord.new(prompt, params, resume)
        try:
            await self._submit(request_id, token_ids, prompt, params, resume)
        except BaseException:
            self._forget(request_id)
            self.owner.pop(request_id, None)
            raise

    async def abort(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            if self.owner.pop(request_id, None) is None:
                continue
            dp = self.router.rank_of.get(request_id)
            if dp is not None and dp >= 0 and self.serving[dp]:
                by_rank.setdefault(dp, []).append(request_id)
            self._forget(request_id)
        for dp, ids in by_rank.items():
            self.ranks[dp].abort.remote(ids)

    async def rank_process_ids(self) -> list[tuple[str, int]]:
        """(node address, pid) of every rank serving now: DP rank 0's TP ranks first, then DP rank 1's, ..."""
        ranks = [rank for dp, rank in enumerate(self.ranks) if self.serving[dp]]
        per_rank = await asyncio.gather(*(rank.rank_process_ids.remote() for rank in ranks))
        return [pid for ranks in per_rank for pid in ranks]

    def stats(self) -> dict:
        """The sums over DP ranks of their engines' counters, each rank's own under 'dp_ranks' (with the
        requests this router sent it and whether it serves), and the failover's counters."""
        router = self.router
        ranks = []
        for dp, stats in enumerate(self._rank_stats):
            ranks.append({**stats, "dp_rank": dp, "routed_requests": router.routed[dp],
                          "outstanding_requests": router.outstanding[dp], "serving": self.serving[dp]})
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
        total["affinity_routed_requests"] = router.affinity_routed
        total.update(resumed_requests=self.resumed_requests, failed_resumes=self.failed_resumes,
                     resume_latency_s_sum=self.resume_latency_s_sum, resume_latency_s_max=self.resume_latency_s_max,
                     dp_rank_restarts=self.rank_restarts)
        total["error"] = repr(self._error) if self._error is not None else None
        return total

    async def shutdown(self) -> None:
        for task in [*self._pollers, *self._tasks]:
            if task is not None:
                task.cancel()
        live = [rank for rank in self.ranks if rank is not None]
        # Together: lockstep ranks stop at the same agreement. A rank that hangs in its teardown is killed.
        try:
            results = await asyncio.wait_for(asyncio.gather(*(rank.shutdown.remote() for rank in live),
                                                            return_exceptions=True), self.SHUTDOWN_TIMEOUT_S)
        except asyncio.TimeoutError:
            results = [TimeoutError(f"no clean stop within {self.SHUTDOWN_TIMEOUT_S:.0f} s")] * len(live)
        for result in results:
            if isinstance(result, BaseException):
                logger.warning("a DP rank did not stop cleanly: %r", result)
        import ray
        for rank in live:
            ray.kill(rank)

    # ---- requests to ranks -----------------------------------------------------------------------------
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

    async def _submit(self, request_id: str, token_ids: list[int] | None, prompt, params: SamplingParams,
                      resume: ResumeState | None) -> bool:
        """Send a request (or a continuation) to a serving rank, waiting for one while none serves. Raises the
        rank's refusal; False when the rank failed meanwhile (the failover then moves the request again) or
        the request was aborted while it waited."""
        while True:
            dp = self.router.route(token_ids, self.serving)
            if dp is not None:
                break
            await self._any_serving.wait()
            if self._error is not None:
                raise EngineDeadError(f"the engine failed: {self._error!r}")
            if request_id not in self.owner:
                return False
        num_tokens = (len(token_ids) if token_ids else 0) + (resume.max_num_tokens if resume is not None else 0)
        self.router.assign(request_id, dp, num_tokens)
        rank, generation, fenced = self.ranks[dp], self._generation[dp], self._fenced[dp]
        call = asyncio.ensure_future(rank.add_request.remote(self.ROUTER_CLIENT, request_id, prompt, params, resume))
        call.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved either way
        fence = asyncio.ensure_future(fenced.wait())
        try:
            await asyncio.wait([call, fence], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the caller gave up: a request the rank took is stopped again
            self.router.release(request_id)
            rank.abort.remote([request_id])
            raise
        finally:
            fence.cancel()
        if not call.done() or generation != self._generation[dp]:
            return False  # the rank was fenced meanwhile: its requests, this one included, move on
        exc = call.exception()
        if exc is None:
            return True
        import ray
        if isinstance(exc, ray.exceptions.RayActorError) or isinstance(_unwrap(exc), EngineDeadError):
            self._rank_failed(dp, generation, _unwrap(exc))  # the rank died under the call, or had died
            return False
        if self.router.rank_of.get(request_id) == dp:
            self.router.release(request_id)
            rank.abort.remote([request_id])
        raise _unwrap(exc) from None

    def _forget(self, request_id: str) -> None:
        self.router.release(request_id)
        self.journal.pop(request_id, None)

    # ---- outputs ---------------------------------------------------------------------------------------
    async def _poll_rank(self, dp: int, generation: int) -> None:
        rank = self.ranks[dp]
        # A poll answers within POLL_TIMEOUT_S: one that has not answered step_timeout_s later hangs.
        limit = self.POLL_TIMEOUT_S + self.config.step_timeout_s if self.config.step_timeout_s else None
        while True:
            failure = None
            try:
                deltas, stats = await asyncio.wait_for(rank.poll.remote(self.ROUTER_CLIENT, self.POLL_TIMEOUT_S),
                                                       limit)
            except asyncio.CancelledError:
                raise
            except asyncio.TimeoutError:
                failure = EngineDeadError(f"DP rank {dp} has not answered its poll for {limit:.0f} s (its process "
                                          "hangs)")
            except Exception as exc:  # its actor died
                failure = exc
            if generation != self._generation[dp]:
                return
            if failure is not None:
                self._rank_failed(dp, generation, failure)
                return
            self._rank_stats[dp] = stats
            now = time.monotonic()
            for delta in deltas:
                self._deliver(dp, delta, now)
            if stats.get("error"):
                self._rank_failed(dp, generation, RuntimeError(stats["error"]))
                return

    def _deliver(self, dp: int, delta: OutputDelta, now: float) -> None:
        if self.router.rank_of.get(delta.request_id) != dp:
            return  # aborted, or moved on from a rank that failed
        record = self.journal.get(delta.request_id)
        if record is not None:
            if record.resumed_at is not None:
                latency, record.resumed_at = now - record.resumed_at, None
                self.resume_latency_s_sum += latency
                self.resume_latency_s_max = max(self.resume_latency_s_max, latency)
            delta = record.record(delta, now)
        if delta.finished:
            self._forget(delta.request_id)
        self._hand_to_owner(delta)

    # ---- failover ----------------------------------------------------------------------------------------
    def _rank_failed(self, dp: int, generation: int, exc: BaseException) -> None:
        """Fence the failed rank (under expert parallelism, its whole EP group), move its requests to the
        ranks that serve, and start it again. News from an incarnation already fenced is ignored."""
        if generation != self._generation[dp] or self._error is not None:
            return
        logger.error("DP rank %d failed: %r; its requests resume elsewhere and it is started again", dp, exc)
        detected = time.monotonic()
        failed = list(range(self.size)) if self.config.lockstep else [dp]
        moved = [request_id for rank in failed for request_id in self._fence(rank)]
        for request_id in moved:
            self._spawn(self._resume(request_id, dp, detected))
        self._spawn(self._restart(failed, exc, moved if any(self.serving) else []))

    def _fence(self, dp: int) -> list[str]:
        """Stop routing to `dp`, drop what its current incarnation still says, kill its actor (its TP peers,
        owned by it, go with it). Returns its requests, now on no rank."""
        import ray
        self.serving[dp] = False
        self._generation[dp] += 1
        self._fenced[dp].set()
        self._fenced[dp] = asyncio.Event()
        if not any(self.serving):
            self._any_serving.clear()
        poller, self._pollers[dp] = self._pollers[dp], None
        if poller is not None and poller is not asyncio.current_task():
            poller.cancel()
        if self.ranks[dp] is not None:
            ray.kill(self.ranks[dp])  # a stopped process too (Ray's force kill, after ~5 s)
            self.ranks[dp] = None
        self._rank_stats[dp] = {}
        return self.router.detach(dp)

    async def _resume(self, request_id: str, failed_dp: int, detected: float) -> None:
        """Continue one request of a failed rank on a serving rank; one that cannot be continued ends with an
        error naming why, alone."""
        record = self.journal.get(request_id)
        if record is None or request_id not in self.owner:
            self._forget(request_id)
            return
        prompt, params, resume = record.continuation()
        record.num_resumes += 1
        record.resumed_at = detected
        token_ids = record.prompt_token_ids or self._token_ids(prompt)
        try:
            if await self._submit(request_id, token_ids, prompt, params, resume):
                self.resumed_requests += 1
        except EngineDeadError:
            return  # the whole engine failed: every client is told so
        except Exception as exc:
            self.failed_resumes += 1
            logger.warning("request %s could not be resumed: %r", request_id, exc)
            self._forget(request_id)
            self._hand_to_owner(record.failure(
                request_id, f"the request could not be resumed after DP rank {failed_dp} failed: {exc}"))

    async def _restart(self, dps: list[int], cause: BaseException, moved: list[str] = ()) -> None:
        """Start the fenced ranks `dps` again (with backoff), once the `moved` requests have resumed on the
        survivors; after RESTART_ATTEMPTS failed starts in a row the engine is dead."""
        await self._resumed(moved, self.RESTART_DEFER_S)
        backoff = self.RESTART_BACKOFF_S
        for attempt in range(1, self.RESTART_ATTEMPTS + 1):
            try:
                await self._start_ranks(dps)
                self.rank_restarts += len(dps)
                logger.warning("DP rank(s) %s serving again", dps)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.error("restarting DP rank(s) %s, attempt %d of %d, failed: %r", dps, attempt,
                             self.RESTART_ATTEMPTS, exc)
                cause = exc
            await asyncio.sleep(backoff)
            backoff *= 2
        self._error = EngineDeadError(f"DP rank(s) {dps} could not be started again: {cause!r}")
        self._any_serving.set()  # requests waiting for a rank learn it
        self._wake_all_clients()

    async def _resumed(self, request_ids: list[str], timeout_s: float) -> None:
        """Wait until none of `request_ids` still waits for its first token after a resume (each either has it,
        finished, failed or was aborted), at most `timeout_s`, and only while some rank serves them."""
        deadline = time.monotonic() + timeout_s
        await asyncio.sleep(0)  # the resumes spawned before this mark their records first
        while time.monotonic() < deadline and any(self.serving) and any(
                (record := self.journal.get(request_id)) is not None and record.resumed_at is not None
                for request_id in request_ids):
            await asyncio.sleep(0.05)

    async def _start_ranks(self, dps: list[int]) -> list[dict]:
        """Start DP ranks `dps` on their bundles (under expert parallelism: every rank, one new EP group),
        wait until each has loaded the model, then route to them and poll them."""
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
        started = {dp: actor.options(**rank_options(self._group, dp * tp, self._options), max_concurrency=10_000)
                   .remote(self.config, self._group, self._options, dp, init_method) for dp in dps}
        try:
            infos = await asyncio.wait_for(asyncio.gather(*(rank.initialize.remote() for rank in started.values())),
                                           self._options.timeout_s)
        except BaseException:
            for rank in started.values():
                ray.kill(rank)
            raise
        for dp, info in zip(dps, infos):
            self.ranks[dp], self._rank_stats[dp], self.serving[dp] = started[dp], info["stats"], True
            self._pollers[dp] = asyncio.create_task(self._poll_rank(dp, self._generation[dp]))
        self._any_serving.set()
        return infos

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
