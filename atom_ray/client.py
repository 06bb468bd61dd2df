"""Client of a Coordinator, with the same methods as engine.async_llm.AsyncLLM (generate, abort, stats,
tokenizer, max_model_len, is_healthy), so the HTTP app runs unchanged on a distributed engine.

One background thread keeps one poll call outstanding and fans each batch of outputs out to the
waiting requests' asyncio queues, whichever event loops they belong to: one thread hop per event loop per
batch, not one per request (each hop wakes the loop; at batch 16 that was 16 wake-ups per engine step).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import uuid
from typing import AsyncIterator

from engine.errors import EngineDeadError, RequestFailedError
from engine.outputs import CompletionOutput, RequestOutput, drain_merged
from engine.resume import ResumeState
from engine.sampling_params import SamplingParams

from atom_ray.coordinator import OutputDelta

logger = logging.getLogger(__name__)


def unwrap_ray_error(exc: BaseException) -> BaseException:
    """The user-facing exception inside a RayTaskError (e.g. InvalidRequestError from add_request); a
    coordinator that died or cannot be reached is an EngineDeadError (HTTP 503 with Retry-After), not the
    actor error as it came."""
    import ray
    if isinstance(exc, ray.exceptions.RayActorError):  # died, or unavailable
        return EngineDeadError(f"the engine's coordinator is not available ({type(exc).__name__}: {exc})")
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


async def shielded(future: concurrent.futures.Future):
    """`future`'s result, awaited so that the caller's cancellation does not cancel it. Its outcome is read
    even when it comes after the caller has gone: asyncio.shield stops watching the inner future once the
    outer one is cancelled (Python 3.11), and an error nobody reads is logged as "Future exception was never
    retrieved" (once per client that gave up while a rank hung: Ray cancels the call late)."""
    wrapped = asyncio.wrap_future(future)
    wrapped.add_done_callback(_read_outcome)
    return await asyncio.shield(wrapped)


def _read_outcome(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()

class OutputAccumulator:
    """A request's cumulative RequestOutput, built from its OutputDeltas (each a fresh object: earlier ones stay
    valid). Started from `output`, it continues that output (a request resumed elsewhere, deployments/)."""

    def __init__(self, prompt=None, output: RequestOutput | None = None) -> None:
        self.output = output
        self.prompt = prompt if isinstance(prompt, str) else None

    def apply(self, delta: OutputDelta) -> RequestOutput:
        """The cumulative RequestOutput after this delta."""
        if self.output is None:
            self.output = RequestOutput(delta.request_id, self.prompt, delta.prompt_token_ids or [], [],
                                        prompt_logprobs=delta.prompt_logprobs)
        completions = {c.index: c for c in self.output.outputs}
        for change in delta.completions:
            current = completions.get(change.index) or CompletionOutput(
                index=change.index, logprobs=[] if change.new_logprobs is not None else None)
            completions[change.index] = CompletionOutput(
                index=change.index, text=current.text + change.new_text,
                token_ids=current.token_ids + change.new_token_ids, finish_reason=change.finish_reason,
                stop_reason=change.stop_reason,
                logprobs=(current.logprobs or []) + change.new_logprobs if change.new_logprobs is not None
                else current.logprobs,
                new_text=change.new_text, new_token_ids=change.new_token_ids)
        changed = {c.index for c in delta.completions}
        outputs = [completions[i] if i in changed else _without_delta(completions[i]) for i in sorted(completions)]
        self.output = RequestOutput(self.output.request_id, self.output.prompt, self.output.prompt_token_ids,
                                    outputs, delta.finished, self.output.prompt_logprobs, delta.num_cached_tokens,
                                    delta.metrics or self.output.metrics, delta.error)
        return self.output


class _Stream(OutputAccumulator):
    def __init__(self, loop: asyncio.AbstractEventLoop, prompt) -> None:
        super().__init__(prompt)
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, item) -> bool:
        """Hand an item to the reader's event loop; False if that loop has closed."""
        return _hand_over(self.loop, [(self, item)])


def _hand_over(loop: asyncio.AbstractEventLoop, items: list[tuple[_Stream, object]]) -> bool:
    """Queue each item for its stream's reader with a single call into `loop`; False if it has closed."""
    try:
        loop.call_soon_threadsafe(_put_all, items)
        return True
    except RuntimeError:
        return False


def _put_all(items: list[tuple[_Stream, object]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


def _without_delta(completion: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(completion.index, completion.text, completion.token_ids, completion.finish_reason,
                            completion.stop_reason, completion.logprobs)


class RayEngineClient:
    POLL_TIMEOUT_S = 1.0
    # A poll answers within POLL_TIMEOUT_S; one that has not answered this much later means the coordinator
    # hangs (a stopped process, a stuck event loop): its requests fail and the client reports it dead.
    COORDINATOR_SILENCE_S = 10.0

    def __init__(self, coordinator, info: dict) -> None:
        self.coordinator = coordinator
        self.client_id = uuid.uuid4().hex[:12]
        self.tokenizer = info["tokenizer"]
        self.max_model_len = info["max_model_len"]
        self.model = info["model"]
        self._ids = itertools.count()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._stats: dict = info.get("stats", {})
        self.error: BaseException | None = None
        self._closed = False
        self._poller = threading.Thread(target=self._poll_loop, name=f"atom-ray-poll-{self.client_id}", daemon=True)
        self._poller.start()

    @property
    def is_healthy(self) -> bool:
        return self.error is None and not self._closed and not self._stats.get("error")

    def stats(self) -> dict:
        return dict(self._stats)

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None,
                       resume: ResumeState | None = None) -> AsyncIterator[RequestOutput]:
        """`resume`: the request continues one that failed elsewhere (engine/resume.py); its outputs then carry
        only what comes after what was delivered."""
        if not self.is_healthy:
            raise EngineDeadError(f"the engine is not available: {self.error or self._stats.get('error')}")
        request_id = request_id or f"{self.client_id}-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), prompt)
        with self._lock:  # registered first: outputs may arrive before add_request returns
            self._streams[request_id] = stream
        added = self.coordinator.add_request.remote(self.client_id, request_id, prompt, params,
                                                   resume).future()
        try:
            # Shielded: a caller that is cancelled (its HTTP client left) must not cancel the coordinator's call
            # half-way; the request is aborted below instead, after the add, which the coordinator orders.
            await shielded(added)
        except BaseException as exc:
            # Refused, or this caller was cancelled while the add was under way: the coordinator may have
            # taken the request already, so it is aborted (a no-op for one it never took).
            self.abort(request_id)
            if isinstance(exc, Exception):
                raise unwrap_ray_error(exc) from None
            raise
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine failed: {item!r}") from item
                item = drain_merged(stream.queue, item)  # a slow reader gets one output per read
                finished = item.finished
                if item.error is not None:
                    raise RequestFailedError(item.error)
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        self.coordinator.abort.remote([request_id])

    def close(self) -> None:
        self._closed = True

    def _poll_loop(self) -> None:
        import ray
        while not self._closed:
            try:
                deltas, stats = ray.get(self.coordinator.poll.remote(self.client_id, self.POLL_TIMEOUT_S),
                                        timeout=self.POLL_TIMEOUT_S + self.COORDINATOR_SILENCE_S)
            except Exception as exc:
                if not self._closed:
                    if isinstance(exc, ray.exceptions.GetTimeoutError):
                        exc = EngineDeadError(f"the coordinator has not answered for {self.COORDINATOR_SILENCE_S:.0f} s "
                                              "(its process hangs)")
                    logger.error("coordinator unreachable: %r", exc)
                    self.error = exc
                    self._fail_all(exc)
                return
            self._stats = stats
            if stats.get("error"):
                self._fail_all(RuntimeError(stats["error"]))
            if deltas:
                self._dispatch(deltas)

    def _dispatch(self, deltas: list[OutputDelta]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        with self._lock:
            streams = [(delta, self._streams.pop(delta.request_id, None) if delta.finished
                        else self._streams.get(delta.request_id)) for delta in deltas]
        for delta, stream in streams:
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, stream.apply(delta)))
        for loop, items in by_loop.items():
            if not _hand_over(loop, items):
                for _, output in items:
                    self.abort(output.request_id)  # their readers' event loop is gone

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.put(exc)
