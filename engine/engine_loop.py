"""One thread owns an LLMEngine: it builds the engine, runs its step loop, and takes commands (add, abort)
from other threads through a queue between steps, so no caller ever waits behind a lock for a step to end.

What each step produces goes to `publish`, called on the step thread with the step's outputs; a failed
step goes to `fail`. The in-process asyncio front (AsyncLLM) and the Ray coordinator differ only there.
The engine is built on the step thread itself, so that everything the engine does on a GPU (loading,
graph capture, steps) runs on one thread with one current device.
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from typing import Callable

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine's step loop failed or stopped; no request can be served any more."""


class EngineLoop:
    def __init__(self, build_engine: Callable[[], LLMEngine], publish: Callable[[list[RequestOutput]], None],
                 fail: Callable[[BaseException], None], name: str = "engine-step-loop") -> None:
        self._publish, self._fail = publish, fail
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._work = threading.Event()
        self._built: concurrent.futures.Future = concurrent.futures.Future()
        self.engine: LLMEngine | None = None
        self.error: BaseException | None = None
        self._stats: dict = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._main, args=(build_engine,), name=name, daemon=True)
        self._thread.start()

    @property
    def built(self) -> concurrent.futures.Future:
        """Resolves to the engine once built, or raises what building it raised."""
        return self._built

    @property
    def is_healthy(self) -> bool:
        return self.engine is not None and self.error is None and not self._stopped

    def add(self, request_id: str, prompt, params: SamplingParams) -> concurrent.futures.Future:
        """Queue a request; the future resolves when the engine took it, or raises why it refused it."""
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("add", request_id, prompt, params, accepted))
        return accepted

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks (before the next step)."""
        self._send(("abort", request_id))

    def stats(self) -> dict:
        """The engine's counters as of the latest step or command."""
        return dict(self._stats)

    def shutdown(self, timeout_s: float = 90.0) -> None:
        """Stop the loop; the step thread shuts the engine down itself (on its own current device)."""
        self._stopped = True
        self._work.set()
        self._thread.join(timeout=timeout_s)

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._work.set()
        if not self._thread.is_alive():  # the loop has exited: nobody will take the command
            self._refuse_pending_commands()

    # ---- the step thread ------------------------------------------------------------------------------
    def _main(self, build_engine: Callable[[], LLMEngine]) -> None:
        try:
            engine = build_engine()
        except BaseException as exc:
            self.error = exc
            self._built.set_exception(exc)
            self._refuse_pending_commands()
            return
        self.engine, self._stats = engine, engine.stats()
        self._built.set_result(engine)
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
                self._fail(exc)
                break
            self._stats = engine.stats()
            if outputs:
                self._publish(outputs)
        self._refuse_pending_commands()
        try:
            engine.shutdown()
        except Exception:
            logger.exception("engine shutdown failed")

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
                command[-1].set_exception(EngineDeadError(f"the engine is stopped{f': {self.error!r}' if self.error else ''}"))

    def _run_commands(self) -> None:
        ran = False
        for command in self._take_commands():
            ran = True
            if command[0] == "add":
                _, request_id, prompt, params, accepted = command
                try:
                    self.engine.add_request(request_id, prompt, params)
                except Exception as exc:  # refused: the caller raises it
                    accepted.set_exception(exc)
                    continue
                accepted.set_result(None)
            else:
                self.engine.abort_request(command[1])
        if ran:
            self._stats = self.engine.stats()
