"""One thread owns an LLMEngine: it builds the engine, runs its step loop, and takes commands (add, abort)
from other threads through a queue between steps, so no caller ever waits behind a lock for a step to end.

What each step produces goes to `publish`, called on the step thread with the step's outputs; an engine
that dies (a step raised, or overran the watchdog) goes to `fail`, once. The in-process asyncio front
(AsyncLLM) and the Ray coordinator differ only there. The engine is built on the step thread itself, so
that everything the engine does on a GPU (loading, graph capture, steps) runs on one thread with one
current device.

The watchdog: a step may run `step_timeout_s` longer than twice the slowest step so far (the first step,
which may compile kernels, gets four times `step_timeout_s`). Past that, a rank or a collective is taken
to hang: the engine is declared dead, its requests fail, and the stuck thread is left behind (a Python
thread cannot be stopped; the process that owns it is replaced by whoever supervises it).
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from typing import Callable

from engine.errors import EngineDeadError
from engine.llm_engine import LLMEngine
from engine.lockstep import BUSY, IDLE, STOP
from engine.outputs import RequestOutput
from engine.resume import ResumeState
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["EngineLoop", "EngineDeadError"]

FIRST_STEP_ALLOWANCE = 4  # the first step's limit, in step_timeout_s
# Lockstep DP ranks (MoE layers exchanging tokens across DP ranks) agree before every step (engine/lockstep.py).
# While all are idle they agree this often (a tiny CPU all-reduce), so a request that reaches one rank starts
# every rank's steps within this time.
LOCKSTEP_IDLE_POLL_S = 0.02


class EngineLoop:
    def __init__(self, build_engine: Callable[[], LLMEngine], publish: Callable[[list[RequestOutput]], None],
                 fail: Callable[[BaseException], None], name: str = "engine-step-loop",
                 step_timeout_s: float | None = None) -> None:
        self._publish, self._fail = publish, fail
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._work = threading.Event()
        self._built: concurrent.futures.Future = concurrent.futures.Future()
        self._dead_lock = threading.Lock()
        self.engine: LLMEngine | None = None
        self.error: BaseException | None = None
        self._stats: dict = {}
        self._stopped = False
        self._step_timeout_s = step_timeout_s
        self._step_started: float | None = None  # monotonic start of the running step
        self._slowest_step_s = 0.0
        self._steps_done = 0
        self._thread = threading.Thread(target=self._main, args=(build_engine,), name=name, daemon=True)
        self._thread.start()

    @property
    def built(self) -> concurrent.futures.Future:
        """Resolves to the engine once built, or raises what building it raised."""
        return self._built

    @property
    def is_healthy(self) -> bool:
        return self.engine is not None and self.error is None and not self._stopped

    def add(self, request_id: str, prompt, params: SamplingParams,
            resume: ResumeState | None = None) -> concurrent.futures.Future:
        """Queue a request (`resume`: one continued from a failed engine, engine/resume.py); the future
        resolves when the engine took it, or raises why it refused it. A caller that cancels the future
        before the engine takes the request withdraws it."""
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("add", request_id, prompt, params, resume, accepted))
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

    def step_limit_s(self) -> float | None:
        """How long the running step may take before the watchdog declares the engine dead."""
        if not self._step_timeout_s:
            return None
        if self._steps_done == 0:
            return FIRST_STEP_ALLOWANCE * self._step_timeout_s
        return self._step_timeout_s + 2 * self._slowest_step_s

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._work.set()
        if self.error is not None or not self._thread.is_alive():  # nobody will take the command
            self._refuse_pending_commands()

    def _die(self, exc: BaseException) -> None:
        """Declare the engine dead (once): refuse what is queued and tell `fail`."""
        with self._dead_lock:
            if self.error is not None:
                return
            self.error = exc
        self._refuse_pending_commands()
        self._fail(exc)

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
        if self._step_timeout_s:
            threading.Thread(target=self._watch, name=f"{self._thread.name}-watchdog", daemon=True).start()
        lockstep = engine.lockstep is not None  # every DP rank steps, or none does; a stop by any stops all
        while (lockstep or not self._stopped) and self.error is None:
            self._work.clear()
            try:
                self._run_commands()
            except BaseException as exc:  # adding or aborting broke the engine's own state
                logger.exception("engine command failed")
                self._die(exc)
                break
            if lockstep:
                engine.stop_requested = self._stopped
            elif not engine.has_unfinished_requests():
                self._work.wait(timeout=0.5)
                continue
            self._step_started = time.monotonic()
            try:
                outputs = engine.step()
            except BaseException as exc:  # a failed step leaves the engine state unknown
                logger.exception("engine step failed")
                self._die(exc)
                break
            finally:
                elapsed, self._step_started = time.monotonic() - self._step_started, None
            if self.error is not None:  # the watchdog gave up on this step while it ran
                break
            if not lockstep or engine.lockstep_status == BUSY:
                self._slowest_step_s = max(self._slowest_step_s, elapsed)
                self._steps_done += 1
            self._stats = engine.stats()
            if outputs:
                self._publish(outputs)
            if lockstep and engine.lockstep_status == STOP:
                break
            if lockstep and engine.lockstep_status == IDLE:
                self._work.wait(timeout=LOCKSTEP_IDLE_POLL_S)
        self._refuse_pending_commands()
        try:
            engine.shutdown()
        except Exception:
            logger.exception("engine shutdown failed")

    def _watch(self) -> None:
        while not self._stopped and self.error is None:
            started, limit = self._step_started, self.step_limit_s()
            if started is not None and time.monotonic() - started > limit:
                logger.error("an engine step has run for more than %.1f s: a rank or a collective hangs", limit)
                self._die(EngineDeadError(f"an engine step ran for more than {limit:.1f} s (the step watchdog's "
                                          "limit): a rank or a collective hangs"))
                return
            time.sleep(0.25)

    def _take_commands(self):
        """The commands sent so far, oldest first, each taken off the queue."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _refuse_pending_commands(self) -> None:
        for command in self._take_commands():
            if command[0] == "add" and command[-1].set_running_or_notify_cancel():
                reason = f": {self.error!r}" if self.error is not None else ""
                command[-1].set_exception(EngineDeadError(f"the engine is stopped{reason}"))

    def _run_commands(self) -> None:
        ran = False
        for command in self._take_commands():
            ran = True
            if command[0] == "add":
                _, request_id, prompt, params, resume, accepted = command
                if not accepted.set_running_or_notify_cancel():  # the caller gave up before the engine took it
                    continue
                try:
                    self.engine.add_request(request_id, prompt, params, resume=resume)
                except Exception as exc:  # refused: the caller raises it
                    accepted.set_exception(exc)
                    continue
                accepted.set_result(None)
            else:
                self.engine.abort_request(command[1])
        if ran:
            self._stats = self.engine.stats()
