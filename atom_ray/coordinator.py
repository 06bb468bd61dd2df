"""The Coordinator actor: one per engine instance. It owns the scheduler and the step loop, sends one plan
per step to the TP group leader, and hands outputs to clients in batches (one poll returns every output
a client's requests produced since its last poll), so Ray is never called per token per request."""
from __future__ import annotations

import asyncio
import logging
from collections import defaultdict, deque
from dataclasses import dataclass, field
from functools import partial

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import PositionLogprobs, RequestOutput
from engine.sampling_params import SamplingParams

from atom_ray.executor import RayExecutor

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

    @classmethod
    def from_output(cls, output: RequestOutput, first: bool) -> "OutputDelta":
        completions = [CompletionDelta(c.index, c.new_text, c.new_token_ids,
                                       c.logprobs[len(c.logprobs) - len(c.new_token_ids):] if c.logprobs is not None else None,
                                       c.finish_reason, c.stop_reason)
                       for c in output.outputs if c.new_token_ids or c.new_text or c.finish_reason]
        return cls(output.request_id, completions, output.finished, output.num_cached_tokens,
                   output.prompt_token_ids if first else None, output.prompt_logprobs if first else None)


@dataclass
class _Client:
    outbox: list[OutputDelta] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class Coordinator:
    @staticmethod
    def pipeline_depth_for(tensor_parallel_size: int) -> int:
        """Plans at the workers at once. A step's result travels leader -> coordinator -> next plan -> leader
        (-> peers over gloo) through Ray while the plans already queued run. With two, that round trip
        must fit into one GPU step: it does at TP=1, not at TP>1 (measured at TP=2: 0.4-0.6 ms idle per
        4 ms step; with three, none). TP=1 keeps two: its serving figures were measured so, and a third
        plan only makes a new request wait one more step."""
        return 2 if tensor_parallel_size == 1 else 3

    def __init__(self, config: EngineConfig, cpus_per_rank: int | None = None,
                 accelerator_type: str | None = None, placement_timeout_s: float = 600.0) -> None:
        logging.basicConfig(level=logging.INFO)
        self.config = config
        self.pipeline_depth = self.pipeline_depth_for(config.tensor_parallel_size)
        self._executor_factory = partial(RayExecutor, cpus_per_rank=cpus_per_rank, accelerator_type=accelerator_type,
                                         placement_timeout_s=placement_timeout_s)
        self.engine: LLMEngine | None = None
        self.clients: dict[str, _Client] = defaultdict(_Client)
        self.owner: dict[str, str] = {}  # request id -> client id
        self.started: set[str] = set()  # requests that already sent their first output
        self.error: BaseException | None = None
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._stopping = False

    async def initialize(self) -> dict:
        """Start the rank workers and load the model (off the event loop: it blocks on Ray calls).
        Returns what clients need: model, max_model_len and the tokenizer."""
        if self.engine is None:
            self.engine = await asyncio.get_running_loop().run_in_executor(
                None, lambda: LLMEngine(self.config, executor_factory=self._executor_factory, show_progress=False))
            self.executor = self.engine.executor
        return {"model": self.config.model, "max_model_len": self.engine.max_model_len,
                "tokenizer": self.engine.tokenizer, "config": self.engine.config}

    # ---- called by clients ----------------------------------------------------------------------------
    async def add_request(self, client_id: str, request_id: str, prompt, params: SamplingParams) -> None:
        if self.error is not None:
            raise RuntimeError(f"the engine failed: {self.error!r}")
        self.engine.add_request(request_id, prompt, params)  # raises InvalidRequestError to the caller
        self.owner[request_id] = client_id
        self._ensure_loop()
        self._wake.set()

    async def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self.owner.pop(request_id, None) is not None:
                self.engine.abort_request(request_id)
                self.started.discard(request_id)

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

    def stats(self) -> dict:
        stats = self.engine.stats()
        stats["error"] = repr(self.error) if self.error is not None else None
        return stats

    async def shutdown(self) -> None:
        self._stopping = True
        if self._wake is not None:
            self._wake.set()
        if self._loop_task is not None:
            await asyncio.wait([self._loop_task], timeout=30)
        if self.engine is not None:
            self.executor.shutdown()

    # ---- the step loop --------------------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        engine = self.engine
        in_flight: deque = deque()  # (plan, ObjectRef), oldest first
        try:
            while not self._stopping:
                self._launch(in_flight)
                if not in_flight:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                plan, ref = in_flight.popleft()
                output = await ref
                updated = engine.update_step(plan, output)
                # Top the pipeline up before detokenizing, so the leader always has its next plan.
                self._launch(in_flight)
                self._deliver(engine.process_step(updated, output))
        except Exception as exc:
            logger.exception("engine step loop failed")
            self.error = exc
            for client in self.clients.values():
                client.ready.set()

    def _launch(self, in_flight: deque) -> None:
        """Keep `pipeline_depth` plans at the workers. A plan is made before the previous step's tokens
        are known (the scheduler counts them as pending; the leader's runner already has them), so the
        leader runs step after step without waiting for a round trip through Ray."""
        while len(in_flight) < self.pipeline_depth and self.engine.scheduler.has_unfinished:
            plan = self.engine.schedule_step()
            if plan is None:
                return
            in_flight.append((plan, self.executor.execute_async(plan)))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            client_id = self.owner.get(output.request_id)
            if client_id is None:
                continue
            first = output.request_id not in self.started
            self.started.add(output.request_id)
            if output.finished:
                del self.owner[output.request_id]
                self.started.discard(output.request_id)
            client = self.clients[client_id]
            client.outbox.append(OutputDelta.from_output(output, first))
            client.ready.set()
