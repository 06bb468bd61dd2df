"""An engine on Ray that brings itself back: when its engine dies (a step raised, the step watchdog fired, a
rank or the coordinator was killed), the requests in flight have already failed with a clear error (the
client fails them); the supervisor tears the dead engine down (its actors and placement group) and starts a
new one. Meanwhile it says it is unhealthy, so a new request gets a fast 503 instead of hanging. After
`max_restarts` failed starts in a row it gives up, and `failed` says why: Serve then replaces the replica.

It offers the client interface the OpenAI app takes (generate, abort, stats, tokenizer, max_model_len,
is_healthy), so the app is unaware of restarts. In a Serve replica, deployments/replica_failover.py sits
above it and continues the failed requests on another replica, or here once the engine is back."""
from __future__ import annotations

import logging
import threading
from typing import AsyncIterator, Callable

from engine.errors import EngineDeadError
from engine.outputs import RequestOutput
from engine.resume import ResumeState
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.2
TEARDOWN_TIMEOUT_S = 5.0


class SupervisedEngine:
    def __init__(self, start: Callable[[], "EngineHandle"], max_restarts: int = 5,  # noqa: F821
                 first_backoff_s: float = 2.0) -> None:
        self._start = start
        self.handle = start()  # a first start that fails is the caller's error (bad model, bad config)
        self.tokenizer = self.handle.tokenizer
        self.max_model_len = self.handle.client.max_model_len
        self.max_restarts, self.first_backoff_s = max_restarts, first_backoff_s
        self.restarts = 0
        self.restarting = False
        self.failed: str | None = None  # set when restarts are given up
        self.last_error: str | None = None
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="atom-ray-engine-supervisor", daemon=True)
        self._watcher.start()

    # ---- the client interface ---------------------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return not self.restarting and self.failed is None and self.handle.client.is_healthy

    def generate(self, prompt, params: SamplingParams, request_id: str | None = None,
                 resume: ResumeState | None = None) -> AsyncIterator[RequestOutput]:
        """The current engine's stream itself (not a wrapper around it: closing it must abort the request
        at once, not when a wrapper is collected). `resume`: a request continued after an engine failed."""
        if self.restarting or self.failed is not None:
            raise EngineDeadError(self._unavailable_reason())
        return self.handle.client.generate(prompt, params, request_id, resume)

    def abort(self, request_id: str) -> None:
        self.handle.client.abort(request_id)

    def stats(self) -> dict:
        stats = self.handle.client.stats()
        stats["engine_restarts"] = self.restarts
        return stats

    def shutdown(self) -> None:
        self._closed.set()
        self.handle.shutdown(timeout_s=TEARDOWN_TIMEOUT_S)

    def _unavailable_reason(self) -> str:
        if self.failed is not None:
            return f"the engine could not be restarted: {self.failed}"
        return f"the engine is restarting after a failure ({self.last_error})"

    # ---- the watcher thread -------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closed.wait(WATCH_INTERVAL_S):
            client = self.handle.client
            if client.is_healthy:
                continue
            self.last_error = repr(client.error) if client.error is not None else str(client.stats().get("error"))
            logger.error("the engine failed (%s); restarting it", self.last_error)
            self.restarting = True
            self._restart()
            self.restarting = False
            if self.failed is not None:
                return

    def _restart(self) -> None:
        self.handle.shutdown(timeout_s=TEARDOWN_TIMEOUT_S)  # kills the actors even when a rank hangs
        backoff = self.first_backoff_s
        for attempt in range(1, self.max_restarts + 1):
            if self._closed.is_set():
                return
            try:
                self.handle = self._start()
                if self._closed.is_set():  # shut down while this one started
                    self.handle.shutdown(timeout_s=TEARDOWN_TIMEOUT_S)
                    return
                self.restarts += 1
                logger.warning("the engine is serving again (restart %d)", self.restarts)
                return
            except Exception as exc:
                logger.error("restart attempt %d of %d failed: %r", attempt, self.max_restarts, exc)
                self.last_error = repr(exc)
            if self._closed.wait(backoff):
                return
            backoff = min(backoff * 2, 60.0)
        self.failed = self.last_error
