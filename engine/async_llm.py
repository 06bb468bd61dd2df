"""asyncio front of an in-process engine. An EngineLoop thread owns the engine and runs its step loop;
callers send it commands (add, abort) and await their own stream of outputs, so no caller ever waits
behind a lock for the loop to let go. The Ray client (atom_ray) offers the same methods for a
distributed engine. `shutdown()`, the end of a `with` (or `async with`) block, or dropping the AsyncLLM stops
the loop, which gives the engine's memory back."""
from __future__ import annotations

import asyncio
import threading
import weakref
from typing import AsyncIterator

from engine.config import EngineConfig
from engine.engine_loop import EngineLoop
from engine.errors import EngineDeadError, RequestFailedError
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput, drain_merged
from engine.resume import ResumeState
from engine.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "EngineDeadError"]


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        # The loop's thread reaches this object only weakly, so that a dropped AsyncLLM is collected and
        # its finalizer stops the loop (which then shuts the engine down).
        self._loop = EngineLoop(lambda: engine, _weak_method(self._publish), _weak_method(self._fail_all),
                                step_timeout_s=engine.config.step_timeout_s)
        self._finalizer = weakref.finalize(self, _stop_loop, self._loop)
        self._finalizer.atexit = False
        self._loop.built.result()

    @classmethod
    def from_config(cls, config: EngineConfig, show_progress: bool = False) -> "AsyncLLM":
        return cls(LLMEngine(config, show_progress=show_progress))

    @property
    def error(self) -> BaseException | None:
        return self._loop.error

    @property
    def is_healthy(self) -> bool:
        return self._loop.is_healthy

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None,
                       resume: ResumeState | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (each cumulative, with the step's delta). Raises InvalidRequestError
        before the first output if the request is refused. Leaving the loop early aborts the request.
        `resume`: the request continues one that failed elsewhere (engine/resume.py)."""
        if not self._finalizer.alive:
            raise EngineDeadError("this AsyncLLM was shut down; create a new one to generate")
        if self.error is not None:
            raise EngineDeadError(f"the engine failed earlier: {self.error!r}")
        request_id = request_id or self.engine.new_request_id()
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:  # registered first: outputs may arrive before the add is confirmed
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
        try:
            await asyncio.wrap_future(self._loop.add(request_id, prompt, params, resume))  # a refusal is raised here
        except BaseException:
            # Refused, or the caller was cancelled: a request the engine took just before is stopped again.
            self.abort(request_id)
            raise
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine failed: {item!r}") from item
                item = drain_merged(stream, item)  # a slow reader gets one output per read, not a backlog
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
        """Stop a request and free its KV blocks (takes effect before the next step)."""
        with self._lock:
            self._streams.pop(request_id, None)
        self._loop.abort(request_id)

    def stats(self) -> dict:
        """The engine's counters as of the latest step."""
        return self._loop.stats()

    def shutdown(self) -> None:
        """Stop the step loop, which frees the engine's weights, KV cache and graphs; generate raises
        EngineDeadError afterwards. Calling it again does nothing."""
        self._finalizer()

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await asyncio.to_thread(self.shutdown)  # it waits for the step thread: not on the event loop

    # ---- called on the step thread ----------------------------------------------------------------------
    def _publish(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._deliver(output.request_id, output, remove=output.finished)

    def _deliver(self, request_id: str, item, remove: bool) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None) if remove else self._streams.get(request_id)
        if stream is not None:
            loop, queue_ = stream
            try:
                loop.call_soon_threadsafe(queue_.put_nowait, item)
            except RuntimeError:  # the caller's event loop is gone: nobody reads this stream any more
                self.abort(request_id)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._deliver(request_id, exc, remove=True)


def _weak_method(method):
    """`method` called through a weak reference to its object: a no-op once the object is gone."""
    ref = weakref.WeakMethod(method)

    def call(*args) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)
    return call


def _stop_loop(loop: EngineLoop) -> None:
    try:
        loop.shutdown()
    except RuntimeError:  # dropped on the step thread itself, which cannot wait for itself; it stops next
        pass
