"""The engine side of one HTTP request: its engine requests (one per prompt) read as a single stream, aborted
when the request ends early; the in-flight limit; and waiting on work while watching for a client that left."""
from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

from .errors import bad_request, too_many_requests
from .metrics import AppMetrics, RequestTimer

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was complete."""


async def resolve(value: Any) -> Any:
    """A client's answer, whether the client returned it or an awaitable of it (a remote call)."""
    return await value if inspect.isawaitable(value) else value


class Admission:
    """Counts the sequences in flight at this app (a request with 4 prompts and n=2 is 8) and turns away
    what is past the limit: 429 when the others must finish first, 400 when the request alone is larger."""

    def __init__(self, max_pending_sequences: int) -> None:
        self.max_pending_sequences = max_pending_sequences
        self.in_flight = 0

    def admit(self, num_sequences: int) -> Ticket:
        if num_sequences > self.max_pending_sequences:
            raise bad_request(f"The request asks for {num_sequences} sequences (prompts x n), more than this "
                              f"server runs at once ({self.max_pending_sequences}); split it", "n")
        if self.in_flight + num_sequences > self.max_pending_sequences:
            raise too_many_requests(self.in_flight, self.max_pending_sequences)
        self.in_flight += num_sequences
        return Ticket(self, num_sequences)


class Ticket:
    __slots__ = ("admission", "num_sequences")

    def __init__(self, admission: Admission, num_sequences: int) -> None:
        self.admission: Admission | None = admission
        self.num_sequences = num_sequences

    def release(self) -> None:
        if self.admission is not None:  # idempotent: both a finally and a response close may call it
            self.admission.in_flight -= self.num_sequences
            self.admission = None


_ABORTS_IN_FLIGHT: set[asyncio.Future] = set()


class EngineRequests:
    """The engine requests of one HTTP request, one per prompt. `outputs()` yields (prompt index, output) in
    arrival order; `close()` aborts the unfinished ones so their KV blocks are freed."""

    def __init__(self, client, prompts: list[list[int]], params: SamplingParams, request_ids: list[str],
                 metrics: AppMetrics, arrival_time: float) -> None:
        self.client = client
        self.prompts = prompts
        self.params = params
        self.request_ids = request_ids
        self.unfinished = set(range(len(prompts)))
        self.timers = [RequestTimer(metrics, arrival_time) for _ in prompts]
        self.metrics = metrics
        self._generators: list = []
        self._tasks: list[asyncio.Task] = []

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            if len(self.prompts) == 1:  # the common case, read directly without a task
                generator = self.client.generate(self.prompts[0], self.params, self.request_ids[0])
                self._generators.append(generator)
                async for output in generator:
                    self._observe(0, output)
                    yield 0, output
            else:
                async for index, output in self._merged():
                    self._observe(index, output)
                    yield index, output
        finally:
            await self.close()

    def _observe(self, index: int, output: RequestOutput) -> None:
        self.timers[index].on_output(output.finished, output.metrics)
        if output.finished:
            self.unfinished.discard(index)
            for completion in output.outputs:
                self.metrics.record_finished(completion.finish_reason)

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(index: int) -> None:
            generator = self.client.generate(self.prompts[index], self.params, self.request_ids[index])
            self._generators.append(generator)
            try:
                async for output in generator:
                    queue.put_nowait((index, output))
            except Exception as exc:  # handed to the reader, which raises it in the request's context
                queue.put_nowait((index, exc))
            queue.put_nowait((index, done))

        self._tasks = [asyncio.create_task(pump(index)) for index in range(len(self.prompts))]
        remaining = len(self._tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item

    def abort(self) -> None:
        """Abort what has not finished, without awaiting anything: it runs whole even in a task whose every
        await is cancelled (Serve cancels the handler of a client that left, and a cancelled scope cancels
        each later await), so cleanup code calls it before its first await. Safe to call more than once."""
        for task in self._tasks:
            task.cancel()
        for index in sorted(self.unfinished):
            result = self.client.abort(self.request_ids[index])
            if inspect.isawaitable(result):  # kept referenced until done: the loop holds tasks weakly
                task = asyncio.ensure_future(result)
                _ABORTS_IN_FLIGHT.add(task)
                task.add_done_callback(_ABORTS_IN_FLIGHT.discard)
            for _ in range(self.params.n):
                self.metrics.record_finished("abort")
        self.unfinished.clear()

    async def close(self) -> None:
        """`abort`, then close the engine streams (each awaited alone: one that fails skips none of the
        others)."""
        self.abort()
        generators, self._generators = self._generators, []
        for generator in generators:
            try:
                await generator.aclose()
            except (Exception, asyncio.CancelledError):
                pass


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientDisconnected) if the HTTP client goes away first.
    The body has been read by now, so the next ASGI message is the disconnect: it is awaited, not polled
    for (uvicorn and Serve's proxy repeat it to later readers such as the streaming response)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientDisconnected()
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (a receive channel that fails counts as gone)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:
        pass
