"""The Coordinator actor: one per engine instance, running in the process of TP rank 0 (it holds that rank's
GPU or cores, as vLLM's engine core does). An EngineLoop thread owns the scheduler and runs rank 0's steps,
rank 0 broadcasting each plan to its peers (RankWorker actors), so a step costs no Ray call; the actor's
event loop takes requests and aborts and hands outputs to clients in batches (one poll returns every
output a client's requests produced since its last poll), so Ray is never called per token per request."""
from __future__ import annotations

import asyncio
import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field, replace
from functools import partial

from engine.config import EngineConfig
from engine.engine_loop import EngineLoop
from engine.errors import EngineDeadError
from engine.llm_engine import LLMEngine
from engine.outputs import PositionLogprobs, RequestMetrics, RequestOutput
from engine.resume import ResumeState
from engine.sampling_params import SamplingParams

from atom_ray.executor import RayExecutor
from atom_ray.placement import PlacementOptions

logger = logging.getLogger(__name__)


@dataclass
class CompletionDelta:
    index: int
    new_text: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None
    finish_reason: str | None
    stop_reason: str | int | None


@dataclass
class OutputDelta:
    """What one engine step added to a request: the wire format between coordinator and clients."""
    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int
    # Sent once, with a request's first output.
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list | None = None
    # The engine's timestamps (time.monotonic() on the coordinator's node; compare intervals only), sent with
    # the first output and the last.
    metrics: RequestMetrics | None = None
    error: str | None = None  # the request failed alone in a step (its last delta)

    @classmethod
    def from_output(cls, output: RequestOutput, first: bool) -> "OutputDelta":
        completions = [CompletionDelta(c.index, c.new_text, c.new_token_ids,
                                       c.logprobs[len(c.logprobs) - len(c.new_token_ids):] if c.logprobs is not None else None,
                                       c.finish_reason, c.stop_reason)
                       for c in output.outputs if c.new_token_ids or c.new_text or c.finish_reason]
        metrics = replace(output.metrics) if output.metrics is not None and (first or output.finished) else None
        return cls(output.request_id, completions, output.finished, output.num_cached_tokens,
                   output.prompt_token_ids if first else None, output.prompt_logprobs if first else None, metrics,
                   output.error)


@dataclass
class _Client:
    outbox: list[OutputDelta] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class ClientOutboxes:
    """The client side of a coordinator: each client's outbox of output deltas, and the long poll that
    empties it (one Ray call returns everything a client's requests produced since its last poll)."""

    def __init__(self) -> None:
        self.clients: dict[str, _Client] = defaultdict(_Client)
        self.owner: dict[str, str] = {}  # request id -> client id

    @property
    def error(self) -> BaseException | None:
        raise NotImplementedError

    def stats(self) -> dict:
        raise NotImplementedError

    async def poll(self, client_id: str, timeout_s: float = 1.0) -> tuple[list[OutputDelta], dict]:
        """Every output for this client's requests since its last poll; waits up to timeout_s for one."""
        client = self.clients[client_id]
        if not client.outbox and self.error is None:
            client.ready.clear()
            try:
                await asyncio.wait_for(client.ready.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        outbox, client.outbox = client.outbox, []
        return outbox, self.stats()

    def _wake_all_clients(self) -> None:
        """Each client's poll returns at once, carrying the engine's error in its stats."""
        for client in self.clients.values():
            client.ready.set()

    def _hand_to_owner(self, delta: OutputDelta) -> None:
        client_id = self.owner.get(delta.request_id)
        if client_id is None:
            return
        if delta.finished:
            del self.owner[delta.request_id]
        client = self.clients[client_id]
        client.outbox.append(delta)
        client.ready.set()


class Coordinator(ClientOutboxes):
    def __init__(self, config: EngineConfig, group, options: PlacementOptions, dp_rank: int = 0,
                 init_method: str | None = None) -> None:
        """One engine instance; under data parallelism, DP rank `dp_rank` of several, whose DPCoordinator
        is its only client (`init_method`: the EP group's rendezvous, shared by every DP rank)."""
        logging.basicConfig(level=logging.INFO)
        self.config = config
        self.dp_rank = dp_rank
        self._executor_factory = partial(RayExecutor, group=group, options=options, dp_rank=dp_rank,
                                         init_method=init_method)
        self._engine_loop: EngineLoop | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        super().__init__()
        self.started: set[str] = set()  # requests that already sent their first output

    async def initialize(self) -> dict:
        """Start the peers and load the model (on the engine thread). Returns what clients need: model,
        max_model_len and the tokenizer."""
        if self._engine_loop is None:
            self._event_loop = asyncio.get_running_loop()
            self._engine_loop = EngineLoop(
                lambda: LLMEngine(self.config, executor_factory=self._executor_factory, show_progress=False),
                self._publish, self._fail, name="coordinator-step-loop", step_timeout_s=self.config.step_timeout_s)
        engine = await asyncio.wrap_future(self._engine_loop.built)
        return {"model": self.config.model, "max_model_len": engine.max_model_len,
                "tokenizer": engine.tokenizer, "config": engine.config, "stats": self.stats()}

    @property
    def error(self) -> BaseException | None:
        return self._engine_loop.error if self._engine_loop is not None else None

    # ---- called by clients ----------------------------------------------------------------------------
    async def add_request(self, client_id: str, request_id: str, prompt, params: SamplingParams,
                          resume: ResumeState | None = None) -> None:
        """`resume`: the request continues one that a failed DP rank ran (engine/resume.py)."""
        if self.error is not None:
            raise EngineDeadError(f"the engine failed: {self.error!r}")
        self.owner[request_id] = client_id  # first: outputs may come before the engine confirms the add
        try:
            # Raises InvalidRequestError to the caller when the engine refuses the request.
            await asyncio.wrap_future(self._engine_loop.add(request_id, prompt, params, resume))
        except BaseException:
            # Refused, or the caller's call was cancelled (its client timed out): a request the engine took
            # just before the cancellation is stopped again.
            self.owner.pop(request_id, None)
            self._engine_loop.abort(request_id)
            raise

    async def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self.owner.pop(request_id, None) is not None:
                self._engine_loop.abort(request_id)
                self.started.discard(request_id)

    async def rank_process_ids(self) -> list[tuple[str, int]]:
        """(node address, pid) of every TP rank, rank 0 (this process) first."""
        import ray
        peers = self._engine_loop.engine.executor.peers
        return [(ray.util.get_node_ip_address(), os.getpid())] + await asyncio.gather(
            *(peer.process_id.remote() for peer in peers))

    def stats(self) -> dict:
        stats = self._engine_loop.stats()
        stats["error"] = repr(self.error) if self.error is not None else None
        stats["dp_rank"] = self.dp_rank
        return stats

    async def shutdown(self) -> None:
        if self._engine_loop is not None:  # joins the engine thread, then stops the peers: off the event loop
            await asyncio.get_running_loop().run_in_executor(None, self._engine_loop.shutdown)

    # ---- called on the engine thread ------------------------------------------------------------------
    def _publish(self, outputs: list[RequestOutput]) -> None:
        self._event_loop.call_soon_threadsafe(self._deliver, outputs)

    def _fail(self, exc: BaseException) -> None:
        self._event_loop.call_soon_threadsafe(self._wake_all_clients)

    # ---- on the event loop ----------------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.request_id not in self.owner:
                continue
            first = output.request_id not in self.started
            self.started.add(output.request_id)
            if output.finished:
                self.started.discard(output.request_id)
            self._hand_to_owner(OutputDelta.from_output(output, first))
