"""A failed DP rank starts again only once the requests it held have resumed on the survivors (its model
load would take the CPU their re-prefills need), bounded, and at once where no rank serves them."""
from __future__ import annotations

import asyncio

from atom_ray.dp_coordinator import DPCoordinator
from atom_ray.request_journal import RequestRecord
from engine import SamplingParams
from engine.config import EngineConfig


def _coordinator(serving: list[bool]) -> tuple[DPCoordinator, list]:
    coordinator = DPCoordinator(EngineConfig(model="m", data_parallel_size=len(serving)), None, None)
    coordinator.serving = list(serving)
    started = []

    async def start(dps):
        started.append(dps)
        return []
    coordinator._start_ranks = start
    return coordinator, started


def _waiting_record(coordinator: DPCoordinator, request_id: str) -> RequestRecord:
    record = RequestRecord.new([1, 2, 3], SamplingParams(max_tokens=8), None)
    record.resumed_at = 1.0  # moved off the failed rank, no token since
    coordinator.journal[request_id] = record
    return record


def test_the_restart_waits_for_the_moved_requests_next_tokens():
    async def scenario():
        coordinator, started = _coordinator([True, False])
        first, second = _waiting_record(coordinator, "a"), _waiting_record(coordinator, "b")
        restart = asyncio.create_task(coordinator._restart([1], RuntimeError("killed"), ["a", "b"]))
        await asyncio.sleep(0.2)
        first.resumed_at = None  # its next token arrived
        await asyncio.sleep(0.2)
        assert started == [], "started while a moved request still waited for its next token"
        coordinator.journal.pop("b")  # the other finished (or was aborted)
        await asyncio.wait_for(restart, 2)
        assert started == [[1]]
    asyncio.run(scenario())


def test_the_restart_waits_at_most_its_bound():
    async def scenario():
        coordinator, started = _coordinator([True, False])
        coordinator.RESTART_DEFER_S = 0.3
        _waiting_record(coordinator, "a")
        await asyncio.wait_for(coordinator._restart([1], RuntimeError("killed"), ["a"]), 2)
        assert started == [[1]]
    asyncio.run(scenario())


def test_without_a_serving_rank_the_restart_does_not_wait():
    async def scenario():
        coordinator, started = _coordinator([False, False])
        _waiting_record(coordinator, "a")
        await asyncio.wait_for(coordinator._restart([0], RuntimeError("killed"), ["a"]), 0.5)
        assert started == [[0]]
    asyncio.run(scenario())
