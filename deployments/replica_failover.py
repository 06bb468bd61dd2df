"""Failover across Serve replicas: the engine client of one replica (what the OpenAI app and the handle methods
call) that keeps, per request, what its client was handed (atom_ray/request_journal.py: prompt ids, params,
per sample the token ids and characters delivered) and, when the engine under a request fails mid-stream,
continues it elsewhere from there (engine/resume.py) under the same request id, in the same stream:

- on another replica of the deployment, through a Serve handle (`resume_stream`; the router,
  deployments/replica_router.py, never sends it back here), whose engine runs the continuation and streams
  its output deltas back; or
- on this replica's own engine once the supervisor (atom_ray/supervisor.py) has started it again,

whichever takes it first, within `resume_timeout_s` of the failure; past that the request ends with a clean
error (503 before the stream started, an error event after). The caller sees one stream: nothing repeated
or dropped, the first prompt and cache hit, usage of the original prompt plus every completion token.
The replica itself holds the HTTP connection: a replica process that dies takes its streams with it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import AsyncIterator, Callable

from engine.errors import EngineDeadError, RequestFailedError
from engine.outputs import RequestOutput
from engine.resume import ResumeState
from engine.sampling_params import SamplingParams

from atom_ray.client import OutputAccumulator, unwrap_ray_error
from atom_ray.coordinator import OutputDelta
from atom_ray.request_journal import RequestRecord
from deployments.replica_router import AVOID_REPLICA

logger = logging.getLogger(__name__)

PEER_ATTEMPT_S = 2.0  # one try to have another replica take a continuation: routed, and its engine serving
RETRY_INTERVAL_S = 0.25
LOCAL_POLL_S = 0.1

Peers = Callable[[], tuple[object, str]]  # -> (a handle to this deployment, this replica's tag)


def is_engine_failure(exc: BaseException) -> bool:
    """The engine or replica under a request is gone (the request itself is not at fault): worth continuing
    elsewhere. Ray wraps a remote exception in a RayTaskError whose `cause` is the original."""
    import ray
    from ray.serve.exceptions import ReplicaUnavailableError
    failures = (EngineDeadError, ray.exceptions.RayActorError, ReplicaUnavailableError)
    return isinstance(exc, failures) or isinstance(getattr(exc, "cause", None), failures)


def _as_delivered(output: RequestOutput | None, record: RequestRecord) -> RequestOutput | None:
    """`output` as its client has it. An engine's cumulative text may end with text it still holds back (a
    possible stop string), which a continuation sends again: only what was sent is kept."""
    if output is None:
        return None
    outputs = [dataclasses.replace(c, text=c.text[:record.samples[c.index].num_chars]) for c in output.outputs]
    return dataclasses.replace(output, outputs=outputs)


class ReplicaFailover:
    """The SupervisedEngine's client interface (generate, abort, stats, tokenizer, max_model_len, is_healthy)
    with every request journaled and continued when its engine fails. `peers` (None outside Serve) reaches
    the other replicas; `resume_timeout_s` 0 turns failover off."""

    def __init__(self, engine, resume_timeout_s: float, peers: Peers | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.resume_timeout_s = resume_timeout_s
        self._peers = peers
        self._peer_streams: dict[str, object] = {}  # request id -> the handle stream running its continuation
        self.resumed_requests = self.failed_resumes = self.peer_continuations = 0
        self.resume_latency_s_sum = self.resume_latency_s_max = 0.0

    @property
    def is_healthy(self) -> bool:
        return self.engine.is_healthy

    def stats(self) -> dict:
        stats = self.engine.stats()
        stats.update(replica_resumed_requests=self.resumed_requests, replica_failed_resumes=self.failed_resumes,
                     replica_resume_latency_s_sum=self.resume_latency_s_sum,
                     replica_resume_latency_s_max=self.resume_latency_s_max, peer_continuations=self.peer_continuations)
        return stats

    def abort(self, request_id: str) -> None:
        """Stop the request wherever it runs now (without awaiting anything: see EngineRequests.abort)."""
        self.engine.abort(request_id)
        stream = self._peer_streams.pop(request_id, None)
        if stream is not None:
            stream.cancel()

    async def generate(self, prompt, params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs, each cumulative with the step's delta, across however many engines run it.
        Until its first failure the engine's own outputs pass through; after, they are rebuilt from deltas."""
        request_id = request_id or f"request-{uuid.uuid4().hex}"
        record = RequestRecord.new(prompt, params)
        merged: OutputAccumulator | None = None  # from the first failure on
        last: RequestOutput | None = None
        source = self._local_source(prompt, params, request_id, None)
        while True:
            try:
                async for output, delta in source:
                    now = time.monotonic()
                    if record.resumed_at is not None:  # the continuation's first output
                        self._count_resumed(now - record.resumed_at)
                        record.resumed_at = None
                    delta = record.record(delta, now)
                    last = output if merged is None else merged.apply(delta)
                    yield last
                    if last.finished:
                        return
                failure: BaseException = EngineDeadError("the engine's stream ended before the request finished")
            except Exception as exc:
                if not is_engine_failure(exc):
                    raise self._not_continued(record, exc) from None
                failure = exc
            finally:
                await source.aclose()
            if self.resume_timeout_s <= 0:
                raise unwrap_ray_error(failure)
            if merged is None:
                merged = OutputAccumulator(prompt, _as_delivered(last, record))
            source = await self._continuation(record, request_id, failure)

    async def resume_stream(self, request: dict) -> AsyncIterator[list[OutputDelta]]:
        """Run another replica's continuation on this engine: first an empty list (taken: this engine serves),
        then the output deltas. `request`: request_id, prompt (token ids), params, resume."""
        if not self.engine.is_healthy:
            raise EngineDeadError("this replica's engine is not serving (it is being restarted)")
        yield []
        self.peer_continuations += 1
        stream = self.engine.generate(request["prompt"], request["params"], request["request_id"], request["resume"])
        try:
            first = True
            async for output in stream:
                yield [OutputDelta.from_output(output, first)]
                first = False
        finally:
            await stream.aclose()

    # ---- where a request's outputs come from --------------------------------------------------------------
    async def _local_source(self, prompt, params: SamplingParams, request_id: str, resume: ResumeState | None):
        """(output, delta) pairs from this replica's engine."""
        stream = self.engine.generate(prompt, params, request_id, resume)
        try:
            first = True
            async for output in stream:
                yield output, OutputDelta.from_output(output, first)
                first = False
        finally:
            await stream.aclose()

    async def _peer_source(self, stream, request_id: str):
        """(None, delta) pairs from a continuation another replica runs."""
        try:
            async for deltas in stream:
                for delta in deltas:
                    yield None, delta
        finally:
            if self._peer_streams.get(request_id) is stream:
                del self._peer_streams[request_id]
            stream.cancel()

    # ---- failover ---------------------------------------------------------------------------------------------
    async def _continuation(self, record: RequestRecord, request_id: str, failure: BaseException):
        """The source of the request's continuation: another replica or the restarted engine, whichever takes
        it first within resume_timeout_s of the failure; past that a clean error. A continuation that fails
        again before its first output is tried again after a pause, within the same time."""
        now = time.monotonic()
        if record.resumed_at is not None:
            await asyncio.sleep(RETRY_INTERVAL_S)
        else:
            record.resumed_at = now  # until the continuation's first output: the pause the client sees
        prompt, params, resume = record.continuation()
        record.num_resumes += 1
        cause = unwrap_ray_error(failure)
        logger.warning("request %s: its engine failed (%r); continuing it on another replica or the restarted "
                       "engine", request_id, cause)
        request = {"request_id": request_id, "prompt": prompt, "params": params, "resume": resume}
        source = await self._first_taker(request, record.resumed_at + self.resume_timeout_s)
        if source is None:
            self.failed_resumes += 1
            raise EngineDeadError(f"the engine under this request failed ({cause}) and neither another replica nor "
                                  f"the restarted engine took the request over within {self.resume_timeout_s:g} s")
        return source

    async def _first_taker(self, request: dict, deadline: float):
        """Race the local engine's restart against another replica taking the request; None at the deadline."""
        local = asyncio.ensure_future(self._local_serving(deadline))
        peer = asyncio.ensure_future(self._peer_taking(request, deadline)) if self._peers is not None else None
        pending = {local} if peer is None else {local, peer}
        taken, by_peer = None, False
        try:
            while pending and taken is None:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if local in done and local.result():  # preferred: no relay through another replica
                    taken = self._local_source(request["prompt"], request["params"], request["request_id"],
                                               request["resume"])
                elif peer is not None and peer in done and peer.result() is not None:
                    taken, by_peer = self._peer_source(peer.result(), request["request_id"]), True
            return taken
        finally:
            for task in (local, peer):
                if task is not None and not task.done():
                    task.cancel()
            if peer is not None and not by_peer and peer.done() and not peer.cancelled() and peer.result() is not None:
                peer.result().cancel()  # taken by the restarted engine at the same moment
                self._peer_streams.pop(request["request_id"], None)

    async def _local_serving(self, deadline: float) -> bool:
        while time.monotonic() < deadline:
            if self.engine.is_healthy:
                return True
            await asyncio.sleep(LOCAL_POLL_S)
        return False

    async def _peer_taking(self, request: dict, deadline: float):
        """A handle stream on which another replica has taken the continuation; None at the deadline."""
        try:
            handle, own_tag = self._peers()
        except Exception as exc:  # not in a Serve replica after all, or Serve's controller unreachable
            logger.warning("no handle to the other replicas: %r", exc)
            return None
        while (remaining := deadline - time.monotonic()) > 0:
            stream = None
            try:
                stream = handle.options(stream=True).resume_stream.remote(request, **{AVOID_REPLICA: own_tag})
                await asyncio.wait_for(stream.__anext__(), min(PEER_ATTEMPT_S, remaining))
                self._peer_streams[request["request_id"]] = stream
                return stream
            except BaseException as exc:  # no other replica (a time-out), its engine restarting too, or gone
                if stream is not None:
                    stream.cancel()
                if not isinstance(exc, Exception):  # cancelled: the request was taken elsewhere, or given up
                    raise
                logger.debug("no replica took request %s: %r", request["request_id"], exc)
            await asyncio.sleep(min(RETRY_INTERVAL_S, max(0.0, deadline - time.monotonic())))
        return None

    def _count_resumed(self, latency_s: float) -> None:
        self.resumed_requests += 1
        self.resume_latency_s_sum += latency_s
        self.resume_latency_s_max = max(self.resume_latency_s_max, latency_s)

    def _not_continued(self, record: RequestRecord, exc: BaseException) -> BaseException:
        """The error a request ends with when it is not continued: a continuation the engine refused (it no
        longer fits, its grammar refuses the delivered tokens) says so and counts as a failed resume."""
        exc = unwrap_ray_error(exc)
        if record.resumed_at is None:  # not resumed, or its continuation already produced outputs
            return exc
        record.resumed_at = None
        self.failed_resumes += 1
        return RequestFailedError(f"the request could not be continued after its engine failed: {exc}")
