"""asyncio front of an in-process engine. One thread owns the engine and runs its step loop; callers send
it commands (add, abort) through a queue and await their own stream of outputs, so no caller ever waits
behind a lock for the loop to let go. The Ray client (atom_ray) offers the same methods for a
distributed engine."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import AsyncIterator

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput, drain_merged
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine's step loop failed; no request can be served any more."""


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._work = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # step thread only
        self._stats = engine.stats()
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
        request_id = request_id or self.engine.new_request_id()
        stream: asyncio.Queue = asyncio.Queue()
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("add", request_id, prompt, params, asyncio.get_running_loop(), stream, accepted))
        await asyncio.wrap_future(accepted)  # the engine's refusal, if any, is raised here
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine failed: {item!r}") from item
                item = drain_merged(stream, item)  # a slow reader gets one output per read, not a backlog
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks (takes effect before the next step)."""
        self._send(("abort", request_id))

    def stats(self) -> dict:
        """The engine's counters as of the latest step."""
        return dict(self._stats)

    def shutdown(self) -> None:
        self._stopped = True
        self._work.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._work.set()
        if not self._thread.is_alive():  # the loop has exited: nobody will take the command
            self._refuse_pending_commands()

    # ---- the step thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        while not self._stopped:
            self._work.clear()
            self._run_commands()
            if not engine.has_unfinished_requests():
                self._work.wait(timeout=0.5)
                continue
            try:
                outputs = engine.step()
            except BaseException as exc:  # a failed step leaves the engine state unknown
                logger.exception("engine step failed")
                self.error = exc
                self._fail_all(exc)
                break
            for output in outputs:
                self._deliver(output.request_id, output, remove=output.finished)
            self._stats = engine.stats()
        self._refuse_pending_commands()

    def _take_commands(self):
        """The commands sent so far, oldest first, each taken off the queue."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _refuse_pending_commands(self) -> None:
        for command in self._take_commands():
            if command[0] == "add":
                command[-1].set_exception(EngineDeadError("the engine is stopped"))

    def _run_commands(self) -> None:
        ran = False
        for command in self._take_commands():
            ran = True
            if command[0] == "add":
                _, request_id, prompt, params, loop, stream, accepted = command
                try:
                    self.engine.add_request(request_id, prompt, params)
                except Exception as exc:  # refused: the caller's generate() raises it
                    accepted.set_exception(exc)
                    continue
                self._streams[request_id] = (loop, stream)
                accepted.set_result(None)
            else:
                request_id = command[1]
                self._streams.pop(request_id, None)
                self.engine.abort_request(request_id)
        if ran:
            self._stats = self.engine.stats()

    def _deliver(self, request_id: str, item, remove: bool) -> None:
        stream = self._streams.pop(request_id, None) if remove else self._streams.get(request_id)
        if stream is not None:
            loop, queue_ = stream
            try:
                loop.call_soon_threadsafe(queue_.put_nowait, item)
            except RuntimeError:  # the caller's event loop is gone: nobody reads this stream any more
                self._streams.pop(request_id, None)
                self.engine.abort_request(request_id)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self._streams):
            self._deliver(request_id, exc, remove=True)

