"""RayEngineClient's fan-out: a batch of outputs polled from the coordinator reaches each waiting request,
in order, with one hand-over per event loop (not one per request)."""
from __future__ import annotations

import asyncio
import sys
import threading

from atom_ray.client import RayEngineClient, _Stream
from atom_ray.coordinator import CompletionDelta, OutputDelta
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput


class _NoCoordinator:
    """abort() is the only coordinator call a dispatch can make."""

    class abort:
        calls: list = []

        @classmethod
        def remote(cls, request_ids):
            cls.calls.append(request_ids)


def _client() -> RayEngineClient:
    client = RayEngineClient.__new__(RayEngineClient)  # no poll thread: the test plays the poller
    client.coordinator, client._streams, client._lock = _NoCoordinator, {}, threading.Lock()
    return client


def _delta(request_id: str, token: int, text: str, finished: bool = False, metrics=None) -> OutputDelta:
    return OutputDelta(request_id, [CompletionDelta(0, text, [token], None, "length" if finished else None, None)],
                       finished, 0, prompt_token_ids=[1, 2], metrics=metrics)


def test_a_polled_batch_reaches_every_reader_in_order_with_one_hand_over_per_loop():
    # Streams are popped when they finish: the test keeps its own references.
    async def run_and_read():
        loop = asyncio.get_running_loop()
        client = _client()
        streams = {name: _Stream(loop, "p") for name in ("a", "b")}
        client._streams = dict(streams)
        hand_overs = []
        original = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda callback, *args: (hand_overs.append(callback), original(callback, *args))[1]
        batch = [_delta("a", 7, " x"), _delta("b", 8, " y"), _delta("a", 9, " z", finished=True)]
        await asyncio.to_thread(client._dispatch, batch)
        a = [await streams["a"].queue.get(), await streams["a"].queue.get()]
        b = [await streams["b"].queue.get()]
        return client, hand_overs, a, b

    client, hand_overs, a, b = asyncio.run(run_and_read())
    assert [callback.__name__ for callback in hand_overs].count("_put_all") == 1  # to_thread adds its own
    assert [o.outputs[0].token_ids for o in a] == [[7], [7, 9]] and a[-1].text == " x z" and a[-1].finished
    assert [o.outputs[0].new_text for o in a] == [" x", " z"]
    assert b[0].outputs[0].token_ids == [8] and not b[0].finished
    assert set(client._streams) == {"b"}  # a finished request is forgotten


def test_outputs_for_a_reader_whose_loop_has_closed_abort_its_request():
    loop = asyncio.new_event_loop()
    client = _client()
    client._streams = {"gone": _Stream(loop, "p")}
    loop.close()
    _NoCoordinator.abort.calls.clear()
    client._dispatch([_delta("gone", 7, " x")])
    assert _NoCoordinator.abort.calls == [["gone"]]


def test_engine_metrics_go_with_the_first_and_last_delta_and_stay_on_the_outputs():
    metrics = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.5, first_token_time=2.0, last_token_time=2.0)
    output = RequestOutput("r", "p", [1, 2], [CompletionOutput(0, " x", [7], new_text=" x", new_token_ids=[7])],
                           metrics=metrics)
    first = OutputDelta.from_output(output, first=True)
    metrics.last_token_time = 3.0  # the engine goes on updating its own object
    middle = OutputDelta.from_output(output, first=False)
    metrics.finished_time = 3.5
    output.finished = True
    last = OutputDelta.from_output(output, first=False)
    assert first.metrics == RequestMetrics(1.0, 1.5, 2.0, 2.0) and first.metrics is not metrics  # a snapshot
    assert middle.metrics is None  # not on every step's delta
    assert last.metrics.finished_time == 3.5

    stream = _Stream(asyncio.new_event_loop(), "p")
    outputs = [stream.apply(delta) for delta in (first, middle, last)]
    assert [o.metrics.last_token_time for o in outputs] == [2.0, 2.0, 3.0]
    assert outputs[-1].metrics.finished_time == 3.5


def test_a_request_sent_as_the_coordinator_dies_is_an_engine_dead_error(ray_cluster):
    """The coordinator's process dies during add_request: the caller gets EngineDeadError (the HTTP layer's
    503 with Retry-After), not Ray's ActorDiedError (a 500)."""
    import itertools

    import pytest
    import ray

    from deployments.openai.errors import from_exception
    from engine.errors import EngineDeadError
    from engine.sampling_params import SamplingParams

    @ray.remote(num_cpus=0)
    class DyingCoordinator:
        def add_request(self, *args):
            import os
            os._exit(1)

        def abort(self, request_ids):
            pass

    client = _client()
    client.coordinator = DyingCoordinator.remote()
    client.client_id, client._ids, client.error, client._closed, client._stats = "c", itertools.count(), None, False, {}

    async def send():
        async for _ in client.generate([1, 2, 3], SamplingParams(max_tokens=2)):
            pass
    with pytest.raises(EngineDeadError, match="coordinator is not available") as caught:
        asyncio.run(send())
    error = from_exception(caught.value)
    assert error.status_code == 503 and "Retry-After" in error.headers


def _late_error_messages(await_call) -> list[str]:
    """What the event loop reports when a caller awaiting `await_call(future)` is cancelled (its client left)
    and the call fails afterwards (Ray cancels it late)."""
    import concurrent.futures
    import gc
    errors = []
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda _, context: errors.append(context["message"]))

    async def main():
        call = concurrent.futures.Future()
        caller = asyncio.ensure_future(await_call(call))
        await asyncio.sleep(0)
        caller.cancel()
        try:
            await caller
        except asyncio.CancelledError:
            pass
        call.set_exception(RuntimeError("cancelled late"))
        await asyncio.sleep(0.05)  # the outcome reaches the loop
    loop.run_until_complete(main())
    loop.close()
    gc.collect()
    return errors


def test_a_call_that_fails_after_its_caller_left_is_not_logged_as_never_retrieved():
    from atom_ray.client import shielded
    assert _late_error_messages(shielded) == []
    if sys.version_info >= (3, 11):  # the negative control: from 3.11 shielding alone leaves the late error unread
        assert _late_error_messages(lambda call: asyncio.shield(asyncio.wrap_future(call))) == \
            ["Future exception was never retrieved"]
