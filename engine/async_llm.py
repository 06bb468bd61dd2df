"""asyncio front of an in-process engine: the step loop runs on a background thread, each caller awaits
its own stream of outputs. The Ray client (atom_ray) offers the same methods for a distributed engine."""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import AsyncIterator

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine's step loop failed; no request can be served any more."""


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="engine-step-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, show_progress: bool = False) -> "AsyncLLM":
        return cls(LLMEngine(config, show_progress=show_progress))

    @property
    def is_healthy(self) -> bool:
        return self.error is None and not self._stopped

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (each cumulative, with the step's delta). Raises InvalidRequestError
        before the first output if the request is refused. Leaving the loop early aborts the request."""
        if self.error is not None:
            raise EngineDeadError(f"the engine failed earlier: {self.error!r}")
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            request_id = request_id or self.engine.new_request_id()
            self.engine.add_request(request_id, prompt, params)
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._work.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine failed: {item!r}") from item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)
        self._work.set()  # the next step tells the runner to forget it

    def stats(self) -> dict:
        with self._lock:
            return self.engine.stats()

    def shutdown(self) -> None:
        self._stopped = True
        self._work.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()

    def _loop(self) -> None:
        while not self._stopped:
            with self._lock:
                busy = self.engine.has_unfinished_requests()
                if busy:
                    try:
                        outputs = self.engine.step()
                    except BaseException as exc:  # a failed step leaves the engine state unknown
                        logger.exception("engine step failed")
                        self.error = exc
                        self._fail_all(exc)
                        return
                    for output in outputs:
                        self._deliver(output.request_id, output, remove=output.finished)
            if not busy:
                self._work.wait(timeout=0.5)
                self._work.clear()

    def _deliver(self, request_id: str, item, remove: bool) -> None:
        stream = self._streams.pop(request_id, None) if remove else self._streams.get(request_id)
        if stream is not None:
            loop, queue = stream
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self._streams):
            self._deliver(request_id, exc, remove=True)
